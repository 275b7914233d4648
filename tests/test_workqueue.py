"""The work queue on SQLite and PostgreSQL: idempotent enqueue, atomic claims, leases that run
out and are taken again, and 4 processes claiming at once with no item claimed twice."""

from __future__ import annotations

import json
import multiprocessing
import time
from collections import Counter

from sqlalchemy import select

from memory import workqueue
from memory.models import WorkItemRow
from memory.records import Batch, Setback, WorkItem
from memory.store import open_store, transaction

BATCH = Batch(round_index=1, purpose="train", policy_version="policy-r0")


def items(count: int, round_index: int = 1) -> list[WorkItem]:
    return [
        WorkItem(
            round_index=round_index,
            purpose="train",
            policy_version="policy-r0",
            task_id=f"task-{i:03d}",
            plan=json.dumps({"task": {"task_id": f"task-{i:03d}"}, "group_size": 4}),
        )
        for i in range(count)
    ]


def test_enqueue_is_idempotent_and_keeps_the_plan(db_url: str) -> None:
    engine = open_store(db_url)
    with transaction(engine) as session:
        assert workqueue.enqueue(session, items(5)) == 5
    with transaction(engine) as session:
        assert workqueue.enqueue(session, items(7)) == 2
    with workqueue.claiming(engine) as session:
        claimed = workqueue.claim(session, "w1", limit=1, lease_s=60)
    assert json.loads(claimed[0].plan) == {"task": {"task_id": "task-000"}, "group_size": 4}
    assert claimed[0].claims == 1 and claimed[0].owner == "w1"


def test_claims_do_not_overlap_and_expired_leases_are_taken_again(db_url: str) -> None:
    engine = open_store(db_url)
    with transaction(engine) as session:
        workqueue.enqueue(session, items(4))
    with workqueue.claiming(engine) as session:
        first = workqueue.claim(session, "w1", limit=3, lease_s=60, now=1000.0)
    with workqueue.claiming(engine) as session:
        second = workqueue.claim(session, "w2", limit=3, lease_s=60, now=1001.0)
    assert len(first) == 3 and len(second) == 1
    assert not {i.id for i in first} & {i.id for i in second}
    with workqueue.claiming(engine) as session:  # w1 renews one lease, then goes silent
        assert workqueue.renew(session, "w1", [first[0].id], lease_s=60, now=1030.0) == 1
        assert workqueue.claim(session, "w3", limit=5, lease_s=60, now=1050.0) == []
    with workqueue.claiming(engine) as session:
        retaken = workqueue.claim(session, "w3", limit=5, lease_s=60, now=1070.0)
    assert {i.id for i in retaken} == {first[1].id, first[2].id, second[0].id}
    assert all(i.claims == 2 for i in retaken)
    with transaction(engine) as session:  # w1 lost those: it can no longer renew them
        assert workqueue.renew(session, "w1", [i.id for i in first], lease_s=60) == 1


def test_done_items_are_never_claimed_and_completing_twice_is_harmless(db_url: str) -> None:
    engine = open_store(db_url)
    with transaction(engine) as session:
        workqueue.enqueue(session, items(2))
    with workqueue.claiming(engine) as session:
        claimed = workqueue.claim(session, "w1", limit=2, lease_s=1, now=0.0)
    with transaction(engine) as session:
        assert workqueue.complete(session, claimed[0].id)
        assert not workqueue.complete(session, claimed[0].id)
        assert workqueue.progress(session, BATCH) == {
            "queued": 0,
            "claimed": 1,
            "done": 1,
            "failed": 0,
        }
    with workqueue.claiming(engine) as session:
        again = workqueue.claim(session, "w2", limit=5, lease_s=60, now=100.0)
    assert [i.id for i in again] == [claimed[1].id]


def test_claims_stay_within_their_batch_and_dead_owners_are_released(db_url: str) -> None:
    engine = open_store(db_url)
    with transaction(engine) as session:
        workqueue.enqueue(session, items(2, round_index=1) + items(2, round_index=2))
    with workqueue.claiming(engine) as session:
        second = BATCH.model_copy(update={"round_index": 2})
        claimed = workqueue.claim(session, "dead", limit=10, lease_s=600, batch=second)
    assert {i.round_index for i in claimed} == {2}
    with transaction(engine) as session:
        assert workqueue.claim_holders(session) == ["dead"]
        assert workqueue.release(session, ["dead"], dead=True) == 2
        assert workqueue.queue_depth(session) == 4


