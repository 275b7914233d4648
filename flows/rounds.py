"""One flywheel round as a state machine over the store: collect, (curate,) train, swap,
evaluate, promote.

1. The round samples from the promoted version, which is served first (a restarted server lost
   its adapters).
2. The round's record (its data cursor: the ids of the complete groups it trains on, and the
   new version's name) is committed before training, so a round killed while training resumes
   on the same groups under the same name, from the trainer's last save; a published
   checkpoint is never trained twice.
3. A round with nothing to learn from (no group with a reward spread) is recorded as skipped;
   a server that fails never makes a round skipped: collection raises first.
4. The new version is served, evaluated on the same held-out tasks (and, when it trained on
   captured traffic, on the agent's own held-out work, `flows.scorecards`), and promoted only if
   the gate lets it through. Every stage runs under its deadline (`stage_timeout_s`).
5. Overlapped rounds (`overlap`): while a round trains, `beside` collects the next one from the
   version serving then, so the model server does not wait for the trainer; the swap waits for
   that collection, so no group straddles it. The next round trains from whatever version is
   promoted by then, on groups sampled by the one before it: each group's sampling version is
   stored, the trainer's importance weights correct against its sampling logprobs, and groups
   more than `max_staleness` promotions old are left out. The round's record counts both, and
   its stage times say how long training and collection ran together (`hidden`).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
from prefect import get_run_logger
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from agents.insight import insight_advantage
from flows import artifacts, evaluation, scorecards, stages
from flows.settings import RunSettings
from memory import store
from memory.records import (
    ROLLOUT_KINDS,
    Group,
    PolicyVersion,
    RoundMetrics,
    Scorecard,
    TrainingRound,
)
from memory.sessions import CAPTURED
from reports.summary import RoundSummary
from serving import promotion
from serving.adapters import ensure_loaded
from trainer.dataset import member_advantages
from trainer.errors import TrainerError
from trainer.round import RoundResult
from verifiers.catalog import train_tasks
from verifiers.task import Task

log = logging.getLogger(__name__)
MAX_STARTS = 3  # a round killed while training this often is skipped, not resumed again


class RoundContext(BaseModel):
    """What every stage of one round needs, fixed when the round starts."""

    model_config = ConfigDict(frozen=True)

    settings: RunSettings
    server_url: str
    base_name: str
    base_model: Path
    held_out: list[Task]
    round_index: int
    current: PolicyVersion  # the promoted version the round samples from


class Clock:
    """Wall seconds per stage, summed over rounds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str, into: dict[str, float] | None = None) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - started, into)

    def add(self, name: str, elapsed: float, into: dict[str, float] | None = None) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        if into is not None:
            into[name] = into.get(name, 0.0) + elapsed


def start(
    settings: RunSettings, server_url: str, base_name: str, base_model: Path, held_out: list[Task]
) -> RoundContext:
    """The next round's context: its index and the promoted version, served."""
    with store.transaction(store.shared_engine(settings.db_url)) as session:
        round_index = store.next_round_index(session)
        current = store.promoted_policy(session)
    assert current is not None, "the baseline promotes the base model first"
    if current.adapter_path and settings.weights == "lora":
        ensure_loaded(server_url, current.name, Path(current.adapter_path))
    return RoundContext(
        settings=settings,
        server_url=server_url,
        base_name=base_name,
        base_model=base_model,
        held_out=held_out,
        round_index=round_index,
        current=current,
    )


def restart(ctx: RoundContext) -> RoundContext:
    """A collected round's context, retargeted at the version promoted since it was collected:
    the version it trains from (its groups keep the version that sampled them)."""
    with store.transaction(store.shared_engine(ctx.settings.db_url)) as session:
        current = store.promoted_policy(session)
    assert current is not None
    return ctx.model_copy(update={"current": current})


def round_tasks(ctx: RoundContext) -> list[Task]:
    """The round's fresh train tasks, seeded by the round."""
    settings = ctx.settings
    return train_tasks(
        settings.taskset, settings.tasks, seed=ctx.round_index, held_out=ctx.held_out
    )


async def run_round(ctx: RoundContext, clock: Clock) -> RoundSummary:
    """A whole round: fresh train tasks (seeded by the round), collected, then trained."""
    seconds: dict[str, float] = {}
    with clock.stage("collect", seconds):
        groups = await collect_stage(ctx, round_tasks(ctx), clock)
    return await train_stage(ctx, groups, seconds, clock)


