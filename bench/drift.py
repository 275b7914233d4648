"""Drift benchmark: how far one round's training moves the policy from the one that sampled its
tokens, under other training settings, on the very rows the round trained on.

Reads a finished round from a run's store (its groups, its settings, its parent), trains it
again with each variant of the settings (nothing is published), and reports the KL from the
sampling policy over the first and last tenth of the steps (k3 estimator on the sampled tokens of
importance-weighted rows) and the share of those tokens past PPO's trust region (0.2).

    .venv/bin/python -m bench.drift --db sqlite:///RUN/flywheel.db --round 1
        [--variants '[{}, {"clip": 0.2}, {"learning_rate": 0.0003}]'] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT, Figure, provenance, write_results
from memory import store
from reports.table import text_table
from serving.model import prepare_smollm2
from trainer.round import train_round
from trainer.settings import TrainSettings

VARIANTS = '[{}, {"clip": 0.2}, {"learning_rate": 0.0003}, {"learning_rate": 0.0003, "clip": 0.2}]'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="the run's database URL")
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--variants", default=VARIANTS, help="JSON list of TrainSettings changes")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    engine = store.open_store(args.db)
    with store.transaction(engine) as session:
        record = store.training_round(session, args.round)
        if record is None or record.status != "done":
            parser.error(f"round {args.round} is not a finished round of {args.db}")
        groups = store.groups_by_id(session, record.group_ids)
        parent = store.policy_version(session, record.policy_in)
    model = prepare_smollm2(ROOT / ".flywheel" / "models")
    results = []
    for variant in json.loads(args.variants):
        settings = TrainSettings(**{**record.hyperparameters, **variant, "save_steps": 0})
        with tempfile.TemporaryDirectory(prefix="bench-drift-") as scratch:
            trained = train_round(
                groups,
                base_model=model,
                parent_adapter=Path(parent.adapter_path) if parent.adapter_path else None,
                adapters_root=Path(scratch),
                name="drift",
                settings=settings,
            )
        results.append({"variant": variant, **trained.model_dump(exclude={"adapter_path"})})
        print(f"{variant or 'as trained'}: KL last {trained.kl_last}", file=sys.stderr, flush=True)
    print_table(results)
    if args.json:
        arguments = {k: str(v) for k, v in vars(args).items()}
        names = [json.dumps(r["variant"]) if r["variant"] else "as trained" for r in results]
        figures = [Figure.single(f"{name}: KL at the end of the round", r["kl_last"])
                   for name, r in zip(names, results, strict=True)]  # fmt: skip
        write_results(args.json, {"settings": arguments, "results": results}, made, figures)


def print_table(results: list[dict[str, Any]]) -> None:
    rows = [
        [json.dumps(r["variant"]) if r["variant"] else "as trained", str(r["rows"]),
         f"{r['kl_first']:.4f}", f"{r['kl_last']:.4f}", f"{r['outside_share']:.2f}",
         f"{r['train_seconds']:.0f}"]
        for r in results
    ]  # fmt: skip
    header = ["variant", "rows", "KL first tenth", "KL last tenth", "outside 0.2", "train s"]
    print(text_table(header, rows))


if __name__ == "__main__":
    main()
