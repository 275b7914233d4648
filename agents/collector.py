"""Collect groups: G attempts per task from the policy server, each verified and recorded.

1. All attempts of a batch run concurrently inside one task group, bounded by one limiter on
   server slots, so vLLM can batch them.
2. A call the server refused is data: the attempt records the error and reward 0, and its
   group is marked incomplete (never trained on). A server that could not answer
   (`ServerUnavailable`) abandons the group instead: nothing of it is kept, `on_failure` hears
   of it (a worker gives the task back to the queue), and the rest of the batch goes on.
   So does the task's own failure (`TaskFault`: its verifier, environment or sandbox raised or
   hung, recorded on the attempt), and any other exception met while collecting one task: it
   is that task's, and never cancels the other groups.
3. Each group is handed to `on_group` as soon as it is whole, so a crash loses at most the groups
   in flight; tasks listed in `skip` (already stored) are not sampled again.
4. The methods, each in its own module: what each slot's prompt holds (`agents.slots`: guided
   half-groups, SGE's strategy-first sampling and its second wave); RLTLDR's sequential
   attempts with judged insights (`agents.insight`); R3L's reflections and retries
   (`agents.reflection`); HeRL's hindsight revision of a group that all failed
   (`agents.revision`), and NudgeRL's hinted attempts for such a group (`agents.nudge`). With
   `own_examples`, the batch's `ExampleBook` (`agents.examples`) keeps the policy's verified
   answers, and each group's guided slots show the nearest one as their worked example.
   Guided attempts keep the bare prompt's ids, as the server tokenised them, so training can
   distil them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import anyio

from agents.attempt import bare_prompt_ids
from agents.context import Messages, bare_messages
from agents.errors import ServerUnavailable
from agents.examples import ExampleBook
from agents.insight import InsightBoard, sequential_attempts
from agents.nudge import nudge
from agents.policy import Endpoint
from agents.reflection import reflect_and_retry
from agents.revision import revise
from agents.settings import CollectSettings
from agents.slots import wave
from memory.records import Attempt, Group, GroupPurpose
from verifiers.catalog import is_episodic
from verifiers.errors import TaskFault
from verifiers.guard import applied
from verifiers.task import Task

__all__ = ["Failure", "GroupSpec", "Hooks", "collect_group", "collect_groups", "first_failure"]

log = logging.getLogger(__name__)

Failure = ServerUnavailable | TaskFault  # why a group could not be collected


@dataclass(frozen=True)
class GroupSpec:
    """What a batch's groups are: their round, their purpose, and how they are sampled."""

    round_index: int
    purpose: GroupPurpose
    settings: CollectSettings


@dataclass(frozen=True)
class Hooks:
    """Who hears of each group: `on_group` as soon as one is whole, `on_failure` with why one
    could not be collected (without it, the failure cancels the batch)."""

    on_group: Callable[[Group], None]
    on_failure: Callable[[Task, Failure], None] | None = None


