"""The stages of a round as Prefect tasks: collect, curate, train and swap.

1. `collect` enqueues a batch on the store's work queue and works it here, with any other
   workers sharing the store, until every task is done or failed. A task that failed by its
   own doing (its verifier, environment or sandbox raised or hung, `max_failures` times) is
   left out with its reason, and the batch goes on; one that failed for want of a server fails
   the stage, so no figure is ever computed from calls the server could not answer.
2. `curate` grows the experience library from a round's lessons the verifier confirmed: the
   principles of retries that beat their parent, and insights a later attempt succeeded with.
3. `train` runs one TRL round on complete groups and publishes the adapter.
4. `merge` folds the round's adapter into the base weights (merged mode); `swap` serves the
   new version, as an adapter or as merged weights reloaded in place. It is the one stage
   Prefect retries (twice, 5 s then 30 s), because serving what is already served is a no-op.
   Collection is retried by the work queue, per task; training by running again, from the
   trainer's last save.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TypeVar

import anyio
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from sqlalchemy import Engine
from tqdm import tqdm

from agents import ruler
from agents.errors import PolicyError, ServerUnavailable
from agents.examples import ExampleBook
from agents.outcome import OutcomeSettings
from agents.policy import Endpoint, PolicyClient
from agents.settings import CollectSettings
from flows.settings import RunSettings
from memory import library, sessions, store, workqueue
from memory.embedding import Embedder
from memory.library import Admission
from memory.records import INSIGHTS, Attempt, Batch, Group, GroupPurpose, LessonDraft, PolicyVersion
from memory.retrieval import Index
from serving.adapters import ensure_loaded
from trainer import distributed
from trainer.round import RoundResult
from verifiers.task import Task
from workers import worker
from workers.readiness import Readiness

log = logging.getLogger(__name__)
T = TypeVar("T")


def within_deadline(stage: T, settings: RunSettings) -> T:
    """The stage with its deadline: one that runs past `stage_timeout_s` fails (Prefect)."""
    bounded: T = stage.with_options(  # type: ignore[attr-defined]
        timeout_seconds=settings.stage_timeout_s
    )
    return bounded


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
    that failed by its own doing is left out (logged, and kept on its work item); one that
    failed for want of a server fails the stage."""
    db = store.shared_engine(settings.db_url)
    batch = Batch(round_index=round_index, purpose=purpose, policy_version=version)
    shaping = settings.outcome if purpose == "train" else None
    await Readiness(db, server_url, settings.outage_s).ensure(version, swap=True)
    with store.transaction(db) as session:
        done = {g.task_id for g in store.load_groups(session, purpose, round_index, version)}
    todo = [t for t in tasks if t.task_id not in done]
    examples = await own_examples(db, todo, sampling) if purpose == "train" else {}
    plan = _planner(settings, db, purpose, sampling, shaping, examples)
    with store.transaction(db) as session:
        workqueue.enqueue(session, worker.plan_items(batch, todo, plan))
        workqueue.requeue_failed(session, batch)  # a re-run gives them another chance
    get_run_logger().info(
        "%s with %s: %d tasks (%d already stored)", purpose, version, len(tasks), len(done)
    )
    worker.release_dead_local_workers(db)
    reviewer = reviewer_endpoint(settings)
    # A progress bar on a terminal; logs already say how far a batch is everywhere else.
    bar = tqdm(total=len(todo), desc=f"{purpose} {version}", unit="task", leave=False,
               disable=not sys.stderr.isatty())  # fmt: skip
    try:
        await worker.work(
            db,
            server_url,
            worker.new_owner(),
            worker.WorkerSettings(concurrency=settings.concurrency, outage_s=settings.outage_s),
            worker.Shift(lambda: worker.batch_done(db, batch), batch, lambda g: bar.update(1)),
            reviewer=reviewer,
        )
    finally:
        bar.close()
        if reviewer is not None:
            await reviewer.client.aclose()
    wanted = {t.task_id for t in tasks}
    with store.transaction(db) as session:
        failed = workqueue.failed(session, batch)
        groups = store.load_groups(session, purpose, round_index, version)
    server = [item for item in failed if item.fault != "task"]
    if server:
        raise ServerUnavailable(
            f"{len(server)} of {len(tasks)} {purpose} tasks failed {server[0].failures} times "
            f"(run again to retry them); the last error: {server[0].error}"
        )
    for item in failed:
        get_run_logger().warning(
            "%s: %s task left out, failed by its own doing: %s", item.task_id, purpose, item.error
        )
    return [g for g in groups if g.task_id in wanted]


