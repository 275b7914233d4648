"""Learning benchmark: held-out pass@1 after each flywheel round, one curve per arm.

Each arm is a real `flywheel run` (subprocess, its own database and checkpoints) from the base
model on the same task set and held-out tasks, against one shared vLLM server, with the default
settings except for what the arm changes. Arms:

    grpo     GRPO advantages (guided half-groups, distilled, as by default)
    r3l      R3L: half the slots (one guided, one bare), a reflection and retry for each bare
             attempt short of full reward, positive amplification, improved retries as
             single-item groups; about the same number of sampled rollouts
    filtered  the default: mean-only advantages, rows filtered to 75% positive
    rltldr   RLTLDR whole: the filtered mode, with insights collected and trained as SFT rows
    plain    GRPO on plain sampling: no guidance at all
    herl     plain sampling, and HeRL: the reviewer revises the best attempt of each group that
             all failed, and a verified revision is trained off-policy in its group
    ead      plain sampling with the temperature annealed over each answer's tokens (EAD)
    nudge    plain sampling, and NudgeRL: the reviewer writes a hint for each group that all
             failed, half a group tries again with it, successes distilled into the bare prompt
    nudge+herl  both
    filtered+herl, filtered+nudge  the default (worked example, filtered rows) with HeRL's
             revisions or NudgeRL's hints on top
    filtered+herl4  the default with HeRL drawing 4 revisions at temperature 1.0, the best
             verified one trained as a distill copy
    filtered+herl2p  the same with 2 draws, revising every group with a failure (its best one)
    filtered+herl4b  as filtered+herl4, the reviewer answering afresh, not shown the failed
             attempt
    filtered+herl4pb  the same, revising every group with a failure (`make run`'s settings)
    default  those settings again, under the name the arms below build on
    default+sge, default+r3l, default+insights, default+library, default+outcome,
    default+nudge, default+examples  `make run`'s settings with one structured method on top
             (SGE's strategies, R3L's reflections and retries, RLTLDR's insights, EDGE's
             library, outcome bonuses, NudgeRL's hints, the policy's own examples): what each
             adds beyond the reviewer's revisions
    default+examples+r3l+outcome  several of those methods at once (any two or more)
    alone    the policy alone, no reviewer (`make run REVIEWER=`)

(Results written before the default mode was named `filtered` call these arms `rltldr...`.)

Each arm starts and supervises its own server (new versions served as merged weights), and
with `--reviewer NAME` the arms that use a reviewer (r3l, herl, nudge) serve it beside the
policy, each on its own core: an arm's wall time holds everything its method costs. Without a
reviewer the policy reviews itself. `--server-url` shares one running server instead (versions
as adapters).

`--minutes M` runs the arms at equal wall time: each runs rounds (up to `--rounds`) while the
time left covers its last round, and the arms are compared by the version each serves at the
end, paired on the same held-out tasks (each arm against the first, with a 95% interval).
`--runs N` runs every arm N times, the arms alternating so that a slow spell of the machine
falls on all, and compares each arm's final pass@1 with the first arm's, Welch over runs.
A round may end past the budget, and an arm whose rounds are long may stop well before it, so
with `--minutes` the arms are also compared at the same instant: by the version each served
when the budget ran out (its last round promoted by then), Welch over runs.
`--shared-rounds K` runs the first K rounds once in each run, with the first arm's settings,
and every arm goes on from a copy of their store: the arms differ only in the rounds after K,
and the run-to-run spread of the rounds before (as large as the gains sought) falls on none of
their differences. An arm's curve and wall time include the shared rounds.
`--refigure P` recomputes the figures of an earlier results file from its runs; `--merge P Q
--json R` puts the runs of files measured with the same settings, on the same kind of machine,
into one, with the arms they all ran (R's provenance is P's, and names the runs added).
`--any-machine` merges runs of other processors too: each run keeps its machine, and what a
time budget held, which depends on the machine's speed, is left out of R's figures; the minutes
until each arm's last round ended, a figure over runs, are given for each kind of machine.

`--set KEY=VALUE` adds a setting to every arm's own (`train.micro_batch_size=2` trains a 0.5B
policy in half the memory, the same steps); files merged must have been measured with the same.

Prints a table, writes the curves as JSON (--json) and PNG (--png); `--keep DIR` keeps every
run's stores, versions and logs in `DIR/run-N/ARM` (and `DIR/run-N/shared`). Each arm's
progress is in its folder's `run.log` while it runs (the path is printed).

    .venv/bin/python -m bench.learn [--arms grpo,r3l] [--runs N] [--rounds 3] [--minutes M]
        [--shared-rounds K] [--reviewer NAME] [--set KEY=VALUE ...] [--keep DIR] [--json P]
        [--png P]
    .venv/bin/python -m bench.learn --refigure P
    .venv/bin/python -m bench.learn --merge P Q [...] [--any-machine] --json R
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy.orm import Session

from bench.common import (
    FLYWHEEL,
    Figure,
    checkout_env,
    provenance,
    run_command,
    write_results,
)
from bench.smollm2_server import MODELS, smollm2_server
from cli.arguments import model_folder
from flows.errors import FlowError
from flows.settings import load_run_settings
from memory import library, store
from memory.records import Attempt
from reports.intervals import error_bars, paired_difference, welch_difference
from reports.table import text_table
from verifiers import catalog
from verifiers.errors import VerifierError

# Arms as settings by their dotted keys (a TOML file of dotted keys each).
UNGUIDED: dict[str, Any] = {"collect.guided_fraction": 0.0, "train.mode": "grpo"}
HERL: dict[str, Any] = {"collect.revise.enabled": True}
# the default with HeRL's revisions drawn at 1.0, the best verified one trained as a distill copy
DISTILLED_HERL: dict[str, Any] = {
    **HERL,
    "collect.revise.temperature": 1.0,
    "train.mode": "filtered",
    "train.revision_weight": "distill",
}
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"train.mode": "grpo"},
    "r3l": {"collect.retry.enabled": True, "halve_group": True, "train.mode": "r3l"},
    "filtered": {"train.mode": "filtered"},
    "rltldr": {"collect.insights": True, "train.mode": "rltldr"},
    "plain": UNGUIDED,
    "herl": {**UNGUIDED, **HERL},
    "ead": {**UNGUIDED, "collect.anneal.enabled": True},
    "nudge": {**UNGUIDED, "collect.nudge": True},
    "nudge+herl": {**UNGUIDED, **HERL, "collect.nudge": True},
    "filtered+herl": {**HERL, "train.mode": "filtered"},
    "filtered+herl4": {**DISTILLED_HERL, "collect.revise.revisions": 4},
    "filtered+herl2p": {
        **DISTILLED_HERL,
        "collect.revise.revisions": 2,
        "collect.revise.partial": True,
    },
    "filtered+herl4b": {
        **DISTILLED_HERL,
        "collect.revise.revisions": 4,
        "collect.revise.blind": True,
    },
    "filtered+herl4pb": {
        **DISTILLED_HERL,
        "collect.revise.revisions": 4,
        "collect.revise.partial": True,
        "collect.revise.blind": True,
    },
    "filtered+nudge": {"collect.nudge": True, "train.mode": "filtered"},
}
# `make run`'s settings (examples/reviewer.toml), and each structured method on top of them:
# what a method adds beyond the reviewer's blind revisions.
DEFAULT = ARMS["filtered+herl4pb"]
ON_TOP: dict[str, dict[str, Any]] = {
    "sge": {"collect.strategy.enabled": True},
    "r3l": {"collect.retry.enabled": True},
    "insights": {"collect.insights": True, "train.mode": "rltldr"},
    # the library's lessons are insights the verifier confirmed: collected, not trained as rows
    "library": {"library.enabled": True, "collect.insights": True},
    "outcome": {"outcome.bonus": 0.1, "outcome.repeat_penalty": 0.1},
    "nudge": {"collect.nudge": True},
    "examples": {"collect.own_examples": True},  # the guided half shown the policy's own answers
}
ARMS["default"] = DEFAULT
ARMS |= {f"default+{name}": {**DEFAULT, **extra} for name, extra in ON_TOP.items()}
ARMS["alone"] = {}  # the policy alone: `make run REVIEWER=`
ARMS["examples"] = {"collect.own_examples": True}  # the policy alone, with its own examples


def arm_settings(arm: str) -> dict[str, Any] | None:
    """An arm's settings: a named arm, or the default with several methods on top of it at once
    (`default+examples+r3l+outcome`); None for a name that is neither."""
    if arm in ARMS:
        return ARMS[arm]
    base, *methods = arm.split("+")
    if base != "default" or len(methods) < 2 or not set(methods) <= set(ON_TOP):
        return None
    return DEFAULT | {k: v for m in methods for k, v in ON_TOP[m].items()}


def reviewed(arm: str) -> bool:
    """Whether a reviewer serves the arm: it reflects, revises or nudges."""
    spec = arm_settings(arm) or {}
    return any(spec.get(f"collect.{m}") for m in ("retry.enabled", "revise.enabled", "nudge"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="grpo,r3l")
    parser.add_argument("--runs", type=int, default=1, help="of each arm, the arms alternating")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=None, help="each arm's time budget")
    parser.add_argument(
        "--shared-rounds",
        type=int,
        default=0,
        metavar="K",
        help="run the first K rounds once, with the first arm's settings, and each arm on from "
        "a copy of them (paired on the same start)",
    )
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--eval-tasks", type=int, default=64)
    parser.add_argument("--taskset", default="arithmetic", help="what every arm trains on")
    parser.add_argument(
        "--model",
        default="smollm2",
        help="the policy every arm starts from: smollm2, a reviewer's name (qwen2.5-coder-0.5b) "
        "or a model folder",
    )
    parser.add_argument("--server-url", default=None, help="a running vLLM server with SmolLM2")
    parser.add_argument("--reviewer", default=None, help="a reviewer model for r3l and herl")
    parser.add_argument("--port", type=int, default=8021)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for every arm beside its own, as a TOML value (train.micro_batch_size=2: "
        "a 0.5B policy's training in less memory)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep every run here (run-N/ARM)")
    parser.add_argument(
        "--pair",
        nargs="+",
        default=None,
        metavar="JSON:ARM",
        help="instead: pair arms of earlier runs' JSON (the first against the others)",
    )
    parser.add_argument(
        "--refigure",
        type=Path,
        default=None,
        metavar="JSON",
        help="instead: recompute an earlier results file's figures from its runs",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="instead: the runs of earlier results files of the same arms and settings, in one "
        "file (--json)",
    )
    parser.add_argument(
        "--any-machine",
        action="store_true",
        help="with --merge: files measured on another processor too (each run keeps its "
        "machine; figures that depend on speed, rounds and pass@1 at the budget, are left out)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    if args.merge:
        if args.json is None:
            parser.error("--merge writes its result to --json PATH")
        merge(parser, args.merge, args.json, args.any_machine)
        return
    if args.pair:
        print_pairs(paired({spec: _arm_of(parser, spec) for spec in args.pair}))
        return
    if args.refigure:
        refigure(parser, args.refigure)
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(arm for arm in arms if arm_settings(arm) is None)
    if unknown:
        parser.error(
            f"unknown arms {unknown}; choose from {', '.join(ARMS)}, or several methods on "
            f"top of the default at once: default+{'+'.join(ON_TOP)}"
        )
    if not 0 <= args.shared_rounds < args.rounds:
        parser.error(f"--shared-rounds {args.shared_rounds}: 0 to {args.rounds - 1} (--rounds)")
    try:
        common_settings(args.set, arms)
    except FlowError as error:
        parser.error(str(error))
    if args.server_url and args.model != "smollm2":
        parser.error("--server-url serves SmolLM2: leave --model out, or the server out")
    try:
        catalog.check(args.taskset)
    except VerifierError as error:
        parser.error(str(error))
    try:  # a named reviewer is built once, here, not in each arm's working folder
        reviewer = model_folder(args.reviewer, MODELS, "--reviewer") if args.reviewer else None
    except FlowError as error:
        parser.error(str(error))
    made = provenance()
    with contextlib.ExitStack() as servers:
        url: str | None = None
        if args.server_url:
            server = smollm2_server(args.server_url, args.port, "vllm-learn.log")
            url, model = servers.enter_context(server)
        else:
            try:
                model = model_folder(args.model, MODELS)
            except FlowError as error:
                parser.error(str(error))
        settings = {k: str(v) for k, v in vars(args).items()}
        serving = Serving(model, url, reviewer)
        runs: list[dict[str, Any]] = []
        for n in range(1, args.runs + 1):
            keep = None if args.keep is None else args.keep / f"run-{n}"
            run = {"arms": run_arms(arms, args, serving, keep)}
            run["paired"] = paired(run["arms"])
            print_table({"settings": settings, **run})
            runs.append(run)
            result = with_runs({**settings, "runs": str(len(runs))}, runs)  # as many as done
            if args.json:  # each finished run is kept, should a later one be cut short
                write_results(args.json, result, made, figures(result))
    print_over_runs(result)
    if args.png:
        plot(result, args.png)


def with_runs(settings: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A results file's payload: the settings, the first run's arms and pairs at the top (as
    files with one run hold them), and every run."""
    return {"settings": settings, **runs[0], "runs": runs}


