"""The default run, end to end: `make run` against `make run REVIEWER=`, several runs of each.

Each run is `flywheel run` with the Makefile's defaults (the reviewer's arm: `--reviewer
qwen2.5-coder-0.5b --config examples/reviewer.toml`; `overlap`: the same with `--overlap 1`, each
round's training beside the next round's collection; `shuffled-float32`, `shuffled-bfloat16` and
`length-bfloat16`: the reviewer's arm with the trainer's rows shuffled in float32 or in bfloat16, or
in batches of near length in bfloat16; the policy alone: no flags), from an empty store in a folder
of its own (and Prefect's temporary server, so that no run leaves one behind), the arms alternating
so that a slow spell of the machine falls on all. From each run's summary: the wall time of the run
and of each stage, and the held-out pass@1 of the version the gate kept serving, with its paired
gain over the base model on the same tasks; and the table the run printed, as a user sees it. Each
arm's final pass@1 is compared with the first arm's, with Welch's interval over runs.

    .venv/bin/python -m bench.run [--runs 3] [--arms reviewer,alone] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    FLYWHEEL,
    ROOT,
    Figure,
    checkout_env,
    provenance,
    run_command,
    write_results,
)
from reports.intervals import mean_interval, welch_difference
from reports.summary import serving_share
from reports.table import text_table

REVIEWER = ["--reviewer", "qwen2.5-coder-0.5b", "--config", "examples/reviewer.toml"]
ARMS = {
    "reviewer": REVIEWER,
    "overlap": [*REVIEWER, "--overlap", "1"],
    "alone": [],
    # The reviewer's arm with the trainer's rows shuffled, in float32 (the default on a CPU)...
    "shuffled-float32": [*REVIEWER, "--batch-order", "random", "--train-dtype", "float32"],
    # ...and in batches of near length, in bfloat16: a faster training stage.
    "length-bfloat16": [*REVIEWER, "--batch-order", "length", "--train-dtype", "bfloat16"],
    # bfloat16 alone, the rows shuffled as by default: which of the two changed the outcome.
    "shuffled-bfloat16": [*REVIEWER, "--batch-order", "random", "--train-dtype", "bfloat16"],
}
STAGES = ("collect", "train", "merge", "swap", "evaluate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="of each arm")
    parser.add_argument("--arms", default="reviewer,alone", help=f"of {', '.join(ARMS)}")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        parser.error(f"unknown arm {sorted(unknown)[0]}; arms: {', '.join(ARMS)}")
    made = provenance()
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for index in range(args.runs):
        for arm in arms:
            print(f"run {index + 1}/{args.runs} of {arm} ...", flush=True)
            runs[arm].append(one_run(arm, args.port))
            print(f"  {describe(runs[arm][-1])}", flush=True)
    print_table(runs)
    if args.json:
        payload = {"settings": {"runs": args.runs, "arms": arms}, "runs": runs}
        write_results(args.json, payload, made, figures(runs))


def one_run(arm: str, port: int) -> dict[str, Any]:
    """`flywheel run` of `arm` from an empty store; its summary's figures."""
    with tempfile.TemporaryDirectory(prefix=f"bench-run-{arm}-") as scratch:
        work = Path(scratch)
        command = [
            *FLYWHEEL, "run", *ARMS[arm],
            "--db", f"sqlite:///{work / 'flywheel.db'}", "--workdir", str(work),
            "--summary-json", str(work / "summary.json"), "--port", str(port),
            "--prefect", "temporary",
        ]  # fmt: skip
        log = work / "run.log"
        print(f"  progress: {log}", flush=True)
        started = time.monotonic()
        done = run_command(command, log=log, cwd=ROOT, env=checkout_env())
        seconds = time.monotonic() - started
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise SystemExit(f"flywheel run ({arm}) exited {done.returncode}: {tail}")
        summary = json.loads((work / "summary.json").read_text())
    return figures_of(summary, seconds) | {"printed": done.stdout.strip().splitlines()[-40:]}


