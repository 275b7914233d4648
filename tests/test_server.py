"""Server lifecycle failures, each a one-line `ServingError` (no vLLM needed)."""

import contextlib
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from serving.errors import ServingError
from serving.server import (
    ServerSettings,
    VllmServer,
    close_together,
    ensure_port_free,
    free_port,
)
from tests.helpers import wait_until


def settings(tmp_path: Path, python: Path, port: int = 1) -> ServerSettings:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return ServerSettings(
        python=python,
        model_path=model,
        served_name="m",
        port=port,
        startup_timeout_s=20,
        log_path=tmp_path / "server.log",
    )


def test_port_taken_is_reported() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServingError, match=f"port {port} on 127.0.0.1 is already in use"):
            ensure_port_free("127.0.0.1", port)


def test_missing_interpreter_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ServingError, match="interpreter .* not found"):
        VllmServer(settings(tmp_path, tmp_path / "nope" / "python")).start()


def test_server_that_dies_reports_its_log_tail(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'loading model'\necho 'CUDA out of memory' >&2\nexit 3\n")
    fake.chmod(0o755)
    port = free_port()
    with pytest.raises(ServingError, match="exited with code 3.*CUDA out of memory"):
        VllmServer(settings(tmp_path, fake, port)).start()


def test_server_that_never_answers_times_out(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(
        f"#!/bin/sh\necho 'stuck'\nexec {sys.executable} -c 'import time; time.sleep(60)'\n"
    )
    fake.chmod(0o755)
    s = settings(tmp_path, fake, free_port()).model_copy(update={"startup_timeout_s": 2})
    with pytest.raises(ServingError, match="did not become healthy in 2 s.*stuck"):
        VllmServer(s).start()


def test_two_servers_get_disjoint_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import server

    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert server.split_cores() == ("0,1", "2")
    assert server.all_cores() == "0,1,2"  # a server alone on the host takes every core
    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: {5})
    with pytest.raises(ServingError, match="at least 2 cores"):
        server.split_cores()
    settings = ServerSettings(python=Path(sys.executable), model_path=Path("m"), served_name="m",
                              cpus="1", weights="fixed")  # fmt: skip
    process = VllmServer(settings)
    assert process._env()["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "--enable-lora" not in process._command()
    assert process._env().get("VLLM_SERVER_DEV_MODE") == os.environ.get("VLLM_SERVER_DEV_MODE")


def test_a_server_with_a_key_is_launched_so_that_every_route_takes_it() -> None:
    from serving import server

    settings = ServerSettings(python=Path(sys.executable), model_path=Path("m"), served_name="m")
    open_command = VllmServer(settings)._command()
    assert open_command[1] == "-c" and f'run_module("{server.API_SERVER}"' in open_command[2]
    assert "GUARDED_PREFIX" not in open_command[2]
    keyed = VllmServer(settings.model_copy(update={"api_key": "k"}))._command()
    assert keyed[1] == "-c" and 'GUARDED_PREFIX = ("/",)' in keyed[2]
    assert keyed[3:] == open_command[3:] and "k" not in keyed  # the key goes by environment


# Stands in for vLLM's API server: starts an engine process in its group, and both ignore
# SIGTERM (as vLLM may while it loads), so that only SIGKILL stops them.
FAKE_API_SERVER = """
import os, pathlib, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
engine = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                           "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
pathlib.Path(os.environ["FAKE_PIDS"]).write_text(f"{os.getpid()} {engine.pid}")
time.sleep(600)
"""

# Starts a server, then waits to be killed.
OWNER = """
import sys, time
from pathlib import Path
from serving.server import ServerSettings, VllmServer
model, port, log = sys.argv[1:]
VllmServer(ServerSettings(python=Path(sys.executable), model_path=Path(model), served_name="m",
                          port=int(port), log_path=Path(log), stop_grace_s=2.0)).launch()
time.sleep(600)
"""


def test_a_server_whose_owner_is_killed_stops_with_its_engine(tmp_path: Path) -> None:
    """`flywheel run` killed outright (by the kernel, for want of memory) leaves no server
    holding its port, cores and memory: the server's launch stops its whole group once its
    owner is gone, with SIGKILL where SIGTERM is ignored. While the owner lives, it runs on."""
    import signal
    import subprocess

    fake = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    fake.mkdir(parents=True)
    for package in (fake, fake.parent, fake.parent.parent):
        (package / "__init__.py").write_text("")
    (fake / "api_server.py").write_text(FAKE_API_SERVER)
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "FAKE_PIDS": str(pids)}
    (tmp_path / "model").mkdir()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "model"), str(free_port()),
         str(tmp_path / "server.log")],
        env=env, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    try:
        wait_until(pids.exists, 30.0, lambda: f"no server: {(tmp_path / 'server.log').read_text()}")
        server, engine = map(int, pids.read_text().split())
        time.sleep(2.0)
        assert not _gone(server) and not _gone(engine), "stopped while its owner lives"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        wait_until(
            lambda: _gone(server) and _gone(engine), 20.0, lambda: "the server outlived its owner"
        )
    finally:
        owner.kill()
        for pid in map(int, pids.read_text().split() if pids.exists() else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie awaiting its reaper has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_reviewer_beside_the_policy_caches_its_prompts_in_small_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reviewer's prompts share their opening and are asked several times over: its KV
    blocks are small enough to be reused; the policy keeps vLLM's own."""
    from serving import server

    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: {0, 1})
    base = ServerSettings(python=Path(sys.executable), model_path=Path("m"), served_name="m")
    policy, reviewer = server.side_by_side(base, base.model_copy(update={"port": 8012}))
    asked = VllmServer(reviewer)._command()
    assert asked[asked.index("--block-size") + 1] == str(server.REVIEWER_BLOCK) == "32"
    assert "--block-size" not in VllmServer(policy)._command()
    assert (policy.cpus, reviewer.cpus, reviewer.weights) == ("0", "1", "fixed")


