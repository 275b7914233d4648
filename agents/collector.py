"""Collect groups: G attempts per task from the policy server, each verified and recorded.

1. All attempts of a batch run concurrently inside one task group, bounded by one limiter on
   server slots, so vLLM can batch them.
2. A call the server refused is data: the attempt records the error and reward 0, and its
   group is marked incomplete (never trained on). A server that could not answer
   (`ServerUnavailable`) abandons the group instead: nothing of it is kept, `on_failure` hears
   of it (a worker gives the task back to the queue), and the rest of the batch goes on.
3. Each group is handed to `on_group` as soon as it is whole, so a crash loses at most the groups
   in flight; tasks listed in `skip` (already stored) are not sampled again.
4. Guided half-groups: the first `guided_fraction` of a group's slots are sampled with a worked
   example in context (`agents.context`). Each guided attempt keeps the bare prompt's ids, as
   the server tokenised them for the group's unguided attempts, so training can distil it.
5. With `reflect_retry`, every unguided attempt short of full reward is reflected on and retried
   (`agents.reflection`); the reflection and the retry join the group as extra attempts.
6. With `strategy` (SGE), each attempt writes a strategy, then answers (`agents.strategy`); the
   second half of a group sees the first half's strategies with their outcomes.
7. With `insights`, a group's attempts run in sequence; a judge turns each failure into a
   one-line insight on the batch's board, and later attempts see the board's insights while
   the batch's success rate is at most 50% (`agents.insight`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field

from agents.context import (
    Messages,
    bare_messages,
    demo_messages,
    demo_text,
    experience_messages,
    hint_messages,
    insight_messages,
    strategies_messages,
)
from agents.episode import retry_episode, run_episode
from agents.errors import PolicyError, ServerUnavailable
from agents.insight import InsightBoard, judge
from agents.policy import PolicyClient, Reviewer
from agents.reflection import Reflection, reflect, wants_retry
from agents.strategy import StrategySettings, reflection_note, strategy_attempt
from memory.records import Attempt, AttemptKind, Group, GroupPurpose, SamplingSettings
from verifiers.catalog import averify, environment, is_episodic, system_prompt, worked_example
from verifiers.task import Task

log = logging.getLogger(__name__)


class CollectSettings(BaseModel):
    """How one batch is sampled."""

    model_config = ConfigDict(frozen=True)

    group_size: int = 4
    temperature: float = 1.0
    max_tokens: int = 128
    system_prompt: str | None = None  # None: the task set's own
    guided_fraction: float = Field(0.0, ge=0.0, le=1.0)
    reflect_retry: bool = False
    insights: bool = False
    strategy: StrategySettings | None = None
    experience: tuple[str, ...] = ()  # library lessons for the guided slots, instead of the demo

    def system(self, task: Task) -> str:
        return self.system_prompt or system_prompt(task.taskset)

    def guided_slots(self) -> int:
        return round(self.group_size * self.guided_fraction)


async def collect_groups(
    client: PolicyClient,
    tasks: Sequence[Task],
    *,
    model: str,
    round_index: int,
    purpose: GroupPurpose,
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
    on_group: Callable[[Group], None],
    skip: Collection[str] = (),
    reviewer: Reviewer | None = None,
    on_failure: Callable[[Task, ServerUnavailable], None] | None = None,
) -> list[Group]:
    """Sample, verify and hand over one group per task not in `skip`; returns the new groups.

    Reflections and judgements come from `reviewer`, by default the policy itself. A group the
    server could not finish goes to `on_failure`; without one, the failure cancels the batch.
    """
    todo = [task for task in tasks if task.task_id not in skip]
    groups: list[Group] = []
    board = InsightBoard() if settings.insights else None

    async def run_group(task: Task) -> None:
        group: Group | None = None
        try:
            group = await collect_group(
                client,
                task,
                model=model,
                round_index=round_index,
                purpose=purpose,
                settings=settings,
                limiter=limiter,
                board=board,
                reviewer=reviewer,
            )
        except* ServerUnavailable as failures:
            if on_failure is None:
                raise
            on_failure(task, first_failure(failures))
        if group is None:
            return
        on_group(group)
        groups.append(group)
        if len(groups) % max(1, len(todo) // 4) == 0 or len(groups) == len(todo):
            log.info("%s: %d/%d groups collected", purpose, len(groups), len(todo))

    async with anyio.create_task_group() as tg:
        for task in todo:
            tg.start_soon(run_group, task)
    return groups


def first_failure(group: BaseExceptionGroup[ServerUnavailable]) -> ServerUnavailable:
    """The first server failure in a (possibly nested) exception group."""
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, ServerUnavailable)
    return leaf


async def collect_group(
    client: PolicyClient,
    task: Task,
    *,
    model: str,
    round_index: int,
    purpose: GroupPurpose,
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
    board: InsightBoard | None = None,
    reviewer: Reviewer | None = None,
) -> Group:
    bare = bare_messages(task, settings.system(task))
    policy = Reviewer(client, model)
    reviewer = reviewer or policy
    if board is None:
        size = settings.group_size
        reflect = settings.strategy is not None and settings.strategy.reflect and size > 1
        half = (size + 1) // 2 if reflect else size
        attempts = await _wave(client, task, model, settings, limiter, range(half), [])
        attempts += await _wave(client, task, model, settings, limiter, range(half, size), attempts)
    else:
        attempts = await _sequential_attempts(policy, reviewer, task, settings, limiter, board)
    attempts = await _with_bare_ids(attempts, client, model, bare)
    if settings.reflect_retry:
        attempts += await reflect_and_retry(policy, reviewer, task, attempts, settings, limiter)
    return Group(
        round_index=round_index,
        purpose=purpose,
        task_id=task.task_id,
        taskset=task.taskset,
        question=task.question,
        policy_version=model,
        size=settings.group_size,
        attempts=attempts,
    )


async def _wave(
    client: PolicyClient,
    task: Task,
    model: str,
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
    indices: range,
    earlier: list[Attempt],
) -> list[Attempt]:
    """Slots `indices` sampled concurrently; SGE's second wave sees the first's strategies."""
    attempts_W: dict[int, Attempt] = {}

    async def run_attempt(index: int) -> None:
        async with limiter:
            attempts_W[index] = await _first_attempt(
                client, task, model, settings, index, earlier=earlier
            )

    async with anyio.create_task_group() as tg:
        for index in indices:
            tg.start_soon(run_attempt, index)
    return [attempts_W[i] for i in indices]


async def _first_attempt(
    client: PolicyClient,
    task: Task,
    model: str,
    settings: CollectSettings,
    index: int,
    insights: list[str] | None = None,
    earlier: list[Attempt] | None = None,
) -> Attempt:
    """Slot `index`: a worked example in the first guided slots, else the insights, else the
    earlier strategies (SGE), else bare; sampled plainly or strategy first (SGE)."""
    sampling = SamplingSettings(temperature=settings.temperature, max_tokens=settings.max_tokens)
    if is_episodic(task.taskset):  # played turn by turn; no guidance yet
        return await run_episode(client, environment(task), model, sampling, index)
    tried = [a for a in earlier or [] if a.strategy]
    plan: dict[str, Any]
    if index < settings.guided_slots() and settings.experience:
        lessons = list(settings.experience)
        messages = experience_messages(task, settings.system(task), lessons)
        plan = {"kind": "guided", "context": "experience", "guidance": "\n".join(lessons)}
    elif index < settings.guided_slots():
        example = worked_example(task.taskset)
        messages = demo_messages(task, settings.system(task), example)
        plan = {"kind": "guided", "context": "demo", "guidance": demo_text(example)}
    elif insights:
        messages = insight_messages(task, settings.system(task), insights)
        plan = {"kind": "guided", "context": "insights", "guidance": "\n".join(insights)}
    elif tried:
        note = reflection_note(tried)
        messages = strategies_messages(task, settings.system(task), note)
        plan = {"kind": "guided", "context": "strategies", "guidance": note}
    else:
        messages = bare_messages(task, settings.system(task))
        plan = {}
    if settings.strategy is None:
        return await attempt_task(client, task, messages, model, sampling, index, **plan)
    try:
        prompt_ids = await client.tokenize(model, messages)
    except PolicyError as exc:
        base = {"sample_index": index, "policy_version": model, "messages": messages}
        return Attempt.failed(str(exc), **base, sampling=sampling, **plan)
    temperature = settings.strategy.temperature(index, settings.group_size)
    return await strategy_attempt(
        client,
        task,
        model,
        messages,
        prompt_ids,
        index,
        temperature,
        settings.strategy,
        settings.max_tokens,
        plan,
    )


async def _sequential_attempts(
    policy: Reviewer,
    reviewer: Reviewer,
    task: Task,
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
    board: InsightBoard,
) -> list[Attempt]:
    """RLTLDR: attempts one after another, each failure judged into an insight for the board."""
    client, model = policy.client, policy.model
    attempts: list[Attempt] = []
    judged: list[Attempt] = []
    for index in range(settings.group_size):
        async with limiter:
            attempt = await _first_attempt(
                client, task, model, settings, index, board.conditioning()
            )
        board.record(attempt)
        attempts.append(attempt)
        if attempt.sample is None or attempt.reward >= 1:
            continue
        bare = bare_messages(task, settings.system(task))
        bare_ids = await _bare_ids(attempts, client, model, bare)
        if bare_ids is None:
            continue
        async with limiter:
            insight = await judge(reviewer, policy, task.question, attempt, bare_ids)
        judged.append(insight)
        if insight.guidance:
            board.add(insight.guidance)
    return attempts + judged


async def _bare_ids(
    attempts: list[Attempt], client: PolicyClient, model: str, bare: Messages
) -> list[int] | None:
    """The bare prompt's ids: from an unguided sample, else /tokenize; None if that fails."""
    ids = next((a.sample.prompt_token_ids for a in attempts if a.sample and not a.guided), None)
    if ids is not None:
        return ids
    try:
        return await client.tokenize(model, bare)
    except PolicyError as exc:
        log.warning("no bare prompt ids; guided attempts will not be distilled: %s", exc)
        return None


