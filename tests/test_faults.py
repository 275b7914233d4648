"""A task's own failure is that task's: a verifier, plugin or environment that raises or hangs
is recorded against its task, never cancels the other groups, and fails the task for good after
bounded tries (the worker and the stage are exercised end to end in test_e2e)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest

from agents.collector import Failure, GroupSpec, Hooks, collect_groups
from agents.policy import Endpoint
from agents.settings import CollectSettings
from memory import store, workqueue
from memory.records import Batch, Group, Setback, WorkItem
from tests import faulty
from tests.helpers import client_for, completion
from verifiers import catalog, guard
from verifiers.errors import TaskFault
from verifiers.guard import Guard
from verifiers.task import Task

SUMS = "tests.faulty:sums"
QUICK = Guard(deadline_s=0.5)


def guarded(function, *args, limits: Guard = QUICK):
    async def main():
        with guard.applied(limits):
            return await guard.run("part", function, *args)

    return anyio.run(main)


def test_a_guarded_call_returns_its_value_and_a_raise_is_one_line() -> None:
    assert guarded(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(TaskFault, match="^part raised KeyError: 'x'$"):
        guarded(lambda: {}["x"])


def test_a_hung_call_is_a_fault_at_its_deadline_and_its_thread_is_interrupted() -> None:
    spinning = threading.Event()

    def spin() -> None:
        spinning.set()
        while True:
            pass

    started = time.monotonic()
    with pytest.raises(TaskFault, match="no answer within 0.5 s"):
        guarded(spin)
    assert time.monotonic() - started < 2.0
    assert spinning.is_set()
    deadline = time.monotonic() + 5
    while any(t.name == "guard part" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the spinning thread was never interrupted"
        time.sleep(0.01)


def test_an_answer_over_the_size_limit_is_wrong_unread() -> None:
    task = catalog.eval_tasks("arithmetic", 1)[0]

    async def main():
        with guard.applied(Guard(max_chars=50)):
            return await catalog.averify(task, "9" * 51)

    verdict = anyio.run(main)
    assert verdict.reward == 0.0 and "over the 50 verified" in verdict.reason


def collect(tasks: list[Task], settings: CollectSettings) -> tuple[list[Group], dict[str, str]]:
    """Collect `tasks` from a scripted server that answers every task correctly."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1, 2, 3]})
        if request.url.path == "/v1/completions":  # an episode's turn, continued from ids
            choice = {"index": 0, "text": "1", "finish_reason": "stop", "token_ids": [5],
                      "prompt_token_ids": body["prompt"],
                      "logprobs": {"tokens": ["1"], "token_logprobs": [-0.5]}}  # fmt: skip
            return httpx.Response(
                200,
                json={
                    "id": "c",
                    "object": "text_completion",
                    "created": 0,
                    "model": "m",
                    "choices": [choice],
                },
            )
        question = body["messages"][-1]["content"]
        answer = next((t.answer for t in tasks if t.question in question), "1")
        return httpx.Response(200, json=completion(f"<answer>{answer}</answer>", [5, 6]))

    failures: dict[str, str] = {}

    def on_failure(task: Task, failure: Failure) -> None:
        failures[task.task_id] = f"{type(failure).__name__}: {failure}"

    async def main() -> list[Group]:
        return await collect_groups(
            Endpoint(client_for(handler), "m"), tasks, GroupSpec(1, "train", settings),
            anyio.CapacityLimiter(8), Hooks(lambda g: None, on_failure),
        )  # fmt: skip

    return anyio.run(main), failures


def test_a_verifier_that_raises_or_hangs_fails_its_own_task_and_no_other() -> None:
    tasks = catalog.train_tasks(SUMS, 8, seed=0, held_out=[])
    settings = CollectSettings(group_size=2, guard=QUICK)
    started = time.monotonic()
    groups, failures = collect(tasks, settings)
    by_question = {t.task_id: t.question for t in tasks}
    assert {by_question[t] for t in failures} == {faulty.RAISES, faulty.HANGS}
    assert len(groups) == 6 and all(g.complete and g.fault is None for g in groups)
    raised = next(f for t, f in failures.items() if by_question[t] == faulty.RAISES)
    assert raised.startswith("TaskFault: task set 'tests.faulty:sums': verify raised ValueError")
    assert time.monotonic() - started < 10


def test_an_environment_that_raises_at_a_step_fails_its_own_episode() -> None:
    tasks = catalog.train_tasks("tests.faulty:counter", 12, seed=1, held_out=[])
    broken = {t.task_id for t in tasks if int(t.answer) % 7 == 3}
    groups, failures = collect(tasks, CollectSettings(group_size=2))
    assert set(failures) == broken and broken
    assert all("environment Counter: step raised RuntimeError" in f for f in failures.values())
    assert {g.task_id for g in groups} == {t.task_id for t in tasks} - broken


def test_a_task_fault_always_counts_and_fails_the_item_with_whose_it_was(tmp_path: Path) -> None:
    engine = store.open_store(f"sqlite:///{tmp_path / 'q.db'}")
    batch = Batch(round_index=1, purpose="train", policy_version="v0")
    item = WorkItem(round_index=1, purpose="train", policy_version="v0", task_id="t", plan="{}")
    with store.transaction(engine) as session:
        workqueue.enqueue(session, [item])
    for attempt in range(3):
        with workqueue.claiming(engine) as session:
            [claimed] = workqueue.claim(session, "w", 1, 60, batch, now=1000.0 + attempt)
        with store.transaction(engine) as session:
            setback = Setback(error="verify raised ValueError", fault="task", counted=True,
                              retry_after_s=0, max_failures=3)  # fmt: skip
            state = workqueue.give_back(session, claimed.id, "w", setback, now=1000.0 + attempt)
    assert state == "failed"
    with store.transaction(engine) as session:
        [failed] = workqueue.failed(session)
    assert failed.fault == "task" and failed.failures == 3 and "ValueError" in failed.error


def test_an_item_whose_workers_keep_dying_fails_as_the_task_s_fault(tmp_path: Path) -> None:
    engine = store.open_store(f"sqlite:///{tmp_path / 'q.db'}")
    item = WorkItem(round_index=1, purpose="train", policy_version="v0", task_id="t", plan="{}")
    with store.transaction(engine) as session:
        workqueue.enqueue(session, [item])
    now = 1000.0
    for claim in range(workqueue.MAX_ABANDONED + 1):  # each worker dies holding it
        with workqueue.claiming(engine) as session:
            claimed = workqueue.claim(session, "w", 1, lease_s=10, now=now)
        assert len(claimed) == int(claim < workqueue.MAX_ABANDONED)
        now += 11  # the lease runs out
    # The third abandoned claim failed it instead of handing it out a fourth time.
    with store.transaction(engine) as session:
        [failed] = workqueue.failed(session)
        assert workqueue.queue_depth(session) == 0
    assert failed.fault == "task" and failed.abandoned == workqueue.MAX_ABANDONED
    assert "workers stopped while collecting it" in (failed.error or "")
