"""Sandbox benchmark: what isolation costs per execution, against a bare subprocess.

Runs the same small program (a code-task harness call) `--runs` times as a bare
`python3 -I -S -c` subprocess and through the sandbox at each isolation level this host supports,
one at a time, then `--workers` at a time for throughput. Overhead is the sandboxed wall time
minus the bare median. Also times one full code-task verification.

    .venv/bin/python -m bench.sandbox [--runs 200] [--workers 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import Figure, provenance, write_results
from verifiers.coding import HARNESS, train_tasks, verify
from verifiers.sandbox import SYSTEM_PYTHON, Isolation, Sandbox, Status, best_isolation

PAYLOAD = json.dumps(
    {"code": "def add(a, b):\n    return a + b", "entry": "add", "cases": [[1, 2], [3, 4]]}
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    bare = [bare_run() for _ in range(args.runs)]
    rows = [row("bare subprocess", bare, throughput(bare_run, args), baseline=bare)]
    for isolation in levels():
        sandbox = Sandbox(isolation=isolation, slots=args.workers)
        timings = [sandboxed_run(sandbox) for _ in range(args.runs)]
        rate = throughput(lambda s=sandbox: sandboxed_run(s), args)
        rows.append(row(isolation.value, timings, rate, baseline=bare))
    task = next(t for t in train_tasks(18, seed=0) if t.task_id == "code:add")
    started = time.perf_counter()
    verify(task, "```python\ndef add(a, b):\n    return a + b\n```")
    result = {
        "settings": {"runs": args.runs, "workers": args.workers},
        "best_isolation": best_isolation().value,
        "rows": rows,
        "verify_ms": (time.perf_counter() - started) * 1000,
    }
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(result))


def figures(result: dict[str, Any]) -> list[Figure]:
    """Each isolation level's overhead over a bare subprocess (median over runs, its interval
    from the order statistics), and its executions/s with `--workers` at once (one pass)."""
    found = []
    for r in result["rows"][1:]:
        found.append(Figure.median(f"{r['isolation']}: overhead per execution",
                                   r["overhead_ms"], "ms"))  # fmt: skip
        found.append(Figure.single(f"{r['isolation']}: executions/s, "
                                   f"{result['settings']['workers']} at once",
                                   r["executions_per_s"]))  # fmt: skip
    found.append(Figure.single("one code-task verification", result["verify_ms"], "ms"))
    return found


def levels() -> list[Isolation]:
    order = list(Isolation)
    return order[order.index(best_isolation()) :]


def bare_run() -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-S", "-B", "-c", HARNESS], input=PAYLOAD.encode(),
        capture_output=True, env={}, check=True,
    )  # fmt: skip
    assert b'"value": 3' in done.stdout
    return time.perf_counter() - started


def sandboxed_run(sandbox: Sandbox) -> float:
    started = time.perf_counter()
    execution = sandbox.run(HARNESS, PAYLOAD)
    assert execution.status is Status.OK and '"value": 3' in execution.stdout, execution
    return time.perf_counter() - started


def throughput(run: Any, args: argparse.Namespace) -> float:
    count = args.runs
    started = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda _: run(), range(count)))
    return float(count / (time.perf_counter() - started))


def row(name: str, timings: list[float], rate: float, baseline: list[float]) -> dict[str, Any]:
    base = statistics.median(baseline)
    ms = sorted(t * 1000 for t in timings)
    overhead = sorted((t - base) * 1000 for t in timings)
    return {
        "isolation": name,
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[int(0.99 * (len(ms) - 1))],
        "overhead_p50_ms": statistics.median(overhead),
        "overhead_p99_ms": overhead[int(0.99 * (len(overhead) - 1))],
        "executions_per_s": rate,
        "overhead_ms": overhead,
    }


def print_table(result: dict[str, Any]) -> None:
    workers = result["settings"]["workers"]
    print(f"{'isolation':<16} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'+p99 ms':>8} "
          f"{f'exec/s ({workers} at once)':>20}")  # fmt: skip
    for r in result["rows"]:
        print(
            f"{r['isolation']:<16} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} "
            f"{r['overhead_p50_ms']:>8.1f} {r['overhead_p99_ms']:>8.1f} "
            f"{r['executions_per_s']:>20.1f}"
        )
    print(f"one code-task verification: {result['verify_ms']:.1f} ms")


if __name__ == "__main__":
    main()
