"""The vLLM server process: start it from its own environment, prove it generates, stop it.

1. The server runs from a separate Python environment (vLLM's pins conflict with Prefect's), as
   vLLM's `vllm.entrypoints.openai.api_server`, bound to loopback, through a few lines (`LAUNCH`)
   that stop it when the process that started it is gone. It serves new versions
   either as LoRA adapters hot-loaded under new names (`weights="lora"`), or as merged weights
   reloaded in place through vLLM's dev-mode routes (`weights="merged"`, `serving.weights`),
   which leaves LoRA off and the model on its fast path. A restarted server starts from the base
   weights; whoever needs a version serves it again (`workers.readiness`).
2. Healthy means `/health` answers 200 *and* a 1-token generation succeeds: a dead engine can still
   answer some routes. A probe that times out on a busy server still counts as alive when the
   engine's generated-token counter (`/metrics`) moved since the last probe, or when the
   server's processes computed on a quarter of a core since then: one scheduler step of a long
   prefill on one core can outlast several probes without a token to show for it.
3. Tool calls work the OpenAI way (`tools`, `tool_choice` auto, required or named): the server
   parses `<tool_call>` blocks into `tool_calls` (vLLM's `hermes` parser, the format of the Qwen2.5
   template). A model whose chat template ignores tools, SmolLM2's, is served with its twin from
   `serving/templates/` that adds them and renders everything else exactly as the original.
4. Every failure is one line: the port is taken, the interpreter is missing, or the server died or
   never became healthy, with the last lines of its log.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict

from serving import access, probe
from serving.errors import ServingError

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 8
BUSY_CORES = 0.25  # a server computing on a quarter of a core between probes is busy, not hung
TEMPLATES = Path(__file__).resolve().parent / "templates"
TOOL_TEMPLATES = {  # the sha256 of a chat template that ignores tools: its twin with tools
    "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788": "smollm2_tools.jinja",
}


class ServerSettings(BaseModel):
    """How to run one vLLM server. Defaults are the measured working flags for vLLM on CPU."""

    model_config = ConfigDict(frozen=True)

    python: Path
    model_path: Path
    served_name: str
    host: str = "127.0.0.1"
    port: int = 8011
    dtype: str = "float32"
    weights: Literal["lora", "merged", "fixed"] = "lora"  # fixed: one version, no LoRA
    max_model_len: int = 2048
    max_lora_rank: int = 16
    max_loras: int = 4
    kv_cache_gib: int = 2
    tool_parser: str | None = "hermes"  # how `<tool_call>` blocks become OpenAI tool_calls
    cpus: str | None = None  # cores its compute threads are pinned to, e.g. "0" or "2-3"
    block_size: int | None = None  # KV-cache block in tokens; None: vLLM's own (128 on CPU)
    api_key: str | None = None  # its own key (`serving.access`); None: /v1 is open
    startup_timeout_s: float = 300.0
    probe_timeout_s: float = 15.0
    stop_grace_s: float = 30.0  # from SIGTERM to SIGKILL (a server still starting may not act)
    log_path: Path = Path(".flywheel/logs/vllm.log")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class VllmServer:
    """A running vLLM server; use as a context manager so it is always stopped."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._process: subprocess.Popen[bytes] | None = None
        self._generated: float | None = None
        self._cpu: tuple[float, float] | None = None
        self._closing = threading.Event()  # set once: no (re)start may begin or finish after

    @property
    def url(self) -> str:
        return self.settings.url

    @property
    def pid(self) -> int | None:
        """The API server's process id while it runs."""
        return self._process.pid if self._process is not None else None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop for good: a restart under way (the supervisor's) gives up."""
        close_together([self])

    def start(self) -> None:
        """Launch the server and wait until it generates."""
        self.launch()
        self.wait_healthy()

    def launch(self) -> None:
        """Start the server's process without waiting for it (`wait_healthy` does), so that
        servers side by side start at the same time."""
        s = self.settings
        if self._closing.is_set():
            raise ServingError(f"the model server on {s.url} is closing")
        if not s.python.is_file():
            raise ServingError(f"model server interpreter {s.python} not found (run `make setup`)")
        if not s.model_path.is_dir():
            raise ServingError(f"model folder {s.model_path} not found")
        if s.weights == "merged" and s.host not in ("127.0.0.1", "localhost", "::1"):
            raise ServingError("merged weights need vLLM's dev routes: bind the server to loopback")
        ensure_port_free(s.host, s.port)
        s.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting vLLM on %s (log: %s)", s.url, s.log_path)
        with s.log_path.open("wb") as log_file:
            self._process = subprocess.Popen(
                self._command(),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,
            )
        if self._closing.is_set():
            self.stop()
            raise ServingError(f"the model server on {s.url} is closing")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        with httpx.Client(base_url=self.url, timeout=30.0, headers=self._headers()) as client:
            while time.monotonic() < deadline:
                if self._closing.is_set():
                    raise ServingError(f"the model server on {self.url} is closing")
                self._raise_if_exited()
                if _healthy(client) and generates(client, self.settings.served_name):
                    log.info("vLLM is healthy and generating")
                    return
                time.sleep(1.0)
        self.stop()
        raise ServingError(
            f"vLLM did not become healthy in {self.settings.startup_timeout_s:.0f} s; "
            f"log tail: {self.log_tail()}"
        )

    def alive(self) -> bool:
        """The process runs and a 1-token generation succeeds within the probe deadline."""
        if self._process is None or self._process.poll() is not None:
            return False
        timeout = self.settings.probe_timeout_s
        with httpx.Client(base_url=self.url, timeout=timeout, headers=self._headers()) as client:
            if generates(client, self.settings.served_name):
                self._generated, self._cpu = generated_tokens(client), self._cpu_now()
                return True
            before, self._generated = self._generated, generated_tokens(client)
        cpu_before, self._cpu = self._cpu, self._cpu_now()
        # Busy, not dead: the engine produced tokens since the last probe, or computed without
        # producing any (one scheduler step of a long prefill can outlast several probes).
        produced = before is not None and self._generated is not None and self._generated > before
        return produced or busy(cpu_before, self._cpu)

    def _cpu_now(self) -> tuple[float, float] | None:
        """(wall clock, CPU seconds the server's process group has used), where /proc tells."""
        if self._process is None:
            return None
        used = group_cpu_seconds(self._process.pid)
        return None if used is None else (time.monotonic(), used)

    def ensure_alive(self) -> bool:
        """Restart the server if it died or stopped generating; returns whether it restarted.

        A restarted server has no adapters: whoever serves them (the gateway) reloads them.
        """
        if self.alive():
            return False
        self.restart("it is not generating")
        return True

    def supervise(self, stop: threading.Event, interval_s: float = 10.0, strikes: int = 2) -> int:
        """Probe every `interval_s` until `stop` is set; restart after `strikes` failed probes
        in a row (one slow probe on a busy machine is not a death). A restart that fails is
        logged and tried again at the next probe. Returns the restarts."""
        restarts = failures = 0
        while not stop.wait(interval_s) and not self._closing.is_set():
            failures = 0 if self.alive() else failures + 1
            if failures < strikes:
                continue
            try:
                self.restart(f"it failed {failures} probes in a row")
            except ServingError as exc:
                log.error("restarting the model server failed: %s", exc)
                continue
            restarts, failures = restarts + 1, 0
        return restarts

    @contextlib.contextmanager
    def supervised(self, interval_s: float = 10.0) -> Iterator[None]:
        """`supervise` in a background thread for the length of the block."""
        stop = threading.Event()
        thread = threading.Thread(
            target=self.supervise, args=(stop, interval_s), name="vllm-supervisor", daemon=True
        )
        thread.start()
        try:
            yield
        finally:
            stop.set()
            self._closing.set()  # a restart under way gives up
            thread.join(timeout=60)

    def restart(self, reason: str) -> None:
        log.warning("restarting vLLM on %s: %s", self.url, reason)
        self.stop()
        self.start()

    def stop(self) -> None:
        """Stop the server's whole process group and wait until its port is free again."""
        self._reap(self._terminate())

    def _terminate(self) -> subprocess.Popen[bytes] | None:
        """Ask the server's process group to stop, without waiting; its process, if any."""
        process, self._process = self._process, None
        self._generated = self._cpu = None  # the next server is a new process group
        if process is not None and process.poll() is None:
            _signal_group(process.pid, signal.SIGCONT)  # a stopped group cannot act on SIGTERM
            _signal_group(process.pid, signal.SIGTERM)
        return process

    def _reap(self, process: subprocess.Popen[bytes] | None) -> None:
        """Wait out the grace period, kill what is left of the group, wait for the port."""
        if process is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=self.settings.stop_grace_s)
        _signal_group(process.pid, signal.SIGKILL)  # engine workers that outlived the server
        if process.poll() is None:
            process.wait()
        _wait_port_free(self.settings.host, self.settings.port, timeout_s=30.0)

    def log_tail(self) -> str:
        path = self.settings.log_path
        if not path.is_file():
            return "(no log)"
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        return " | ".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"

    def _raise_if_exited(self) -> None:
        if self._process is not None and self._process.poll() is not None:
            code = self._process.returncode
            self._process = None
            raise ServingError(f"vLLM exited with code {code}; log tail: {self.log_tail()}")

    def _command(self) -> list[str]:
        s = self.settings
        guard = GUARD_EVERY_ROUTE if s.api_key else ""
        return [
            str(s.python),
            "-c",
            owned(API_SERVER, s.stop_grace_s, guard),
            "--model",
            str(s.model_path),
            "--served-model-name",
            s.served_name,
            "--host",
            s.host,
            "--port",
            str(s.port),
            "--dtype",
            s.dtype,
            "--max-model-len",
            str(s.max_model_len),
            *(["--block-size", str(s.block_size)] if s.block_size else []),
            *self._lora_flags(),
            *self._tool_flags(),
        ]

    def _tool_flags(self) -> list[str]:
        s = self.settings
        if s.tool_parser is None:
            return []
        flags = ["--enable-auto-tool-choice", "--tool-call-parser", s.tool_parser]
        template = tools_template(s.model_path)
        return [*flags, "--chat-template", str(template)] if template else flags

    def _lora_flags(self) -> list[str]:
        s = self.settings
        if s.weights != "lora":
            return []
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(s.max_lora_rank),
            "--max-loras",
            str(s.max_loras),
        ]

    def _headers(self) -> dict[str, str]:
        return access.bearer(self.settings.api_key)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("VLLM_API_KEY", None)
        if self.settings.api_key:  # by environment: a command line is readable by anyone here
            env["VLLM_API_KEY"] = self.settings.api_key
        env[OWNER] = str(os.getpid())  # the server stops when this process is gone
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.settings.kv_cache_gib))
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.settings.weights == "merged":  # in-place reload; the server is bound to loopback
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if self.settings.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.settings.cpus
        return env


