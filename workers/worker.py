"""Collection workers: claim queued tasks from the store, collect their groups, store them.

1. A collection batch (round, purpose, policy version) is enqueued as one work item per task,
   with its plan: the task, the sampling settings and the outcome shaping. Any number of
   workers, in any process on any machine sharing the database and the model server, claim
   items in small lots under leases, and renew the leases while they work.
2. A group is stored and its item marked done in one transaction, by natural key: an item
   collected twice (its lease ran out under a slow worker) is stored once, and its outcome
   counts are added once.
3. `flywheel run` is itself a worker for its own batch, and waits until the batch is done; a
   worker that dies stops renewing, and its items are taken again when its leases run out (at
   once, for dead workers on this machine).
4. Insights (RLTLDR) are shared within one worker's lot, not across workers.
5. When the plan carries library lessons, the group's with/without gain is credited to them in
   the same transaction (EDGE's utility).
6. A group that could not be collected is not stored: its item goes back to the queue with
   backoff (`workqueue.give_back`). The task's own failure (`TaskFault`: its verifier,
   environment or sandbox raised or hung) is always counted, up to `max_failures`, after which
   the item fails with the reason and the batch goes on without it. For the server's failure,
   one probe decides whose it was: a server that still generates makes it the item's failure
   (counted, up to `max_failures`), a server that does not makes it an outage (not counted).
   A deadline passed under load (`ServerBusy`) is never counted: the queue was too long, not
   the task at fault. The worker then halves the requests it keeps in flight, and grows them
   back by one a stored group (`_ease_off`). Before each lot the worker waits for the server to
   generate with the lot's version (`workers.readiness`), up to `outage_s`; after that it stops
   with `ServerUnavailable`, giving back everything it held.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Engine

from agents import outcome
from agents.collector import Failure, GroupSpec, Hooks, collect_groups, first_failure
from agents.errors import ServerBusy, ServerUnavailable
from agents.outcome import OutcomeSettings
from agents.policy import Endpoint, PolicyClient
from agents.settings import CollectSettings
from agents.watchdog import WatchdogSettings
from memory import library, store, workqueue
from memory.library import LibrarySettings
from memory.records import LIBRARY_CONTEXTS, Batch, Group, GroupPlan, Record, Setback, WorkItem
from verifiers.task import Task
from workers.readiness import Readiness

log = logging.getLogger(__name__)


class WorkerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    lease_s: float = Field(120.0, gt=0, description="how long a claim holds without renewal")
    lot_size: int = Field(16, ge=1, description="items claimed at a time")
    lots_in_flight: int = Field(
        4,
        ge=1,
        description="lots' worth of tasks collected at once: enough that the policy's server "
        "samples new groups while a reviewer revises the ones before",
    )
    poll_s: float = Field(2.0, gt=0, description="wait between claims when nothing is free")
    concurrency: int = Field(64, ge=1, description="requests in flight to the model server")
    max_failures: int = Field(3, ge=1, description="failures of a task, server up, before it fails")
    retry_s: float = Field(5.0, ge=0, description="first backoff of a given-back task; doubles")
    outage_s: float = Field(300.0, gt=0, description="how long the server may stay down")
    watchdog: WatchdogSettings = WatchdogSettings()

    def backoff(self, failures: int) -> float:
        return min(self.retry_s * 2.0 ** max(failures - 1, 0), 60.0)


class Plan(Record):
    """What a worker needs to collect one item: stored on the item as JSON text, typed here.

    Version 2 nests each method's sampling settings in a table of its own (`CollectSettings`),
    names the guided slots' library lessons `sampling.lessons`, and carries the library's
    settings, which credit them; a version 1 plan (queued by an older flywheel) is read as
    version 2.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = 2
    task: Task
    sampling: CollectSettings
    outcome: OutcomeSettings | None = None
    experience_ids: list[int] = Field(default_factory=list)  # library lessons in the guided slots
    similarities: list[float] = Field(default_factory=list)
    library: LibrarySettings = LibrarySettings()

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, stored: Any) -> Any:
        stored_v1 = isinstance(stored, dict) and "schema_version" not in stored
        if not stored_v1 or not isinstance(stored.get("sampling"), dict):
            return stored  # built in code, or stored by version 2 (which stores its version)
        sampling = _sampling_v2(dict(stored.get("sampling") or {}))
        return {**stored, "sampling": sampling, "schema_version": 2}

    def conditioning(self) -> GroupPlan:
        """What the group collected under this plan keeps of it: all but the task."""
        return GroupPlan(
            sampling=self.sampling.model_dump(mode="json"),
            outcome=None if self.outcome is None else self.outcome.model_dump(mode="json"),
            experience_ids=self.experience_ids,
            similarities=self.similarities,
        )

    def share_key(self) -> str:
        """Items whose plans agree but for the task are collected together."""
        return self.model_dump_json(exclude={"task"})


