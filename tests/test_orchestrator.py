"""Which Prefect API a command uses: PREFECT_API_URL, else a local server that is reused when
already running and started (detached) when not, or a temporary server of the command's own
that goes when the command does, killed outright included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest

from flows import orchestrator
from tests.helpers import wait_until


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_configured_api_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://prefect.example:4200/api")
    assert orchestrator.api_url(tmp_path) == "http://prefect.example:4200/api"
    assert not (tmp_path / "server.pid").exists()


def test_a_running_local_server_is_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    server = HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert orchestrator.api_url(tmp_path, port) == f"http://127.0.0.1:{port}/api"
    finally:
        server.shutdown()
    assert not (tmp_path / "server.pid").exists()  # nothing was started


def test_a_temporary_server_stops_when_its_block_ends() -> None:
    with orchestrator.temporary() as url:
        assert httpx.get(f"{url}/health", timeout=10.0).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=10.0)


# Starts a temporary server, says where, then waits to be killed.
OWNER = """
import sys, time
from flows import orchestrator
with orchestrator.temporary() as url:
    print(url, flush=True)
    time.sleep(600)
"""


def test_a_temporary_server_whose_command_is_killed_outright_stops_too() -> None:
    """`flywheel run --prefect temporary` killed with SIGKILL (by the kernel, for want of memory)
    leaves no Prefect server behind holding its port and memory, as Prefect's own would."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).parents[1],
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        url = owner.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        assert httpx.get(f"{url}/health", timeout=10.0).status_code == 200
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        wait_until(lambda: not _answers(url), 20.0, lambda: "the server outlived its command")
    finally:
        owner.kill()


def _answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2.0)
    except httpx.ConnectError:
        return False
    return True


def test_a_temporary_server_is_the_one_flows_report_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within `using`, flows report to the temporary server, though Prefect, imported already,
    read its settings before the server existed; afterwards the setting is gone again."""
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow
    def answer() -> int:
        return 42

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with orchestrator.temporary() as url, orchestrator.using(url):
        assert orchestrator.configured() == url
        state = answer(return_state=True)
        assert state.result() == 42
        with get_client(sync_client=True) as client:
            assert client.read_flow_run(state.state_details.flow_run_id).state_type == "COMPLETED"
    assert "PREFECT_API_URL" not in os.environ
