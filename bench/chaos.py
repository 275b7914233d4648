"""Chaos benchmark: the reliability plan's faults against real servers, one row per fault.

Each collection row enqueues a batch (tasks x group size rollouts) and runs a collection worker
on it while the fault strikes; the row counts the rollouts submitted, the attempts stored, those
lost and those stored twice, and the seconds from the fault to the first group stored after it
(recovery). The faults: the model server killed with SIGKILL (its supervisor restarts it), its
engine stopped while the API still answers (the stall watch catches it), bursts of 503s and
connection resets (through `bench/faults.py`), a worker killed while holding claims, the trainer
killed in the middle of a save (torn state and weights), and an adapter load whose answer is lost.

    .venv/bin/python -m bench.chaos [--tasks 32] [--group-size 4] [--runs 3] [--json PATH]
    .venv/bin/python -m bench.chaos --soak 30 [--json PATH]

`--soak MINUTES` runs one collection worker for that long through a proxy that answers 3% of
requests with a 503, resets 3% and stalls 1%, batch after batch (a new round each), and samples
the process's resident memory, threads and open files after every batch: its row says whether
every batch was stored whole, and how far each of the three grew over the second half.

`tests/test_chaos.py` runs the same scenarios and asserts nothing is lost or duplicated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from pydantic import BaseModel
from sqlalchemy import Engine, func, select

from agents.settings import CollectSettings
from agents.watchdog import WatchdogSettings
from bench.common import ROOT, Figure, provenance, server_settings, write_results
from bench.faults import FaultProxy, Faults
from memory import store, workqueue
from memory.models import AttemptRow, RolloutGroupRow, WorkItemRow
from memory.records import Batch
from serving.server import VllmServer
from verifiers.reasoning import train_tasks
from workers import worker

STRUCK_TOKENS = 512  # the struck rollouts' length: it sets how long recollecting them takes


class Row(BaseModel):
    fault: str
    submitted: int
    stored: int
    lost: int
    duplicated: int
    recover_s: float | None
    note: str = ""


class Scene:
    """One collection batch against `url`, a worker on it in a thread, and a clock of stores."""

    def __init__(
        self, url: str, model: str, db_url: str, tasks: int, group_size: int, max_tokens: int = 32
    ) -> None:
        self.url, self.model, self.group_size = url, model, group_size
        self.engine: Engine = store.open_store(db_url)
        self.batch = Batch(round_index=1, purpose="train", policy_version=model)
        self.tasks = train_tasks("arithmetic", tasks, seed=5, held_out=[])
        self.stored_at: list[float] = []
        sampling = CollectSettings(group_size=group_size, max_tokens=max_tokens)
        with store.transaction(self.engine) as session:
            workqueue.enqueue(
                session,
                worker.plan_items(
                    self.batch, self.tasks, lambda t: worker.Plan(task=t, sampling=sampling)
                ),
            )

    def collect(self, settings: worker.WorkerSettings) -> threading.Thread:
        """Start a worker on the batch in a thread; it ends when the batch is done."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                anyio.run(self._work, settings)
            except BaseException as exc:  # noqa: BLE001 - reported by `finish`
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.errors = errors  # type: ignore[attr-defined]
        thread.start()
        return thread

    async def _work(self, settings: worker.WorkerSettings) -> None:
        await worker.work(
            self.engine, self.url, worker.new_owner(), settings,
            worker.Shift(lambda: worker.batch_done(self.engine, self.batch), self.batch,
                         lambda group: self.stored_at.append(time.monotonic())),
        )  # fmt: skip

    def claimed(self) -> int:
        """Work items of the batch a worker holds or held."""
        with store.transaction(self.engine) as session:
            return session.scalar(select(func.count()).where(WorkItemRow.claims > 0)) or 0

    def wait_stored(self, count: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.stored_at) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} groups stored in {timeout_s:.0f} s")
            time.sleep(0.05)

    def row(self, fault: str, struck_at: float | None, note: str = "") -> Row:
        with store.transaction(self.engine) as session:
            per_task = dict(
                session.execute(
                    select(RolloutGroupRow.task_id, func.count()).group_by(RolloutGroupRow.task_id)
                ).all()
            )
            attempts = session.scalar(select(func.count()).select_from(AttemptRow)) or 0
            given_back = session.scalar(select(func.count()).where(WorkItemRow.error.is_not(None)))
        submitted = len(self.tasks) * self.group_size
        after = [t for t in self.stored_at if struck_at is not None and t > struck_at]
        return Row(
            fault=fault,
            submitted=submitted,
            stored=attempts,
            lost=sum(self.group_size for t in self.tasks if t.task_id not in per_task),
            duplicated=sum((n - 1) * self.group_size for n in per_task.values() if n > 1),
            recover_s=round(after[0] - struck_at, 1) if after and struck_at else None,
            note=note or f"{given_back} tasks given back and collected again",
        )


