"""The flywheel as a Prefect flow: per round collect, verify, store, train, swap, evaluate.

1. The base model is evaluated once on held-out tasks (greedy, no guidance): the baseline.
2. Each round samples G attempts per train task from the promoted version, verifies and stores
   them, trains a LoRA on the complete groups, hot-loads it into vLLM under a new versioned name,
   evaluates it on the same held-out tasks, and promotes it only if it is not worse.
3. Every stage is idempotent through the store: stored groups are not sampled again, and the
   round's record (its data cursor: the group ids, and the version name) is committed before
   training, so a re-run after a crash trains the same groups under the same name, resuming from
   the trainer's last save, and a published checkpoint is never trained twice.
4. Retries, one layer each: a collection task whose group failed for want of a server goes back
   to the work queue with backoff (`flows.worker`); the swap retries twice (5 s, then 30 s),
   since loading an adapter that is already served is a no-op. Training is not retried: a failed
   round is resumed by running again. An infrastructure failure is never an answer: a batch
   with a task that failed for good, or a server that stays down, ends the stage with
   `ServerUnavailable`, and nothing it could not finish is stored as a result or an evaluation.
5. Each stage first checks that the server generates with the version it needs
   (`flows.readiness`), serving the version's adapter again if a restarted server lost it.
6. The continuous loop (`serve_rounds`) splits a round across two deployments: `collect_batch`
   gathers a fresh batch for the next round on an interval, and `train_when_ready` trains,
   swaps, evaluates and promotes once that round has enough complete groups.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from functools import cache
from pathlib import Path

from prefect import flow, get_run_logger, serve, task
from prefect.cache_policies import NO_CACHE
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from tqdm import tqdm

from agents.collector import CollectSettings
from agents.errors import ServerUnavailable
from agents.outcome import OutcomeSettings
from agents.policy import PolicyClient, Reviewer
from flows import worker
from flows.readiness import Readiness
from flows.settings import RunSettings
from flows.summary import RoundSummary, RunSummary
from memory import library, store, workqueue
from memory.embedding import Embedder
from memory.library import Admission, LibrarySettings
from memory.records import Group, GroupPurpose, Guidance, PolicyVersion, TrainingRound
from memory.retrieval import Index
from serving import promotion
from serving.adapters import ensure_loaded
from trainer.dataset import member_advantages
from trainer.errors import TrainerError
from trainer.round import RoundResult, train_round
from verifiers.catalog import eval_tasks, train_tasks
from verifiers.task import Task

log = logging.getLogger(__name__)


@cache
def _engine(db_url: str) -> Engine:
    return store.open_store(db_url)


@task(cache_policy=NO_CACHE)
async def collect(
    settings: RunSettings,
    server_url: str,
    tasks: list[Task],
    version: str,
    round_index: int,
    purpose: GroupPurpose,
    sampling: CollectSettings,
) -> list[Group]:
    """Enqueue one work item per task not yet stored, collect them here (with any other
    workers sharing the store), wait until the batch is done; return all its groups. A task
    that failed for good fails the stage: a batch is complete or it is an error."""
    engine = _engine(settings.db_url)
    batch = (round_index, purpose, version)
    shaping = settings.outcome if purpose == "train" else None
    await Readiness(engine, server_url, settings.outage_s).ensure(version)
    with store.transaction(engine) as session:
        done = {g.task_id for g in store.load_groups(session, purpose, round_index, version)}
    todo = [t for t in tasks if t.task_id not in done]
    plan = _planner(settings, engine, purpose, sampling, shaping)
    with store.transaction(engine) as session:
        workqueue.enqueue(session, worker.plan_items(batch, todo, plan))
        workqueue.requeue_failed(session, *batch)  # a re-run gives them another chance
    get_run_logger().info(
        "%s with %s: %d tasks (%d already stored)", purpose, version, len(tasks), len(done)
    )
    worker.release_dead_local_workers(engine)
    reviewer = _reviewer(settings)
    # A progress bar on a terminal; logs already say how far a batch is everywhere else.
    bar = tqdm(total=len(todo), desc=f"{purpose} {version}", unit="task", leave=False,
               disable=not sys.stderr.isatty())  # fmt: skip
    try:
        await worker.work(
            engine,
            server_url,
            owner=worker.new_owner(),
            settings=worker.WorkerSettings(
                concurrency=settings.concurrency, outage_s=settings.outage_s
            ),
            until=lambda: worker.batch_done(engine, batch),
            batch=batch,
            reviewer=reviewer,
            on_stored=lambda group: bar.update(1),
        )
    finally:
        bar.close()
        if reviewer is not None:
            await reviewer.client.aclose()
    wanted = {t.task_id for t in tasks}
    with store.transaction(engine) as session:
        failed = workqueue.failed(session, *batch)
        groups = store.load_groups(session, purpose, round_index, version)
    if failed:
        raise ServerUnavailable(
            f"{len(failed)} of {len(tasks)} {purpose} tasks failed {failed[0].failures} times "
            f"(run again to retry them); the last error: {failed[0].error}"
        )
    return [g for g in groups if g.task_id in wanted]


def _planner(
    settings: RunSettings,
    engine: Engine,
    purpose: GroupPurpose,
    sampling: CollectSettings,
    shaping: OutcomeSettings | None,
) -> Callable[[Task], worker.Plan]:
    """How each task is collected; with the library on, train tasks get its lessons."""
    if not (settings.library and purpose == "train"):
        return lambda task: worker.Plan(task=task, sampling=sampling, outcome=shaping)
    with store.transaction(engine) as session:
        entries = library.entries(session)
        vectors = library.embeddings(session, [e.id for e in entries])
    index = Index(entries, vectors, _embedder())

    def plan(task: Task) -> worker.Plan:
        hits = index.search(task.question, task.task_id, task.taskset, k=settings.library_k)
        lessons = tuple(hit.entry.text for hit in hits)
        return worker.Plan(
            task=task,
            sampling=sampling.model_copy(update={"experience": lessons}),
            outcome=shaping,
            experience_ids=[hit.entry.id for hit in hits],
            similarities=[hit.score for hit in hits],
        )

    return plan


@task(cache_policy=NO_CACHE)
def curate(settings: RunSettings, groups: list[Group]) -> Admission:
    """Grow the library from this round: valid insights, and the principles of retries that
    beat their parent, for the task set."""
    candidates = [
        Guidance(
            kind="insight" if a.kind == "insight" else "principle",
            scope="task_type",
            scope_key=g.taskset,
            text=a.guidance,
            source=f"{a.kind} of group {g.id}, slot {a.sample_index}",
        )
        for g in groups
        for a in g.attempts
        if a.guidance
        and ((a.kind == "insight" and a.format_ok) or (a.kind == "retry" and a.improved))
    ]
    with store.transaction(_engine(settings.db_url)) as session:
        report = library.admit(session, candidates, LibrarySettings(), _embedder().embed_bytes)
        size = library.size(session)
    get_run_logger().info(
        "library: %d lessons added, %d merged, %d refused; %d active",
        len(report.added), len(report.merged), len(report.refused), size,
    )  # fmt: skip
    return report


@cache
def _embedder() -> Embedder:
    return Embedder()


def _reviewer(settings: RunSettings) -> Reviewer | None:
    if settings.reviewer_url is None or settings.reviewer_model is None:
        return None
    return Reviewer(PolicyClient(settings.reviewer_url), settings.reviewer_model)


@task(cache_policy=NO_CACHE)
def train(
    settings: RunSettings, groups: list[Group], base_model: Path, parent: PolicyVersion, name: str
) -> RoundResult:
    parent_path = Path(parent.adapter_path) if parent.adapter_path else None
    return train_round(
        groups,
        base_model=base_model,
        parent_adapter=parent_path,
        checkpoint_root=settings.checkpoint_root,
        name=name,
        settings=settings.train,
    )


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 30])
def swap(server_url: str, name: str, adapter_path: str) -> None:
    """Serve the new version; a no-op when a resumed round finds it already served."""
    ensure_loaded(server_url, name, Path(adapter_path))


def _pass_at_1(groups: list[Group]) -> tuple[float, float]:
    attempts = [a for g in groups for a in g.attempts]
    if not attempts:
        return 0.0, 0.0
    return (
        statistics.fmean(a.correct for a in attempts),
        statistics.fmean(a.format_ok for a in attempts),
    )


async def _evaluate(
    settings: RunSettings, server_url: str, held_out: list[Task], version: PolicyVersion
) -> tuple[float, float]:
    groups = await collect(
        settings,
        server_url,
        held_out,
        version.name,
        version.round_index,
        "eval",
        settings.eval_settings(),
    )
    return _pass_at_1(groups)


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, stage: str, since: float) -> float:
        elapsed = time.monotonic() - since
        self.seconds[stage] = self.seconds.get(stage, 0.0) + elapsed
        return elapsed


@flow(name="flywheel-run", log_prints=False)
async def flywheel_run(
    settings: RunSettings, server_url: str, base_name: str, base_model_path: str
) -> RunSummary:
    clock = _Clock()
    held_out, baseline, baseline_format = await _baseline(settings, server_url, base_name, clock)
    summary = RunSummary(
        base_model=base_name,
        taskset=settings.taskset,
        baseline_pass_at_1=baseline,
        baseline_format_rate=baseline_format,
        eval_tasks=len(held_out),
        db_url=settings.db_url,
    )
    for _ in range(settings.rounds):
        summary.rounds.append(
            await _run_round(
                settings, server_url, base_name, Path(base_model_path), held_out, clock
            )
        )
    summary.wall_seconds = clock.seconds
    return summary


@flow(name="flywheel-collect", log_prints=False)
async def collect_batch(
    settings: RunSettings, server_url: str, base_name: str, base_model_path: str
) -> int:
    """The loop's collection deployment: one batch of train tasks from the promoted version,
    for the next round; a fresh batch of tasks each time. Returns the groups collected."""
    clock = _Clock()
    held_out, _, _ = await _baseline(settings, server_url, base_name, clock)
    round_index, current = _next_round(settings, server_url)
    with store.transaction(_engine(settings.db_url)) as session:
        have = len(store.load_groups(session, "train", round_index, current.name))
    batch = have // settings.tasks
    seed = round_index if batch == 0 else round_index * 1000 + batch
    tasks = train_tasks(settings.taskset, settings.tasks, seed=seed, held_out=held_out)
    groups = await _collect_stage(settings, server_url, round_index, current, tasks, clock)
    get_run_logger().info(
        "round %d: batch %d collected, %d groups", round_index, batch + 1, len(groups)
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
    clock = _Clock()
    held_out, _, _ = await _baseline(settings, server_url, base_name, clock)
    round_index, current = _next_round(settings, server_url)
    with store.transaction(_engine(settings.db_url)) as session:
        record = store.training_round(session, round_index)
        groups = store.load_groups(session, "train", round_index, current.name, complete_only=True)
    if (record is None or record.status != "running") and len(groups) < min_groups:
        get_run_logger().info(
            "round %d waits: %d of %d complete groups", round_index, len(groups), min_groups
        )
        return None
    return await _train_stage(
        settings, server_url, base_name, Path(base_model_path), held_out, clock,
        round_index, current, groups, {},
    )  # fmt: skip


async def _baseline(
    settings: RunSettings, server_url: str, base_name: str, clock: _Clock
) -> tuple[list[Task], float, float]:
    """Record the base model (promoted if nothing is) and its held-out score; evaluating it
    again finds every group stored and samples nothing."""
    engine = _engine(settings.db_url)
    with store.transaction(engine) as session:
        store.save_policy_version(session, PolicyVersion(name=base_name, base_model=base_name))
        if store.promoted_policy(session) is None:
            store.set_promoted(session, base_name, True)
        base = store.policy_version(session, base_name)
    held_out = eval_tasks(settings.taskset, settings.eval_tasks)
    started = time.monotonic()
    baseline, baseline_format = await _evaluate(settings, server_url, held_out, base)
    clock.add("evaluate", started)
    get_run_logger().info("baseline held-out pass@1 %.3f (format %.2f)", baseline, baseline_format)
    with store.transaction(engine) as session:
        store.record_evaluation(session, base_name, baseline)
    return held_out, baseline, baseline_format


def _paired(session: Session, base_name: str, name: str, held_out: list[Task]) -> tuple[int, int]:
    """Held-out tasks the version solves that the base did not, and the reverse."""
    wanted = {t.task_id for t in held_out}

    def solved(version: str) -> dict[str, bool]:
        groups = store.load_groups(session, "eval", policy_version=version)
        return {
            g.task_id: g.attempts[0].correct for g in groups if g.task_id in wanted and g.attempts
        }

    base, new = solved(base_name), solved(name)
    common = base.keys() & new.keys()
    return (
        sum(new[t] and not base[t] for t in common),
        sum(base[t] and not new[t] for t in common),
    )


def _round_record(
    settings: RunSettings, round_index: int, current: PolicyVersion, groups: list[Group]
) -> tuple[TrainingRound, list[Group]]:
    """The round's record with its data cursor: the one stored, or a new one committed now."""
    engine = _engine(settings.db_url)
    with store.transaction(engine) as session:
        stored = store.training_round(session, round_index)
        if stored is not None and stored.status == "running" and stored.group_ids:
            log.info(
                "round %d: resuming %s on its %d recorded groups",
                round_index,
                stored.policy_out,
                len(stored.group_ids),
            )
            return stored, store.groups_by_id(session, stored.group_ids)
        trainable = [g for g in groups if g.complete]
        record = TrainingRound(
            round_index=round_index,
            method=settings.train.mode,
            policy_in=current.name,
            policy_out=f"policy-r{round_index}-{uuid.uuid4().hex[:6]}",
            status="running",
            hyperparameters=settings.train.model_dump(),
            group_ids=[g.id for g in trainable if g.id is not None],
        )
        store.save_training_round(session, record)
    return record, trainable