async def collect_stage(ctx: RoundContext, tasks: list[Task], clock: Clock) -> list[Group]:
    """The round's train groups (and, with the library on, its curation)."""
    settings = ctx.settings
    collect = stages.within_deadline(stages.collect, settings)
    groups = await collect(
        settings, ctx.server_url, tasks, ctx.current.name, ctx.round_index, "train",
        settings.collect,
    )  # fmt: skip
    if settings.library.enabled:
        with clock.stage("curate"):
            stages.within_deadline(stages.curate, settings)(settings, groups)
    return groups


Beside = Callable[[], Awaitable[object]]


async def train_stage(
    ctx: RoundContext,
    groups: list[Group],
    seconds: dict[str, float],
    clock: Clock,
    beside: Beside | None = None,
) -> RoundSummary:
    """Train on the round's groups (with `beside` running meanwhile: the next round's
    collection), then serve, evaluate and promote the new version."""
    record, groups = _round_record(ctx, groups)
    summary = _collected(ctx, groups).model_copy(
        update={
            "groups": len(groups),
            "stale_groups": record.metrics.stale_groups,
            "dropped_groups": record.metrics.dropped_groups,
        }
    )
    name = record.policy_out
    assert name is not None
    try:
        if reason := given_up(record):
            raise TrainerError(reason)
        trained = await _train(ctx, groups, name, (seconds, clock), beside)
    except TrainerError as exc:
        get_run_logger().warning("round %d skipped: %s", ctx.round_index, exc)
        skipped = record.metrics.model_copy(update={"reason": str(exc)})
        _finish(ctx, record, {"status": "skipped", "metrics": skipped})
        await artifacts.publish_round(ctx.settings, ctx.round_index)
        return summary.model_copy(update={"note": str(exc), "wall_seconds": seconds})
    weights_path = None
    if ctx.settings.weights == "merged":
        with clock.stage("merge", seconds):
            merge = stages.within_deadline(stages.merge, ctx.settings)
            weights_path = merge(ctx.settings, ctx.base_model, trained.adapter_path, name)
    version = _publish(ctx, name, trained, groups, weights_path)
    swap = stages.within_deadline(stages.swap, ctx.settings)
    with clock.stage("swap", seconds):
        await swap(ctx.settings, ctx.server_url, version)
    with clock.stage("evaluate", seconds):
        figures, cards = await _evaluate(ctx, version, groups)
    promoted = _decide(ctx, record, name, trained, cards)
    if ctx.settings.weights == "merged":
        if not promoted:  # the promoted version serves again, not the refused candidate
            with clock.stage("swap", seconds):
                await swap(ctx.settings, ctx.server_url, ctx.current)
        _prune_merged(ctx)
    gained, lost = evaluation.paired(
        store.shared_engine(ctx.settings.db_url), ctx.base_name, name, ctx.held_out
    )
    await artifacts.publish_round(ctx.settings, ctx.round_index)
    return summary.model_copy(
        update={
            "policy_version": name,
            "adapter_path": trained.adapter_path,
            "train_tokens": trained.train_tokens,
            "eval_pass_at_1": figures.pass_at_1 if figures else None,
            "eval_format_rate": figures.format_rate if figures else None,
            "eval_gained": gained,
            "eval_lost": lost,
            "promoted": promoted,
            "wall_seconds": seconds,
        }
    )


async def _train(
    ctx: RoundContext,
    groups: list[Group],
    name: str,
    timing: tuple[dict[str, float], Clock],
    beside: Beside | None,
) -> RoundResult:
    """The round's training; with `beside`, the two run together, and the seconds they
    overlapped are recorded as `hidden` (training's own seconds as `train`). A training that
    fails still lets `beside` finish, then raises."""
    seconds, clock = timing
    if beside is None:
        with clock.stage("train", seconds):
            train = stages.within_deadline(stages.train, ctx.settings)
            return train(ctx.settings, groups, ctx.base_model, ctx.current, name)
    trained: list[RoundResult] = []
    failed: list[TrainerError] = []
    own: dict[str, float] = {}

    async def learn() -> None:
        began = time.monotonic()
        try:
            train = stages.within_deadline(stages.train_beside, ctx.settings)
            trained.append(await train(ctx.settings, groups, ctx.base_model, ctx.current, name))
        except TrainerError as exc:
            failed.append(exc)
        own["train"] = time.monotonic() - began

    async def alongside() -> None:
        began = time.monotonic()
        await beside()
        own["beside"] = time.monotonic() - began

    began = time.monotonic()
    async with anyio.create_task_group() as both:
        both.start_soon(learn)
        both.start_soon(alongside)
    clock.add("train", own["train"], seconds)
    clock.add("hidden", max(0.0, sum(own.values()) - (time.monotonic() - began)), seconds)
    if failed:
        raise failed[0]
    return trained[0]