API_SERVER = "vllm.entrypoints.openai.api_server"
# The server is started through these lines (`python -c`, then vLLM's own arguments). They stop
# its whole process group, which it leads, once the process that started it is gone (killed, say,
# for want of memory): else the server would keep its port, its cores and gigabytes of memory
# with no one left to stop it. The owner's pid comes by environment (`OWNER`).
LAUNCH = """
import os, runpy, signal, threading, time

def stop_when_orphaned(owner, grace_s):
    while os.getppid() == owner:
        time.sleep(1.0)
    os.killpg(0, signal.SIGTERM)
    time.sleep(grace_s)
    os.killpg(0, signal.SIGKILL)

owner = int(os.environ.pop("{owner}"))
threading.Thread(target=stop_when_orphaned, args=(owner, {grace_s}), daemon=True).start()
{guard}
runpy.run_module("{module}", run_name="__main__", alter_sys=True)
"""
OWNER = "FLYWHEEL_SERVER_OWNER"


def owned(module: str, grace_s: float, guard: str = "") -> str:
    """The lines (`python -c`, then the module's own arguments) that run `module` as a program
    and stop its process group once the process that started it is gone. That process passes
    its pid as `OWNER` in the environment and starts the program in a session of its own."""
    return LAUNCH.format(owner=OWNER, grace_s=grace_s, guard=guard, module=module)


