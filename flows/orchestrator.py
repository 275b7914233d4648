"""The Prefect API that `flywheel serve` runs its deployments against.

The one `PREFECT_API_URL` names (a team's server, or Prefect Cloud), else a local server that
outlives the command: started once, detached, with its database under the work folder, and
found again by the next command on the same port. Its UI shows every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flows.errors import FlowError

LOCAL_PORT = 4200


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