def _collected(ctx: RoundContext, groups: list[Group]) -> RoundSummary:
    """The round's summary as collected: rollouts are attempts at the task (first attempts and
    retries), not reflections or insights."""
    attempts = [a for g in groups for a in g.attempts if a.kind in ROLLOUT_KINDS]
    bare = [a for g in groups for a in g.bare_attempts]
    logger = get_run_logger()
    logger.info(
        "round %d: %d rollouts, %d correct",
        ctx.round_index, len(attempts), sum(a.correct for a in attempts),
    )  # fmt: skip
    check = insight_advantage(groups)
    if check is not None and check.advantage <= 0:
        logger.warning(
            "round %d: insights did not help: %.2f of %d attempts that saw them succeeded, "
            "%.2f of %d with nothing in context (RLTLDR needs this above zero)",
            ctx.round_index, check.with_insights, check.seen, check.without, check.bare,
        )  # fmt: skip
    return RoundSummary(
        round_index=ctx.round_index,
        policy_version=None,
        parent_version=ctx.current.name,
        adapter_path=None,
        rollouts=len(attempts),
        successes=sum(a.correct for a in attempts),
        bare_rollouts=len(bare),
        bare_successes=sum(a.correct for a in bare),
        insight_advantage=None if check is None else check.advantage,
        train_tokens=0,
        eval_pass_at_1=None,
        eval_format_rate=None,
        promoted=False,
    )


def _round_record(ctx: RoundContext, groups: list[Group]) -> tuple[TrainingRound, list[Group]]:
    """The round's record with its data cursor: the one stored, or a new one committed now."""
    with store.transaction(store.shared_engine(ctx.settings.db_url)) as session:
        stored = store.training_round(session, ctx.round_index)
        if stored is not None and stored.status == "running" and stored.group_ids:
            log.info(
                "round %d: resuming %s on its %d recorded groups",
                ctx.round_index, stored.policy_out, len(stored.group_ids),
            )  # fmt: skip
            starts = stored.metrics.starts + 1
            stored = stored.model_copy(
                update={"metrics": stored.metrics.model_copy(update={"starts": starts})}
            )
            store.save_training_round(session, stored)
            return stored, store.groups_by_id(session, stored.group_ids)
        trainable, stale, dropped = _fresh(session, ctx, [g for g in groups if g.complete])
        record = TrainingRound(
            round_index=ctx.round_index,
            method=ctx.settings.train.mode,
            policy_in=ctx.current.name,
            policy_out=f"policy-r{ctx.round_index}-{uuid.uuid4().hex[:6]}",
            status="running",
            hyperparameters=ctx.settings.train.model_dump(mode="json"),
            metrics=RoundMetrics(stale_groups=stale, dropped_groups=dropped, starts=1),
            group_ids=[g.id for g in trainable if g.id is not None],
        )
        store.save_training_round(session, record)
    return record, trainable


def given_up(record: TrainingRound) -> str | None:
    """Why a resumed round is not trained again: training began on its groups `MAX_STARTS`
    times and never finished (the trainer killed each time, most often for memory)."""
    if record.metrics.starts <= MAX_STARTS:
        return None
    return (
        f"training began {MAX_STARTS} times on these groups and never finished (killed while "
        "training: out of memory?); set [train] micro_batch_size (the same steps in less "
        "memory) or lower max_length"
    )


def _fresh(
    session: Session, ctx: RoundContext, groups: list[Group]
) -> tuple[list[Group], int, int]:
    """The groups sampled at most `max_staleness` promotions before the version the round
    trains from; how many of them are stale (sampled by an earlier version), how many older
    ones are left out."""
    history = [v.name for v in store.promoted_history(session)]
    age = {name: index for index, name in enumerate(history)}
    start = age.get(ctx.current.name, 0)
    kept, stale, dropped = [], 0, 0
    for group in groups:
        staleness = age.get(group.policy_version, len(history)) - start
        if group.policy_version == ctx.current.name or 0 <= staleness <= ctx.settings.max_staleness:
            kept.append(group)
            stale += group.policy_version != ctx.current.name
        else:
            dropped += 1
    return kept, stale, dropped


