"""What each round of a run trained on, read back from its store: to tell a round that collapsed
from one that learned.

Per round: the parent's and the new version's held-out pass@1, the paired change on the same
held-out tasks (tasks gained and lost against the parent), the rows rebuilt from the round's
recorded groups with its recorded settings (by context), the share of trained tokens pushed
down (negative advantage) and the advantage mass each way, the share of those rows that are
distill copies (trained under a prompt they were not sampled in, without an importance weight),
the bare success rate of its train groups, and, where the trainer recorded them, the KL from the
sampling policy over the first and last tenth of the steps and the share of sampled tokens past
PPO's trust region. "Lucky" is the share of correct train attempts whose answer contradicts the
working right before it (`7 - 9 = 2. <answer>-2`), and "contra" the share of the new version's
held-out answers that do.

    .venv/bin/python -m bench.rounds --db sqlite:///RUN/flywheel.db [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.common import Figure, provenance, write_results
from memory import store
from memory.records import Attempt, Group, TrainingRound
from reports.table import text_table
from trainer.dataset import IGNORE, TrainRow, build_rows, context_counts
from trainer.settings import TrainSettings
from verifiers.answer import extract_answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="the run's database URL")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    engine = store.open_store(args.db)
    with store.transaction(engine) as session:
        rounds = store.training_rounds(session, last=1000)
        diagnosed = [diagnose(session, r) for r in rounds if r.status == "done"]
    print_table(diagnosed)
    if args.json:
        payload = {"settings": {"db": args.db}, "rounds": diagnosed}
        write_results(args.json, payload, made, figures(diagnosed))


def figures(diagnosed: list[dict[str, Any]]) -> list[Figure]:
    """Per round (one run): its version's change from its parent on the same held-out tasks,
    and the drift at the end of its training."""
    found = []
    for r in diagnosed:
        change = f"{r['gained']} tasks gained, {r['lost']} lost"
        gain = r["pass_at_1"] - r["parent_pass_at_1"]
        name = f"round {r['round']}: pass@1 minus its parent's ({change})"
        found.append(Figure.single(name, gain, counts="policy"))
        if r["kl_last"] is not None:
            found.append(Figure.single(f"round {r['round']}: KL at the end of training",
                                       r["kl_last"]))  # fmt: skip
    return found


def diagnose(session: Any, record: TrainingRound) -> dict[str, Any]:
    groups = store.groups_by_id(session, record.group_ids)
    rows = build_rows(groups, TrainSettings(**record.hyperparameters))
    held_out = _held_out(session, record.policy_out or "")
    parent = _solved(_held_out(session, record.policy_in))
    child = _solved(held_out)
    common = parent.keys() & child.keys()
    return {
        "round": record.round_index,
        "parent": record.policy_in,
        "parent_pass_at_1": _share(parent),
        "pass_at_1": _share(child),
        "gained": sum(child[t] and not parent[t] for t in common),
        "lost": sum(parent[t] and not child[t] for t in common),
        "rows": len(rows),
        "contexts": context_counts(rows),
        **token_mass(rows),
        "bare_success": _bare_success(groups),
        "lucky": _contradicted([a for g in groups for a in g.attempts if a.correct]),
        "contradicted": _contradicted([a for g in held_out for a in g.attempts[:1]]),
        "kl_first": record.metrics.kl_first,
        "kl_last": record.metrics.kl_last,
        "outside_share": record.metrics.outside_share,
    }


def token_mass(rows: list[TrainRow]) -> dict[str, float]:
    """Trained tokens pushed down, and the advantage mass up and down, over all rows; and the
    share of rows that are distill copies."""
    advantages = [
        a for row in rows for a, label in zip(row.advantages, row.labels, strict=True)
        if label != IGNORE
    ]  # fmt: skip
    up = sum(a for a in advantages if a > 0)
    down = -sum(a for a in advantages if a < 0)
    return {
        "tokens": len(advantages),
        "negative_share": sum(a < 0 for a in advantages) / max(1, len(advantages)),
        "mass_up": up,
        "mass_down": down,
        "distill_share": sum(r.context.startswith("distill") for r in rows) / max(1, len(rows)),
    }


def _held_out(session: Any, name: str) -> list[Group]:
    return store.load_groups(session, "eval", policy_version=name)


def _solved(groups: list[Group]) -> dict[str, bool]:
    return {g.task_id: g.attempts[0].correct for g in groups if g.attempts}


def _share(solved: dict[str, bool]) -> float | None:
    return statistics.fmean(solved.values()) if solved else None


def _bare_success(groups: list[Group]) -> float | None:
    bare = [a.correct for g in groups for a in g.bare_attempts]
    return statistics.fmean(bare) if bare else None


def _contradicted(attempts: list[Attempt]) -> float | None:
    flags = [extract_answer(a.sample.text).contradicted for a in attempts if a.sample]
    return statistics.fmean(flags) if flags else None


def print_table(figures: list[dict[str, Any]]) -> None:
    header = ["round", "parent", "pass@1", "gained/lost", "rows", "distill", "tokens down"]
    header += ["mass up/down", "bare ok", "lucky", "contra", "KL first/last", "outside"]

    def num(value: float | None, fmt: str = ".3f") -> str:
        return "-" if value is None else format(value, fmt)

    rows = [
        [
            str(f["round"]), num(f["parent_pass_at_1"]), num(f["pass_at_1"]),
            f"+{f['gained']}/-{f['lost']}", str(f["rows"]), num(f["distill_share"], ".2f"),
            num(f["negative_share"], ".2f"), f"{f['mass_up']:.0f}/{f['mass_down']:.0f}",
            num(f["bare_success"], ".2f"), num(f["lucky"], ".2f"), num(f["contradicted"], ".2f"),
            f"{num(f['kl_first'], '.4f')}/{num(f['kl_last'], '.4f')}",
            num(f["outside_share"], ".2f"),
        ]
        for f in figures
    ]  # fmt: skip
    print(text_table(header, rows))
    for f in figures:
        print(f"round {f['round']} rows by context: {f['contexts']}")


if __name__ == "__main__":
    main()
