"""The Prefect API that `flywheel run` and `flywheel serve` run their flows against.

The one `PREFECT_API_URL` names (a team's server, or Prefect Cloud), else a local server that
outlives the command: started once, detached, with its database under the work folder, and
found again by the next command on the same port. Its UI shows every run.

Or, for one command (`flywheel run --prefect temporary`, the tests, the benchmarks), a
`temporary` server as Prefect's own ephemeral one (no UI, its database in `PREFECT_HOME`), but
started through `serving.server.owned`: it stops with the command even when the command is
killed outright, where Prefect's own would outlive it and keep its port and memory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx

from flows.errors import FlowError
from serving.server import OWNER, free_port, owned

LOCAL_PORT = 4200
STOP_GRACE_S = 5.0


def api_url(home: Path, port: int = LOCAL_PORT, timeout_s: float = 120.0) -> str:
    """`PREFECT_API_URL` if set, else a local server on `port` (started if not running)."""
    if configured := os.environ.get("PREFECT_API_URL"):
        return configured
    url = f"http://127.0.0.1:{port}/api"
    if not _healthy(url):
        _start(home, port)
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if time.monotonic() > deadline:
                log = home / "server.log"
                raise FlowError(
                    f"the local Prefect server did not start in {timeout_s:.0f} s; see {log}"
                )
            time.sleep(0.5)
    return url


def running(port: int = LOCAL_PORT) -> str | None:
    """`PREFECT_API_URL` if set, else the local server's URL if it answers; starts nothing."""
    if configured := os.environ.get("PREFECT_API_URL"):
        return configured
    url = f"http://127.0.0.1:{port}/api"
    return url if _healthy(url) else None


@contextlib.contextmanager
def temporary(timeout_s: float = 120.0) -> Iterator[str]:
    """A Prefect server for this process only, on a free loopback port; its API URL. Stopped
    when the block ends, and by itself once this process is gone."""
    with tempfile.TemporaryFile() as log:
        port = free_port()
        process = _launch(port, log)
        try:
            url = f"http://127.0.0.1:{port}/api"
            _wait_healthy(url, process, log, timeout_s)
            yield url
        finally:
            _send_queued_logs()
            _stop(process)


def _launch(port: int, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """uvicorn serving Prefect's API as Prefect starts its ephemeral server, through the lines
    that stop it with this process (not importing Prefect here: it reads `PREFECT_API_URL` once,
    when first imported)."""
    arguments = [
        "--factory", "prefect.server.api.server:create_app",
        "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", owned("uvicorn", STOP_GRACE_S), *arguments],
        env={
            **os.environ,
            OWNER: str(os.getpid()),
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",  # Prefect's own mark of such a server
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        },
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def configured() -> str | None:
    """The Prefect API this process already reports to: `PREFECT_API_URL`, or what Prefect's
    settings hold once it is imported (a test harness's server, say)."""
    if url := os.environ.get("PREFECT_API_URL"):
        return url
    if "prefect" not in sys.modules:
        return None
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


@contextlib.contextmanager
def using(url: str) -> Iterator[None]:
    """This process's flows report to `url` within the block."""
    os.environ["PREFECT_API_URL"] = url
    try:
        if "prefect" not in sys.modules:
            yield
        else:  # Prefect read its settings when it was imported
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings({PREFECT_API_URL: url}):
                yield
    finally:
        del os.environ["PREFECT_API_URL"]


def _wait_healthy(
    url: str, process: subprocess.Popen[bytes], log: IO[bytes], timeout_s: float
) -> None:
    """Until the server answers; FlowError with its log's last lines if it exits or takes too
    long (the caller stops it)."""
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            tail = b" | ".join(log.read().strip().splitlines()[-4:]).decode(errors="replace")
            state = f"did not start in {timeout_s:.0f} s"
            if process.returncode is not None:
                state = f"exited with code {process.returncode}"
            raise FlowError(f"the temporary Prefect server {state}: {tail or '(no output)'}")
        time.sleep(0.2)


def _send_queued_logs() -> None:
    """Send the run logs Prefect still holds while the server can take them (else they fail at
    exit, one error each)."""
    if "prefect" in sys.modules:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=STOP_GRACE_S)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the server's process group: SIGTERM, then SIGKILL after the grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _start(home: Path, port: int) -> subprocess.Popen[bytes]:
    home.mkdir(parents=True, exist_ok=True)
    prefect = Path(sys.executable).parent / "prefect"
    log = (home / "server.log").open("ab")
    process = subprocess.Popen(
        [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # it outlives this command
    )
    (home / "server.pid").write_text(f"{process.pid}\n")
    return process


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