def test_bfloat16_only_where_the_cpu_computes_it(tmp_path: Path) -> None:
    from serving.server import cpu_dtype

    info = tmp_path / "cpuinfo"
    info.write_text("flags\t: fpu sse avx2 avx512f\n")
    assert cpu_dtype(info) == "float32"
    info.write_text("flags\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    assert cpu_dtype(info) == "bfloat16"
    assert cpu_dtype(tmp_path / "missing") == "float32"


@pytest.mark.parametrize(("work", "alive"), [("while True: pass", True), ("time.sleep(60)", False)])
def test_a_server_that_computes_without_answering_is_busy_and_one_that_idles_is_not(
    tmp_path: Path, work: str, alive: bool
) -> None:
    """A server that takes connections and answers none: busy while it computes (a long
    prefill), stalled while it does not."""
    port = free_port()
    listen = f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()"
    code = f"import socket, time\n{listen}\n{work}"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{code}"\n')
    fake.chmod(0o755)
    s = settings(tmp_path, fake, port).model_copy(update={"probe_timeout_s": 1.0})
    server = VllmServer(s)
    try:
        server.launch()
        time.sleep(1.0)
        assert not server.alive(), "the first probe has no earlier reading to compare with"
        assert server.alive() is alive
    finally:
        server.close()


def test_servers_side_by_side_are_told_to_stop_before_either_is_waited_on(
    tmp_path: Path,
) -> None:
    """Two servers that ignore SIGTERM (as vLLM may while it starts): the second is told to stop
    while the first still waits out its grace period, so they stop in one period, not two."""
    servers = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        script = folder / "fake.py"
        script.write_text(
            "import os, pathlib, signal, time\n"
            f"root = pathlib.Path({str(tmp_path)!r})\n"
            f"(root / '{name}.pid').write_text(str(os.getpid()))\n"
            "def told(*_):\n"
            "    other = int((root / 'a.pid').read_text())\n"
            "    alive = other != os.getpid() and os.path.exists(f'/proc/{other}')\n"
            f"    (root / '{name}.told').write_text('a alive' if alive else '-')\n"
            "signal.signal(signal.SIGTERM, told)\n"
            "while True:\n"
            "    time.sleep(0.1)\n"
        )
        fake = folder / "python"
        fake.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
        fake.chmod(0o755)
        each = settings(folder, fake, free_port()).model_copy(update={"stop_grace_s": 1.0})
        servers.append(VllmServer(each))
    for server in servers:
        server.launch()
    pids = [tmp_path / "a.pid", tmp_path / "b.pid"]
    wait_until(lambda: all(p.exists() for p in pids), 20.0, lambda: "a fake server never started")
    close_together(servers)
    assert (tmp_path / "a.told").read_text() == "-"
    assert (tmp_path / "b.told").read_text() == "a alive", "b was told only after a was killed"
    for name in ("a", "b"):
        assert not os.path.exists(f"/proc/{(tmp_path / f'{name}.pid').read_text()}")