def _claim_until_empty(db_url: str, owner: str, found: multiprocessing.Queue, start) -> None:
    engine = open_store(db_url)
    mine: list[int] = []
    start.wait()
    while True:
        with workqueue.claiming(engine) as session:
            claimed = workqueue.claim(session, owner, limit=3, lease_s=600)
        if not claimed:
            break
        time.sleep(0.05)  # working on them: one process alone cannot drain the queue at once
        with transaction(engine) as session:
            for item in claimed:
                workqueue.complete(session, item.id)
        mine += [item.id for item in claimed]
    found.put(mine)


def test_four_processes_claiming_at_once_never_share_an_item(db_url: str) -> None:
    engine = open_store(db_url)
    with transaction(engine) as session:
        workqueue.enqueue(session, items(120))
    context = multiprocessing.get_context("spawn")
    found, start = context.Queue(), context.Barrier(4)
    workers = [
        context.Process(target=_claim_until_empty, args=(db_url, f"w{i}", found, start))
        for i in range(4)
    ]
    for worker in workers:
        worker.start()
    claimed = [found.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    counts = Counter(item for mine in claimed for item in mine)
    assert len(counts) == 120 and max(counts.values()) == 1
    assert sum(1 for mine in claimed if mine) >= 2  # they did run at the same time
    with transaction(engine) as session:
        assert workqueue.progress(session, BATCH) == {
            "queued": 0,
            "claimed": 0,
            "done": 120,
            "failed": 0,
        }


def test_a_given_back_item_waits_out_its_backoff_and_fails_after_max_failures(
    db_url: str,
) -> None:
    engine = open_store(db_url)
    with transaction(engine) as session:
        workqueue.enqueue(session, items(1))

    def claim_at(now: float) -> list[WorkItem]:
        with workqueue.claiming(engine) as session:
            return workqueue.claim(session, "w1", limit=1, lease_s=60, now=now)

    def give_back(item: WorkItem, counted: bool, now: float) -> str | None:
        with transaction(engine) as session:
            setback = Setback(error=f"down at {now}", fault="server", counted=counted,
                              retry_after_s=10, max_failures=2)  # fmt: skip
            return workqueue.give_back(session, item.id, "w1", setback, now=now)

    [item] = claim_at(1000.0)
    assert give_back(item, counted=False, now=1000.0) == "queued"  # an outage: not counted
    assert claim_at(1005.0) == []  # still backing off
    [item] = claim_at(1011.0)
    assert item.failures == 0 and item.error == "down at 1000.0"
    assert give_back(item, counted=True, now=1011.0) == "queued"
    [item] = claim_at(1030.0)
    assert give_back(item, counted=True, now=1030.0) == "failed"
    assert claim_at(5000.0) == []
    with transaction(engine) as session:
        assert workqueue.progress(session, BATCH)["failed"] == 1
        [failed] = workqueue.failed(session, BATCH)
        assert failed.failures == 2 and failed.error == "down at 1030.0"
        assert (
            workqueue.give_back(  # no longer held: nothing changes
                session,
                item.id,
                "w1",
                Setback(
                    error="late", fault="server", counted=True, retry_after_s=0, max_failures=2
                ),
            )
            is None
        )
        assert workqueue.requeue_failed(session, BATCH) == 1
    [item] = claim_at(6000.0)
    assert item.failures == 0


def test_a_worker_whose_server_stays_down_stops_and_gives_everything_back(tmp_path) -> None:
    import anyio
    import pytest

    from agents.errors import ServerUnavailable
    from workers import worker

    engine = open_store(f"sqlite:///{tmp_path / 'q.db'}")
    with transaction(engine) as session:
        workqueue.enqueue(session, items(3))
    settings = worker.WorkerSettings(lot_size=2, outage_s=0.5)

    async def run() -> int:
        return await worker.work(
            engine, "http://127.0.0.1:9", "w1", settings, worker.Shift(lambda: False)
        )

    with pytest.raises(ServerUnavailable, match=r"127.0.0.1:9 does not generate with policy-r0"):
        anyio.run(run)
    with transaction(engine) as session:
        assert workqueue.progress(session, BATCH)["queued"] == 3
        assert workqueue.claim_holders(session) == []


def test_only_dead_workers_of_this_machine_lose_their_claims(tmp_path) -> None:
    import socket
    import subprocess

    from workers.worker import new_owner, release_dead_local_workers

    engine = open_store(f"sqlite:///{tmp_path / 'q.db'}")
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    owners = [new_owner(), f"{host}/{gone.pid}/abcdef", f"elsewhere/{gone.pid}/abcdef", "odd-name"]
    with transaction(engine) as session:
        workqueue.enqueue(session, items(4))
    for owner in owners:
        with workqueue.claiming(engine) as session:
            workqueue.claim(session, owner, limit=1, lease_s=600)
    assert release_dead_local_workers(engine) == 1
    with transaction(engine) as session:
        assert sorted(workqueue.claim_holders(session)) == sorted([owners[0], *owners[2:]])


def test_a_worker_that_fails_gives_its_claims_back_at_once(tmp_path, monkeypatch) -> None:
    import anyio
    import pytest

    from workers import worker

    engine = open_store(f"sqlite:///{tmp_path / 'q.db'}")
    with transaction(engine) as session:
        workqueue.enqueue(session, items(3))

    async def broken(*args, **kwargs) -> int:
        raise RuntimeError("the database went away")

    async def ready(*args, **kwargs) -> None:
        return None

    monkeypatch.setattr(worker, "_collect_lot", broken)
    monkeypatch.setattr(worker.Readiness, "ensure", ready)
    settings = worker.WorkerSettings(lot_size=2)

    async def run() -> int:
        return await worker.work(
            engine, "http://127.0.0.1:9", "w1", settings, worker.Shift(lambda: False)
        )

    with pytest.raises(ExceptionGroup) as failure:
        anyio.run(run)
    assert failure.group_contains(RuntimeError, match="the database went away")
    with transaction(engine) as session:
        assert workqueue.claim_holders(session) == []
        assert workqueue.progress(session, BATCH) == {
            "queued": 3,
            "claimed": 0,
            "done": 0,
            "failed": 0,
        }


def test_a_group_from_a_merged_server_is_recorded_under_its_version() -> None:
    """A merged-weights server answers under its one model name: the group and the policy's
    attempts take the version's name; a reviewer's reflection keeps its own."""
    from tests.helpers import make_group
    from workers.worker import _as_version

    group = make_group([1.0, 0.0]).model_copy(update={"policy_version": "base"})
    reflection = group.attempts[1].model_copy(
        update={"sample_index": 2, "kind": "reflection", "policy_version": "reviewer"}
    )
    group = group.model_copy(update={"attempts": [*group.attempts, reflection]})
    recorded = _as_version(group, "policy-r1")
    assert recorded.policy_version == "policy-r1"
    assert [a.policy_version for a in recorded.attempts] == ["policy-r1", "policy-r1", "reviewer"]


def test_a_task_that_timed_out_under_load_is_given_back_uncounted(tmp_path) -> None:
    """With the server up, a plain failure counts against the task and a `ServerBusy` (a
    deadline passed under a long queue) does not: load never fails a task for good."""
    import anyio

    from agents.errors import ServerBusy, ServerUnavailable
    from workers import worker

    class Up:
        def check(self, version: str) -> None:
            return None

    engine = open_store(f"sqlite:///{tmp_path / 'q.db'}")
    with transaction(engine) as session:
        workqueue.enqueue(session, items(2))
    with workqueue.claiming(engine) as session:
        lot = workqueue.claim(session, "w1", limit=2, lease_s=600)
    busy, failing = (item.id or 0 for item in lot)
    failures = {
        busy: ServerBusy("gave no answer in 60 s (128 requests in flight)", 128),
        failing: ServerUnavailable("answered 500"),
    }
    settings = worker.WorkerSettings(max_failures=1)
    crew = worker._Crew(engine, None, "w1", settings, anyio.CapacityLimiter(1), Up(), None)
    anyio.run(worker._give_back, crew, lot, failures)
    with transaction(engine) as session:
        states = {row.id: (row.state, row.failures) for row in session.scalars(select(WorkItemRow))}
    assert states == {busy: ("queued", 0), failing: ("failed", 1)}


def test_a_worker_whose_answers_came_too_late_under_load_halves_its_load() -> None:
    """From the most requests in flight when deadlines passed, not from the limit it had; a
    plain failure (the server down, a 500) leaves the load alone."""
    import anyio

    from agents.errors import ServerBusy, ServerUnavailable
    from workers.worker import _ease_off

    async def eased(limit: int, failures: list[ServerUnavailable]) -> float:
        limiter = anyio.CapacityLimiter(limit)
        _ease_off(limiter, failures)
        return limiter.total_tokens

    late = [ServerBusy("late", 128), ServerBusy("late", 90), ServerUnavailable("answered 500")]
    assert anyio.run(eased, 256, late) == 64
    assert anyio.run(eased, 40, late) == 20
    assert anyio.run(eased, 1, late) == 1
    assert anyio.run(eased, 256, [ServerUnavailable("connection refused")]) == 256


def test_a_lot_is_claimed_while_earlier_lots_wait_on_their_slowest_groups(
    tmp_path, monkeypatch
) -> None:
    """Two lots of two, each with one slow group (a revision, say): as soon as the fast groups
    are stored there is room for a lot, and the third lot is collected while both wait."""
    import types

    import anyio

    from agents.settings import CollectSettings
    from verifiers.reasoning import train_tasks
    from workers import worker

    engine = open_store(f"sqlite:///{tmp_path / 'q.db'}")
    tasks = train_tasks("arithmetic", 6, seed=5, held_out=[])
    slow = {tasks[0].task_id, tasks[2].task_id}
    plan = worker.Plan(task=tasks[0], sampling=CollectSettings(group_size=2))
    with transaction(engine) as session:
        workqueue.enqueue(
            session, worker.plan_items(BATCH, tasks, lambda t: plan.model_copy(update={"task": t}))
        )
    stored: list[str] = []

    fast_ones: dict[str, anyio.Event] = {}

    async def collect_groups(policy, tasks, spec, limiter, hooks, **kwargs) -> None:
        fast_stored = fast_ones.setdefault("stored", anyio.Event())

        async def one(task) -> None:
            if task.task_id in slow:
                await fast_stored.wait()  # the slow ones end once the third lot is stored
            hooks.on_group(types.SimpleNamespace(task_id=task.task_id))
            if len(stored) == 4:
                fast_stored.set()

        async with anyio.create_task_group() as tg:
            for task in tasks:
                tg.start_soon(one, task)

    async def ready(*args, **kwargs) -> None:
        return None

    monkeypatch.setattr(worker, "collect_groups", collect_groups)
    monkeypatch.setattr(worker, "_store_group", lambda engine, group, item, plan: 1)
    monkeypatch.setattr(worker.Readiness, "ensure", ready)
    settings = worker.WorkerSettings(lot_size=2, lots_in_flight=2, poll_s=0.05)

    async def run() -> int:
        with anyio.fail_after(10):  # claimed only when a whole lot ended, it would never end
            return await worker.work(
                engine, "http://127.0.0.1:9", "w1", settings,
                worker.Shift(lambda: len(stored) == 6, BATCH, lambda g: stored.append(g.task_id)),
            )  # fmt: skip

    assert anyio.run(run) == 6
    assert set(stored[-2:]) == slow


def test_a_plan_queued_by_an_older_version_is_read_as_the_current_one() -> None:
    """Version 1 kept the sampling settings flat and named the guided slots' library lessons
    `experience`; a queue left by it is collected with them nested by method, as version 2."""
    from verifiers.reasoning import train_tasks
    from workers import worker

    [task] = train_tasks("arithmetic", 1, seed=5, held_out=[])
    flat = {"experience": ["carry the one"], "revise": True, "revisions": 4, "revise_blind": True,
            "reflect_retry": True, "reflection": "full", "annealing": None,
            "strategy": {"max_tokens": 32}, "group_size": 2}  # fmt: skip
    old = {"task": task.model_dump(mode="json"), "sampling": flat}
    plan = worker.Plan.model_validate_json(json.dumps(old))
    sampling = plan.sampling
    assert plan.schema_version == 2 and sampling.lessons == ("carry the one",)
    assert sampling.revise.enabled and sampling.revise.revisions == 4 and sampling.revise.blind
    assert sampling.retry.enabled and sampling.retry.reflection == "full"
    assert sampling.strategy.enabled and sampling.strategy.max_tokens == 32
    assert not sampling.anneal.enabled and sampling.group_size == 2
    again = worker.Plan.model_validate_json(plan.model_dump_json())
    assert again == plan and again.conditioning().stored() == {
        "sampling": plan.sampling.model_dump(mode="json")
    }  # the group keeps all of the plan but its task