async def reflect_and_retry(
    policy: Reviewer,
    reviewer: Reviewer,
    task: Task,
    attempts: list[Attempt],
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
) -> list[Attempt]:
    """Reflections and retries for the unguided attempts of a group short of full reward: a
    retry with the principle as a hint, or for an episode, a replay from the reflection's
    step."""
    failed = [a for a in attempts if not a.guided and a.sample and a.reward < 1 and not a.error]
    sampling = SamplingSettings(temperature=settings.temperature, max_tokens=settings.max_tokens)
    extras: list[Attempt] = []

    async def retry(parent: Attempt, reflection: Reflection) -> Attempt:
        if is_episodic(task.taskset):
            return await retry_episode(
                policy.client, environment(task), parent, reflection.principle,
                reflection.retry_from_step, sampling,
            )  # fmt: skip
        return await _hint_retry(policy, task, settings.system(task), parent, reflection, sampling)

    async def one(parent: Attempt) -> None:
        async with limiter:
            reflection_attempt, reflection = await reflect(reviewer, task.question, parent)
        if not wants_retry(parent, reflection):
            extras.append(reflection_attempt)
            return
        assert reflection is not None
        async with limiter:
            retried = await retry(parent, reflection)
        extras.extend(
            [reflection_attempt.model_copy(update={"improved": retried.improved}), retried]
        )

    async with anyio.create_task_group() as tg:
        for parent in failed:
            tg.start_soon(one, parent)
    return sorted(extras, key=lambda a: (a.sample_index, a.kind))