# vLLM's key guards /v1 and a few other prefixes; its other routes stay open (/tokenize,
# /metrics, and with dev mode /pause and /collective_rpc, which reload weights in place). With a
# key of its own, the server's launch makes every route take it.
GUARD_EVERY_ROUTE = """
import vllm.entrypoints.serve.middleware.authenticate as authenticate
assert isinstance(authenticate.GUARDED_PREFIX, tuple), "vLLM's key guard has moved"
authenticate.GUARDED_PREFIX = ("/",)
"""


def close_together(servers: list[VllmServer]) -> None:
    """Close servers side by side: each is told to stop before any is waited on, so a run with
    a reviewer stops in one grace period, not one per server."""
    for server in servers:
        server._closing.set()  # a restart under way gives up
    for server, process in [(server, server._terminate()) for server in servers]:
        server._reap(process)


def tools_template(model_path: Path) -> Path | None:
    """The tool-aware twin of a model folder's chat template, where it ignores tools."""
    own = model_path / "chat_template.jinja"
    if not own.is_file():
        return None
    twin = TOOL_TEMPLATES.get(hashlib.sha256(own.read_bytes()).hexdigest())
    return TEMPLATES / twin if twin else None


REVIEWER_BLOCK = 32  # tokens a KV block holds on the reviewer's server (vLLM: a multiple of 32)


