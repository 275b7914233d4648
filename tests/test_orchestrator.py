"""Which Prefect API a long-lived command uses: PREFECT_API_URL, else a local server that is
reused when already running and started (detached) when not."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from flows import orchestrator


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
