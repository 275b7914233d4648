"""Server lifecycle against a real vLLM (tiny model): a server that stops producing tokens is
detected by the generation probe and restarted."""

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from serving.server import ServerSettings, VllmServer
from tests.helpers import SERVER_PYTHON, free_port

pytestmark = pytest.mark.vllm


def test_a_stalled_server_is_restarted(tiny_model_path: Path, tmp_path: Path) -> None:
    if not SERVER_PYTHON.is_file():
        pytest.skip("no model server environment")
    settings = ServerSettings(
        python=SERVER_PYTHON,
        model_path=tiny_model_path,
        served_name="tiny",
        port=free_port(),
        probe_timeout_s=5,
        log_path=tmp_path / "vllm.log",
    )
    with VllmServer(settings) as server:
        assert not server.ensure_alive(), "a healthy server is left alone"
        process = server._process
        assert process is not None
        os.killpg(process.pid, signal.SIGSTOP)  # alive, listening, producing nothing
        assert not server.alive()
        stop = threading.Event()
        result: list[int] = []
        supervisor = threading.Thread(
            target=lambda: result.append(server.supervise(stop, interval_s=0.5, strikes=2))
        )
        supervisor.start()
        try:
            process.wait(timeout=120)  # the supervisor ends the stalled group...
            deadline = time.monotonic() + 300
            while not server.alive():  # ...and brings a new one up
                assert time.monotonic() < deadline, "no restart within 300 s"
                stop.wait(1.0)
        finally:
            stop.set()
            supervisor.join()
        assert result == [1]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (
            httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code
            == 200
        )
