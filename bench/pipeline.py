"""Pipeline benchmark: generated tokens/s through the collection flow against the raw server.

The same requests (tasks x attempts, same prompt, temperature and token limit) go to the vLLM
server twice at the same concurrency: once raw (the openai client alone), once through the real
path: a Prefect flow running the `collect` task, which samples through the agents, verifies
every attempt and stores every group in SQLite; its rate is over the task's wall time. Also
reported: the orchestration overhead, the flow run's wall time (Prefect's flow and task
bookkeeping, and its local server's start-up the first time) minus the task's.

With `--workers`, it measures scale-out instead: one batch collected by one `flywheel worker`
on one model server (with vLLM's own core binding, then pinned to all the host's cores), then
the same batch by two workers, each on a model server of its own pinned to half the cores (a
fresh SQLite store each time).
Reported: seconds from the batch entering the queue to its last group stored, tasks/s, and
the speed-up.

    .venv/bin/python -m bench.pipeline [--tasks 64] [--group-size 4] [--server-url URL]
        [--workers] [--json P]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio

from bench.common import FLYWHEEL, Figure, checkout_env, provenance, write_results

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from agents.context import bare_messages
from agents.policy import PolicyClient
from agents.settings import CollectSettings
from bench.smollm2_server import smollm2_server
from flows.settings import RunSettings
from memory.records import Batch, SamplingSettings
from reports.table import text_table
from serving.server import split_cores
from verifiers.catalog import train_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--server-url", default=None)
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--workers", action="store_true", help="one worker against two, instead")
    parser.add_argument("--passes", type=int, default=3, help="raw and flow, alternating")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    if args.workers:
        result = scale_out(args)
        print_scale_out(result)
        if args.json:
            write_results(args.json, result, made, scale_out_figures(result))
        return
    with smollm2_server(args.server_url, args.port, "vllm-pipeline.log") as (url, model):
        result = measure(args, url, model.name)
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(result))


def figures(result: dict[str, Any]) -> list[Figure]:
    """Raw and flow tokens/s, their ratio paired by pass, the flow's own overhead."""
    passes = result["passes"]
    return [
        Figure.mean("raw vLLM", passes["raw"], "tokens/s"),
        Figure.mean("collection flow", passes["flow"], "tokens/s"),
        Figure.mean("flow / raw, paired by pass (goal >= 0.9)", passes["ratio"]),
        Figure.mean("orchestration overhead per round", passes["overhead"], "s"),
    ]


def scale_out_figures(result: dict[str, Any]) -> list[Figure]:
    """Seconds to collect the batch in each layout, and the speed-ups (one pass)."""
    return [
        *(Figure.single(f"{layout.replace('_', ' ')}: batch collected", result[layout]["seconds"],
                        "s") for layout in ("one_worker_auto", "one_worker", "two_workers")),
        Figure.single("two workers over one server on every core", result["speedup"]),
        Figure.single("two workers over one server, vLLM's binding", result["speedup_vs_auto"]),
    ]  # fmt: skip


def measure(args: argparse.Namespace, url: str, model: str) -> dict[str, Any]:
    tasks = train_tasks("arithmetic", args.tasks, seed=11, held_out=[])
    passes: dict[str, list[float]] = {"raw": [], "flow": [], "ratio": [], "overhead": []}
    for index in range(args.passes):
        raw_tokens, raw_seconds = anyio.run(raw, args, url, model, tasks)
        flow_tokens, task_seconds, flow_seconds = through_flow(args, url, model, tasks)
        passes["raw"].append(raw_tokens / raw_seconds)
        passes["flow"].append(flow_tokens / task_seconds)
        passes["ratio"].append(passes["flow"][-1] / passes["raw"][-1])
        passes["overhead"].append(flow_seconds - task_seconds)
        print(f"pass {index + 1}/{args.passes}: raw {passes['raw'][-1]:.1f}, flow "
              f"{passes['flow'][-1]:.1f} tokens/s", flush=True)  # fmt: skip
    return {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "raw_tokens_per_s": statistics.median(passes["raw"]),
        "flow_tokens_per_s": statistics.median(passes["flow"]),
        "ratio": statistics.median(passes["ratio"]),
        "orchestration_overhead_s": statistics.median(passes["overhead"]),
        "passes": passes,
    }


async def raw(
    args: argparse.Namespace, url: str, model: str, tasks: list[Any]
) -> tuple[int, float]:
    client = PolicyClient(url)
    limiter = anyio.CapacityLimiter(args.concurrency)
    sampling = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens)
    generated = 0

    async def one(task: Any) -> None:
        nonlocal generated
        async with limiter:
            messages = bare_messages(task, CollectSettings().system(task))
            sample = await client.sample(model, messages, sampling)
        generated += len(sample.completion_token_ids)

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for task in tasks:
            for _ in range(args.group_size):
                tg.start_soon(one, task)
    seconds = time.monotonic() - started
    await client.aclose()
    return generated, seconds