V1_REVISE = {"revise": "enabled", "revisions": "revisions", "revise_temperature": "temperature",
             "revise_partial": "partial", "revise_blind": "blind"}  # fmt: skip
V1_MOVED = {*V1_REVISE, "experience", "reflect_retry", "reflection", "annealing", "strategy"}


def _sampling_v2(old: dict[str, Any]) -> dict[str, Any]:
    """Version 1's flat sampling settings, nested by method as version 2 has them."""
    new = {key: value for key, value in old.items() if key not in V1_MOVED}
    new["lessons"] = old.get("lessons", old.get("experience", []))
    new["revise"] = {field: old[key] for key, field in V1_REVISE.items() if key in old}
    new["retry"] = {"enabled": old.get("reflect_retry", False)} | (
        {"reflection": old["reflection"]} if "reflection" in old else {}
    )
    schedule, strategy = old.get("annealing"), old.get("strategy")
    new["anneal"] = {"enabled": schedule is not None} | ({"schedule": schedule} if schedule else {})
    new["strategy"] = {**(strategy or {}), "enabled": strategy is not None}
    return new


def new_owner() -> str:
    """A worker identity: this machine, this process, and a random part for reuse of pids."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"


def here(db_url: str, server_url: str) -> tuple[str, str]:
    """The store and the model server as this machine reaches them: `FLYWHEEL_DB_URL` and
    `FLYWHEEL_SERVER_URL` where set (a worker on another machine), else the given ones."""
    return (
        os.environ.get("FLYWHEEL_DB_URL") or db_url,
        os.environ.get("FLYWHEEL_SERVER_URL") or server_url,
    )


class IdleClock:
    """True once the queue has been empty for `limit` seconds (never, without a limit)."""

    def __init__(self, engine: Engine, limit: float | None) -> None:
        self.engine, self.limit = engine, limit
        self.since: float | None = None

    def expired(self) -> bool:
        if self.limit is None:
            return False
        with store.transaction(self.engine) as session:
            empty = workqueue.queue_depth(session) == 0
        if not empty:
            self.since = None
            return False
        self.since = self.since or time.monotonic()
        return time.monotonic() - self.since >= self.limit


def plan_items(batch: Batch, tasks: list[Task], plan: Callable[[Task], Plan]) -> list[WorkItem]:
    return [
        WorkItem(
            round_index=batch.round_index,
            purpose=batch.purpose,
            policy_version=batch.policy_version,
            task_id=task.task_id,
            plan=plan(task).model_dump_json(),
        )
        for task in tasks
    ]


def release_dead_local_workers(engine: Engine) -> int:
    """Put back the claims of workers on this machine whose process is gone."""
    host = socket.gethostname()
    with store.transaction(engine) as session:
        dead = [owner for owner in workqueue.claim_holders(session) if _dead_here(owner, host)]
        released = workqueue.release(session, dead, dead=True) if dead else 0
    if released:
        log.info("released %d claims of %d dead workers on this machine", released, len(dead))
    return released


def _release_own(engine: Engine, owner: str) -> None:
    """A worker that stops, for any reason, gives back what it had not finished at once."""
    with store.transaction(engine) as session:
        released = workqueue.release(session, [owner], dead=False)
    if released:
        log.warning("worker %s stopped with %d tasks unfinished: put back", owner, released)


def batch_done(engine: Engine, batch: Batch) -> bool:
    with store.transaction(engine) as session:
        counts = workqueue.progress(session, batch)
    return counts["queued"] == 0 and counts["claimed"] == 0


@dataclass(frozen=True)
class Shift:
    """What a worker works on, and for how long: claims of `batch` only (any batch, if None),
    until `until()` is true; `on_stored` hears of every group it stores."""

    until: Callable[[], bool]
    batch: Batch | None = None
    on_stored: Callable[[Group], None] | None = None


@dataclass(frozen=True)
class _Crew:
    """What every lot of one worker shares."""

    engine: Engine
    client: PolicyClient
    owner: str
    settings: WorkerSettings
    limiter: anyio.CapacityLimiter
    readiness: Readiness
    reviewer: Endpoint | None


async def work(
    engine: Engine,
    server_url: str,
    owner: str,
    settings: WorkerSettings,
    shift: Shift,
    reviewer: Endpoint | None = None,
) -> int:
    """Claim and collect lots for the `shift`; returns the number of groups this worker
    stored. `lots_in_flight` lots' worth of tasks are open at once, and a lot is claimed as
    soon as there is room for it, not when a whole lot ends, so the server stays busy while a
    lot waits on its slowest groups (a reviewer's revision, a retry)."""
    client = PolicyClient(server_url, watchdog=settings.watchdog)
    readiness = Readiness(engine, server_url, settings.outage_s)
    crew = _Crew(engine, client, owner, settings, anyio.CapacityLimiter(settings.concurrency),
                 readiness, reviewer)  # fmt: skip
    until, batch, on_stored = shift.until, shift.batch, shift.on_stored
    stored, open_items = 0, 0  # items claimed, neither stored nor given back yet
    room = settings.lot_size * settings.lots_in_flight

    async def run_lot(lot: list[WorkItem]) -> None:
        nonlocal stored, open_items
        left = len(lot)

        def finished(group: Group) -> None:
            nonlocal open_items, left
            open_items, left = open_items - 1, left - 1
            if on_stored is not None:
                on_stored(group)

        try:
            for version in sorted({item.policy_version for item in lot}):
                await readiness.ensure(version)
            count = await _collect_lot(crew, lot, finished)
            stored += count  # not `stored += await`: that reads `stored` before lots overlap
        finally:
            open_items -= left

    try:
        async with anyio.create_task_group() as tg:
            while True:
                if open_items + settings.lot_size > room:
                    await anyio.sleep(0.05)
                    continue
                if until():
                    break
                if batch is not None:  # wait out an outage before claiming, not holding claims
                    await readiness.ensure(batch.policy_version)
                with workqueue.claiming(engine) as session:
                    lot = workqueue.claim(
                        session, owner, settings.lot_size, settings.lease_s, batch
                    )
                if not lot:
                    await anyio.sleep(settings.poll_s if open_items == 0 else 0.2)
                    continue
                open_items += len(lot)
                tg.start_soon(run_lot, lot)
    except* ServerUnavailable as outage:  # the server stayed down: the worker stops
        raise first_failure(outage) from None
    finally:
        await client.aclose()
        _release_own(engine, owner)
    return stored


async def _collect_lot(crew: _Crew, lot: list[WorkItem], on_stored: Callable[[Group], None]) -> int:
    """Collect a lot, renewing its leases meanwhile; items of one batch and plan settings are
    collected together (so they share an insight board). Items whose group failed go back to
    the queue."""
    engine, settings, limiter, readiness = crew.engine, crew.settings, crew.limiter, crew.readiness
    stored = 0
    failures: dict[int, Failure] = {}

    async def collect_share(share: list[tuple[WorkItem, Plan]]) -> None:
        nonlocal stored
        plans = {item.task_id: (item, plan) for item, plan in share}
        first, first_plan = share[0]

        def on_group(group: Group) -> None:
            nonlocal stored
            if limiter.total_tokens < settings.concurrency:
                limiter.total_tokens += 1  # the load eased off after a passed deadline grows back
            item, plan = plans[group.task_id]
            stored += _store_group(engine, group, item, plan)
            on_stored(group)

        def on_failure(task: Task, failure: Failure) -> None:
            failures[plans[task.task_id][0].id or 0] = failure

        await collect_groups(
            Endpoint(crew.client, readiness.served_as(first.policy_version)),
            [plan.task for _, plan in plans.values()],
            GroupSpec(first.round_index, first.purpose, first_plan.sampling),
            limiter,
            Hooks(on_group, on_failure),
            reviewer=crew.reviewer,
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(_keep_leases, engine, crew.owner, [item.id for item in lot], settings)
        async with anyio.create_task_group() as collecting:
            planned = [(item, Plan.model_validate_json(item.plan)) for item in lot]  # once each
            for _, share in groupby(sorted(planned, key=_share_key), key=_share_key):
                collecting.start_soon(collect_share, list(share))
        tg.cancel_scope.cancel()
    if failures:
        _ease_off(limiter, failures.values())
        await _give_back(crew, lot, failures)
    return stored


def _ease_off(limiter: anyio.CapacityLimiter, failures: Iterable[Failure]) -> None:
    """Deadlines that passed under load (`ServerBusy`): halve the requests this worker keeps in
    flight, from the most that were in flight then. Each group stored adds one back, up to
    `concurrency`, so a server slower than the load settles where its answers come in time."""
    crowds = [failure.in_flight for failure in failures if isinstance(failure, ServerBusy)]
    if not crowds:
        return
    eased = max(1, min(int(limiter.total_tokens), max(crowds)) // 2)
    if eased < limiter.total_tokens:
        log.warning(
            "answers came too late with %d requests in flight: %d at most from now on",
            max(crowds), eased,
        )  # fmt: skip
        limiter.total_tokens = eased


async def _give_back(crew: _Crew, lot: list[WorkItem], failures: dict[int, Failure]) -> None:
    """Put failed items back. The task's own failures always count; for the server's, one
    probe per version says whether they count."""
    engine, owner, settings, readiness = crew.engine, crew.owner, crew.settings, crew.readiness
    items = {item.id: item for item in lot if item.id in failures}
    server = {i for i, failure in failures.items() if isinstance(failure, ServerUnavailable)}
    versions = {item.policy_version for i, item in items.items() if i in server}
    up = {v: await anyio.to_thread.run_sync(readiness.check, v) is None for v in versions}
    with store.transaction(engine) as session:
        for item_id, item in items.items():
            assert item_id is not None
            failure = failures[item_id]
            counted = item_id not in server or (
                up[item.policy_version] and not isinstance(failure, ServerBusy)
            )
            setback = Setback(
                error=str(failure), fault="server" if item_id in server else "task",
                counted=counted, retry_after_s=settings.backoff(item.failures + int(counted)),
                max_failures=settings.max_failures,
            )  # fmt: skip
            state = workqueue.give_back(session, item_id, owner, setback)
            log.warning(
                "%s: %s (%s)", item.task_id, failures[item_id],
                "failed for good" if state == "failed" else "given back",
            )  # fmt: skip


def _store_group(engine: Engine, group: Group, item: WorkItem, plan: Plan) -> int:
    """Store the group, with the plan it was collected under, and finish its item in one
    transaction; 1 if the group was new."""
    group = _as_version(group, item.policy_version)
    group = group.model_copy(update={"plan": plan.conditioning()})
    with store.transaction(engine) as session:
        if plan.outcome is not None and plan.outcome.enabled:
            counts = store.outcome_counts(session, group.task_id)
            group = outcome.shape(group, counts, plan.outcome)
        [(group_id, new)] = store.save_groups(session, [group])
        if new and plan.outcome is not None and plan.outcome.enabled:
            store.add_outcomes(session, group.task_id, [a.answer_key for a in group.first_attempts])
        if new and plan.experience_ids:
            library.record_use(session, group_id, plan.experience_ids, plan.similarities)
            library.credit(session, group_id, experience_gain(group), plan.library)
        assert item.id is not None
        workqueue.complete(session, item.id)
    return int(new)


def _as_version(group: Group, version: str) -> Group:
    """The group recorded under the version that sampled it (a merged-weights server answers
    under its one model name, whatever version it holds). Attempts another model wrote (a
    reviewer's reflections) keep their own name."""
    served = group.policy_version
    if served == version:
        return group
    attempts = [
        a.model_copy(update={"policy_version": version}) if a.policy_version == served else a
        for a in group.attempts
    ]
    return group.model_copy(update={"policy_version": version, "attempts": attempts})


def experience_gain(group: Group) -> float:
    """EDGE's gain: success rate of the slots shown library lessons minus that of bare slots
    (0 when either side is empty)."""
    firsts = [a for a in group.first_attempts if a.error is None]
    guided = [a.correct for a in firsts if a.context in LIBRARY_CONTEXTS]
    bare = [a.correct for a in firsts if not a.guided]
    if not guided or not bare:
        return 0.0
    return sum(guided) / len(guided) - sum(bare) / len(bare)


async def _keep_leases(
    engine: Engine, owner: str, item_ids: list[int | None], settings: WorkerSettings
) -> None:
    ids = [i for i in item_ids if i is not None]
    while True:
        await anyio.sleep(settings.lease_s / 3)
        with store.transaction(engine) as session:
            workqueue.renew(session, owner, ids, settings.lease_s)


def _share_key(planned: tuple[WorkItem, Plan]) -> tuple[int, str, str, str]:
    item, plan = planned
    return item.round_index, item.purpose, item.policy_version, plan.share_key()


def _dead_here(owner: str, host: str) -> bool:
    """True for an owner from `new_owner` on this host whose process is gone."""
    parts = owner.split("/")
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return False
    return not _alive(int(parts[1]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
