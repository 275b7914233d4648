"""Scale-out against a real vLLM server: collection workers in separate processes share one
store. One is killed with SIGKILL while it holds claims; two others finish the batch. Every task
ends with exactly one complete group: nothing lost, nothing duplicated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from agents.settings import CollectSettings
from memory import store, workqueue
from memory.models import AttemptRow, RolloutGroupRow
from memory.records import Batch
from verifiers.reasoning import train_tasks
from workers import worker

pytestmark = pytest.mark.vllm

TASKS = 24
GROUP_SIZE = 4


def start_worker(
    db_url: str, server: str, tmp_path: Path, name: str, *extra: str
) -> subprocess.Popen:
    log = (tmp_path / f"{name}.log").open("w")
    command = [
        sys.executable, "-m", "cli", "worker", "--db", db_url, "--server-url", server,
        "--lease", "4", "--lot-size", "3", "--workdir", str(tmp_path), *extra,
    ]  # fmt: skip
    return subprocess.Popen(command, stderr=log, stdout=log, start_new_session=True)


def test_workers_share_a_batch_and_a_killed_one_loses_nothing(
    db_url: str, tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    engine = store.open_store(db_url)
    batch = Batch(round_index=1, purpose="train", policy_version=tiny_model_path.name)
    sampling = CollectSettings(group_size=GROUP_SIZE, max_tokens=24)
    tasks = train_tasks("arithmetic", TASKS, seed=3, held_out=[])
    with store.transaction(engine) as session:
        workqueue.enqueue(
            session,
            worker.plan_items(batch, tasks, lambda t: worker.Plan(task=t, sampling=sampling)),
        )

    doomed = start_worker(db_url, tiny_server, tmp_path, "doomed")
    deadline = time.monotonic() + 120
    while True:  # kill it once it has stored a group and holds claims
        with store.transaction(engine) as session:
            done = workqueue.progress(session, batch)["done"]
            holders = workqueue.claim_holders(session)
        if done >= 1 and holders:
            break
        assert doomed.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait()

    # one task claimed at a time (four in flight), so the first helper up cannot take it all
    helpers = [
        start_worker(
            db_url, tiny_server, tmp_path, f"helper{i}", "--idle-exit", "3", "--lot-size", "1"
        )
        for i in range(2)
    ]
    for helper in helpers:
        assert helper.wait(timeout=300) == 0, (tmp_path / "helper0.log").read_text()[-2000:]

    with store.transaction(engine) as session:
        groups = store.load_groups(session, "train", 1, tiny_model_path.name)
        per_key = session.execute(
            select(RolloutGroupRow.task_id, func.count()).group_by(RolloutGroupRow.task_id)
        ).all()
        attempts = session.scalar(select(func.count()).select_from(AttemptRow))
        counts = workqueue.progress(session, batch)
    assert {g.task_id for g in groups} == {t.task_id for t in tasks}
    assert all(n == 1 for _, n in per_key)
    assert all(len(g.first_attempts) == GROUP_SIZE for g in groups)
    assert all((g.plan.sampling or {})["group_size"] == GROUP_SIZE for g in groups)  # its plan
    assert attempts == TASKS * GROUP_SIZE
    assert counts == {"queued": 0, "claimed": 0, "done": TASKS, "failed": 0}
    stored = [
        int((tmp_path / f"helper{i}.log").read_text().split("stored ")[-1].split()[0])
        for i in range(2)
    ]
    assert all(n > 0 for n in stored), stored  # both helpers did part of the work
