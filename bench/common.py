"""What every benchmark shares: where the project is, and a results file that says how it was made.

`write_results(path, payload, made)` adds the provenance every figure needs (the command that
produced it, the commit it ran, the date it started, the machine: CPU model, cores) and writes the
JSON atomically. Take `provenance()` when the run starts: the commit at the end may be another.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def provenance() -> dict[str, Any]:
    """The command line, commit, UTC date and machine of this run."""
    command = shlex.join([".venv/bin/python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    return {
        "command": command,
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
    }


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "system": platform.platform(terse=True)}


def write_results(path: Path, payload: dict[str, Any], made: dict[str, Any]) -> None:
    """`payload` with the provenance `made` (from `provenance()` at the start), written to
    `path` atomically."""
    from memory.folders import atomic_file

    with atomic_file(path) as out:
        out.write(json.dumps({"provenance": made, **payload}, indent=2) + "\n")


def stop_serve(process: subprocess.Popen[bytes], workdir: Path) -> None:
    """Stop a `flywheel serve` started in its own process group, and the Prefect server it
    started under `workdir`."""
    import signal

    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)
    pid_file = workdir / "prefect" / "server.pid"
    if pid_file.exists():
        os.killpg(int(pid_file.read_text()), signal.SIGTERM)


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip()
