"""What every benchmark shares: where the project is, and a results file that says how it was made.

`write_results(path, payload, made, figures)` writes the JSON atomically with the provenance every
figure needs (the command that produced it, the commit it ran, the date it started, the machine:
CPU model, cores, the serving dtype) and its headline `Figure`s, each with its n and 95% interval:
`python -m bench.results` builds the results page from those alone. Take `provenance()` when the
run starts: the commit at the end may be another.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from reports.intervals import mean_interval, wilson
from serving.server import ServerSettings
from serving.server import free_port as free_port  # the benchmarks take it from here

ROOT = Path(__file__).resolve().parent.parent
# Run as `.venv/bin/python bench/NAME.py`, a benchmark's own folder leads the import path; the
# checkout (for the example agent and the tests' random adapters) comes last, after the packages.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt("terminated")


def _run_as_benchmark() -> bool:
    main = sys.modules.get("__main__")
    path = Path(getattr(main, "__file__", None) or "/").resolve()
    return path.parent == ROOT / "bench" and threading.current_thread() is threading.main_thread()


# A benchmark stopped with `kill` unwinds as Ctrl-C does: the model servers it started, in
# sessions of their own, stop on the way out instead of outliving it.
if _run_as_benchmark() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _terminate)

SERVER_PYTHON = ROOT / ".venv-serving" / "bin" / "python"  # the model server's environment
# The flywheel command of this checkout: a benchmark may run from a copy of the tree (a git
# worktree) while the environment's editable install points at another.
FLYWHEEL = [sys.executable, "-m", "cli"]


def checkout_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with this checkout first on PYTHONPATH, so commands
    started from a benchmark run this checkout's code."""
    base = dict(os.environ if env is None else env)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
    return base


@dataclass(frozen=True)
class Figure:
    """One headline figure of a run: `value` over `n` measurements, with its 95% interval
    (`low`, `high`; None where one measurement has no spread to go by), and whose work it counts
    (`counts`: "policy", "reviewer", "system"...; empty where the question does not arise)."""

    name: str
    value: float
    n: int
    low: float | None = None
    high: float | None = None
    unit: str = ""
    counts: str = ""

    @classmethod
    def mean(cls, name: str, values: list[float], unit: str = "", counts: str = "") -> Figure:
        """The mean of independent measurements, with Student's interval."""
        mean, low, high = mean_interval(values)
        finite = len(values) > 1
        return cls(name, mean, len(values), low if finite else None, high if finite else None,
                   unit, counts)  # fmt: skip

    @classmethod
    def median(cls, name: str, values: list[float], unit: str = "", counts: str = "") -> Figure:
        """The median of independent measurements, with the distribution-free interval between
        the order statistics around it (ranks n/2 -+ 1.96 sqrt(n)/2)."""
        ordered = sorted(values)
        n = len(ordered)
        if n < 6:
            return cls(name, statistics.median(ordered), n, None, None, unit, counts)
        half = 1.959964 * math.sqrt(n) / 2
        low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
        return cls(name, statistics.median(ordered), n, ordered[low], ordered[high], unit, counts)

    @classmethod
    def share(cls, name: str, successes: int, n: int, counts: str = "") -> Figure:
        """A share of `n`, with Wilson's interval."""
        low, high = wilson(successes, n)
        return cls(name, successes / n if n else 0.0, n, low, high, "share", counts)

    @classmethod
    def single(cls, name: str, value: float, unit: str = "", counts: str = "") -> Figure:
        """One measurement: no interval."""
        return cls(name, value, 1, None, None, unit, counts)


def provenance() -> dict[str, Any]:
    """The command line, commit, UTC date and machine of this run."""
    module = f"bench.{Path(sys.argv[0]).stem}"
    command = shlex.join([".venv/bin/python", "-m", module, *map(portable, sys.argv[1:])])
    return {
        "command": command,
        "commit": _git("rev-parse", "--short", "HEAD"),
        # Uncommitted changes to anything but results (a run writes its own results file).
        "dirty": bool(
            _git(
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!bench/results",
                ":!bench/README.md",
            )
        ),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
    }


def portable(argument: str) -> str:
    """A command-line argument as another checkout would write it: a path under the repository
    relative to it, any other absolute path by its name alone (it names this machine only)."""
    flag, equals, value = (
        argument.rpartition("=") if argument.startswith("--") else ("", "", argument)
    )
    if not value.startswith("/"):
        return argument
    path = Path(value)
    value = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    return f"{flag}{equals}{value}"


def write_results(
    path: Path, payload: dict[str, Any], made: dict[str, Any], figures: list[Figure]
) -> None:
    """`payload` with the provenance `made` (from `provenance()` at the start) and the headline
    `figures`, written to `path` atomically."""
    from memory.folders import atomic_file

    record = {"provenance": made, "figures": [asdict(f) for f in figures], **payload}
    with atomic_file(path) as out:
        out.write(json.dumps(record, indent=2) + "\n")


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from serving.server import cpu_dtype

        dtype = cpu_dtype()
    except ImportError:  # a machine with the trainer's packages only
        dtype = "unknown"
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "dtype": dtype,
        "system": platform.platform(terse=True),
    }


CHILD_STOP_S = 120.0  # how long an interrupted benchmark waits for a command to stop its servers


def run_command(
    command: list[str], log: Path | None = None, **popen: Any
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True)`, except in two ways. Its output
    goes to files, not pipes, and is read once the command ends: a server the command started
    in a session of its own (Prefect's temporary one) holds the pipes open after the command is
    killed outright (for want of memory, say), and reading them to their end would wait on it
    for good. And when the benchmark is interrupted, `subprocess.run` kills the command outright,
    and the model servers it started outlive both: here the command is asked to stop (SIGTERM)
    and given `CHILD_STOP_S` to stop them first. With `log`, its stderr (a flywheel command's
    progress) is written there as it comes, to be followed while it runs."""
    with contextlib.ExitStack() as files:
        out = files.enter_context(tempfile.TemporaryFile("w+"))
        err = (
            files.enter_context(log.open("w+", encoding="utf-8"))
            if log
            else files.enter_context(tempfile.TemporaryFile("w+"))
        )
        with subprocess.Popen(command, stdout=out, stderr=err, text=True, **popen) as process:
            try:
                process.wait()
            except KeyboardInterrupt:
                process.terminate()
                try:
                    process.wait(timeout=CHILD_STOP_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())


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


def server_settings(model_path: Path, log_path: Path, **options: Any) -> ServerSettings:
    """A vLLM server of `model_path` from the serving environment, serving it under its folder's
    name on a free port (unless `options` name one), logging to `log_path`; `options`: more
    `ServerSettings`."""
    options.setdefault("port", free_port())
    return ServerSettings(python=SERVER_PYTHON, model_path=model_path,
                          served_name=model_path.name, log_path=log_path, **options)  # fmt: skip
