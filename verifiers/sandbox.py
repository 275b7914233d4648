"""A sandbox for untrusted Python: model-written code runs here, never in our process.

1. Isolation, strongest available first: bubblewrap (every namespace unshared, no network, a
   read-only /usr and nothing else of the host's files, size-capped private tmpfs /tmp and
   /dev/shm, an empty environment, a new session, killed with its parent); else `unshare` (no
   network, own pid namespace, but the host filesystem stays readable); else a bare process
   (rlimits and a dropped uid only: it cannot block the network, and says so). Code task sets
   run only under bubblewrap (`verifiers.catalog.check`): the weaker two keep runaways in check
   but show the code the host's files.
2. Under any isolation the code runs as an unprivileged uid of its own slot (root is exempt from
   RLIMIT_NPROC, and one uid per slot keeps `kill -9 -1` inside its slot), under rlimits (address
   space, CPU seconds, processes, file size, open files) and, where cgroups are writable, a pids
   and memory cgroup per slot (on cgroup v2 the controllers are enabled for the sandbox's
   subtree first; `enforcement()` says what a run gets here).
3. Every run sits under a small reaper of ours (a child subreaper): whatever the sandboxed
   code orphans is reaped there, not left as a zombie charged to the slot's uid on a host whose
   init does not reap.
4. The parent enforces the wall-clock deadline and the output cap, then kills whatever is left:
   the process group, everything in the slot's cgroup, every process of the slot's uid. An
   `Execution` reports what happened; a sandboxed program can make its run fail, never ours.
5. A slot is a uid held with a file lock, so sandboxes in separate processes (two collection
   workers) never share one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path

import anyio
from pydantic import BaseModel, ConfigDict

from verifiers.errors import VerifierError

logger = logging.getLogger(__name__)

UID_BASE = 62000
UID_RANGE = 256
LOCK_DIR = Path(tempfile.gettempdir()) / "flywheel-sandbox"
CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSTEM_PYTHON = "/usr/bin/python3"
PR_SET_CHILD_SUBREAPER = 36
UNSHARE_KILLED = b"unshare: sigprocmask unblock failed"
REAPER = f"""
import ctypes, os, sys
ctypes.CDLL(None).prctl({PR_SET_CHILD_SUBREAPER}, 1, 0, 0, 0)
main = os.fork()
if main == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
code = 1
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == main:
        code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


class Isolation(StrEnum):
    BUBBLEWRAP = "bubblewrap"
    UNSHARE = "unshare"
    PROCESS = "process"


class Status(StrEnum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    KILLED = "killed"
    OUTPUT_LIMIT = "output-limit"


class Limits(BaseModel):
    """What one execution may use. The defaults suit a unit-test run of a small function."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    processes: int = 32
    output_bytes: int = 65_536
    file_mb: int = 8
    tmp_mb: int = 16
    open_files: int = 64


class Execution(BaseModel):
    """The outcome of one sandboxed run. Output is decoded with replacement and capped."""

    model_config = ConfigDict(frozen=True)
    schema_version: int = 1

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: Isolation


class Sandbox:
    """Runs Python source under `limits` with the strongest isolation this host offers.

    `run` is blocking and thread-safe; `arun` is its async form, bounded by a limiter of `slots`.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        isolation: Isolation | None = None,
        slots: int = 4,
        python: str | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.isolation = isolation or best_isolation()
        self.python = python or SYSTEM_PYTHON
        if not Path(self.python).is_file():
            raise VerifierError(f"the sandbox needs a Python interpreter at {self.python}")
        self._limiter = anyio.CapacityLimiter(slots)
        if self.isolation is Isolation.PROCESS:
            logger.warning("sandbox isolation is 'process': sandboxed code can reach the network")

    def run(self, source: str, stdin: str = "") -> Execution:
        with _slot() as slot, _cgroup(slot, self.limits) as cgroup:
            command = self._command(source, slot.uid)
            return _execute(command, stdin, self.limits, cgroup, slot.uid, self.isolation)

    async def arun(self, source: str, stdin: str = "") -> Execution:
        return await anyio.to_thread.run_sync(self.run, source, stdin, limiter=self._limiter)

    def _command(self, source: str, uid: int) -> list[str]:
        inner = [self.python, "-I", "-S", "-B", "-c", source]
        if self.isolation is Isolation.BUBBLEWRAP:
            inner = _bubblewrap(self.limits) + inner
        elif self.isolation is Isolation.UNSHARE:
            inner = [
                "unshare", "--user", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                "--mount-proc", "--map-user=65534", "--map-group=65534", *inner,
            ]  # fmt: skip
        reaper = [self.python, "-I", "-S", "-c", REAPER]
        return reaper + _drop_privileges(uid) + _prlimit(self.limits) + inner


def _bubblewrap(limits: Limits) -> list[str]:
    return [
        "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
        "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.tmp_mb << 20), "--tmpfs", "/dev/shm",
        "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp",
        "--uid", "65534", "--gid", "65534", "--",
    ]  # fmt: skip


def _prlimit(limits: Limits) -> list[str]:
    return [
        "prlimit",
        f"--as={limits.memory_mb << 20}",
        f"--cpu={limits.cpu_s}",
        f"--nproc={limits.processes}",
        f"--fsize={limits.file_mb << 20}",
        f"--nofile={limits.open_files}",
        "--core=0",
        "--",
    ]


def _drop_privileges(uid: int) -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]


