"""Prefect work pools on real parts: a Prefect server on PostgreSQL, `prefect worker start`
processes, the store in PostgreSQL, and a real vLLM server.

1. Two process workers on one pool run two drain runs that share a batch; one worker and its
   run are killed with SIGKILL in the middle, and every task still ends with exactly one
   complete group.
2. `flywheel deploy` registers the loop on two pools. A training run and a collection run
   overlap on different workers, and a second training run that would overlap the first is
   cancelled by Prefect (the deployment's concurrency limit), not by a lock of ours. The round
   leaves its table and a link to its report as artifacts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import anyio
import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, temporary_settings
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from agents.settings import CollectSettings
from flows import orchestrator, pools
from flows.flywheel import DRAIN
from memory import store, workqueue
from memory.models import RolloutGroupRow, WorkItemRow
from memory.records import Batch
from tests.helpers import free_port, make_group, pg_database, wait_until
from verifiers.reasoning import train_tasks
from workers import worker

pytestmark = [pytest.mark.vllm, pytest.mark.postgres, pytest.mark.slow]

PREFECT = Path(sys.executable).parent / "prefect"
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for the store."""
    with pg_database("flywheel") as url:
        yield url


@pytest.fixture
def prefect_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A Prefect server of its own, on PostgreSQL (many polling workers), stopped at the end;
    this process talks to it."""
    with pg_database("prefect") as url:
        async_url = make_url(url).set(drivername="postgresql+asyncpg")
        connection = async_url.render_as_string(hide_password=False)
        monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", connection)
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
        home = tmp_path / "prefect"
        api = orchestrator.api_url(home, free_port(), timeout_s=180)
        try:
            with temporary_settings({PREFECT_API_URL: api}):
                yield api
        finally:
            os.killpg(int((home / "server.pid").read_text()), signal.SIGTERM)
            time.sleep(2)  # its connections close before the database is dropped


def start_worker(
    api: str, pool: str, name: str, tmp_path: Path, limit: int = 1
) -> subprocess.Popen:
    """`prefect worker start` in its own process group, polling every second."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    environment |= {
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(tmp_path / f"{name}-home"),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    command = [str(PREFECT), "worker", "start", "--pool", pool, "--name", name,
               "--limit", str(limit)]  # fmt: skip
    log = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen(
        command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(workers: list[subprocess.Popen]) -> None:
    for process in workers:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
    for process in workers:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def started_runs(deployment: str) -> list[FlowRun]:
    """The deployment's flow runs that left the schedule (any later scheduled ones excluded)."""
    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[found.id]))
        )
    return [r for r in runs if r.state_type is not None and r.state_type.value != "SCHEDULED"]


def flow_run(run_id: uuid.UUID) -> FlowRun:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def enqueue(db_url: str, batch: Batch, tasks: int, seed: int) -> list[str]:
    sampling = CollectSettings(group_size=4, max_tokens=24)
    chosen = train_tasks("arithmetic", tasks, seed=seed, held_out=[])
    with store.transaction(store.open_store(db_url)) as session:
        workqueue.enqueue(
            session,
            worker.plan_items(batch, chosen, lambda t: worker.Plan(task=t, sampling=sampling)),
        )
    return [t.task_id for t in chosen]


def logs(tmp_path: Path, db_url: str | None = None) -> str:
    """The workers' logs, and the queue's counts."""
    text = "\n".join(f"{p.name}: {p.read_text()[-1500:]}" for p in tmp_path.glob("*.log"))
    if db_url is None:
        return text
    with store.transaction(store.open_store(db_url)) as session:
        states = session.execute(
            select(WorkItemRow.state, func.count()).group_by(WorkItemRow.state)
        ).all()
    return f"{text}\nqueue: {dict(states)}"


