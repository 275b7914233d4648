"""Exploration benchmark: tasks solved at an equal budget of generated tokens, per method.

For each method, every task gets groups of attempts until it has used its budget of generated
tokens (all calls count: strategies, answers, reflections, retries, judges). A task counts as
solved when a verified success comes before the budget runs out, attempts taken in the order
they were made, so the last group's overshoot earns nothing. Reported per method: that fraction,
first-attempt pass@1 (the first unguided attempt of each task) and the tokens spent. Real
SmolLM2 on the CPU vLLM server.

    .venv/bin/python bench/explore.py [--tasks 32] [--budget 768] [--server-url URL] [--json P]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from smollm2_server import smollm2_server  # noqa: E402

from agents.collector import collect_group  # noqa: E402
from agents.insight import InsightBoard  # noqa: E402
from agents.policy import PolicyClient  # noqa: E402
from agents.settings import CollectSettings  # noqa: E402
from agents.strategy import StrategySettings  # noqa: E402
from flows.table import text_table  # noqa: E402
from memory.records import FIRST_KINDS, Group  # noqa: E402
from verifiers.catalog import train_tasks  # noqa: E402
from verifiers.task import Task  # noqa: E402

METHODS: dict[str, dict[str, Any]] = {
    "plain": {},
    "sge": {"strategy": StrategySettings()},
    "sge+r3l": {"strategy": StrategySettings(), "reflect_retry": True},
    "sge+r3l+insights": {"strategy": StrategySettings(), "reflect_retry": True, "insights": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--taskset", default="arithmetic")
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--budget", type=int, default=768, help="generated tokens per task")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--server-url", default=None)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    tasks = train_tasks(args.taskset, args.tasks, seed=7, held_out=[])
    with smollm2_server(args.server_url, args.port, "vllm-explore.log") as (url, model):
        results = {m: anyio.run(run_method, m, tasks, args, url, model.name) for m in methods}
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "methods": results}
    if "plain" in results:
        base = results["plain"]["solved"]
        for figures in results.values():
            figures["solved_vs_plain"] = figures["solved"] / base if base else None
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


async def run_method(
    method: str, tasks: list[Task], args: argparse.Namespace, url: str, model: str
) -> dict[str, Any]:
    settings = CollectSettings(
        group_size=args.group_size, temperature=1.0, max_tokens=args.max_tokens, **METHODS[method]
    )
    client = PolicyClient(url)
    limiter = anyio.CapacityLimiter(args.concurrency)
    board = InsightBoard() if settings.insights else None
    groups: dict[str, list[Group]] = {t.task_id: [] for t in tasks}
    spent = dict.fromkeys(groups, 0)
    started = time.monotonic()

    async def explore(task: Task) -> None:
        while spent[task.task_id] < args.budget:
            group = await collect_group(
                client,
                task,
                model=model,
                round_index=0,
                purpose="train",
                settings=settings,
                limiter=limiter,
                board=board,
            )
            groups[task.task_id].append(group)
            used = sum(a.generated_tokens for a in group.attempts)
            spent[task.task_id] += max(used, 1)

    try:
        async with anyio.create_task_group() as tg:
            for task in tasks:
                tg.start_soon(explore, task)
    finally:
        await client.aclose()
    solved = [solved_within(gs, args.budget) for gs in groups.values()]
    first = [next((a for a in gs[0].attempts if not a.guided), None) for gs in groups.values()]
    attempts = [a for gs in groups.values() for g in gs for a in g.attempts]
    print(f"[{method}] done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return {
        "solved": statistics.fmean(solved),
        "first_attempt_pass_at_1": statistics.fmean(bool(a and a.correct) for a in first),
        "tokens_per_task": statistics.fmean(spent.values()),
        "attempts": len(attempts),
        "errors": sum(a.error is not None for a in attempts),
        "seconds": time.monotonic() - started,
    }


def solved_within(groups: list[Group], budget: int) -> bool:
    """A success before `budget` generated tokens: first attempts by slot, then the extras
    (reflections, retries, insights) in the order they were made."""
    spent = 0
    for group in groups:
        ordered = sorted(group.first_attempts, key=lambda a: a.sample_index)
        ordered += [a for a in group.attempts if a.kind not in FIRST_KINDS]
        for attempt in ordered:
            spent += attempt.generated_tokens
            if spent > budget:
                return False
            if attempt.correct:
                return True
    return False


def print_table(result: dict[str, Any]) -> None:
    header = ["method", "solved", "vs plain", "pass@1 first", "tokens/task", "attempts", "errors"]
    rows = [header]
    for method, f in result["methods"].items():
        ratio = f.get("solved_vs_plain")
        rows.append(
            [
                method,
                f"{f['solved']:.3f}",
                "-" if ratio is None else f"{ratio:.2f}x",
                f"{f['first_attempt_pass_at_1']:.3f}",
                f"{f['tokens_per_task']:.0f}",
                str(f["attempts"]),
                str(f["errors"]),
            ]
        )
    print(text_table(rows[0], rows[1:]))
    s = result["settings"]
    print(
        f"\n{s['tasks']} {s['taskset']} tasks, {s['budget']} generated tokens per task, groups of "
        f"{s['group_size']}; solved = at least one verified success (goal: sge+r3l >= 1.3x plain)"
    )


if __name__ == "__main__":
    main()
