"""The flywheel as Prefect flows: `flywheel_run` for `flywheel run`, and the two deployments of
`flywheel serve`.

1. The base model is evaluated once on held-out tasks (greedy, no guidance): the baseline
   (`flows.evaluation`).
2. Each round samples G attempts per train task from the promoted version, verifies and stores
   them, trains a LoRA on the complete groups, serves it under a new versioned name, evaluates
   it on the same held-out tasks, and promotes it only if the gate lets it through
   (`flows.rounds`, whose stages are the Prefect tasks of `flows.stages`).
3. Every stage is idempotent through the store, so running again after a crash resumes: stored
   groups are not sampled again, a round killed while training resumes on its recorded groups.
4. An infrastructure failure is never an answer: a stage that meets a server that stays down,
   or a task that failed for good, raises `ServerUnavailable`, and nothing it could not finish
   is stored as a result or an evaluation. Each stage first checks that the server generates
   with the version it needs (`workers.readiness`).
5. The continuous loop (`serve_rounds`) splits a round across two deployments: `collect_batch`
   gathers a fresh batch for the next round on an interval, and `train_when_ready` trains,
   swaps, evaluates and promotes once that round has enough complete groups. With `source`
   captured or mixed, each training check first samples siblings for sessions whose task was
   met once (`flows.siblings`), then adopts the rated episode groups of captured agent traffic
   into the round (`memory.sessions`); with captured alone nothing is generated,
   and a version is judged on the agent's own held-out work alone, never on the task set's
   (`flows.scorecards`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from prefect import flow, get_run_logger, serve
from prefect.deployments import run_deployment
from prefect.deployments.runner import RunnerDeployment

from flows import evaluation, rounds, siblings, stages
from flows.settings import RunSettings
from memory import sessions, store, workqueue
from memory.records import Group
from reports.summary import FailedTask, RoundSummary, RunSummary
from verifiers.catalog import train_tasks
from verifiers.task import Task
from workers import worker

DRAIN = "flywheel-drain/drain"  # the queue worker deployment of `flows.pools`


@flow(name="flywheel-run", log_prints=False)
async def flywheel_run(
    settings: RunSettings, server_url: str, base_name: str, base_model_path: str
) -> RunSummary:
    clock = rounds.Clock()
    started = time.monotonic()
    held_out, base = await evaluation.baseline(
        settings, server_url, base_name, Path(base_model_path), clock.seconds
    )
    summary = RunSummary(
        base_model=base_name,
        taskset=settings.taskset,
        baseline_pass_at_1=base.pass_at_1,
        baseline_format_rate=base.format_rate,
        eval_tasks=len(held_out),
        db_url=settings.db_url,
    )
    model = (base_name, Path(base_model_path))
    if settings.overlap:
        await _overlapped(settings, server_url, model, held_out, (clock, started), summary)
    else:
        for _ in range(settings.rounds):
            if not _time_for_a_round(settings.minutes, time.monotonic() - started, summary.rounds):
                get_run_logger().info("time budget of %s minutes spent", settings.minutes)
                break
            began = time.monotonic() - started
            ctx = rounds.start(settings, server_url, *model, held_out)
            done = await rounds.run_round(ctx, clock)
            ended = time.monotonic() - started
            summary.rounds.append(done.model_copy(update={"started_s": began, "ended_s": ended}))
    summary.wall_seconds = clock.seconds
    summary.failed_tasks = _failed_tasks(settings, {0, *(r.round_index for r in summary.rounds)})
    return summary


@dataclass
class _Collected:
    """A round collected beside the one before it trained: its context, groups, stage seconds,
    and when its collection began (seconds into the run)."""

    ctx: rounds.RoundContext
    groups: list[Group]
    seconds: dict[str, float]
    began: float


async def _overlapped(
    settings: RunSettings,
    server_url: str,
    model: tuple[str, Path],
    held_out: list[Task],
    timing: tuple[rounds.Clock, float],
    summary: RunSummary,
) -> None:
    """Rounds that overlap: each round's training runs beside the next round's collection
    (`flows.rounds`, 5); the first round is collected alone."""
    clock, started = timing

    async def collect(into: list[_Collected], after: int | None = None) -> None:
        """Collect the next round: the store's next one, or the one after round `after` (which
        is still training, so the store would name it next)."""
        began = time.monotonic() - started
        ctx = rounds.start(settings, server_url, *model, held_out)
        if after is not None:
            ctx = ctx.model_copy(update={"round_index": after + 1})
        seconds: dict[str, float] = {}
        with clock.stage("collect", seconds):
            groups = await rounds.collect_stage(ctx, rounds.round_tasks(ctx), clock)
        into.append(_Collected(ctx, groups, seconds, began))

    pending: list[_Collected] = []
    await collect(pending)
    for index in range(settings.rounds):
        this = pending.pop()
        ctx = rounds.restart(this.ctx) if index else this.ctx
        more = index + 1 < settings.rounds and _time_for_a_round(
            settings.minutes, time.monotonic() - started, summary.rounds
        )
        beside = functools.partial(collect, pending, ctx.round_index) if more else None
        done = await rounds.train_stage(ctx, this.groups, this.seconds, clock, beside)
        ended = time.monotonic() - started
        summary.rounds.append(done.model_copy(update={"started_s": this.began, "ended_s": ended}))
        if not pending:
            break


def _failed_tasks(settings: RunSettings, round_indices: set[int]) -> list[FailedTask]:
    """The tasks of these rounds left out for failing by their own doing."""
    with store.transaction(store.shared_engine(settings.db_url)) as session:
        items = workqueue.failed(session)
    return [
        FailedTask(
            round_index=item.round_index,
            purpose=item.purpose,
            task_id=item.task_id,
            failures=item.failures,
            error=item.error or "",
        )  # fmt: skip
        for item in items
        if item.fault == "task" and item.round_index in round_indices
    ]


def _time_for_a_round(minutes: float | None, elapsed_s: float, done: list[RoundSummary]) -> bool:
    """With a budget, a round starts only while the time left covers the last round's length
    (the first round always starts)."""
    if minutes is None or not done:
        return True
    last = done[-1]
    return elapsed_s + (last.ended_s - last.started_s) <= minutes * 60


@flow(name="flywheel-collect", log_prints=False)
async def collect_batch(
    settings: RunSettings, server_url: str, base_name: str, base_model_path: str, helpers: int = 0
) -> int:
    """The loop's collection deployment: one batch of train tasks from the promoted version,
    for the next round; a fresh batch of tasks each time, shared with `helpers` runs of the
    drain deployment (`flows.pools`). Returns the groups collected."""
    settings, server_url = _here(settings, server_url)
    clock = rounds.Clock()
    held_out, _ = await evaluation.baseline(
        settings, server_url, base_name, Path(base_model_path), clock.seconds
    )
    ctx = rounds.start(settings, server_url, base_name, Path(base_model_path), held_out)
    with store.transaction(store.shared_engine(settings.db_url)) as session:
        have = len(store.load_groups(session, "train", ctx.round_index, ctx.current.name))
    batch = have // settings.tasks
    seed = ctx.round_index if batch == 0 else ctx.round_index * 1000 + batch
    tasks = train_tasks(settings.taskset, settings.tasks, seed=seed, held_out=held_out)
    servers = settings.replicas or [server_url]
    for index in range(helpers):  # they claim from the queue once the batch is in it
        parameters = {"server_url": servers[index % len(servers)]}
        started = run_deployment(DRAIN, parameters=parameters, timeout=0, as_subflow=False)
        await cast(Awaitable[Any], started)  # Prefect's sync-or-async call, awaited here
    groups = await rounds.collect_stage(ctx, tasks, clock)
    get_run_logger().info(
        "round %d: batch %d collected, %d groups", ctx.round_index, batch + 1, len(groups)
    )
    return len(groups)


@flow(name="flywheel-train", log_prints=False)
async def train_when_ready(
    settings: RunSettings,
    server_url: str,
    base_name: str,
    base_model_path: str,
    min_groups: int,
) -> RoundSummary | None:
    """The loop's training deployment: once the next round has `min_groups` complete groups
    (or was interrupted while training), train, swap, evaluate and promote."""
    settings, server_url = _here(settings, server_url)
    clock = rounds.Clock()
    held_out: list[Task] = []  # rounds on captured traffic alone are judged on the agent's work
    if settings.source == "captured":
        evaluation.register_base(
            store.shared_engine(settings.db_url), base_name, Path(base_model_path)
        )
    else:
        held_out, _ = await evaluation.baseline(
            settings, server_url, base_name, Path(base_model_path), clock.seconds
        )
    ctx = rounds.start(settings, server_url, base_name, Path(base_model_path), held_out)
    if settings.source != "generated" and settings.siblings:
        await siblings.grow(settings, server_url, ctx.current.name)
    if settings.source != "generated" and settings.judge:
        await stages.judge_captured(settings)
    with store.transaction(store.shared_engine(settings.db_url)) as session:
        record = store.training_round(session, ctx.round_index)
        if settings.source != "generated" and (record is None or record.status != "running"):
            adopted = sessions.adopt(session, ctx.round_index, ctx.current.name)
            if adopted:
                get_run_logger().info(
                    "round %d: %d groups of captured episodes adopted", ctx.round_index,
                    len(adopted),
                )  # fmt: skip
        groups = store.load_groups(
            session, "train", ctx.round_index, ctx.current.name, complete_only=True
        )
    if (record is None or record.status != "running") and len(groups) < min_groups:
        get_run_logger().info(
            "round %d waits: %d of %d complete groups", ctx.round_index, len(groups), min_groups
        )
        return None
    return await rounds.train_stage(ctx, groups, {}, clock)


def _here(settings: RunSettings, server_url: str) -> tuple[RunSettings, str]:
    """A deployment's store and server as the machine that runs it reaches them."""
    db_url, server_url = worker.here(settings.db_url, server_url)
    return settings.model_copy(update={"db_url": db_url}), server_url


