"""Replicates: arms compared over several runs each, on the tasks all their runs were scored on.

One run of an arm is one draw: two runs with the same settings can end 0.08 pass@1 apart on the
same tasks. This reads `bench/confirm.py` results (or `bench/learn.py` results, for the gate
tasks), groups their runs by arm, keeps the tasks every run was scored on, and reports each
arm's runs with their mean and spread, and each arm against the baseline: the difference of
the means with Welch's 95% interval over runs (the runs are the units), and the interval over
tasks with the runs held fixed (which leaves out the run-to-run spread and is narrower).

    .venv/bin/python -m bench.replicates RESULT.json [RESULT.json ...] [--baseline ARM]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import Figure, provenance, write_results
from reports.intervals import mean_interval, welch_difference
from reports.table import text_table


@dataclass(frozen=True)
class Run:
    """One kept run's final version, scored task by task on fresh tasks."""

    arm: str
    label: str
    solved: dict[str, bool]


@dataclass(frozen=True)
class Comparison:
    """An arm's mean over its runs against the baseline's, on the shared tasks."""

    arm: str
    vs: str
    difference: float
    runs_low: float | None
    runs_high: float | None
    tasks_low: float
    tasks_high: float


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="confirm.py or learn.py JSON")
    parser.add_argument("--baseline", default=None, help="the arm the others are compared to")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    runs = [run for path in args.results for run in load_runs(path)]
    arms = by_arm(runs)
    baseline = args.baseline or next(iter(arms))
    if baseline not in arms:
        sys.exit(f"no run of arm {baseline!r} in these results (arms: {', '.join(arms)})")
    tasks = shared_tasks(runs)
    if not tasks:
        sys.exit("these results share no task: confirm the runs on the same --skip and --tasks")
    scores = {arm: [score(run, tasks) for run in group] for arm, group in arms.items()}
    comparisons = [compare(arms[arm], arms[baseline], tasks) for arm in arms if arm != baseline]
    print_table(scores, comparisons, len(tasks))
    if args.json:
        result = {
            "tasks": len(tasks),
            "runs": {run.label: {"arm": run.arm, "pass_at_1": score(run, tasks)} for run in runs},
            "comparisons": [asdict(c) for c in comparisons],
        }
        write_results(args.json, result, made, figures(scores, comparisons, len(tasks)))


def figures(scores: dict[str, list[float]], comparisons: list[Comparison], n: int) -> list[Figure]:
    """Each arm's mean pass@1 over its runs (Student's interval over runs), and each arm's
    difference from the baseline with Welch's interval over runs (n: the runs of both)."""
    found = [Figure.mean(f"{arm}: pass@1 on {n} shared tasks, mean over runs", values,
                         counts="policy") for arm, values in scores.items()]  # fmt: skip
    for c in comparisons:
        runs = len(scores[c.arm]) + len(scores[c.vs])
        found.append(Figure(f"{c.arm} minus {c.vs} (Welch over runs)", c.difference, runs,
                            c.runs_low, c.runs_high, counts="policy"))  # fmt: skip
    return found


def load_runs(path: Path) -> list[Run]:
    """The runs of one `bench/confirm.py` result (a run's arm is its folder's name), or the
    arms of one `bench/learn.py` result, scored on its gate tasks."""
    data: dict[str, Any] = json.loads(path.read_text())
    runs = data["runs"] if "runs" in data else data["arms"]
    return [
        Run(arm=run.get("arm", name), label=f"{path.stem}:{name}", solved=run["solved"])
        for name, run in runs.items()
    ]


def by_arm(runs: list[Run]) -> dict[str, list[Run]]:
    arms: dict[str, list[Run]] = {}
    for run in runs:
        arms.setdefault(run.arm, []).append(run)
    return arms


def shared_tasks(runs: list[Run]) -> list[str]:
    """The tasks every run was scored on (each confirmation leaves out what its runs trained
    on, so the sets differ a little)."""
    return sorted(set.intersection(*(set(run.solved) for run in runs)))


def score(run: Run, tasks: list[str]) -> float:
    return statistics.fmean(run.solved[t] for t in tasks)


def compare(arm: list[Run], baseline: list[Run], tasks: list[str]) -> Comparison:
    a = [score(run, tasks) for run in arm]
    b = [score(run, tasks) for run in baseline]
    per_task = [_share(arm, t) - _share(baseline, t) for t in tasks]
    difference, tasks_low, tasks_high = mean_interval(per_task)
    runs_low = runs_high = None
    if len(a) > 1 and len(b) > 1:
        _, runs_low, runs_high = welch_difference(a, b)
    return Comparison(
        arm=arm[0].arm, vs=baseline[0].arm, difference=difference, runs_low=runs_low,
        runs_high=runs_high, tasks_low=tasks_low, tasks_high=tasks_high,
    )  # fmt: skip


def _share(runs: list[Run], task: str) -> float:
    return statistics.fmean(run.solved[task] for run in runs)


def print_table(scores: dict[str, list[float]], comparisons: list[Comparison], n: int) -> None:
    rows = [
        [arm, str(len(s)), " ".join(f"{x:.3f}" for x in s), f"{statistics.fmean(s):.3f}",
         f"{statistics.stdev(s):.3f}" if len(s) > 1 else "-"]
        for arm, s in scores.items()
    ]  # fmt: skip
    print(text_table(["arm", "runs", f"pass@1 on {n} tasks", "mean", "sd"], rows))
    for c in comparisons:
        over_runs = (
            f"{c.runs_low:+.3f} to {c.runs_high:+.3f}"
            if c.runs_low is not None and c.runs_high is not None
            else "- (needs two runs of each)"
        )
        print(
            f"{c.arm} vs {c.vs}: {c.difference:+.3f}; 95% over runs {over_runs}; "
            f"runs fixed, over tasks {c.tasks_low:+.3f} to {c.tasks_high:+.3f}"
        )


if __name__ == "__main__":
    main()