def figures(result: dict[str, Any]) -> list[Figure]:
    """Each arm's final held-out pass@1 (the policy's own, greedy, no guidance; Wilson over the
    tasks), and each arm's paired difference from the first arm on the same tasks; over several
    runs, each arm's mean and its difference from the first arm's, with Welch's interval, at
    the end and (`at_budget`) when the time budget ran out."""
    if len(result.get("runs", [])) > 1:
        return over_runs(result) + ([] if mixed_machines(result) else at_budget(result))
    found = []
    for arm, curve in result["arms"].items():
        solved = list(curve["solved"].values())
        found.append(Figure.share(f"{arm}: final held-out pass@1", sum(solved), len(solved),
                                  whose(result, arm)))  # fmt: skip
        found.append(Figure.single(f"{arm}: rounds in the time budget",
                                   len(curve["pass_at_1"]) - 1))  # fmt: skip
    for arm, pair in result["paired"].items():
        found.append(Figure(f"{arm} minus {pair['vs']}, final pass@1 on the same tasks",
                            pair["difference"], pair["tasks"], pair["low"], pair["high"],
                            counts=whose(result, arm, pair["vs"])))  # fmt: skip
    return found


def whose(result: dict[str, Any], *arms: str) -> str:
    """Whose work the arms' held-out answers count: the policy's own always; "policy and
    reviewer" where every arm learnt from a reviewer model's answers too."""
    by_reviewer = result["settings"].get("reviewer", "None") != "None"
    return "policy and reviewer" if by_reviewer and all(map(reviewed, arms)) else "policy"