def side_by_side(
    policy: ServerSettings, reviewer: ServerSettings
) -> tuple[ServerSettings, ServerSettings]:
    """A policy's server and a reviewer's on one host: each pinned to cores of its own, the
    reviewer with one set of weights (no LoRA) in bfloat16 where the CPU computes it, and with
    KV blocks small enough (`REVIEWER_BLOCK`) that its prompts, which share a long opening (the
    instructions and the worked example) and are asked several times over, reuse its cache:
    at vLLM's 128 on CPU none of them filled a block, and the reviewer spent its time in
    prefill."""
    policy_cpus, reviewer_cpus = split_cores()
    reviewer_update = {
        "cpus": reviewer_cpus,
        "weights": "fixed",
        "dtype": cpu_dtype(),
        "block_size": REVIEWER_BLOCK,
    }
    return policy.model_copy(update={"cpus": policy_cpus}), reviewer.model_copy(
        update=reviewer_update
    )


def split_cores() -> tuple[str, str]:
    """Two disjoint core sets for two servers on this host: the policy's first half (the larger
    on odd counts), the reviewer's the rest. Left alone, every vLLM CPU server pins core 0."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ServingError("a reviewer server beside the policy's needs at least 2 cores")
    half = (len(cores) + 1) // 2
    return _core_list(cores[:half]), _core_list(cores[half:])


def all_cores() -> str:
    """Every core this process may run on, for a server alone on its host: measured on 2
    cores, collection ran 1.27x faster pinned to both than with vLLM's own binding, which
    computes on one (docs/experiments.md)."""
    return _core_list(sorted(os.sched_getaffinity(0)))


def _core_list(cores: list[int]) -> str:
    return ",".join(str(core) for core in cores)


def cpu_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX), else float32."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return "float32"
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def free_port() -> int:
    """A loopback port no one listens on now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def ensure_port_free(host: str, port: int) -> None:
    """Raise unless a server could listen on `port`; connections in TIME_WAIT do not count
    (servers bind with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ServingError(f"port {port} on {host} is already in use") from exc


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _wait_port_free(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ensure_port_free(host, port)
            return
        except ServingError:
            time.sleep(0.5)
    log.warning("port %d on %s is still taken after the server stopped", port, host)


def busy(before: tuple[float, float] | None, now: tuple[float, float] | None) -> bool:
    """Whether a process group computed on at least `BUSY_CORES` of a core between two
    (wall clock, CPU seconds) readings: a stopped or hung engine computes nothing."""
    if before is None or now is None or now[0] <= before[0]:
        return False
    return (now[1] - before[1]) / (now[0] - before[0]) >= BUSY_CORES


def group_cpu_seconds(pgid: int) -> float | None:
    """CPU seconds the live processes of process group `pgid` have used (Linux's /proc), or
    None where none can be read."""
    total, found = 0, False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended
            continue
        fields = text[text.rindex(")") + 2 :].split()  # from the state on: pgrp, utime, stime
        if int(fields[2]) == pgid:
            total, found = total + int(fields[11]) + int(fields[12]), True
    return total / os.sysconf("SC_CLK_TCK") if found else None


def generated_tokens(client: httpx.Client) -> float | None:
    """vLLM's generated-token counter from /metrics, or None when it cannot be read."""
    try:
        response = client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    for line in response.text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[-1])
    return None


def generates(client: httpx.Client, model: str) -> bool:
    return probe.generation(client, model).ok


def _healthy(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False