def test_two_pool_workers_share_a_batch_and_a_killed_one_loses_nothing(
    pg_url: str, prefect_api: str, tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    engine = store.open_store(pg_url)
    batch = Batch(round_index=1, purpose="train", policy_version=tiny_model_path.name)
    assert anyio.run(pools.ensure_pool, "collect") is True
    assert anyio.run(pools.ensure_pool, "collect") is False  # exists: kept
    pools.drain.to_deployment(
        name="drain", entrypoint_type=pools.EntrypointType.MODULE_PATH,
        parameters={"db_url": pg_url, "server_url": tiny_server, "idle_s": 40,
                    "settings": {"lease_s": 4, "lot_size": 2}},
    ).apply(work_pool_name="collect")  # fmt: skip
    workers = [start_worker(prefect_api, "collect", f"w{i}", tmp_path) for i in range(2)]
    try:
        runs = [run_deployment(DRAIN, timeout=0).id for _ in range(2)]
        wait_until(  # both runs wait for work; then the batch arrives
            lambda: all(flow_run(r).state_type.value == "RUNNING" for r in runs), 240,
            lambda: logs(tmp_path, pg_url),
        )  # fmt: skip
        task_ids = enqueue(pg_url, batch, 48, seed=5)

        def both_hold_claims() -> bool:
            with store.transaction(engine) as session:
                done = workqueue.progress(session, batch)["done"]
                return done >= 1 and len(workqueue.claim_holders(session)) == 2

        wait_until(both_hold_claims, 240, lambda: logs(tmp_path, pg_url))
        with store.transaction(engine) as session:
            owner = workqueue.claim_holders(session)[0]
        doomed_run = psutil.Process(int(owner.split("/")[1]))  # host/pid/random
        doomed_id = doomed_run.environ()["PREFECT__FLOW_RUN_ID"]
        doomed_worker = next(w for w in workers if w.pid in {p.pid for p in doomed_run.parents()})
        os.killpg(doomed_worker.pid, signal.SIGKILL)
        doomed_run.kill()  # the machine is gone: worker and run, no goodbye

        survivor = next(r for r in runs if str(r) != doomed_id)
        wait_until(
            lambda: flow_run(survivor).state_type.value in FINAL, 300,
            lambda: logs(tmp_path, pg_url),
        )  # fmt: skip
        assert flow_run(survivor).state_type.value == "COMPLETED", logs(tmp_path, pg_url)
    finally:
        stop(workers)

    with store.transaction(engine) as session:
        groups = store.load_groups(session, "train", 1, tiny_model_path.name)
        per_task = session.execute(
            select(RolloutGroupRow.task_id, func.count()).group_by(RolloutGroupRow.task_id)
        ).all()
        counts = workqueue.progress(session, batch)
    assert sorted(g.task_id for g in groups) == sorted(task_ids)
    assert all(n == 1 for _, n in per_task)
    assert all(len(g.first_attempts) == 4 for g in groups)
    assert counts == {"queued": 0, "claimed": 0, "done": 48, "failed": 0}


def test_training_and_collection_overlap_and_training_runs_one_at_a_time(
    pg_url: str, prefect_api: str, tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    engine = store.open_store(pg_url)
    base = tiny_model_path.name
    with store.transaction(engine) as session:  # what round 1 trains on: rewards that differ
        for index in range(2):
            group = make_group([1.0, 0.0, 1.0, 0.0], task_id=f"seeded-{index}")
            store.save_group(session, group.model_copy(update={"policy_version": base}))
    drain = Batch(round_index=9, purpose="train", policy_version=tiny_model_path.name)
    enqueue(pg_url, drain, 48, seed=9)  # the drain's batch
    command = [
        sys.executable, "-m", "cli", "deploy", "--server-url", tiny_server,
        "--model", str(tiny_model_path), "--db", pg_url, "--workdir", str(tmp_path),
        "--collect-pool", "cpu", "--train-pool", "gpu", "--every", "3600", "--train-every",
        "3600", "--tasks", "2", "--group-size", "4", "--eval-tasks", "2", "--lease", "4",
    ]  # fmt: skip
    deployed = subprocess.run(
        command, env={**os.environ, "PREFECT_API_URL": prefect_api}, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    assert "work pool cpu: created (process)" in deployed.stdout
    assert "deployment flywheel-train/train on pool gpu" in deployed.stdout
    assert "prefect worker start --pool cpu" in deployed.stdout

    workers = [
        start_worker(prefect_api, "cpu", "collector", tmp_path),
        start_worker(prefect_api, "gpu", "trainer", tmp_path, limit=2),
    ]
    try:
        drain = run_deployment(DRAIN, parameters={"idle_s": 60.0}, timeout=0).id
        for _ in range(2):
            run_deployment("flywheel-train/train", timeout=0)
        wait_until(
            lambda: flow_run(drain).state_type.value in FINAL
            and all(r.state_type.value in FINAL for r in started_runs("flywheel-train/train")),
            400, lambda: logs(tmp_path, pg_url),
        )  # fmt: skip
        drained, trained = flow_run(drain), started_runs("flywheel-train/train")
    finally:
        stop(workers)

    assert drained.state_type.value == "COMPLETED", logs(tmp_path)
    # Any scheduled run joins the two we started: whatever ran, one ran at a time.
    done = [r for r in trained if r.state_type.value == "COMPLETED"]
    cancelled = [r for r in trained if r.state_type.value == "CANCELLED"]
    assert len(done) + len(cancelled) == len(trained) and done and cancelled, logs(tmp_path)
    assert not any(_overlap(a, b) for i, a in enumerate(done) for b in done[i + 1 :])
    assert any(_overlap(run, drained) for run in done), [(r.start_time, r.end_time) for r in done]
    with store.transaction(engine) as session:
        record = store.training_round(session, 1)
        promoted = store.promoted_policy(session)
    assert record is not None and record.status == "done" and record.policy_out
    with get_client(sync_client=True) as client:  # the round's table and its report, in the UI
        keys = {artifact.key for artifact in client.read_artifacts()}
    assert {"flywheel-rounds", "flywheel-report"} <= keys
    assert (tmp_path / "report.html").is_file()
    assert promoted is not None  # the base, or the round's version if the gate let it through


def _overlap(a: FlowRun, b: FlowRun) -> bool:
    def span(run: FlowRun) -> tuple[datetime, datetime]:
        assert run.start_time is not None and run.end_time is not None
        return run.start_time, run.end_time

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