def figures_of(summary: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What one run's summary says: stage seconds, and the kept version's pass@1 and its paired
    gain over the base (the base itself where no round was promoted)."""
    rounds = summary["rounds"]
    kept = next((r for r in reversed(rounds) if r["promoted"]), None)
    n = summary["eval_tasks"]
    gained, lost = (kept["eval_gained"], kept["eval_lost"]) if kept else (0, 0)
    return {
        "command_seconds": seconds,
        "wall_seconds": summary["wall_seconds"],
        "rounds": [r["wall_seconds"] for r in rounds],
        "base_pass_at_1": summary["baseline_pass_at_1"],
        "final_pass_at_1": kept["eval_pass_at_1"] if kept else summary["baseline_pass_at_1"],
        "final_version": kept["policy_version"] if kept else summary["base_model"],
        "per_round_pass_at_1": [r["eval_pass_at_1"] for r in rounds],
        "gained": gained,
        "lost": lost,
        "eval_tasks": n,
        "rollouts": sum(r.get("rollouts", 0) for r in rounds),
        # the groups the rounds trained on, those an earlier version sampled, those left out
        "groups": sum(r.get("groups", 0) for r in rounds),
        "stale_groups": sum(r.get("stale_groups", 0) for r in rounds),
        "dropped_groups": sum(r.get("dropped_groups", 0) for r in rounds),
    }


def describe(run: dict[str, Any]) -> str:
    return (
        f"{run['command_seconds']:.0f} s, pass@1 {run['base_pass_at_1']:.3f} -> "
        f"{run['final_pass_at_1']:.3f} ({run['gained']} gained, {run['lost']} lost)"
    )


def paired_gain(run: dict[str, Any]) -> tuple[float, float, float]:
    """The kept version's gain over the base on the same tasks, with its 95% interval."""
    n, gained, lost = run["eval_tasks"], run["gained"], run["lost"]
    return mean_interval([1.0] * gained + [-1.0] * lost + [0.0] * (n - gained - lost))


def figures(runs: dict[str, list[dict[str, Any]]]) -> list[Figure]:
    """Per arm, over its runs: the command's wall time, each stage's seconds, the final pass@1
    and its gain over the base; then each arm's difference in final pass@1 from the first arm's
    (Welch)."""
    found = []
    for arm, done in runs.items():
        # Every arm that serves the reviewer learns from its answers, not the "reviewer" arm alone.
        counts = _counts(arm)
        found.append(Figure.mean(f"{arm}: wall time of the command",
                                 [r["command_seconds"] for r in done], "s"))  # fmt: skip
        for stage in ("server_start", *STAGES, "total"):
            values = [r["wall_seconds"].get(stage, 0.0) for r in done]
            if any(values):
                found.append(Figure.mean(f"{arm}: {stage} stage, all rounds", values, "s"))
        shares = [serving_share(r["wall_seconds"]) for r in done]
        if all(share is not None for share in shares):
            found.append(Figure.mean(
                f"{arm}: share of the run after the server's start with work for the policy's "
                "server (baseline, collection, evaluation)", [s or 0.0 for s in shares],
            ))  # fmt: skip
        if all(r.get("rollouts") for r in done):
            per_minute = [60 * r["rollouts"] / r["command_seconds"] for r in done]
            name = f"{arm}: rollouts collected per minute of the command"
            found.append(Figure.mean(name, per_minute))
        found += _staleness(arm, done)
        found.append(Figure.mean(f"{arm}: final held-out pass@1",
                                 [r["final_pass_at_1"] for r in done], counts=counts))  # fmt: skip
        found.append(Figure.mean(f"{arm}: final minus base, paired per run",
                                 [paired_gain(r)[0] for r in done], counts=counts))  # fmt: skip
    (first, baseline), *others = runs.items()
    for arm, done in others:
        if len(done) < 2 or len(baseline) < 2:
            continue
        diff, low, high = welch_difference([r["final_pass_at_1"] for r in done],
                                           [r["final_pass_at_1"] for r in baseline])  # fmt: skip
        name = f"{arm} minus {first}, final pass@1 (Welch over runs)"
        n = len(done) + len(baseline)
        found.append(Figure(name, diff, n, low, high, counts=_counts(first, arm)))
    return found


def _staleness(arm: str, done: list[dict[str, Any]]) -> list[Figure]:
    """Over an arm's runs, the share of trained groups an earlier version sampled, and of the
    groups offered to a round, those left out as too old (overlapped rounds only have any)."""
    trained = sum(r.get("groups", 0) for r in done)
    stale, dropped = (sum(r.get(k, 0) for r in done) for k in ("stale_groups", "dropped_groups"))
    if not trained or not (stale or dropped or "--overlap" in ARMS[arm]):
        return []
    return [
        Figure.share(f"{arm}: trained groups an earlier version sampled", stale, trained),
        Figure.share(f"{arm}: groups left out as too old", dropped, trained + dropped),
    ]


def _counts(*arms: str) -> str:
    """Whose work the held-out answers of these arms count: the policy's own always; "policy
    and reviewer" where every arm learnt from the reviewer's answers too."""
    return "policy and reviewer" if all("--reviewer" in ARMS[a] for a in arms) else "policy"


def print_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    rows = []
    for arm, done in runs.items():
        for index, r in enumerate(done, 1):
            gain, low, high = paired_gain(r)
            stages = " ".join(f"{r['wall_seconds'].get(s, 0):.0f}" for s in STAGES)
            rows.append([
                arm, str(index), f"{r['command_seconds']:.0f}", stages,
                " ".join("-" if p is None else f"{p:.3f}" for p in r["per_round_pass_at_1"]),
                f"{r['final_pass_at_1']:.3f}", f"{gain:+.3f} ({low:+.3f} to {high:+.3f})",
            ])  # fmt: skip
    header = ["arm", "run", "wall s", " ".join(STAGES), "pass@1 per round", "final", "gain (95%)"]
    print(text_table(header, rows))


if __name__ == "__main__":
    main()