@dataclass(frozen=True)
class _Slot:
    uid: int
    lock: int


@contextlib.contextmanager
def _slot() -> Iterator[_Slot]:
    """Hold the first free uid in the range, across processes, for the length of one run."""
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    for uid in range(UID_BASE, UID_BASE + UID_RANGE):
        fd = os.open(LOCK_DIR / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield _Slot(uid=uid, lock=fd)
        finally:
            os.close(fd)
        return
    raise VerifierError(f"all {UID_RANGE} sandbox slots are busy")


@dataclass(frozen=True)
class _Cgroup:
    """The per-slot cgroup directories (cgroup v1 controllers, or one v2 directory)."""

    dirs: tuple[Path, ...]

    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files():
            with contextlib.suppress(OSError):
                found |= {int(line) for line in path.read_text().split()}
        return found


@contextlib.contextmanager
def _cgroup(slot: _Slot, limits: Limits) -> Iterator[_Cgroup | None]:
    cgroup = _make_cgroup(slot.uid, limits) if os.geteuid() == 0 else None
    try:
        yield cgroup
    finally:
        if cgroup is not None:
            _sweep(cgroup)


def _make_cgroup(uid: int, limits: Limits) -> _Cgroup | None:
    name = f"flywheel-sandbox/{uid}"
    memory = str(limits.memory_mb << 20)
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        if not _enable_v2_controllers():
            return None
        settings = {CGROUP_ROOT / name: {"pids.max": str(limits.processes), "memory.max": memory}}
    else:
        settings = {
            CGROUP_ROOT / "pids" / name: {"pids.max": str(limits.processes)},
            CGROUP_ROOT / "memory" / name: {"memory.limit_in_bytes": memory},
        }
    try:
        for directory, files in settings.items():
            directory.mkdir(parents=True, exist_ok=True)
            for file, value in files.items():
                (directory / file).write_text(value)
    except OSError as error:
        _warn_once(f"no sandbox cgroup ({error}); rlimits only")
        return None
    return _Cgroup(dirs=tuple(settings))


def _enable_v2_controllers() -> bool:
    """cgroup v2: a child's pids.max and memory.max exist only once its parents delegate the
    controllers (`+pids +memory` in each parent's cgroup.subtree_control)."""
    parent = CGROUP_ROOT / "flywheel-sandbox"
    try:
        parent.mkdir(exist_ok=True)
        for level in (CGROUP_ROOT, parent):
            enabled = (level / "cgroup.subtree_control").read_text().split()
            missing = [c for c in ("pids", "memory") if c not in enabled]
            if missing:
                (level / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
    except OSError as error:
        _warn_once(f"cgroup v2 controllers cannot be enabled ({error}); rlimits only")
        return False
    return True


@cache
def _warn_once(message: str) -> None:
    logger.warning("sandbox: %s", message)


class Enforcement(BaseModel):
    """What a sandboxed run gets on this host: its isolation, whether a cgroup caps its
    processes and memory (and which version), and the rlimits it always gets."""

    model_config = ConfigDict(frozen=True)

    isolation: Isolation
    cgroup: str  # "v1", "v2", or why there is none
    limits: Limits


def enforcement(limits: Limits | None = None) -> Enforcement:
    """Try a cgroup as a run would make one (in a slot of its own), and say what holds."""
    limits = limits or Limits()
    version = "v2" if (CGROUP_ROOT / "cgroup.controllers").exists() else "v1"
    if os.geteuid() != 0:
        found = "none: cgroups need root"
    else:
        with _slot() as slot:
            cgroup = _make_cgroup(slot.uid, limits)
            found = version if cgroup is not None else "none: cgroups are not writable here"
            if cgroup is not None:
                for directory in cgroup.dirs:
                    with contextlib.suppress(OSError):
                        directory.rmdir()
    return Enforcement(isolation=best_isolation(), cgroup=found, limits=limits)


def _sweep(cgroup: _Cgroup, spare: int | None = None) -> None:
    """Kill every process in the slot's cgroup but `spare`, until none is left."""
    deadline = time.monotonic() + 5.0
    while (pids := cgroup.pids() - {spare}) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _execute(
    command: list[str],
    stdin: str,
    limits: Limits,
    cgroup: _Cgroup | None,
    uid: int,
    isolation: Isolation,
) -> Execution:
    started = time.monotonic()
    with tempfile.TemporaryFile() as payload:
        payload.write(stdin.encode())
        payload.seek(0)
        process = subprocess.Popen(
            _enter_cgroup(cgroup) + command,
            stdin=payload,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            cwd="/",
            start_new_session=True,
            pass_fds=(),
        )
    try:
        stdout, stderr, status = _collect(process, limits, started)
    finally:
        _stop(process, cgroup, uid)
    exit_code = process.wait()
    if status is Status.OK and exit_code != 0:
        # 128 + n is how the reaper and bubblewrap report a child killed by signal n; unshare
        # (util-linux 2.38) fails to re-raise a child's fatal signal and says so instead.
        killed = exit_code < 0 or exit_code > 128 or UNSHARE_KILLED in stderr
        status = Status.KILLED if killed else Status.ERROR
    return Execution(
        status=status,
        exit_code=exit_code,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        wall_s=time.monotonic() - started,
        isolation=isolation,
    )


def _enter_cgroup(cgroup: _Cgroup | None) -> list[str]:
    """A shell prefix that moves itself into the cgroup before exec'ing the sandbox, so nothing
    the sandbox forks can start outside it."""
    if cgroup is None:
        return []
    writes = " && ".join(f'echo $$ > "{path}"' for path in cgroup.procs_files())
    return ["/bin/sh", "-c", f'{writes} && exec "$@"', "sh"]


def _collect(
    process: subprocess.Popen[bytes], limits: Limits, started: float
) -> tuple[bytes, bytes, Status]:
    """Read both pipes until they close, the deadline passes, or the output cap is reached."""
    assert process.stdout is not None and process.stderr is not None
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    status = Status.OK
    with selectors.DefaultSelector() as selector:
        for stream in (process.stdout, process.stderr):
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = started + limits.wall_s - time.monotonic()
            if remaining <= 0:
                status = Status.TIMEOUT
                break
            for key, _ in selector.select(timeout=remaining):
                chunk = os.read(key.fd, 65_536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fd] += chunk
            if sum(len(b) for b in buffers.values()) > limits.output_bytes:
                status = Status.OUTPUT_LIMIT
                break
    if status is Status.OK:
        try:
            process.wait(timeout=max(0.0, started + limits.wall_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            status = Status.TIMEOUT
    out, err = (bytes(b[: limits.output_bytes]) for b in buffers.values())
    return out, err, status


def _stop(process: subprocess.Popen[bytes], cgroup: _Cgroup | None, uid: int) -> None:
    """Kill what the run left. With a cgroup, everything but our own child (the reaper) goes
    first, so the reaper collects them all; with none, every process of the slot's uid goes (a
    double-forked daemon leaves the group)."""
    if cgroup is not None:
        _sweep(cgroup, spare=process.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    if cgroup is None and os.geteuid() == 0:
        subprocess.run(["pkill", "-KILL", "-U", str(uid)], check=False)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


@cache
def best_isolation() -> Isolation:
    """The strongest isolation that actually starts a process on this host."""
    for isolation in (Isolation.BUBBLEWRAP, Isolation.UNSHARE):
        if works(isolation):
            return isolation
    return Isolation.PROCESS


@cache
def works(isolation: Isolation) -> bool:
    """Whether `isolation` starts a sandboxed process on this host."""
    command = {Isolation.BUBBLEWRAP: "bwrap", Isolation.UNSHARE: "unshare"}.get(isolation)
    if command is not None and shutil.which(command) is None:
        return False
    try:
        probe = Sandbox(isolation=isolation, limits=Limits(wall_s=5.0)).run("print(6 * 7)")
    except (OSError, VerifierError):
        return False
    return probe.status is Status.OK and probe.stdout.strip() == "42"
