"""The sandbox attack suite: each attack ends with the right status, the host untouched, the
parent alive and no process left behind. Runs on the strongest isolation this host has; CI
requires bubblewrap (FLYWHEEL_REQUIRE_BWRAP)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import isolated, wait_until
from verifiers.sandbox import (
    UID_BASE,
    UID_RANGE,
    Isolation,
    Limits,
    Sandbox,
    Status,
)

FAST = Limits(wall_s=3.0, cpu_s=2, memory_mb=256, processes=16, output_bytes=4096)


def sandbox_processes() -> list[tuple[int, str]]:
    """(uid, command) of every process, zombies included, running as a sandbox slot's uid."""
    ps = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in ps.stdout.splitlines()]
    return [(int(r[0]), r[2]) for r in rows if UID_BASE <= int(r[0]) < UID_BASE + UID_RANGE]


@pytest.fixture(scope="module", params=list(Isolation))
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return isolated(request.param, FAST)


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """No sandbox process outlives its run: a killed one's zombie may take a moment to be
    reaped by its parent (init, once reparented), so the check waits up to 5 s for that."""
    yield
    wait_until(lambda: not sandbox_processes(), 5.0, lambda: f"left: {sandbox_processes()}")


@pytest.mark.parametrize(
    ("source", "statuses"),
    [
        ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
         {Status.TIMEOUT, Status.KILLED}),
        ("while True:\n    pass", {Status.TIMEOUT, Status.KILLED}),
        ("import time\ntime.sleep(100)", {Status.TIMEOUT}),
        ("import ctypes\nctypes.CDLL(None).sleep(100)", {Status.TIMEOUT}),
        ("import signal\nfor s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
         "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass",
         {Status.TIMEOUT, Status.KILLED}),
        ("x = bytearray(10 * 1024**3)", {Status.ERROR}),
        # On a loaded host the stack may not reach its limit before the wall clock ends it.
        ("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)",
         {Status.ERROR, Status.KILLED, Status.TIMEOUT}),
        ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", {Status.OUTPUT_LIMIT}),
        ("import fcntl, termios\nfcntl.ioctl(0, termios.TIOCSTI, b'x')", {Status.ERROR}),
    ],
    ids=["fork-bomb", "busy-loop", "sleep", "ctypes-sleep", "ignore-signals", "10gb-alloc",
         "deep-recursion", "huge-output", "tiocsti"],
)  # fmt: skip
def test_runaway_code_is_stopped(sandbox: Sandbox, source: str, statuses: set[Status]) -> None:
    execution = sandbox.run(source)
    assert execution.status in statuses, execution
    assert execution.wall_s < FAST.wall_s + 2.0
    assert len(execution.stdout) <= FAST.output_bytes


def test_a_fork_bomb_does_not_starve_the_host(sandbox: Sandbox) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result: list[Status] = []
    thread = threading.Thread(target=lambda: result.append(sandbox.run(bomb).status))
    thread.start()
    probe = subprocess.run(["true"], timeout=2)  # the host can still start processes
    thread.join()
    assert probe.returncode == 0
    assert result and result[0] in (Status.TIMEOUT, Status.KILLED)