async def _run_round(
    settings: RunSettings,
    server_url: str,
    base_name: str,
    base_model: Path,
    held_out: list[Task],
    clock: _Clock,
) -> RoundSummary:
    round_index, current = _next_round(settings, server_url)
    tasks = train_tasks(settings.taskset, settings.tasks, seed=round_index, held_out=held_out)
    stages: dict[str, float] = {}
    started = time.monotonic()
    groups = await _collect_stage(settings, server_url, round_index, current, tasks, clock)
    stages["collect"] = time.monotonic() - started
    return await _train_stage(
        settings, server_url, base_name, base_model, held_out, clock,
        round_index, current, groups, stages,
    )  # fmt: skip


def _next_round(settings: RunSettings, server_url: str) -> tuple[int, PolicyVersion]:
    """The next round's index and the promoted version it samples from, served."""
    with store.transaction(_engine(settings.db_url)) as session:
        round_index = store.next_round_index(session)
        current = store.promoted_policy(session)
    assert current is not None
    if current.adapter_path:
        # A restarted server has none of the earlier adapters: serve the sampling policy first.
        ensure_loaded(server_url, current.name, Path(current.adapter_path))
    return round_index, current


async def _collect_stage(
    settings: RunSettings,
    server_url: str,
    round_index: int,
    current: PolicyVersion,
    tasks: list[Task],
    clock: _Clock,
) -> list[Group]:
    started = time.monotonic()
    groups = await collect(
        settings, server_url, tasks, current.name, round_index, "train", settings.collect_settings()
    )
    clock.add("collect", started)
    if settings.library:
        started = time.monotonic()
        curate(settings, groups)
        clock.add("curate", started)
    return groups