@dataclass(frozen=True)
class Cadence:
    """How the continuous loop turns: a fresh batch collected every `every_s`, and a check every
    `train_every_s` that trains once the next round has `min_groups` complete groups."""

    every_s: float
    train_every_s: float
    min_groups: int


def serve_rounds(
    settings: RunSettings, server_url: str, base_name: str, base_model_path: str, cadence: Cadence
) -> None:
    """The continuous loop as two deployments, run one at a time until stopped, at `cadence`:
    collection of a fresh batch, and a check that trains, swaps, evaluates and promotes."""
    every_s, train_every_s, min_groups = cadence.every_s, cadence.train_every_s, cadence.min_groups
    parameters = {
        "settings": settings.model_dump(mode="json"),
        "server_url": server_url,
        "base_name": base_name,
        "base_model_path": base_model_path,
    }
    collecting = as_deployment(collect_batch.to_deployment(
        name="collect", interval=every_s, parameters=parameters,
        description="A fresh batch of train tasks from the promoted version.",
    ))  # fmt: skip
    training = as_deployment(train_when_ready.to_deployment(
        name="train", interval=train_every_s, parameters={**parameters, "min_groups": min_groups},
        description="Train, swap, evaluate and promote once enough complete groups exist.",
    ))  # fmt: skip
    if settings.source == "captured":  # rounds train on agent traffic alone
        serve(training, limit=1)
    else:
        serve(collecting, training, limit=1)


def as_deployment(made: Any) -> RunnerDeployment:
    """What `to_deployment` returns when called outside an event loop (Prefect types it as
    either that or a coroutine)."""
    assert isinstance(made, RunnerDeployment)
    return made