def test_writes_outside_the_sandbox_do_not_reach_the_host(sandbox: Sandbox, tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    source = f"""
import importlib, os
importlib.reload(os)
for path in ({str(target)!r}, "/usr/pwned", "/tmp/../usr/pwned", "/etc/pwned", "/root/pwned"):
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError:
        pass
try:
    os.symlink("/etc/passwd", "/tmp/link")
    open("/tmp/link", "a").write("x")
    print("wrote through a link")
except OSError:
    pass
try:
    with open("/tmp/fill", "wb") as f:
        while True:
            f.write(b"x" * 2**20)
except OSError as error:
    print("disk full:", type(error).__name__)
"""
    passwd = Path("/etc/passwd").read_bytes()
    execution = sandbox.run(source)
    assert "wrote" not in execution.stdout
    assert not target.exists() and not Path("/usr/pwned").exists()
    assert not Path("/etc/pwned").exists() and not Path("/root/pwned").exists()
    assert Path("/etc/passwd").read_bytes() == passwd


def test_secrets_and_environment_are_out_of_reach(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "flywheel-secret-7f3a"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    home_secret = Path.home() / ".flywheel-test-secret"
    home_secret.write_text(secret)
    home_secret.chmod(0o600)
    source = f"""
import os, glob
print(dict(os.environ))
for path in ("/proc/1/environ", "/proc/self/environ", {str(home_secret)!r}, "/root/.ssh/id_rsa"):
    try:
        print(open(path, "rb").read())
    except OSError as error:
        print(path, type(error).__name__)
print(glob.glob("/root/*"), glob.glob("/home/*"))
"""
    try:
        execution = sandbox.run(source)
    finally:
        home_secret.unlink()
    assert execution.status is Status.OK
    assert secret not in execution.stdout + execution.stderr


def test_no_network_to_the_internet_or_local_servers(sandbox: Sandbox) -> None:
    if sandbox.isolation is Isolation.PROCESS:
        pytest.skip("a bare process cannot be kept off the network: code task sets refuse it")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        source = f"""
import socket
for host in (("1.1.1.1", 80), ("127.0.0.1", {port}), ("localhost", {port})):
    try:
        socket.create_connection(host, timeout=1)
        print("connected", host)
    except OSError as error:
        print("blocked", host, type(error).__name__)
"""
        execution = sandbox.run(source)
        with pytest.raises(TimeoutError):
            server.accept()
    assert execution.stdout.count("blocked") == 3, execution


def test_killing_the_parent_or_everything_hurts_no_one(sandbox: Sandbox) -> None:
    """A neighbour in another slot finishes its work while this one kills all it can."""
    neighbour: list[str] = []
    worker = threading.Thread(
        target=lambda: neighbour.append(
            sandbox.run("import time\ntime.sleep(1)\nprint('ok')").stdout
        )
    )
    worker.start()
    source = """
import os
for pid in (os.getppid(), -1, 0):
    try:
        os.kill(pid, 9)
    except OSError as error:
        print(pid, type(error).__name__)
"""
    parent = os.getppid()
    execution = sandbox.run(source)
    worker.join()
    assert neighbour == ["ok\n"]
    assert execution.status in (Status.OK, Status.KILLED)
    assert os.getppid() == parent  # this process, and its parent, still stand


def test_double_forked_daemons_do_not_outlive_the_run(sandbox: Sandbox) -> None:
    source = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        sys.stdout.close(); sys.stderr.close(); os.close(1); os.close(2)
        time.sleep(60)
    os._exit(0)
print("parent done")
"""
    execution = sandbox.run(source)
    assert execution.stdout == "parent done\n"
    assert sandbox_processes() == []


def test_sandboxes_in_parallel_do_not_share_a_slot(sandbox: Sandbox) -> None:
    threads = [
        threading.Thread(target=sandbox.run, args=("import time\ntime.sleep(1.5)",))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    uids: set[int] = set()
    while len(uids) < 4 and any(thread.is_alive() for thread in threads):
        uids |= {uid for uid, _ in sandbox_processes()}
    for thread in threads:
        thread.join()
    assert len(uids) == 4, uids


@pytest.mark.parametrize("isolation", [Isolation.UNSHARE, Isolation.PROCESS])
def test_fallback_isolation_still_contains_runaways(isolation: Isolation) -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping to a slot uid needs root")
    fallback = Sandbox(limits=FAST, isolation=isolation)
    bomb = fallback.run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    assert bomb.status in (Status.TIMEOUT, Status.KILLED)
    assert fallback.run("x = bytearray(10 * 1024**3)").status is Status.ERROR
    assert fallback.run("print(sum(range(10)))").stdout == "45\n"


def test_unshare_fallback_blocks_the_network() -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping to a slot uid needs root")
    source = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)"
    execution = Sandbox(limits=FAST, isolation=Isolation.UNSHARE).run(source)
    assert execution.status is Status.ERROR
    assert "unreachable" in execution.stderr


def test_unavailable_sandbox_python_is_a_clear_error() -> None:
    from verifiers.errors import VerifierError

    with pytest.raises(VerifierError, match="needs a Python interpreter at /nowhere/python3"):
        Sandbox(python="/nowhere/python3", isolation=Isolation.PROCESS)


def confined(sandbox: Sandbox) -> None:
    """Confidentiality attacks hold only under bubblewrap; code task sets refuse the others."""
    if sandbox.isolation is not Isolation.BUBBLEWRAP:
        pytest.skip(f"{sandbox.isolation} shows the host's files: code task sets refuse it")


def test_reference_solutions_and_the_store_are_out_of_reach(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    confined(sandbox)
    root = Path(__file__).resolve().parent.parent
    store = tmp_path / "flywheel.db"
    store.write_text("secret rows")
    store.chmod(0o644)
    tmp_path.chmod(0o755)
    paths = [root / "verifiers" / "problems.py", root / "verifiers" / "coding.py", store,
             root / ".flywheel" / "flywheel.db", Path("/etc/hostname")]  # fmt: skip
    source = f"""
import glob
for path in {[str(p) for p in paths]!r}:
    try:
        print("read", path, len(open(path).read()))
    except OSError as error:
        print("blocked", path, type(error).__name__)
print(glob.glob({str(root)!r} + "/*"), glob.glob("/home/*"), glob.glob("/work/*"))
"""
    execution = sandbox.run(source)
    assert execution.status is Status.OK, execution
    assert "read" not in execution.stdout and execution.stdout.count("blocked") == len(paths)
    assert "[] [] []" in execution.stdout


def test_filling_tmp_and_dev_shm_stays_inside(sandbox: Sandbox) -> None:
    confined(sandbox)
    before = {d: _free(d) for d in ("/tmp", "/dev/shm")}
    source = """
for folder in ("/tmp", "/dev/shm"):
    try:
        with open(folder + "/fill", "wb") as f:
            for _ in range(64):
                f.write(b"x" * 2**20)
                f.flush()
        print("no limit", folder)
    except OSError as error:
        print("full", folder, error.errno)
"""
    execution = sandbox.run(source)
    assert "no limit" not in execution.stdout and execution.stdout.count("full") == 2, execution
    for folder, free in before.items():  # the host's own tmp and shm got nothing
        assert _free(folder) > free - (4 << 20)
    assert not Path("/dev/shm/fill").exists()


def test_unix_sockets_on_the_host_are_out_of_reach(sandbox: Sandbox, tmp_path: Path) -> None:
    confined(sandbox)
    tmp_path.chmod(0o755)
    path = tmp_path / "gateway.sock"
    with socket.socket(socket.AF_UNIX) as named, socket.socket(socket.AF_UNIX) as abstract:
        named.bind(str(path))
        path.chmod(0o777)
        named.listen()
        abstract.bind("\0flywheel-test-socket")
        abstract.listen()
        source = f"""
import socket
for address in ({str(path)!r}, "\\0flywheel-test-socket", "/run/postgresql/.s.PGSQL.5432"):
    try:
        socket.socket(socket.AF_UNIX).connect(address)
        print("connected", repr(address))
    except OSError as error:
        print("blocked", type(error).__name__)
"""
        execution = sandbox.run(source)
    assert execution.stdout.count("blocked") == 3, execution


def test_nothing_is_left_for_the_next_run(sandbox: Sandbox) -> None:
    confined(sandbox)
    write = "for f in ('/tmp/left', '/dev/shm/left'):\n    open(f, 'w').write('x')\nprint('ok')"
    assert sandbox.run(write).stdout == "ok\n"
    read = "import os\nprint([f for f in ('/tmp/left', '/dev/shm/left') if os.path.exists(f)])"
    assert sandbox.run(read).stdout == "[]\n"


def test_code_task_sets_refuse_every_isolation_but_bubblewrap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from verifiers import catalog, sandbox
    from verifiers.errors import VerifierError

    for weaker in (Isolation.UNSHARE, Isolation.PROCESS):
        monkeypatch.setattr(sandbox, "best_isolation", lambda weaker=weaker: weaker)
        with pytest.raises(
            VerifierError, match=f"needs bubblewrap isolation.*best here is {weaker}"
        ):
            catalog.check("code")


def _free(folder: str) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize
