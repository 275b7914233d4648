"""Counts for status pages and reports: attempts per purpose, held-out tasks per version, a
batch's time span, the versions that sampled each round, the tasks each round's sources solved,
and the success rate per strategy (SGE). Each is one aggregate query, whatever the store's size."""

from __future__ import annotations

from sqlalchemy import (
    case,
    func,
    select,
)
from sqlalchemy.orm import Session

from memory.models import (
    AttemptRow,
    RolloutGroupRow,
    StrategyRow,
)
from memory.records import (
    FIRST_KINDS,
    GroupPurpose,
    StrategyStats,
)


def strategy_stats(session: Session, taskset: str | None = None) -> list[StrategyStats]:
    """Success rate per strategy over first attempts, most tried first."""
    first = AttemptRow.kind.in_(FIRST_KINDS) & AttemptRow.error.is_(None)
    query = (
        select(
            StrategyRow.taskset,
            StrategyRow.text,
            func.count(AttemptRow.id),
            func.sum(case((AttemptRow.correct, 1), else_=0)),
            func.avg(AttemptRow.reward),
        )
        .join(AttemptRow, AttemptRow.strategy_id == StrategyRow.id)
        .where(first)
        .group_by(StrategyRow.id, StrategyRow.taskset, StrategyRow.text)
        .order_by(func.count(AttemptRow.id).desc(), StrategyRow.id)
    )
    if taskset is not None:
        query = query.where(StrategyRow.taskset == taskset)
    return [
        StrategyStats(taskset=t, text=x, attempts=n, successes=int(k or 0), mean_reward=float(r))
        for t, x, n, k, r in session.execute(query)
    ]


def attempt_counts(session: Session) -> dict[str, int]:
    """Stored attempts per group purpose (train, eval, capture)."""
    query = (
        select(RolloutGroupRow.purpose, func.count(AttemptRow.id))
        .join(AttemptRow, AttemptRow.group_id == RolloutGroupRow.id)
        .group_by(RolloutGroupRow.purpose)
    )
    return {purpose: count for purpose, count in session.execute(query)}


def eval_task_counts(session: Session) -> dict[str, int]:
    """Held-out tasks scored per policy version: the n behind its pass@1."""
    query = (
        select(RolloutGroupRow.policy_version, func.count(func.distinct(RolloutGroupRow.task_id)))
        .where(RolloutGroupRow.purpose == "eval")
        .group_by(RolloutGroupRow.policy_version)
    )
    return {version: count for version, count in session.execute(query)}


def round_spans(session: Session) -> dict[int, float]:
    """Seconds between the first and the last stored train attempt, per round."""
    query = (
        select(RolloutGroupRow.round_index, func.min(AttemptRow.created_at),
               func.max(AttemptRow.created_at))
        .join(AttemptRow, AttemptRow.group_id == RolloutGroupRow.id)
        .where(RolloutGroupRow.purpose == "train")
        .group_by(RolloutGroupRow.round_index)
    )  # fmt: skip
    return {r: (last - first).total_seconds() for r, first, last in session.execute(query)}


def sampled_by(session: Session) -> dict[int, dict[str, int]]:
    """Train groups per round, by the version that sampled them."""
    query = (
        select(RolloutGroupRow.round_index, RolloutGroupRow.policy_version, func.count())
        .where(RolloutGroupRow.purpose == "train")
        .group_by(RolloutGroupRow.round_index, RolloutGroupRow.policy_version)
    )
    found: dict[int, dict[str, int]] = {}
    for round_index, version, count in session.execute(query):
        found.setdefault(round_index, {})[version] = count
    return found


def solved_by_source(session: Session) -> dict[int, tuple[int, int, int]]:
    """Per round of train groups: (tasks, tasks an attempt of the policy's own solved, tasks
    only a reviewer's revision solved). A revision is the reviewer's answer; every other verified
    attempt (bare, guided, a retry, one under a hint) is the policy's."""
    own = func.max(case((AttemptRow.correct & (AttemptRow.kind != "revision"), 1), else_=0))
    revised = func.max(case((AttemptRow.correct & (AttemptRow.kind == "revision"), 1), else_=0))
    per_task = (
        select(RolloutGroupRow.round_index.label("round_index"), own.label("own"),
               revised.label("revised"))
        .join(AttemptRow, AttemptRow.group_id == RolloutGroupRow.id)
        .where(RolloutGroupRow.purpose == "train")
        .group_by(RolloutGroupRow.round_index, RolloutGroupRow.task_id)
        .subquery()
    )  # fmt: skip
    query = select(
        per_task.c.round_index, func.count(), func.sum(per_task.c.own),
        func.sum(case(((per_task.c.own == 0) & (per_task.c.revised == 1), 1), else_=0)),
    ).group_by(per_task.c.round_index)  # fmt: skip
    return {r: (n, int(o or 0), int(v or 0)) for r, n, o, v in session.execute(query)}


def attempt_time_span(session: Session, purpose: GroupPurpose, round_index: int) -> float:
    """Seconds between the first and the last stored attempt of a round's groups."""
    query = (
        select(func.min(AttemptRow.created_at), func.max(AttemptRow.created_at))
        .join(RolloutGroupRow, AttemptRow.group_id == RolloutGroupRow.id)
        .where(RolloutGroupRow.purpose == purpose, RolloutGroupRow.round_index == round_index)
    )
    first, last = session.execute(query).one()
    return (last - first).total_seconds() if first and last else 0.0