def finals(result: dict[str, Any]) -> dict[str, list[float]]:
    """Each arm's final held-out pass@1 in each run."""
    arms: dict[str, list[float]] = {}
    for run in result["runs"]:
        for arm, curve in run["arms"].items():
            solved = list(curve["solved"].values())
            arms.setdefault(arm, []).append(statistics.fmean(solved) if solved else 0.0)
    return arms


def over_runs(result: dict[str, Any]) -> list[Figure]:
    """Per arm, the mean final pass@1 and rounds over runs; each arm against the first, Welch
    over runs."""
    arms = finals(result)
    means, differences = compared(result, arms, "final held-out pass@1", "final pass@1")
    rounds = [
        Figure.mean(
            f"{arm}: rounds in the time budget, mean over runs",
            [len(run["arms"][arm]["pass_at_1"]) - 1.0 for run in result["runs"]],
        )
        for arm in arms
        if not mixed_machines(result)
    ]
    return means + rounds + differences + from_shared_rounds(result, arms) + durations(result)


def durations(result: dict[str, Any]) -> list[Figure]:
    """Per arm, the minutes into a run its last round ended (what its method cost in time),
    mean over runs; one figure per kind of machine where the runs were measured on several."""
    machines = by_machine(result)
    found = []
    for runs in machines:
        machine = runs[0].get("machine")
        where = f" on {_named(machine)}" if len(machines) > 1 and machine else ""
        found += [
            Figure.mean(
                f"{arm}: minutes until its last round ended, mean over runs{where}",
                [run["arms"][arm]["ended_s"][-1] / 60 for run in runs],
                unit="min",
            )
            for arm in runs[0]["arms"]
        ]
    return found