def _publish(
    ctx: RoundContext,
    name: str,
    trained: RoundResult,
    groups: list[Group],
    weights_path: str | None,
) -> PolicyVersion:
    """Record the new version, and the advantage each trained segment got (for lineage)."""
    version = PolicyVersion(
        name=name,
        base_model=ctx.current.base_model,
        parent=ctx.current.name,
        adapter_path=trained.adapter_path,
        weights_path=weights_path,
        round_index=ctx.round_index,
    )
    with store.transaction(store.shared_engine(ctx.settings.db_url)) as session:
        store.save_policy_version(session, version)
        for group in groups:
            assert group.id is not None
            store.set_advantages(session, group.id, member_advantages(group, ctx.settings.train))
    return version


async def _evaluate(
    ctx: RoundContext, version: PolicyVersion, groups: list[Group]
) -> tuple[evaluation.Evaluation | None, list[Scorecard]]:
    """The new version judged: on the held-out tasks of the task set (none when rounds train on
    captured traffic alone), and, when the round trained on captured traffic, on the agent's
    own held-out work against the version serving (`flows.scorecards`)."""
    figures, cards = None, []
    if ctx.held_out:
        figures = await evaluation.evaluate(ctx.settings, ctx.server_url, ctx.held_out, version)
        cards.append(figures.card(ctx.settings.taskset))
    if any(g.taskset == CAPTURED for g in groups):
        card = await scorecards.agent_card(
            ctx.settings, ctx.server_url, version.name, ctx.current.name
        )
        cards.append(card)
    return figures, cards


def _decide(
    ctx: RoundContext,
    record: TrainingRound,
    name: str,
    trained: RoundResult,
    cards: list[Scorecard],
) -> bool:
    """Record the scorecards, let the gate decide, finish the round; whether it was promoted."""
    with store.transaction(store.shared_engine(ctx.settings.db_url)) as session:
        for card in cards:
            store.record_scorecard(session, name, card)
        decision = promotion.promote(session, name, ctx.settings.gate)
        measured = {**record.metrics.model_dump(), **trained.model_dump(), **_figures(cards)}
        metrics = RoundMetrics.model_validate(measured)
        update = {"policy_out": name, "status": "done", "metrics": metrics}
        store.save_training_round(session, record.model_copy(update=update))
    promoted = decision.action == "promote"
    get_run_logger().info(
        "round %d: %s %s: %s (%s)",
        ctx.round_index, name, "; ".join(c.line() for c in cards) or "not evaluated",
        "promoted" if promoted else "not promoted", decision.reason,
    )  # fmt: skip
    return promoted


def _figures(cards: list[Scorecard]) -> dict[str, object]:
    """The round's record of how it was judged: the pass@1 (when a task set judged it) and
    every scorecard."""
    found: dict[str, object] = {"scorecards": cards}
    for card in cards:
        if card.figure == "pass@1":
            found["eval_pass_at_1"] = card.value
    return found


def _finish(ctx: RoundContext, record: TrainingRound, update: dict[str, object]) -> None:
    with store.transaction(store.shared_engine(ctx.settings.db_url)) as session:
        store.save_training_round(session, record.model_copy(update=update))


def _prune_merged(ctx: RoundContext) -> None:
    """Keep the newest `keep_merged` merged folders, and those of the serving version and its
    rollback target; remove the others (the adapters stay, the versions' compact records)."""
    with store.transaction(store.shared_engine(ctx.settings.db_url)) as session:
        kept = {v.name for v in store.promoted_history(session)[:2]}
        merged = [v for v in store.policy_versions(session) if v.weights_path and v.adapter_path]
        newest = sorted(merged, key=lambda v: v.round_index)[-ctx.settings.keep_merged :]
        kept |= {v.name for v in newest}
        for version in merged:
            if version.name in kept or version.weights_path is None:
                continue
            shutil.rmtree(version.weights_path, ignore_errors=True)
            store.set_weights_path(session, version.name, None)
            log.info("merged weights of %s removed (its adapter stays)", version.name)
