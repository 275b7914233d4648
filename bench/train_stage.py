"""A run's training stage, replayed: each round's stored groups trained again under each variant.

A variant changes how a round trains, not what on: the rows are rebuilt from the round's groups
with the settings it recorded, and each round trains from the base model (a new LoRA), in a
process of its own, the variants alternating over `--passes` so that a slow spell of the machine
falls on all of them:

- `random`: float32, rows shuffled by the trainer (the default on a CPU);
- `length`: float32, batches of rows of near length in a random order;
- `length-bf16`: the same with the model in bfloat16 (`dtype = "bfloat16"`).

Per variant and round: the round's seconds (model load, training, save), the trainer's own
seconds, the share of computed positions that were padding, trained tokens/s, the first and
last loss, the KL from the sampling policy over the first tenth of the steps (at the start, the
gap between the trainer's numbers and the server's) and the share of sampled tokens outside
PPO's trust region. The figures sum each variant's rounds per pass, as the run's training stage
would.

    .venv/bin/python -m bench.train_stage --db sqlite:///RUN/flywheel.db [--passes 2]
        [--variants random,length,length-bf16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT, Figure, checkout_env, provenance, write_results
from reports.table import text_table

VARIANTS: dict[str, dict[str, str]] = {
    "random": {"batch_order": "random", "dtype": "float32"},
    "length": {"batch_order": "length", "dtype": "float32"},
    "length-bf16": {"batch_order": "length", "dtype": "bfloat16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="the run's database URL")
    parser.add_argument("--passes", type=int, default=2, help="of each variant, alternating")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(replay(args.db, args.variant)))
        return
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variant {sorted(unknown)[0]}; variants: {', '.join(VARIANTS)}")
    made = provenance()
    passes: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    for index in range(args.passes):
        for variant in variants:
            passes[variant].append(in_process(args.db, variant))
            seconds = sum(r["seconds"] for r in passes[variant][-1])
            print(f"pass {index + 1}/{args.passes} {variant}: {seconds:.0f} s", flush=True)
    print_table(passes)
    if args.json:
        payload = {"settings": {"db": args.db, "passes": args.passes}, "passes": passes}
        write_results(args.json, payload, made, figures(passes))


def in_process(db: str, variant: str) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "bench.train_stage", "--db", db, "--variant", variant]
    done = subprocess.run(command, cwd=ROOT, env=checkout_env(), capture_output=True, text=True,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed: {done.stderr.strip().splitlines()[-1:]}")
    rounds: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rounds


def replay(db: str, variant: str) -> list[dict[str, Any]]:
    """Every finished round of the run at `db`, trained again under `variant`."""
    from memory import store
    from trainer.round import train_round
    from trainer.settings import TrainSettings

    engine = store.open_store(db)
    with store.transaction(engine) as session:
        rounds = [r for r in store.training_rounds(session, last=1000) if r.status == "done"]
        groups = {r.round_index: store.groups_by_id(session, r.group_ids) for r in rounds}
        # The base version records its folder: every version names its base.
        bases = {r.round_index: base_folder(session, r.policy_in) for r in rounds}
    measured = []
    for record in rounds:
        settings = TrainSettings(**{**record.hyperparameters, **VARIANTS[variant]})
        with tempfile.TemporaryDirectory(prefix="bench-train-stage-") as scratch:
            result = train_round(
                groups[record.round_index],
                base_model=bases[record.round_index],
                parent_adapter=None,
                adapters_root=Path(scratch),
                name=f"replay-r{record.round_index}",
                settings=settings,
            )
        measured.append({
            "round": record.round_index,
            "seconds": result.seconds,
            "train_seconds": result.train_seconds,
            "rows": result.rows,
            "train_tokens": result.train_tokens,
            "tokens_per_s": result.train_tokens / result.train_seconds,
            "padded_share": result.padded_share,
            "loss_first": result.loss_first,
            "loss_last": result.loss_last,
            "kl_first": result.kl_first,
            "outside_share": result.outside_share,
        })  # fmt: skip
    return measured


def base_folder(session: Any, version: str) -> Path:
    """The folder of the base model `version` was trained from, as the run recorded it."""
    from memory import store

    base = store.policy_version(session, store.policy_version(session, version).base_model)
    assert base.weights_path is not None, f"{base.name} has no recorded folder"
    return Path(base.weights_path)


def figures(passes: dict[str, list[list[dict[str, Any]]]]) -> list[Figure]:
    """Per variant, over passes: the stage's seconds (all rounds), the trainer's own, and the
    padded share; each variant's stage time over the first variant's."""
    found = []
    (first, reference), *_ = passes.items()
    for variant, runs in passes.items():
        stage = [sum(r["seconds"] for r in run) for run in runs]
        found.append(Figure.mean(f"{variant}: training stage, all rounds", stage, "s"))
        own = [sum(r["train_seconds"] for r in run) for run in runs]
        found.append(Figure.mean(f"{variant}: trainer's own seconds, all rounds", own, "s"))
        padded = [r["padded_share"] for run in runs for r in run if r["padded_share"] is not None]
        if padded:
            found.append(Figure.mean(f"{variant}: padded share of computed positions", padded))
        if variant != first:
            ratios = [sum(r["seconds"] for r in a) / sum(r["seconds"] for r in b)
                      for a, b in zip(runs, reference, strict=True)]  # fmt: skip
            found.append(Figure.mean(f"{variant}: stage time over {first}'s, paired by pass",
                                     ratios))  # fmt: skip
    return found


def print_table(passes: dict[str, list[list[dict[str, Any]]]]) -> None:
    rows = []
    for variant, runs in passes.items():
        for index, run in enumerate(runs, start=1):
            for r in run:
                padded = "-" if r["padded_share"] is None else f"{r['padded_share']:.2f}"
                rows.append([variant, str(index), str(r["round"]), str(r["rows"]),
                             f"{r['seconds']:.1f}", f"{r['train_seconds']:.1f}",
                             f"{r['tokens_per_s']:.0f}", padded,
                             f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}",
                             _figure(r.get("kl_first")),
                             _figure(r.get("outside_share"))])  # fmt: skip
    header = ["variant", "pass", "round", "rows", "round s", "trainer s", "tokens/s", "padded",
              "loss", "KL first", "outside"]  # fmt: skip
    print(text_table(header, rows))


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


if __name__ == "__main__":
    main()
