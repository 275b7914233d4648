"""Outcome counts per (task, answer key), for outcome-based exploration bonuses."""

from __future__ import annotations

from collections import Counter

from sqlalchemy import (
    select,
)
from sqlalchemy.orm import Session

from memory.database import insert_for
from memory.models import (
    OutcomeCountRow,
)


def outcome_counts(session: Session, task_id: str) -> dict[str, int]:
    query = select(OutcomeCountRow).filter_by(task_id=task_id)
    return {row.answer_key: row.count for row in session.scalars(query)}


def add_outcomes(session: Session, task_id: str, answer_keys: list[str]) -> None:
    """Count each key once more for the task (an atomic upsert-increment per key)."""
    for key, n in Counter(answer_keys).items():
        statement = insert_for(session, OutcomeCountRow).values(
            task_id=task_id, answer_key=key, count=n
        )
        session.execute(
            statement.on_conflict_do_update(
                index_elements=["task_id", "answer_key"],
                set_={"count": OutcomeCountRow.count + n},
            )
        )
    session.flush()
