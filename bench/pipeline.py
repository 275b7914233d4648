"""Pipeline benchmark: generated tokens/s through the collection flow against the raw server.

The same requests (tasks x attempts, same prompt, temperature and token limit) go to the vLLM
server twice at the same concurrency: once raw (the openai client alone), once through the real
path: a Prefect flow running the `collect` task, which samples through the agents, verifies
every attempt and stores every group in SQLite; its rate is over the task's wall time. Also
reported: the orchestration overhead, the flow run's wall time (Prefect's flow and task
bookkeeping, and its local server's start-up the first time) minus the task's.

    .venv/bin/python bench/pipeline.py [--tasks 64] [--group-size 4] [--server-url URL] [--json P]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from smollm2_server import smollm2_server  # noqa: E402

from agents.context import bare_messages  # noqa: E402
from agents.policy import PolicyClient  # noqa: E402
from agents.settings import CollectSettings  # noqa: E402
from flows.settings import RunSettings  # noqa: E402
from memory.records import SamplingSettings  # noqa: E402
from verifiers.catalog import train_tasks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--server-url", default=None)
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with smollm2_server(args.server_url, args.port, "vllm-pipeline.log") as (url, model):
        result = measure(args, url, model.name)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def measure(args: argparse.Namespace, url: str, model: str) -> dict[str, Any]:
    tasks = train_tasks("arithmetic", args.tasks, seed=11, held_out=[])
    raw_tokens, raw_seconds = anyio.run(raw, args, url, model, tasks)
    flow_tokens, task_seconds, flow_seconds = through_flow(args, url, model, tasks)
    return {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "raw_tokens_per_s": raw_tokens / raw_seconds,
        "flow_tokens_per_s": flow_tokens / task_seconds,
        "ratio": (flow_tokens / task_seconds) / (raw_tokens / raw_seconds),
        "raw_tokens": raw_tokens,
        "flow_tokens": flow_tokens,
        "orchestration_overhead_s": flow_seconds - task_seconds,
    }


async def raw(args: argparse.Namespace, url: str, model: str, tasks: list) -> tuple[int, float]:
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
    args: argparse.Namespace, url: str, model: str, tasks: list
) -> tuple[int, float, float]:
    from prefect import flow

    from flows.stages import collect

    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as scratch:
        settings = RunSettings(
            db_url=f"sqlite:///{scratch}/fw.db",
            workdir=Path(scratch),
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
        )
        sampling = CollectSettings(
            group_size=args.group_size, temperature=1.0, max_tokens=args.max_tokens
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