def through_flow(
    args: argparse.Namespace, url: str, model: str, tasks: list[Any]
) -> tuple[int, float, float]:
    from prefect import flow

    from flows.stages import collect

    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as scratch:
        sampling = CollectSettings(
            group_size=args.group_size, temperature=1.0, max_tokens=args.max_tokens
        )
        settings = RunSettings(
            db_url=f"sqlite:///{scratch}/fw.db",
            workdir=Path(scratch),
            concurrency=args.concurrency,
            collect=sampling.model_dump(),
        )

        @flow(name="bench-pipeline")
        async def one_collection() -> tuple[int, float]:
            started = time.monotonic()
            groups = await collect(settings, url, tasks, model, 1, "train", sampling)
            tokens = sum(a.generated_tokens for g in groups for a in g.attempts)
            return tokens, time.monotonic() - started

        started = time.monotonic()
        tokens, inside = anyio.run(one_collection)
        seconds = time.monotonic() - started
    return tokens, inside, seconds


def scale_out(args: argparse.Namespace) -> dict[str, Any]:
    """The same batch by one worker on a server pinned to every core, then by two workers on
    a server each, pinned to half the cores."""
    halves = split_cores()
    auto = collect_with_workers(args, [None])
    one = collect_with_workers(args, [",".join(halves)])
    two = collect_with_workers(args, list(halves))
    return {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "cores": halves,
        "one_worker_auto": auto,
        "one_worker": one,
        "two_workers": two,
        "speedup": one["seconds"] / two["seconds"],  # against one server on every core
        "speedup_vs_auto": auto["seconds"] / two["seconds"],
    }


def collect_with_workers(args: argparse.Namespace, cpus: list[str | None]) -> dict[str, Any]:
    """One `flywheel worker` per entry of `cpus`, each on its own SmolLM2 server pinned there
    (None: vLLM's own binding); seconds from enqueueing the batch to its last group stored."""
    from memory import store, workqueue
    from workers import worker

    tasks = train_tasks("arithmetic", args.tasks, seed=11, held_out=[])
    sampling = CollectSettings(
        group_size=args.group_size, temperature=1.0, max_tokens=args.max_tokens
    )
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as scratch, ExitStack() as stack:
        db = f"sqlite:///{scratch}/fw.db"
        engine = store.open_store(db)
        servers = [
            stack.enter_context(
                smollm2_server(None, args.port + i, f"vllm-workers-{i}.log", cores, "fixed")
            )
            for i, cores in enumerate(cpus)
        ]
        model = servers[0][1].name
        batch = Batch(round_index=1, purpose="train", policy_version=model)
        for i, (url, _) in enumerate(servers):
            stack.enter_context(_worker(db, url, Path(scratch) / f"worker{i}.log"))
        started = time.monotonic()
        with store.transaction(engine) as session:
            workqueue.enqueue(session, worker.plan_items(
                batch, tasks, lambda t: worker.Plan(task=t, sampling=sampling)
            ))  # fmt: skip
        while not worker.batch_done(engine, batch):
            time.sleep(0.2)
        seconds = time.monotonic() - started
        with store.transaction(engine) as session:
            groups = store.load_groups(session, "train", 1, model)
    tokens = sum(a.generated_tokens for g in groups for a in g.attempts)
    print(f"{len(cpus)} worker(s): {len(groups)} groups in {seconds:.1f} s", file=sys.stderr)
    return {
        "servers": len(cpus),
        "seconds": seconds,
        "groups": len(groups),
        "tasks_per_s": len(groups) / seconds,
        "tokens_per_s": tokens / seconds,
    }


@contextmanager
def _worker(db: str, url: str, log: Path) -> Iterator[None]:
    command = [
        *FLYWHEEL, "worker", "--db", db, "--server-url", url,
        "--workdir", str(log.parent),
    ]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=checkout_env()
        )
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


def print_scale_out(result: dict[str, Any]) -> None:
    s = result["settings"]
    rows = [
        [label, f"{r['seconds']:.1f}", f"{r['tasks_per_s']:.2f}", f"{r['tokens_per_s']:.1f}"]
        for label, r in (
            ("1 worker, 1 server, vLLM's binding", result["one_worker_auto"]),
            ("1 worker, 1 server on every core", result["one_worker"]),
            ("2 workers, 2 servers", result["two_workers"]),
        )
    ]
    print(text_table(["collection", "seconds", "tasks/s", "tokens/s"], rows))
    print(
        f"two workers' speed-up: {result['speedup']:.2f} against one server on every core, "
        f"{result['speedup_vs_auto']:.2f} against vLLM's binding"
    )
    print(
        f"\n{s['tasks']} tasks x {s['group_size']} attempts, {s['max_tokens']} tokens max; "
        f"two servers pinned to cores {' and '.join(result['cores'])}"
    )


def print_table(result: dict[str, Any]) -> None:
    s = result["settings"]
    print(f"{'metric':<40} {'value':>10}  goal")
    print(f"{'raw vLLM tokens/s':<40} {result['raw_tokens_per_s']:>10.1f}")
    print(f"{'collection flow tokens/s':<40} {result['flow_tokens_per_s']:>10.1f}")
    print(f"{'flow / raw':<40} {result['ratio']:>10.3f}  >= 0.9")
    print(
        f"{'orchestration overhead per round, s':<40} {result['orchestration_overhead_s']:>10.2f}"
    )
    print(
        f"\n{s['tasks']} tasks x {s['group_size']} attempts, {s['max_tokens']} tokens max, "
        f"{s['concurrency']} in flight; the flow verifies and stores every group"
    )


if __name__ == "__main__":
    main()
