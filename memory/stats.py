"""Counts for status pages and reports: attempts per purpose, held-out tasks per version, a
batch's time span, and the success rate per strategy (SGE)."""

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


def attempt_time_span(session: Session, purpose: GroupPurpose, round_index: int) -> float:
    """Seconds between the first and the last stored attempt of a round's groups."""
    query = (
        select(func.min(AttemptRow.created_at), func.max(AttemptRow.created_at))
        .join(RolloutGroupRow, AttemptRow.group_id == RolloutGroupRow.id)
        .where(RolloutGroupRow.purpose == purpose, RolloutGroupRow.round_index == round_index)
    )
    first, last = session.execute(query).one()
    return (last - first).total_seconds() if first and last else 0.0