async def _train_stage(
    settings: RunSettings,
    server_url: str,
    base_name: str,
    base_model: Path,
    held_out: list[Task],
    clock: _Clock,
    round_index: int,
    current: PolicyVersion,
    groups: list[Group],
    stages: dict[str, float],
) -> RoundSummary:
    """Train on the round's groups, serve the new version, evaluate it, promote it if it is
    not worse; the round's record (its data cursor) is committed before training."""
    logger = get_run_logger()
    engine = _engine(settings.db_url)
    # Rollouts are attempts at the task (first attempts and retries), not reflections or insights.
    attempts = [a for g in groups for a in g.attempts if a.kind in ("base", "guided", "retry")]
    bare = [a for g in groups for a in g.bare_attempts]
    result = RoundSummary(
        round_index=round_index,
        policy_version=None,
        parent_version=current.name,
        adapter_path=None,
        rollouts=len(attempts),
        successes=sum(a.correct for a in attempts),
        bare_rollouts=len(bare),
        bare_successes=sum(a.correct for a in bare),
        train_tokens=0,
        eval_pass_at_1=None,
        eval_format_rate=None,
        promoted=False,
    )
    logger.info("round %d: %d rollouts, %d correct", round_index, result.rollouts, result.successes)

    record, groups = _round_record(settings, round_index, current, groups)
    name = record.policy_out
    assert name is not None
    started = time.monotonic()
    try:
        trained = train(settings, groups, base_model, current, name)
    except TrainerError as exc:
        stages["train"] = clock.add("train", started)
        logger.warning("round %d skipped: %s", round_index, exc)
        with store.transaction(engine) as session:
            store.save_training_round(
                session,
                record.model_copy(update={"status": "skipped", "metrics": {"reason": str(exc)}}),
            )
        return result.model_copy(update={"note": str(exc), "wall_seconds": stages})
    stages["train"] = clock.add("train", started)
    version = PolicyVersion(
        name=name,
        base_model=current.base_model,
        parent=current.name,
        adapter_path=trained.adapter_path,
        round_index=round_index,
    )
    with store.transaction(engine) as session:
        store.save_policy_version(session, version)
        for group in groups:  # the advantage each trained segment got, for lineage
            assert group.id is not None
            store.set_advantages(session, group.id, member_advantages(group, settings.train))

    started = time.monotonic()
    swap(server_url, name, trained.adapter_path)
    stages["swap"] = clock.add("swap", started)

    started = time.monotonic()
    pass_at_1, format_rate = await _evaluate(settings, server_url, held_out, version)
    stages["evaluate"] = clock.add("evaluate", started)
    with store.transaction(engine) as session:
        gained, lost = _paired(session, base_name, name, held_out)
        store.record_evaluation(session, name, pass_at_1)
        decision = promotion.promote(session, name, settings.gate)
        done = {
            "policy_out": name,
            "status": "done",
            "metrics": {**trained.model_dump(), "eval_pass_at_1": pass_at_1},
        }
        store.save_training_round(session, record.model_copy(update=done))
    promoted = decision.action == "promote"
    logger.info(
        "round %d: %s held-out pass@1 %.3f: %s (%s)",
        round_index,
        name,
        pass_at_1,
        "promoted" if promoted else "not promoted",
        decision.reason,
    )
    return result.model_copy(
        update={
            "policy_version": name,
            "adapter_path": trained.adapter_path,
            "train_tokens": trained.train_tokens,
            "eval_pass_at_1": pass_at_1,
            "eval_format_rate": format_rate,
            "eval_gained": gained,
            "eval_lost": lost,
            "promoted": promoted,
            "wall_seconds": stages,
        }
    )


def serve_rounds(
    settings: RunSettings,
    server_url: str,
    base_name: str,
    base_model_path: str,
    every_s: float,
    train_every_s: float,
    min_groups: int,
) -> None:
    """The continuous loop as two deployments, run one at a time until stopped: collection of
    a fresh batch every `every_s`, and a check every `train_every_s` that trains, swaps,
    evaluates and promotes once the next round has `min_groups` complete groups."""
    parameters = {
        "settings": settings.model_dump(mode="json"),
        "server_url": server_url,
        "base_name": base_name,
        "base_model_path": base_model_path,
    }
    collecting = collect_batch.to_deployment(
        name="collect", interval=every_s, parameters=parameters,
        description="A fresh batch of train tasks from the promoted version.",
    )  # fmt: skip
    training = train_when_ready.to_deployment(
        name="train", interval=train_every_s, parameters={**parameters, "min_groups": min_groups},
        description="Train, swap, evaluate and promote once enough complete groups exist.",
    )  # fmt: skip
    serve(collecting, training, limit=1)