async def collect_groups(
    policy: Endpoint,
    tasks: Sequence[Task],
    spec: GroupSpec,
    limiter: anyio.CapacityLimiter,
    hooks: Hooks,
    *,
    skip: Collection[str] = (),
    reviewer: Endpoint | None = None,
) -> list[Group]:
    """Sample, verify and hand over one group per task not in `skip`; returns the new groups.
    Reflections and judgements come from `reviewer`, by default the policy itself."""
    todo = [task for task in tasks if task.task_id not in skip]
    groups: list[Group] = []
    board = InsightBoard() if spec.settings.insights else None
    examples = ExampleBook() if spec.settings.own_examples else None

    async def run_group(task: Task) -> None:
        try:
            with applied(spec.settings.guard):
                group = await collect_group(
                    policy, task, spec, limiter, board=board, reviewer=reviewer, examples=examples
                )
            if group.fault is not None:
                raise TaskFault(group.fault)
        except Exception as exc:  # noqa: BLE001 - one task's failure is that task's (docstring 2)
            if hooks.on_failure is None:
                raise
            hooks.on_failure(task, classify(task, exc))
            return
        hooks.on_group(group)
        groups.append(group)
        if len(groups) % max(1, len(todo) // 4) == 0 or len(groups) == len(todo):
            log.info("%s: %d/%d groups collected", spec.purpose, len(groups), len(todo))

    async with anyio.create_task_group() as tg:
        for task in todo:
            tg.start_soon(run_group, task)
    return groups


def classify(task: Task, error: Exception) -> Failure:
    """Why a group could not be collected: the server's failure if any part of it was one, else
    the task's own (an unexpected exception is logged with its traceback, then counted as the
    task's, so a bug met on one task cannot stop the others)."""
    leaves = list(_leaves(error))
    server = next((e for e in leaves if isinstance(e, ServerUnavailable)), None)
    if server is not None:
        return server
    fault = next((e for e in leaves if isinstance(e, TaskFault)), None)
    if fault is not None:
        return fault
    first = leaves[0]
    log.error("%s: collecting it raised", task.task_id, exc_info=first)
    line = (str(first).strip().splitlines() or [""])[0][:300]
    return TaskFault(f"collecting the task raised {type(first).__name__}: {line}")


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def first_failure(group: BaseExceptionGroup[ServerUnavailable]) -> ServerUnavailable:
    """The first server failure in a (possibly nested) exception group."""
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, ServerUnavailable)
    return leaf


async def collect_group(
    policy: Endpoint,
    task: Task,
    spec: GroupSpec,
    limiter: anyio.CapacityLimiter,
    *,
    board: InsightBoard | None = None,
    reviewer: Endpoint | None = None,
    examples: ExampleBook | None = None,
) -> Group:
    settings = await _with_example(spec.settings, task, examples)
    bare = bare_messages(task, settings.system(task))
    reviewer = reviewer or policy
    if board is None:
        size = settings.group_size
        reflect = settings.strategy.enabled and settings.strategy.reflect and size > 1
        half = (size + 1) // 2 if reflect else size
        attempts = await wave(policy, task, settings, limiter, range(half), [])
        attempts += await wave(policy, task, settings, limiter, range(half, size), attempts)
    else:
        attempts = await sequential_attempts(policy, reviewer, task, settings, limiter, board)
    attempts = await _with_bare_ids(attempts, policy, bare)
    if settings.retry.enabled:
        attempts += await reflect_and_retry(policy, reviewer, task, attempts, settings, limiter)
    if settings.nudge and not is_episodic(task.taskset):
        attempts += await nudge(policy, reviewer, task, bare, attempts, settings, limiter)
    if settings.revise.enabled and not is_episodic(task.taskset):
        attempts += await revise(policy, reviewer, task, bare, attempts, settings, limiter)
    group = Group(
        round_index=spec.round_index,
        purpose=spec.purpose,
        task_id=task.task_id,
        taskset=task.taskset,
        question=task.question,
        policy_version=policy.model,
        size=settings.group_size,
        attempts=attempts,
    )
    if examples is not None:
        examples.record(group)
    return group


async def _with_example(
    settings: CollectSettings, task: Task, examples: ExampleBook | None
) -> CollectSettings:
    """The settings with the batch's nearest own example for the guided slots, unless one was
    planned or there are no guided slots."""
    if examples is None or settings.example is not None or not settings.guided_slots():
        return settings
    return settings.model_copy(update={"example": await examples.nearest(task)})


async def _with_bare_ids(
    attempts: list[Attempt], policy: Endpoint, bare: Messages
) -> list[Attempt]:
    """Give guided attempts the bare prompt's ids, so training can distil them."""
    if not any(a.distillable for a in attempts):
        return attempts
    ids = await bare_prompt_ids(attempts, policy, bare)
    if ids is None:
        return attempts
    return [
        a.model_copy(update={"bare_prompt_token_ids": ids}) if a.distillable else a
        for a in attempts
    ]
