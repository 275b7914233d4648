"""Confirmation: the versions runs end with, on held-out tasks their gate never saw.

A run promotes a version for its pass@1 on the run's held-out tasks, so the score of the
version it ends with is biased upward: that version won a selection on those very tasks. This
benchmark evaluates the final version of each kept run (`python -m bench.learn --keep DIR`
leaves one folder per arm) on the next held-out tasks: after the run's first `--skip` (its
`--eval-tasks`), leaving out any task whose question one of the runs trained on. Greedy and
with nothing in context, like the run's own evaluation; each version on a server of its own
(its merged weights). Arms are paired with the first on the same tasks; several runs of one
arm are compared over runs by `bench/replicates.py`.

    .venv/bin/python -m bench.confirm --arm DIR [--arm DIR ...] [--skip 128] [--tasks 256]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

from bench.common import Figure, provenance, write_results
from bench.learn import final_version, paired
from bench.smollm2_server import fixed_server
from flows.settings import RunSettings
from memory import store, workqueue
from memory.records import Batch
from reports.table import text_table
from serving.server import VllmServer
from trainer.merge import merge_version
from verifiers.catalog import eval_tasks
from verifiers.task import Task
from workers import worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", type=Path, action="append", required=True, help="a kept run")
    parser.add_argument("--skip", type=int, default=128, help="the runs' own held-out tasks")
    parser.add_argument("--tasks", type=int, default=256, help="fresh held-out tasks to draw")
    parser.add_argument("--port", type=int, default=8061)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    runs = {label: _final(folder) for label, folder in labelled(args.arm).items()}
    taskset = next(iter(runs.values()))["taskset"]
    trained = set().union(*(run["trained"] for run in runs.values()))
    drawn = eval_tasks(taskset, args.skip + args.tasks)[args.skip :]
    tasks = [t for t in drawn if t.question not in trained]
    print(f"{len(tasks)} fresh tasks ({len(drawn) - len(tasks)} left out: trained on)",
          file=sys.stderr)  # fmt: skip
    for name, run in runs.items():
        run["solved"] = evaluate(run["folder"], tasks, args.port)
        print(f"[{name}] {run['version']}: {statistics.fmean(run['solved'].values()):.3f}",
              file=sys.stderr)  # fmt: skip
    result: dict[str, Any] = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "tasks": len(tasks),
        "runs": {
            name: {
                "arm": run["arm"],
                "version": run["version"],
                "gate_pass_at_1": run["gate_pass_at_1"],
                "pass_at_1": statistics.fmean(run["solved"].values()),
                "solved": run["solved"],
            }
            for name, run in runs.items()
        },
    }
    result["paired"] = paired(result["runs"])
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(result))


def figures(result: dict[str, Any]) -> list[Figure]:
    """Each run's final version on the fresh tasks (Wilson), and each run's paired difference
    from the first on the same tasks."""
    found = [Figure.share(f"{name} ({run['version']}): pass@1 on fresh tasks",
                          sum(run["solved"].values()), len(run["solved"]), "policy")
             for name, run in result["runs"].items()]  # fmt: skip
    found += [Figure(f"{name} minus {pair['vs']}, on the same fresh tasks", pair["difference"],
                     pair["tasks"], pair["low"], pair["high"], counts="policy")
              for name, pair in result["paired"].items()]  # fmt: skip
    return found


def labelled(folders: list[Path]) -> dict[str, Path]:
    """Each kept run by its arm's name, or by its parent folder and arm where two runs of the
    same arm are confirmed together."""
    names = [folder.name for folder in folders]
    labels = {
        (f"{folder.parent.name}/{folder.name}" if names.count(folder.name) > 1 else folder.name):
        folder for folder in folders
    }  # fmt: skip
    if len(labels) < len(folders):
        sys.exit("two --arm folders have the same name and parent name: one would hide the other")
    return labels


def _final(folder: Path) -> dict[str, Any]:
    """A kept run's final version: its name, weights folder and gate score, and the
    questions the run trained on."""
    summary = json.loads((folder / "summary.json").read_text())
    version = final_version(summary)
    engine = store.open_store(summary["db_url"])
    with store.transaction(engine) as session:
        record = store.policy_version(session, version)
        base = store.policy_version(session, summary["base_model"])
        trained = {g.question for g in store.load_groups(session, "train")}
    engine.dispose()
    weights = record.weights_path
    if weights is None or not Path(weights).is_dir():  # pruned: merged again from its adapter
        if record.adapter_path is None or base.weights_path is None:
            sys.exit(f"{folder}: neither weights nor an adapter of {version} is left")
        weights = str(merge_version(
            Path(base.weights_path), Path(record.adapter_path), folder / "confirm", version
        ))  # fmt: skip
    return {
        "arm": folder.name,
        "version": version,
        "folder": Path(weights),
        "gate_pass_at_1": record.eval_pass_at_1,
        "taskset": summary["taskset"],
        "trained": trained,
    }


def evaluate(folder: Path, tasks: list[Task], port: int) -> dict[str, bool]:
    """Task id -> solved, greedy, one answer per task, from a server of `folder`."""
    settings = fixed_server(folder, port, f"vllm-confirm-{folder.name}.log", None, "float32")
    with VllmServer(settings) as server, tempfile.TemporaryDirectory() as scratch:
        run = RunSettings(db_url=f"sqlite:///{scratch}/confirm.db", workdir=Path(scratch))
        engine = store.open_store(run.db_url)
        batch = Batch(round_index=0, purpose="eval", policy_version=folder.name)
        sampling = run.eval_settings()
        with store.transaction(engine) as session:
            workqueue.enqueue(session, worker.plan_items(
                batch, tasks, lambda t: worker.Plan(task=t, sampling=sampling)
            ))  # fmt: skip
        anyio.run(lambda: worker.work(
            engine, server.url, "confirm", worker.WorkerSettings(),
            worker.Shift(lambda: worker.batch_done(engine, batch), batch),
        ))  # fmt: skip
        with store.transaction(engine) as session:
            groups = store.load_groups(session, "eval", 0, folder.name)
        engine.dispose()
    return {g.task_id: g.attempts[0].correct for g in groups if g.attempts}


def print_table(result: dict[str, Any]) -> None:
    rows = [
        [name, run["version"], _score(run["gate_pass_at_1"]), f"{run['pass_at_1']:.3f}"]
        for name, run in result["runs"].items()
    ]
    print(text_table(["run", "final version", "gate set", f"fresh {result['tasks']}"], rows))
    for name, p in result["paired"].items():
        print(
            f"{name} vs {p['vs']} on the fresh tasks: {p['difference']:+.3f} "
            f"({p['low']:+.3f} to {p['high']:+.3f}), won {p['won']}, lost {p['lost']}"
        )


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