def _named(machine: dict[str, Any]) -> str:
    """A kind of machine as the figures name it: its processor, and what it serves in."""
    return str(machine["cpu"]) + (f" ({machine['dtype']})" if machine.get("dtype") else "")


def mixed_machines(result: dict[str, Any]) -> bool:
    """Whether the runs were measured on more than one kind of machine (`--any-machine`), so
    that what a time budget held is not one measurement."""
    return len(by_machine(result)) > 1


def by_machine(result: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The runs, grouped by the kind of machine each was measured on, in order."""
    machines: dict[str, list[dict[str, Any]]] = {}
    for run in result["runs"]:
        machines.setdefault(json.dumps(run.get("machine"), sort_keys=True), []).append(run)
    return list(machines.values())


def from_shared_rounds(result: dict[str, Any], arms: dict[str, list[float]]) -> list[Figure]:
    """With `--shared-rounds`: each arm's final pass@1 minus the first arm's, run by run (each
    run's arms went on from the same rounds), the mean of those differences with Student's
    interval over runs. Welch's interval treats the arms' runs as independent, and so keeps
    the shared rounds' spread that the pairing takes out."""
    if result["settings"].get("shared_rounds", UNSET["shared_rounds"]) == "0":
        return []
    (first, base), *others = arms.items()
    return [
        Figure.mean(
            f"{arm} minus {first}, final pass@1 (paired over runs, from shared rounds)",
            [a - b for a, b in zip(values, base, strict=True)],
            counts=whose(result, arm, first),
        )
        for arm, values in others
    ]


def compared(
    result: dict[str, Any], arms: dict[str, list[float]], what: str, short: str
) -> tuple[list[Figure], list[Figure]]:
    """Each arm's mean of `what` over runs, and each arm's difference from the first arm's,
    Welch over runs."""
    means = [Figure.mean(f"{arm}: {what}, mean over runs", values, counts=whose(result, arm))
             for arm, values in arms.items()]  # fmt: skip
    (first, base), *others = arms.items()
    differences = []
    for arm, values in others:
        diff, low, high = welch_difference(values, base)
        differences.append(Figure(f"{arm} minus {first}, {short} (Welch over runs)", diff,
                                  len(values) + len(base), low, high,
                                  counts=whose(result, arm, first)))  # fmt: skip
    return means, differences


def served_at(curve: dict[str, Any], seconds: float) -> float:
    """Held-out pass@1 of the version a run served `seconds` into it (the clock of its rounds'
    `ended_s`, which its `--minutes` budget counts too): its last round promoted by then, else
    the base model."""
    served = curve["pass_at_1"][0]
    ended = zip(curve["promoted"], curve["ended_s"][1:], curve["pass_at_1"][1:], strict=True)
    for promoted, ended_s, score in ended:
        if promoted and ended_s <= seconds and score is not None:
            served = score
    return float(served)


def at_budget(result: dict[str, Any]) -> list[Figure]:
    """With a time budget: each arm's held-out pass@1 served when the budget ran out, mean over
    runs, and each arm against the first, Welch over runs (none without a budget)."""
    minutes = result["settings"].get("minutes", "None")
    if minutes == "None":
        return []
    seconds, label = float(minutes) * 60, f"served at {float(minutes):g} min"
    arms: dict[str, list[float]] = {}
    for run in result["runs"]:
        for arm, curve in run["arms"].items():
            arms.setdefault(arm, []).append(served_at(curve, seconds))
    means, differences = compared(result, arms, f"held-out pass@1 {label}", f"pass@1 {label}")
    return means + differences


def refigure(parser: argparse.ArgumentParser, path: Path) -> None:
    """Rewrite `path`'s figures from its runs with today's accounting; its provenance (the run
    that measured them) stays, and says when the figures were recomputed."""
    record = _read_result(parser, "--refigure", path)
    made = record.pop("provenance")
    record.pop("figures", None)
    found = figures(record)
    now = provenance()
    made["refigured"] = {"commit": now["commit"], "date": now["date"]}
    write_results(path, record, made, found)
    print_over_runs(record)


def _read_result(parser: argparse.ArgumentParser, flag: str, path: Path) -> dict[str, Any]:
    """An earlier results file of this benchmark, or one line saying why `path` is not one."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"{flag} {path}: cannot read it ({exc})")
    if not isinstance(record, dict) or not {"provenance", "settings", "runs"} <= record.keys():
        parser.error(f"{flag} {path}: not a learning benchmark's results (no runs)")
    return record


# Settings that make runs comparable: files merged must agree on them.
SAME = ("arms", "rounds", "shared_rounds", "minutes", "tasks", "group_size", "eval_tasks",
        "server_url", "reviewer", "model", "taskset", "set")  # fmt: skip
# what a setting was before the benchmark recorded it
UNSET = {"shared_rounds": "0", "model": "smollm2", "taskset": "arithmetic", "set": "[]"}


def merge(
    parser: argparse.ArgumentParser, paths: list[Path], out: Path, any_machine: bool = False
) -> None:
    """Write to `out` the runs of `paths`, in order, with figures over all of them. The files
    must agree on `SAME` and, unless `any_machine`, on the machine's processor and cores, save
    that a file may have run more arms than another: the arms all ran are kept (the first arm,
    against which the others are compared, must be the same). Each run keeps the machine it
    was measured on. The provenance is the first file's, with each later file's under "merged"."""
    records = [_read_result(parser, "--merge", path) for path in paths]
    first, *later = records
    for path, record in zip(paths[1:], later, strict=True):
        if differ := _differences(first, record, any_machine):
            parser.error(f"--merge {path}: measured unlike {paths[0]} ({', '.join(differ)})")
    arms = [a for a in _arms(first) if all(a in _arms(record) for record in later)]
    runs = [
        _with_arms(run, arms) | {"machine": _machine_of(run, record)}
        for record in records
        for run in record["runs"]
    ]
    settings = {**first["settings"], "arms": ",".join(arms), "runs": str(len(runs))}
    result = with_runs(settings, runs)
    earlier = first["provenance"].get("merged", [])
    made = {
        **first["provenance"],
        "merged": [*earlier, *(part for record in later for part in _parts(record))],
        "merged_by": provenance()["command"],
    }
    write_results(out, result, made, figures(result))
    print_over_runs(result)


def _differences(first: dict[str, Any], other: dict[str, Any], any_machine: bool) -> list[str]:
    """The settings (`SAME`) and, unless `any_machine`, machine parts (processor, cores) two
    results files differ in: their arms only where the first arms differ or fewer than two are
    common to both."""
    differ = [k for k in SAME if k != "arms" and _setting(other, k) != _setting(first, k)]
    ours, theirs = _arms(first), _arms(other)
    if ours[:1] != theirs[:1] or len(set(ours) & set(theirs)) < 2:
        differ.insert(0, "arms")
    if any_machine:
        return differ
    ours, theirs = (record["provenance"].get("machine", {}) for record in (first, other))
    return differ + [
        k
        for k in ("cpu", "cores", "dtype")
        if ours.get(k) != theirs.get(k) and (k != "dtype" or k in ours and k in theirs)
    ]


def _machine_of(run: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """The processor, cores and serving dtype (where recorded) a run was measured on: its own,
    kept from an earlier merge, else its file's. A processor's name alone does not tell an AMD
    EPYC that serves in bfloat16 from one that serves in float32, at about half the speed."""
    machine = record["provenance"].get("machine", {})
    kept = {k: machine.get(k) for k in ("cpu", "cores")} | (
        {"dtype": machine["dtype"]} if "dtype" in machine else {}
    )
    return dict(run.get("machine", kept))


def _arms(record: dict[str, Any]) -> list[str]:
    return [arm for arm in str(record["settings"].get("arms", "")).split(",") if arm]


def _with_arms(run: dict[str, Any], arms: list[str]) -> dict[str, Any]:
    """A run with only `arms`, each (after the first) paired with the first again."""
    kept = {arm: run["arms"][arm] for arm in arms}
    return {**run, "arms": kept, "paired": paired(kept)}


def _parts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """What a merged file's provenance says of each measurement whose runs `record` holds: its
    own, then those it merged earlier."""
    made = record["provenance"]
    own = {k: made[k] for k in ("command", "commit", "dirty", "date", "machine") if k in made}
    return [own, *made.get("merged", [])]


def print_over_runs(result: dict[str, Any]) -> None:
    if len(result["runs"]) < 2:
        return
    for figure in figures(result):
        form = "+.3f" if " minus " in figure.name else ".3f"  # differences signed
        spread = (f" ({figure.low:{form}} to {figure.high:{form}})"
                  if figure.low is not None and figure.high is not None else "")  # fmt: skip
        print(f"{figure.name}: {figure.value:{form}}{spread}")


@contextmanager
def _workdir(arm: str, keep: Path | None) -> Iterator[Path]:
    """The arm's working folder (its store, versions and logs): `keep/arm`, started afresh, or
    a temporary folder removed at the end."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix=f"flywheel-learn-{arm}-") as scratch:
            yield Path(scratch)
        return
    folder = keep / arm
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    yield folder


class Serving(NamedTuple):
    """What every arm runs against: the base model, a running server's URL (None: each arm
    starts its own) and the reviewer (None: the policy reviews itself)."""

    model: Path
    server_url: str | None
    reviewer: Path | None


def run_arms(
    arms: list[str], args: argparse.Namespace, serving: Serving, keep: Path | None
) -> dict[str, dict[str, Any]]:
    """One run of every arm (its folders kept in `keep`, if given): each from the base model,
    or with `--shared-rounds K` each from a copy of K rounds run once with the first arm's
    settings."""
    if not args.shared_rounds:
        return {arm: run_arm(arm, args, serving, keep) for arm in arms}
    with _workdir("shared", keep) as folder:
        budget = Budget(args.shared_rounds, args.minutes)
        trunk = Trunk(folder, *_flywheel(arms[0], folder, budget, args, serving))
        return {arm: branch_arm(arm, trunk, args, serving, keep) for arm in arms}


def run_arm(
    arm: str, args: argparse.Namespace, serving: Serving, keep: Path | None
) -> dict[str, Any]:
    """One run of an arm from the base model: its curve (`curve`)."""
    with _workdir(arm, keep) as workdir:
        budget = Budget(args.rounds, args.minutes)
        summary, seconds = _flywheel(arm, workdir, budget, args, serving)
        solved, did = _read_store(summary)
    return curve(summary, seconds, solved, did)


class Trunk(NamedTuple):
    """The shared rounds of a run: their folder, `flywheel run` summary and wall seconds."""

    folder: Path
    summary: dict[str, Any]
    seconds: float


def branch_arm(
    arm: str, trunk: Trunk, args: argparse.Namespace, serving: Serving, keep: Path | None
) -> dict[str, Any]:
    """An arm's rounds after the shared ones, from a copy of their store: its curve holds the
    shared rounds too, and its seconds their time (the arm's wall time from the base model)."""
    left = None if args.minutes is None else max(args.minutes - trunk.seconds / 60, 0.1)
    with _workdir(arm, keep) as workdir:
        for path in trunk.folder.glob("flywheel.db*"):
            if not path.name.endswith("-lock"):
                shutil.copy2(path, workdir / path.name)
        budget = Budget(args.rounds - args.shared_rounds, left)
        branch, seconds = _flywheel(arm, workdir, budget, args, serving)
        summary = joined(trunk.summary, branch)
        solved, did = _read_store(summary)
    return curve(summary, trunk.seconds + seconds, solved, did)


def joined(shared: dict[str, Any], branch: dict[str, Any]) -> dict[str, Any]:
    """A branch's run summary with the shared rounds before its own, its rounds' times counted
    from the start of the shared ones."""
    offset = shared["rounds"][-1]["ended_s"] if shared["rounds"] else 0.0
    later = [
        {**r, "started_s": r.get("started_s", 0.0) + offset, "ended_s": r["ended_s"] + offset}
        for r in branch["rounds"]
    ]
    stages = shared["wall_seconds"].keys() | branch["wall_seconds"].keys()
    seconds = {k: shared["wall_seconds"].get(k, 0.0) + branch["wall_seconds"].get(k, 0.0)
               for k in stages}  # fmt: skip
    return {**branch, "rounds": shared["rounds"] + later, "wall_seconds": seconds}


class Budget(NamedTuple):
    """How many rounds an invocation may run, and in how many minutes (None: no limit)."""

    rounds: int
    minutes: float | None


def _flywheel(
    arm: str,
    workdir: Path,
    budget: Budget,
    args: argparse.Namespace,
    serving: Serving,
) -> tuple[dict[str, Any], float]:
    """`flywheel run` with the arm's settings in `workdir` (which may hold earlier rounds to go
    on from): its summary and its wall seconds."""
    rounds, minutes = budget
    model, server_url, reviewer = serving
    settings = arm_settings(arm)
    if settings is None:
        raise ValueError(f"unknown arm {arm!r}")
    spec = settings | _pairs(args.set)  # checked once, by main
    group_size = args.group_size // 2 if spec.pop("halve_group", False) else args.group_size
    config = workdir / "arm.toml"
    config.write_text(_toml(spec))
    summary_path = workdir / "summary.json"
    command = [
        *FLYWHEEL, "run",
        "--config", str(config),
        "--workdir", str(workdir),
        "--model", str(model),
        "--rounds", str(rounds),
        "--tasks", str(args.tasks),
        "--group-size", str(max(2, group_size)),
        "--eval-tasks", str(args.eval_tasks),
        "--taskset", args.taskset,
        "--summary-json", str(summary_path),
        "--prefect", "temporary",  # a Prefect server of the run's own, gone when it ends
    ]  # fmt: skip
    if server_url:  # the shared server serves each arm's versions as adapters
        command += ["--server-url", server_url, "--weights", "lora"]
    else:
        command += ["--port", str(args.port)]
    if minutes:
        command += ["--minutes", str(minutes)]
    if reviewer and reviewed(arm):
        command += ["--reviewer", str(reviewer)]
    log = workdir / "run.log"
    print(f"[{arm}] {' '.join(command[1:])}\n[{arm}] progress: {log}", file=sys.stderr, flush=True)
    started = time.monotonic()
    done = run_command(command, log=log, env=checkout_env())
    if done.returncode != 0:
        sys.exit(f"arm {arm} failed:\n{done.stderr[-3000:]}")
    seconds = time.monotonic() - started
    print(f"[{arm}] done in {seconds / 60:.1f} min", file=sys.stderr)
    return json.loads(summary_path.read_text()), seconds


def curve(
    summary: dict[str, Any], seconds: float, solved: dict[str, bool], did: dict[str, Any]
) -> dict[str, Any]:
    """An arm's record of one run: held-out pass@1 after each round, what it cost, the tasks
    its final version solved and what its method did."""
    rounds = summary["rounds"]
    return {
        "pass_at_1": [summary["baseline_pass_at_1"]] + [r["eval_pass_at_1"] for r in rounds],
        "format_rate": [summary["baseline_format_rate"]] + [r["eval_format_rate"] for r in rounds],
        "promoted": [r["promoted"] for r in rounds],
        "ended_s": [0.0] + [r["ended_s"] for r in rounds],
        "rollouts": sum(r["rollouts"] for r in rounds),
        "bare_success_rate": [
            r["bare_successes"] / r["bare_rollouts"] if r["bare_rollouts"] else None for r in rounds
        ],
        "train_tokens": sum(r["train_tokens"] for r in rounds),
        "seconds": seconds,
        "run_seconds": summary["wall_seconds"].get("total"),
        "final_version": final_version(summary),
        "solved": solved,
        "did": did,
    }


def final_version(summary: dict[str, Any]) -> str:
    """The version the run serves at its end: its last promoted round, else the base model."""
    promoted = [r["policy_version"] for r in summary["rounds"] if r["promoted"]]
    return str(promoted[-1] if promoted else summary["base_model"])


def _read_store(summary: dict[str, Any]) -> tuple[dict[str, bool], dict[str, Any]]:
    """From the arm's store, before its folder goes: held-out task id -> solved, for the version
    the run serves at its end; and what the arm's method did (`what_it_did`)."""
    engine = store.open_store(summary["db_url"])
    with store.transaction(engine) as session:
        groups = store.load_groups(session, "eval", policy_version=final_version(summary))
        did = what_it_did(session)
    engine.dispose()
    return {g.task_id: g.attempts[0].correct for g in groups if g.attempts}, did


def what_it_did(session: Session) -> dict[str, Any]:
    """What an arm's method did, from its store: the train attempts and their successes by kind
    and guidance ("guided:demo", "revision:revision", ...), over all rounds and round by round,
    the attempts whose reward an outcome bonus shaped, and the library's active lessons at the
    end."""
    groups = store.load_groups(session, "train")
    attempts = [a for g in groups for a in g.attempts]
    rounds = sorted({g.round_index for g in groups})
    shaped = sum(a.shaped_reward is not None and a.shaped_reward != a.reward for a in attempts)
    return {
        "attempts": _by_kind(attempts),
        "rounds": {
            str(r): _by_kind([a for g in groups if g.round_index == r for a in g.attempts])
            for r in rounds
        },
        "shaped": shaped,
        "lessons": library.size(session),
    }


def _by_kind(attempts: list[Attempt]) -> dict[str, list[int]]:
    """Attempts and their successes by kind and guidance, e.g. {"guided:demo": [128, 23]}."""
    kinds: dict[str, list[int]] = {}
    for attempt in attempts:
        counts = kinds.setdefault(f"{attempt.kind}:{attempt.context}", [0, 0])
        counts[0] += 1
        counts[1] += attempt.correct
    return dict(sorted(kinds.items()))


def paired(curves: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each arm's final version against the first arm's, on the held-out tasks both solved or
    not: the difference in pass@1 with its 95% interval, and the tasks won and lost."""
    first, *others = curves
    out = {}
    for arm in others:
        a, b = curves[arm]["solved"], curves[first]["solved"]
        common = sorted(a.keys() & b.keys())
        diff, low, high = paired_difference([a[t] for t in common], [b[t] for t in common])
        won = sum(a[t] and not b[t] for t in common)
        lost = sum(b[t] and not a[t] for t in common)
        out[arm] = {"vs": first, "tasks": len(common), "difference": diff, "low": low,
                    "high": high, "won": won, "lost": lost}  # fmt: skip
    return out


def _setting(record: dict[str, Any], key: str) -> Any:
    """A results file's setting `key` as recorded, or as it reads where unrecorded; `--set`'s
    pairs as the values they read as, so that `x=2` and `x = 2` are the same."""
    text = record["settings"].get(key, UNSET.get(key))
    return _pairs(ast.literal_eval(text)) if key == "set" else text


def common_settings(pairs: list[str], arms: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` settings (`_pairs`), checked as `flywheel run` would check them. Raises
    FlowError on one that is no setting, has a bad value, or is one an arm sets itself."""
    found = _pairs(pairs)
    for key in found:
        for arm in arms:
            if key in (arm_settings(arm) or {}):
                raise FlowError(f"--set {key}: arm {arm} sets it itself")
    load_run_settings(None, found, {key: f"--set {key}" for key in found})
    return found


def _pairs(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as settings, each value read as TOML (a bare word as a string). Raises
    FlowError on one that is no pair."""
    found: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = (part.strip() for part in pair.partition("="))
        if not (sep and key and text):
            raise FlowError(f"--set {pair}: expected KEY=VALUE, like train.micro_batch_size=2")
        try:
            found[key] = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:  # a bare word: a string
            found[key] = text
    return found


def _toml(spec: dict[str, Any]) -> str:
    """An arm's settings as TOML, one dotted key a line."""

    def value(v: Any) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)

    return "".join(f"{key} = {value(v)}\n" for key, v in spec.items())


def _arm_of(parser: argparse.ArgumentParser, spec: str) -> dict[str, Any]:
    path, _, arm = spec.rpartition(":")
    try:
        return dict(json.loads(Path(path).read_text())["arms"][arm])
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--pair {spec}: no arm {arm!r} there ({exc})")


def print_pairs(pairs: dict[str, dict[str, Any]]) -> None:
    for arm, p in pairs.items():
        print(
            f"{arm} vs {p['vs']}, final versions on the same {p['tasks']} tasks: "
            f"{p['difference']:+.3f} ({p['low']:+.3f} to {p['high']:+.3f}), "
            f"won {p['won']}, lost {p['lost']}"
        )


def print_table(result: dict[str, Any]) -> None:
    arms = result["arms"]
    rounds = max(len(c["pass_at_1"]) for c in arms.values())
    header = [
        "arm",
        *[("base" if i == 0 else f"r{i}") for i in range(rounds)],
        "final",
        "format",
        "rollouts",
        "min",
    ]
    rows = [header]
    for arm, curve in arms.items():
        cells = [f"{p:.3f}" if p is not None else "-" for p in curve["pass_at_1"]]
        last_format = curve["format_rate"][-1]
        final = statistics.fmean(curve["solved"].values()) if curve["solved"] else 0.0
        cells += ["-"] * (rounds - len(cells)) + [f"{final:.3f}"]
        rows.append(
            [arm, *cells, f"{last_format:.2f}" if last_format is not None else "-",
             str(curve["rollouts"]), f"{curve['seconds'] / 60:.1f}"]
        )  # fmt: skip
    print(text_table(rows[0], rows[1:]))
    s = result["settings"]
    print(
        f"\nheld-out pass@1 (greedy, no guidance) on {s['eval_tasks']} tasks after each round; "
        f"{s['tasks']} tasks x {s['group_size']} attempts per round; final = the version served at "
        "the end (the last promoted); format = last round"
    )
    print_pairs(result["paired"])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = int(result["settings"]["eval_tasks"])
    figure, axis = plt.subplots(figsize=(6, 4))
    for arm, curve in result["arms"].items():
        points = [(i, p) for i, p in enumerate(curve["pass_at_1"]) if p is not None]
        indices, shares = zip(*points, strict=True)
        bars = error_bars(shares, [n] * len(shares))
        axis.errorbar(indices, shares, yerr=bars, marker="o", capsize=3, label=arm)
    longest = max(len(curve["pass_at_1"]) for curve in result["arms"].values())
    axis.set_xticks(range(longest))
    axis.set_xlabel("round (0 = base model)")
    axis.set_ylabel(f"held-out pass@1 (95% Wilson, n {n})")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