async def own_examples(
    db: Engine, tasks: list[Task], sampling: CollectSettings
) -> dict[str, tuple[str, str]]:
    """With `own_examples` on, each task's worked example: the policy's own verified answer to
    the nearest task it solved in earlier rounds (`agents.examples`); tasks with none are
    shown the task set's."""
    if not (sampling.own_examples and sampling.guided_slots()):
        return {}
    book = ExampleBook()
    with store.transaction(db) as session:
        for group in store.solved_groups(session, "train", book.capacity):  # oldest first
            book.record(group)
    found = {task.task_id: await book.nearest(task) for task in tasks}
    shown = {task_id: example for task_id, example in found.items() if example is not None}
    log.info("own examples: %d of %d tasks shown one", len(shown), len(tasks))
    return shown


def _planner(
    settings: RunSettings,
    db: Engine,
    purpose: GroupPurpose,
    sampling: CollectSettings,
    shaping: OutcomeSettings | None,
    examples: dict[str, tuple[str, str]],
) -> Callable[[Task], worker.Plan]:
    """How each task is collected; train tasks get their own example when there is one, and
    the library's lessons when it is on."""

    def sampled(task: Task) -> CollectSettings:
        example = examples.get(task.task_id)
        return sampling if example is None else sampling.model_copy(update={"example": example})

    if not (settings.library.enabled and purpose == "train"):
        return lambda task: worker.Plan(task=task, sampling=sampled(task), outcome=shaping)
    with store.transaction(db) as session:
        stored = library.lessons(session)
        vectors = library.embeddings(session, [lesson.id for lesson in stored])
    index = Index(stored, vectors, _embedder())

    def plan(task: Task) -> worker.Plan:
        hits = index.search(task.question, task.task_id, task.taskset, k=settings.library.k)
        lessons = tuple(hit.lesson.text for hit in hits)
        return worker.Plan(
            task=task,
            sampling=sampled(task).model_copy(update={"lessons": lessons}),
            outcome=shaping,
            experience_ids=[hit.lesson.id for hit in hits],
            similarities=[hit.score for hit in hits],
            library=settings.library,
        )

    return plan


@task(cache_policy=NO_CACHE)
def curate(settings: RunSettings, groups: list[Group]) -> Admission:
    """Grow the library from this round's lessons that the verifier confirmed."""
    drafts = confirmed_lessons(groups)
    with store.transaction(store.shared_engine(settings.db_url)) as session:
        report = library.admit(session, drafts, settings.library, _embedder().embed_bytes)
        size = library.size(session)
    get_run_logger().info(
        "library: %d lessons added, %d merged, %d refused; %d active",
        len(report.added), len(report.merged), len(report.refused), size,
    )  # fmt: skip
    return report


def confirmed_lessons(groups: list[Group]) -> list[LessonDraft]:
    """Lessons the verifier confirmed, for the task set: the principle of a retry that beat its
    parent, and a well-formed insight that was in the prompt of a later attempt that succeeded
    (an insight nothing succeeded with stays out)."""
    helped = {
        line
        for g in groups
        for a in g.attempts
        if a.context == INSIGHTS and a.correct and a.guidance
        for line in a.guidance.splitlines()
    }

    def confirmed(attempt: Attempt) -> bool:
        if attempt.kind == "insight":
            return attempt.format_ok and attempt.guidance in helped
        return attempt.kind == "retry" and bool(attempt.improved)

    return [
        LessonDraft(
            kind="insight" if a.kind == "insight" else "principle",
            scope="task_type",
            scope_key=g.taskset,
            text=a.guidance,
            source=f"{a.kind} of group {g.id}, slot {a.sample_index}",
        )
        for g in groups
        for a in g.attempts
        if a.guidance and confirmed(a)
    ]


