"""`flywheel serve` end to end against a real vLLM server: a local Prefect server is started
and kept, the collection deployment gathers batches on schedule, the training deployment
trains once enough groups exist, and the gateway answers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from memory import store
from tests.helpers import start_serve

pytestmark = pytest.mark.vllm


def test_serve_runs_rounds_on_schedule_and_keeps_its_prefect_server(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    flags = ["--every", "3", "--train-every", "3", "--tasks", "2", "--group-size", "2"]
    run = start_serve(tiny_server, tiny_model_path, tmp_path, [*flags, "--eval-tasks", "2"])
    served, db, prefect_port, gateway_port = run.process, run.db, run.prefect_port, run.gateway_port
    engine = store.open_store(db)
    api = f"http://127.0.0.1:{prefect_port}/api"
    try:
        deadline = time.monotonic() + 400
        while True:
            with store.transaction(engine) as session:
                rounds = store.training_rounds(session)
            if len([r for r in rounds if r.status in ("done", "skipped")]) >= 2:
                break
            assert served.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        only_completed = {"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
        completed = httpx.post(f"{api}/flow_runs/filter", json=only_completed, timeout=10).json()
        assert all(r["deployment_id"] for r in completed)
        flows = {r["flow_id"] for r in completed}
        assert len(flows) == 2  # both deployments ran: collection and training
        with store.transaction(engine) as session:
            trained_on = [len(r.group_ids) for r in store.training_rounds(session)]
        assert all(n >= 2 for n in trained_on)  # each round waited for --tasks complete groups
        models = httpx.get(
            f"http://127.0.0.1:{gateway_port}/v1/models",
            headers={"Authorization": "Bearer admin-key"},
            timeout=10,
        )
        assert models.status_code == 200
    finally:
        os.killpg(served.pid, signal.SIGTERM)
        served.wait(timeout=60)
        assert httpx.get(f"{api}/health", timeout=5).status_code == 200  # it outlives serve
        pid = int((tmp_path / "prefect" / "server.pid").read_text())
        os.killpg(pid, signal.SIGTERM)
