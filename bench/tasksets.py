"""Task-set benchmark: how hard each task set is for the base model, the figure presets are
chosen by.

For every task set (or `--tasksets`), on its held-out tasks: greedy pass@1 and format rate (what
`flywheel run` reports as the base line), then `--group-size` samples at temperature 1.0 per
task: the success rate, and the fraction of groups with mixed outcomes, the only groups that
carry a GRPO signal. A preset is useful when that fraction is high: neither always solved nor
never. Also the verification time per attempt.

    .venv/bin/python -m bench.tasksets [--tasks 32] [--server-url URL] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

from agents.collector import GroupSpec, collect_group
from agents.policy import Endpoint, PolicyClient
from agents.settings import CollectSettings
from bench.common import Figure, provenance, write_results
from bench.smollm2_server import smollm2_server
from memory.records import Group
from verifiers.catalog import eval_tasks, names
from verifiers.errors import VerifierError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasksets", default=",".join(names()))
    parser.add_argument("--tasks", type=int, default=32, help="held-out tasks per task set")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--server-url", default=None)
    parser.add_argument("--port", type=int, default=8032)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    chosen = [name.strip() for name in args.tasksets.split(",") if name.strip()]
    with smollm2_server(args.server_url, args.port, "vllm-tasksets.log") as (url, model):
        rows = {name: anyio.run(measure, name, args, url, model.name) for name in chosen}
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "tasksets": rows}
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(result, args.group_size))


def figures(result: dict[str, Any], group_size: int) -> list[Figure]:
    """Per task set, the base model's greedy pass@1 over its held-out tasks and its sampled
    success over every sample (Wilson)."""
    found = []
    for name, row in result["tasksets"].items():
        n = row["tasks"]
        found.append(Figure.share(f"{name}: greedy pass@1", round(row["greedy_pass_at_1"] * n),
                                  n, "policy"))  # fmt: skip
        samples = n * group_size
        found.append(
            Figure.share(
                f"{name}: sampled success at temperature 1.0",
                round(row["sampled_success"] * samples),
                samples,
                "policy",
            )
        )
    return found


async def measure(name: str, args: argparse.Namespace, url: str, model: str) -> dict[str, Any]:
    # A small fixed set (code) may hold fewer than --tasks: take all of it.
    tasks = next(eval_tasks(name, n) for n in range(args.tasks, 0, -1) if _has(name, n))
    started = time.monotonic()
    greedy = await _collect(tasks, url, model, args, group_size=1, temperature=0.0)
    sampled = await _collect(tasks, url, model, args, args.group_size, temperature=1.0)
    first = [g.attempts[0] for g in greedy]
    attempts = [a for g in sampled for a in g.attempts]
    mixed = [len({a.correct for a in g.attempts}) == 2 for g in sampled]
    return {
        "tasks": len(tasks),
        "greedy_pass_at_1": statistics.fmean(a.correct for a in first),
        "greedy_format": statistics.fmean(a.format_ok for a in first),
        "sampled_success": statistics.fmean(a.correct for a in attempts),
        "mixed_groups": statistics.fmean(mixed),
        "errors": sum(a.error is not None for a in attempts),
        "seconds": time.monotonic() - started,
    }


def _has(name: str, count: int) -> bool:
    try:
        eval_tasks(name, count)
    except VerifierError:
        return False
    return True


async def _collect(
    tasks: list[Any],
    url: str,
    model: str,
    args: argparse.Namespace,
    group_size: int,
    temperature: float,
) -> list[Group]:
    settings = CollectSettings(
        group_size=group_size, temperature=temperature, max_tokens=args.max_tokens
    )
    client = PolicyClient(url)
    limiter = anyio.CapacityLimiter(args.concurrency)
    groups: list[Group] = []

    async def one(task: Any) -> None:
        groups.append(
            await collect_group(
                Endpoint(client, model), task, GroupSpec(0, "eval", settings), limiter
            )
        )  # fmt: skip

    try:
        async with anyio.create_task_group() as tg:
            for task in tasks:
                tg.start_soon(one, task)
    finally:
        await client.aclose()
    return groups


def print_table(result: dict[str, Any]) -> None:
    print(f"{'task set':<12} {'tasks':>5} {'greedy':>7} {'format':>7} {'sampled':>8} "
          f"{'mixed groups':>13} {'errors':>7} {'s':>5}")  # fmt: skip
    for name, r in result["tasksets"].items():
        print(
            f"{name:<12} {r['tasks']:>5} {r['greedy_pass_at_1']:>7.3f} {r['greedy_format']:>7.2f} "
            f"{r['sampled_success']:>8.3f} {r['mixed_groups']:>13.2f} {r['errors']:>7} "
            f"{r['seconds']:>5.0f}"
        )


if __name__ == "__main__":
    main()