def finish(thread: threading.Thread, timeout_s: float = 600.0) -> None:
    thread.join(timeout=timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"the batch did not finish in {timeout_s:.0f} s")
    errors = thread.errors  # type: ignore[attr-defined]
    if errors:
        raise errors[0]


def running_requests(url: str) -> float:
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    values = [
        float(line.rsplit(" ", 1)[-1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    ]
    return sum(values)


def open_connections(port: int) -> int:
    """TCP connections established to `port` on this host (IPv4)."""
    hex_port = f":{port:04X}"
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if row[2].endswith(hex_port) and row[3] == "01")


@dataclass(frozen=True)
class Held:
    """A batch whose requests wait at a stopped engine: the worker's thread, the engine's
    stopped processes, and when they were stopped."""

    batch: threading.Thread
    engines: list[int]
    at: float


def collect_held(scene: Scene, server: VllmServer, at_least: int) -> Held:
    """Start the scene's worker and stop the server's engine (SIGSTOP) as soon as the worker
    claims its lot: the lot's requests reach the API and wait there, none can end, and a fault
    strikes them in flight however fast the machine (a tiny model on a fast one answers
    faster than a batch's requests pile up). Returns once `at_least` connections are open to
    the server; the engine stays stopped."""
    assert server.pid is not None
    engines = engine_pids(server.pid)
    batch = scene.collect(worker_settings())
    _wait(lambda: scene.claimed() > 0, batch, "the worker claimed its lot", timeout_s=120.0)
    for pid in engines:
        os.kill(pid, signal.SIGSTOP)
    held = Held(batch, engines, time.monotonic())
    port = server.settings.port
    # Within the supervisor's patience: two failed probes of up to 10 s each restart the server.
    _wait(lambda: open_connections(port) >= at_least, batch,
          f"{at_least} connections were open to the server", timeout_s=15.0)  # fmt: skip
    return held


def _wait(done: Callable[[], bool], batch: threading.Thread, what: str, timeout_s: float) -> None:
    """Until `done()`; a batch that ended first raises its own error, or says it ended."""
    started = time.monotonic()
    while not done():
        waited = time.monotonic() - started
        if not batch.is_alive():
            finish(batch)
            raise RuntimeError(f"the batch ended after {waited:.1f} s, before {what}")
        if waited > timeout_s:
            raise TimeoutError(f"not in {timeout_s:.0f} s: {what}")
        time.sleep(0.01)


def engine_pids(server_pid: int) -> list[int]:
    """The server's engine processes (`VLLM::EngineCore` and its workers), not its API."""
    found, frontier = [], [server_pid]
    while frontier:
        parent = frontier.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)
                comm = stat.read_text().split("(", 1)[1].rsplit(")", 1)[0]
                ppid = int(fields[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent:
                pid = int(stat.parent.name)
                frontier.append(pid)
                if comm.startswith("VLLM::"):
                    found.append(pid)
    return found


def worker_settings(**overrides: object) -> worker.WorkerSettings:
    base: dict[str, object] = {
        "concurrency": 64, "lot_size": 16, "lease_s": 30.0, "retry_s": 1.0, "outage_s": 240.0,
        "watchdog": WatchdogSettings(poll_s=2.0, stall_s=15.0, floor_s=30.0),
    }  # fmt: skip
    return worker.WorkerSettings.model_validate(base | overrides)


@contextmanager
def supervised_server(model_path: Path, log_path: Path, port: int) -> Iterator[VllmServer]:
    settings = server_settings(model_path, log_path, port=port, probe_timeout_s=10.0)
    with VllmServer(settings) as server, server.supervised(interval_s=2.0):
        yield server


def server_killed(
    server: VllmServer, db_url: str, tasks: int, group_size: int, max_tokens: int = STRUCK_TOKENS
) -> Row:
    """SIGKILL the server's API process with the batch's rollouts in flight."""
    scene = Scene(server.url, server.settings.served_name, db_url, tasks, group_size, max_tokens)
    held = collect_held(scene, server, min(16, tasks * group_size))
    assert server.pid is not None
    struck = time.monotonic()
    os.kill(server.pid, signal.SIGKILL)
    for pid in held.engines:  # resumed, they find their server gone, as after any such kill
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    finish(held.batch)
    return scene.row("server killed (SIGKILL)", struck)


def server_stalled(
    server: VllmServer, db_url: str, tasks: int, group_size: int, max_tokens: int = STRUCK_TOKENS
) -> Row:
    """Stop the engine processes only: `/health` answers, no token comes. Whichever catches it
    first counts: the server's supervisor (its generation probes fail, and it restarts the
    server) or a worker's stall watch, which shows in the store once the worker gives its lot
    back as stalled, after one probe of the server (up to 30 s), so often after the restart."""
    scene = Scene(server.url, server.settings.served_name, db_url, tasks, group_size, max_tokens)
    stalled_pid = server.pid
    held = collect_held(scene, server, min(16, tasks * group_size))
    caught = _stall_caught(scene.engine, server, stalled_pid, timeout_s=300.0)
    finish(held.batch)
    note = "stall never caught"
    if caught is not None:
        at, by = caught
        note = f"stall caught by {by} after {at - held.at:.1f} s"
    return scene.row("engine stalled (SIGSTOP)", held.at, note)


def _stall_caught(
    engine: Engine, server: VllmServer, stalled_pid: int | None, timeout_s: float
) -> tuple[float, str] | None:
    """When a stall was caught, and by whom."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.pid != stalled_pid:
            return time.monotonic(), "the supervisor"
        with store.transaction(engine) as session:
            hit = session.scalar(select(func.count()).where(WorkItemRow.error.contains("stalled")))
        if hit:
            return time.monotonic(), "the worker"
        time.sleep(0.2)
    return None


def error_bursts(url: str, model: str, db_url: str, tasks: int, group_size: int) -> Row:
    """Every inference request gets a 503 for 2 s in each 3 s, three times over, while the
    batch runs (the first burst from its start, however fast the server); recovery is counted
    from the end of the last burst."""
    proxy = FaultProxy(url, Faults(error=1.0))
    with proxy.running() as proxied:
        scene = Scene(proxied, model, db_url, tasks, group_size)
        thread = scene.collect(worker_settings(lot_size=4))
        struck = None
        for burst in range(3):
            if burst:
                time.sleep(1.0)
                if not thread.is_alive():
                    break
                proxy.faults.error = 1.0
            time.sleep(2.0)
            proxy.faults.error = 0.0
            struck = time.monotonic()
        finish(thread)
    return scene.row("5xx bursts", struck, f"{proxy.counts['error']} requests answered 503")


def resets(url: str, model: str, db_url: str, tasks: int, group_size: int) -> Row:
    """One request in ten is reset before any answer."""
    proxy = FaultProxy(url, Faults(reset=0.1, seed=3))
    with proxy.running() as proxied:
        scene = Scene(proxied, model, db_url, tasks, group_size)
        finish(scene.collect(worker_settings()))
    return scene.row("connection resets", None, f"{proxy.counts['reset']} connections reset")


def worker_killed(url: str, model: str, db_url: str, tasks: int, group_size: int) -> Row:
    """A `flywheel worker` process SIGKILLed while it holds claims; another finishes."""
    scene = Scene(url, model, db_url, tasks, group_size)
    logs = Path(tempfile.mkdtemp(prefix="chaos-worker-"))

    def start(name: str, *extra: str) -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "cli", "worker", "--db", db_url, "--server-url", url,
            "--lease", "5", "--lot-size", "4", "--workdir", str(logs), *extra,
        ]  # fmt: skip
        out = (logs / f"{name}.log").open("w")
        return subprocess.Popen(command, stdout=out, stderr=out, start_new_session=True)

    doomed = start("doomed")
    deadline = time.monotonic() + 180
    while True:
        with store.transaction(scene.engine) as session:
            progress = workqueue.progress(session, scene.batch)
            holders = workqueue.claim_holders(session)
        if progress["done"] >= 1 and holders:
            break
        if doomed.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the first worker never held claims; see {logs}/doomed.log")
        time.sleep(0.05)
    struck = time.monotonic()
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait()
    before = _stored(scene.engine)
    helper = start("helper", "--idle-exit", "3")
    recovered = None
    while helper.poll() is None:
        if recovered is None and _stored(scene.engine) > before:
            recovered = time.monotonic()
        time.sleep(0.1)
    if helper.returncode != 0:
        raise RuntimeError(f"the second worker failed; see {logs}/helper.log")
    row = scene.row("worker killed (SIGKILL)", None, "its claims were taken over")
    return row.model_copy(update={"recover_s": round(recovered - struck, 1) if recovered else None})


def _stored(engine: Engine) -> int:
    with store.transaction(engine) as session:
        return session.scalar(select(func.count()).select_from(RolloutGroupRow)) or 0


def trainer_killed_while_saving(model_path: Path, workdir: Path) -> Row:
    """A round stopped after its save at step 2, with two later saves cut short as a kill while
    saving leaves them: truncated weights (step 4) and a torn `trainer_state.json` (step 6). The
    resumed round passes over both, resumes from the whole save, publishes a complete adapter."""
    from memory import folders
    from tests.helpers import make_group
    from trainer.round import PolicyGradientTrainer, RoundResult, train_round
    from trainer.settings import TrainSettings

    settings = TrainSettings(epochs=1, batch_size=2, learning_rate=1e-3, save_steps=2, mode="grpo")
    groups = [make_group([1.0, 0.0, 0.0, 1.0], task_id=f"t{i}") for i in range(3)]
    original = PolicyGradientTrainer.training_step
    steps: list[int] = []

    def stop_after_three(self: PolicyGradientTrainer, *args: object, **kwargs: object) -> object:
        if len(steps) == 3:
            raise KeyboardInterrupt("killed")
        steps.append(self.state.global_step)
        return original(self, *args, **kwargs)  # type: ignore[no-untyped-call]

    def run_round() -> RoundResult:
        return train_round(
            groups, base_model=model_path, parent_adapter=None, adapters_root=workdir,
            name="policy-r1", settings=settings,
        )  # fmt: skip

    PolicyGradientTrainer.training_step = stop_after_three  # type: ignore[method-assign,assignment]
    try:
        run_round()
    except KeyboardInterrupt:
        pass
    finally:
        PolicyGradientTrainer.training_step = original  # type: ignore[method-assign]
    saves = workdir / ".rounds" / "policy-r1"
    for step, tear in ((4, "weights"), (6, "state")):  # two saves cut short, two ways
        torn = saves / f"checkpoint-{step}"
        shutil.copytree(saves / "checkpoint-2", torn)
        state_file = torn / "trainer_state.json"
        state = state_file.read_text().replace('"global_step": 2', f'"global_step": {step}')
        state_file.write_text(state[: len(state) // 2] if tear == "state" else state)
        for weights in torn.glob("*.safetensors") if tear == "weights" else ():
            weights.write_bytes(weights.read_bytes()[:64])
    struck = time.monotonic()
    result = run_round()
    recovered = time.monotonic()
    whole = folders.is_complete(Path(result.adapter_path))
    planned = -(-result.rows // settings.batch_size) * settings.epochs
    return Row(
        fault="trainer killed while saving",
        submitted=planned,
        stored=planned if whole else 0,
        lost=0 if whole else planned,
        duplicated=0 if 0 <= result.resumed_from_step < 4 else 1,
        recover_s=round(recovered - struck, 1),
        note=f"resumed from step {result.resumed_from_step}, passing over the torn saves 4 and 6",
    )


def lost_load_answer(url: str, model_path: Path, adapter: Path) -> Row:
    """The adapter-load request reaches the server, its answer is lost: `/v1/models` decides."""
    from serving.adapters import ensure_loaded, loaded_models

    name = f"chaos-{int(time.time())}"
    proxy = FaultProxy(url, Faults(drop_answer=1.0, routes=("/v1/load_lora_adapter",)))
    with proxy.running() as proxied:
        struck = time.monotonic()
        ensure_loaded(proxied, name, adapter)
        recovered = time.monotonic()
    served = loaded_models(url).count(name)
    return Row(
        fault="adapter-load answer lost",
        submitted=1,
        stored=served,
        lost=1 - served,
        duplicated=max(0, served - 1),
        recover_s=round(recovered - struck, 2),
        note=f"{proxy.counts['drop_answer']} answer dropped; registration read from /v1/models",
    )


def run_all(args: argparse.Namespace) -> list[Row]:
    from serving.model import prepare_smollm2, prepare_tiny_llama
    from tests.helpers import random_adapter  # a LoRA of random weights

    models = ROOT / ".flywheel" / "models"
    model_path = prepare_tiny_llama(models, prepare_smollm2(models))
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    rows: list[Row] = []

    def db(name: str) -> str:
        return f"sqlite:///{work / name}.db"

    def record(row: Row) -> None:
        rows.append(row)
        print(f"  {row.fault}: lost {row.lost}, duplicated {row.duplicated}", file=sys.stderr)

    with supervised_server(model_path, work / "vllm.log", args.port) as server:
        n, g = args.tasks, args.group_size
        record(error_bursts(server.url, model_path.name, db("bursts"), n, g))
        record(resets(server.url, model_path.name, db("resets"), n, g))
        record(worker_killed(server.url, model_path.name, db("worker"), n, g))
        adapter = random_adapter(model_path, work / "adapters")
        record(lost_load_answer(server.url, model_path, adapter))
        record(server_killed(server, db("killed"), n, g))
        record(server_stalled(server, db("stalled"), n, g))
    record(trainer_killed_while_saving(model_path, work / "trainer"))
    return rows


# A stalled request is given up within a minute (the default ceiling is 30 minutes).
SOAK_WATCHDOG = WatchdogSettings(poll_s=2.0, stall_s=30.0, floor_s=30.0, ceiling_s=60.0)


class Sample(BaseModel):
    seconds: float
    rss_mb: float
    threads: int
    open_files: int


def soak(args: argparse.Namespace) -> dict[str, object]:
    """Batches through a faulty proxy for `args.soak` minutes; see the module docstring."""
    import psutil

    from serving.model import prepare_smollm2, prepare_tiny_llama

    models = ROOT / ".flywheel" / "models"
    model_path = prepare_tiny_llama(models, prepare_smollm2(models))
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    me = psutil.Process()
    samples: list[Sample] = []
    totals = {"batches": 0, "submitted": 0, "stored": 0, "lost": 0, "duplicated": 0}
    faults = Faults(error=0.03, reset=0.03, stall=0.01, seed=11)
    with supervised_server(model_path, work / "vllm.log", args.port) as server:
        proxy = FaultProxy(server.url, faults)
        with proxy.running() as proxied:
            started = time.monotonic()
            while time.monotonic() - started < args.soak * 60:
                batch = totals["batches"]
                scene = Scene(proxied, model_path.name, f"sqlite:///{work}/soak.db",
                              args.tasks, args.group_size)  # fmt: skip
                scene.batch = Batch(
                    round_index=batch + 1, purpose="train", policy_version=model_path.name
                )
                _enqueue(scene)
                finish(scene.collect(worker_settings(watchdog=SOAK_WATCHDOG)))
                row = _batch_row(scene)
                for key in ("submitted", "stored", "lost", "duplicated"):
                    totals[key] += getattr(row, key)
                totals["batches"] += 1
                scene.engine.dispose()
                samples.append(Sample(
                    seconds=round(time.monotonic() - started, 1),
                    rss_mb=round(me.memory_info().rss / 2**20, 1),
                    threads=me.num_threads(), open_files=me.num_fds(),
                ))  # fmt: skip
                print(f"  batch {batch + 1}: {row.stored}/{row.submitted} stored, "
                      f"{samples[-1].rss_mb} MB, {samples[-1].threads} threads, "
                      f"{samples[-1].open_files} files", file=sys.stderr)  # fmt: skip
        totals |= {f"proxy_{kind}": n for kind, n in proxy.counts.items()}
    half = samples[len(samples) // 2 :] or samples
    growth = {
        "rss_mb": round(half[-1].rss_mb - half[0].rss_mb, 1),
        "threads": half[-1].threads - half[0].threads,
        "open_files": half[-1].open_files - half[0].open_files,
    }
    return {"minutes": args.soak, **totals, "second_half_growth": growth,
            "peak": {"rss_mb": max(s.rss_mb for s in samples),
                     "threads": max(s.threads for s in samples),
                     "open_files": max(s.open_files for s in samples)},
            "samples": [s.model_dump() for s in samples]}  # fmt: skip


def _enqueue(scene: Scene) -> None:
    """The scene's tasks again, under its batch (the constructor enqueued round 1's)."""
    sampling = CollectSettings(group_size=scene.group_size, max_tokens=32)
    with store.transaction(scene.engine) as session:
        items = worker.plan_items(
            scene.batch, scene.tasks, lambda t: worker.Plan(task=t, sampling=sampling)
        )
        workqueue.enqueue(session, items)


def _batch_row(scene: Scene) -> Row:
    """The scene's own batch counted: attempts of its round's groups, lost and twice-stored."""
    batch = scene.batch
    with store.transaction(scene.engine) as session:
        groups = store.load_groups(session, batch.purpose, batch.round_index, batch.policy_version)
    per_task: dict[str, int] = {}
    for group in groups:
        per_task[group.task_id] = per_task.get(group.task_id, 0) + 1
    size = scene.group_size
    return Row(
        fault="soak batch", submitted=len(scene.tasks) * size,
        stored=sum(len(g.first_attempts) for g in groups),
        lost=sum(size for t in scene.tasks if t.task_id not in per_task),
        duplicated=sum((n - 1) * size for n in per_task.values() if n > 1), recover_s=None,
    )  # fmt: skip


def print_soak(result: dict[str, object]) -> None:
    growth, peak = result["second_half_growth"], result["peak"]
    print(f"{'soak':<10} {'minutes':>7} {'batches':>7} {'submitted':>9} {'stored':>7} "
          f"{'lost':>5} {'dup':>4}")  # fmt: skip
    print(f"{'':<10} {result['minutes']:>7} {result['batches']:>7} {result['submitted']:>9} "
          f"{result['stored']:>7} {result['lost']:>5} {result['duplicated']:>4}")  # fmt: skip
    print(f"peak: {peak}; growth over the second half: {growth}")


def print_table(rows: list[Row]) -> None:
    print(f"{'fault':<30} {'submitted':>9} {'stored':>7} {'lost':>5} {'dup':>4} {'recover s':>9}")
    for r in rows:
        recover = "-" if r.recover_s is None else f"{r.recover_s:.1f}"
        print(
            f"{r.fault:<30} {r.submitted:>9} {r.stored:>7} {r.lost:>5} {r.duplicated:>4} "
            f"{recover:>9}  {r.note}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--port", type=int, default=8051)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=3, help="of every fault")
    parser.add_argument("--soak", type=float, default=None, help="minutes of a soak instead")
    args = parser.parse_args()
    made = provenance()
    if args.soak is not None:
        result = soak(args)
        print_soak(result)
        if args.json:
            result["settings"] = {k: str(v) for k, v in vars(args).items()}
            write_results(args.json, result, made, soak_figures(result))
        return
    rows = [row for _ in range(args.runs) for row in run_all(args)]
    print_table(rows)
    if args.json:
        payload = {
            "settings": {k: str(v) for k, v in vars(args).items()},
            "rows": [r.model_dump() for r in rows],
        }
        write_results(args.json, payload, made, figures(rows))


def figures(rows: list[Row]) -> list[Figure]:
    """Per fault over its runs: attempts lost or stored twice, as shares of those submitted;
    recovery time, median and max."""
    found = []
    for fault in dict.fromkeys(r.fault for r in rows):
        runs = [r for r in rows if r.fault == fault]
        submitted = sum(r.submitted for r in runs)
        if submitted:
            lost, twice = sum(r.lost for r in runs), sum(r.duplicated for r in runs)
            found.append(Figure.share(f"{fault}: attempts lost", lost, submitted, "system"))
            found.append(Figure.share(f"{fault}: stored twice", twice, submitted, "system"))
        recovered = [r.recover_s for r in runs if r.recover_s is not None]
        if recovered:
            median, worst = statistics.median(recovered), max(recovered)
            found.append(Figure(f"{fault}: recovery, median", median, len(recovered), unit="s"))
            found.append(Figure(f"{fault}: recovery, max", worst, len(recovered), unit="s"))
    return found


def soak_figures(result: dict[str, Any]) -> list[Figure]:
    """Attempts lost and stored twice as shares of those submitted; memory growth over the
    second half and its peak (one run)."""
    submitted = result["submitted"]
    return [
        Figure.share("attempts stored", result["stored"], submitted, "system"),
        Figure.share("attempts lost", result["lost"], submitted, "system"),
        Figure.share("attempts stored twice", result["duplicated"], submitted, "system"),
        Figure.single("RSS growth over the second half", result["second_half_growth"]["rss_mb"],
                      "MB"),
        Figure.single("peak RSS", result["peak"]["rss_mb"], "MB"),
        Figure.single("peak threads", result["peak"]["threads"]),
        Figure.single("peak open files", result["peak"]["open_files"]),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