@cache
def _embedder() -> Embedder:
    return Embedder()


async def judge_captured(settings: RunSettings) -> int:
    """Score the unrated episode groups of captured traffic by the reviewer's ranking (RULER);
    the number of episodes scored. A group the judge could not score stays unrated."""
    reviewer = reviewer_endpoint(settings)
    assert reviewer is not None, "the settings require a reviewer to judge"
    db = store.shared_engine(settings.db_url)
    with store.transaction(db) as session:
        unrated = sessions.episode_groups(session, rated=False)
    scored = 0
    try:
        for group in unrated:
            try:
                scores = await ruler.judge(reviewer, group.question, group.attempts)
            except PolicyError as exc:
                log.warning("judge: %s left unrated: %s", group.task_id, exc)
                continue
            with store.transaction(db) as session:
                for sid, score in zip(group.plan.sessions, scores, strict=True):
                    store.record_session_feedback(session, sid, score, "judged against its group")
            scored += len(scores)
    finally:  # a server failure propagates; the client is closed either way
        await reviewer.client.aclose()
    return scored


def reviewer_endpoint(settings: RunSettings) -> Endpoint | None:
    if settings.reviewer_url is None or settings.reviewer_model is None:
        return None
    return Endpoint(PolicyClient(settings.reviewer_url), settings.reviewer_model)


@task(cache_policy=NO_CACHE)
def train(
    settings: RunSettings, groups: list[Group], base_model: Path, parent: PolicyVersion, name: str
) -> RoundResult:
    return _train_round(settings, groups, base_model, parent, name)


@task(cache_policy=NO_CACHE)
async def train_beside(
    settings: RunSettings, groups: list[Group], base_model: Path, parent: PolicyVersion, name: str
) -> RoundResult:
    """`train` in a thread of its own, so that the flow's event loop goes on collecting the next
    round meanwhile; its deadline ends the wait (the thread finishes its step on its own)."""
    return await anyio.to_thread.run_sync(
        _train_round, settings, groups, base_model, parent, name, abandon_on_cancel=True
    )


def _train_round(
    settings: RunSettings, groups: list[Group], base_model: Path, parent: PolicyVersion, name: str
) -> RoundResult:
    parent_path = Path(parent.adapter_path) if parent.adapter_path else None
    return distributed.train(
        distributed.RoundRequest(
            groups=groups,
            base_model=base_model,
            parent_adapter=parent_path,
            adapters_root=settings.adapters_root,
            name=name,
            settings=settings.train,
        )
    )


@task(cache_policy=NO_CACHE)
def merge(settings: RunSettings, base_model: Path, adapter_path: str, name: str) -> str:
    """The version's merged weights, published beside the adapter (a no-op when published)."""
    from trainer.merge import merge_version

    return str(merge_version(base_model, Path(adapter_path), settings.merged_root, name))


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 30])
async def swap(settings: RunSettings, server_url: str, version: PolicyVersion) -> None:
    """Serve the new version: its adapter hot-loaded (on the server and every replica: one that
    cannot load it fails the stage, so no version is evaluated or promoted that a replica does
    not serve), or its merged weights reloaded in place; a no-op where it is already served."""
    if settings.weights == "lora":
        assert version.adapter_path is not None
        for url in (server_url, *settings.replicas):
            await anyio.to_thread.run_sync(
                ensure_loaded, url, version.name, Path(version.adapter_path)
            )
        return
    readiness = Readiness(store.shared_engine(settings.db_url), server_url, settings.outage_s)
    await readiness.ensure(version.name, swap=True)