async def _hint_retry(
    policy: Reviewer,
    task: Task,
    system: str,
    parent: Attempt,
    reflection: Reflection,
    sampling: SamplingSettings,
) -> Attempt:
    """A one-step retry with the principle in the system prompt, paired with its parent."""
    assert parent.sample is not None
    retry = await attempt_task(
        policy.client,
        task,
        hint_messages(task, system, reflection.principle),
        policy.model,
        sampling,
        parent.sample_index,
        kind="retry",
        context="hint",
        guidance=reflection.principle,
    )
    return retry.model_copy(
        update={
            "parent_index": parent.sample_index,
            "bare_prompt_token_ids": parent.sample.prompt_token_ids,
            "improved": retry.error is None and retry.reward > parent.reward,
        }
    )


async def _with_bare_ids(
    attempts: list[Attempt], client: PolicyClient, model: str, bare: Messages
) -> list[Attempt]:
    """Give guided attempts the bare prompt's ids, so training can distil them."""
    if not any(a.guided for a in attempts):
        return attempts
    ids = await _bare_ids(attempts, client, model, bare)
    if ids is None:
        return attempts
    return [
        a.model_copy(update={"bare_prompt_token_ids": ids}) if a.guided else a for a in attempts
    ]


async def attempt_task(
    client: PolicyClient,
    task: Task,
    messages: list[dict[str, Any]],
    model: str,
    sampling: SamplingSettings,
    index: int,
    *,
    kind: AttemptKind = "base",
    context: str = "bare",
    guidance: str | None = None,
) -> Attempt:
    base = {
        "sample_index": index,
        "kind": kind,
        "policy_version": model,
        "messages": messages,
        "context": context,
        "guidance": guidance,
    }
    try:
        sample = await client.sample(model, messages, sampling)
    except PolicyError as exc:
        return Attempt.failed(str(exc), **base, sampling=sampling)
    verdict = await averify(task, sample.text)
    reason = verdict.reason
    if sample.finish_reason == "length":
        reason += ", truncated"
    return Attempt(
        **base,
        sampling=sampling,
        sample=sample,
        generated_tokens=len(sample.completion_token_ids),
        reason=reason,
        **verdict.scores(),
    )
