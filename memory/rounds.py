"""Training rounds: the record of each (its data cursor, status and metrics) and the lineage
from a version back to the base model."""

from __future__ import annotations

from sqlalchemy import (
    func,
    select,
)
from sqlalchemy.orm import Session

from memory.models import (
    TrainingRoundRow,
)
from memory.records import (
    TrainingRound,
)
from memory.versions import policy_row


def save_training_round(session: Session, record: TrainingRound) -> None:
    """Insert or update the round's record (one per round index)."""
    row = session.scalars(
        select(TrainingRoundRow).filter_by(round_index=record.round_index)
    ).first()
    values = record.model_dump(mode="json", exclude={"schema_version"})
    values["metrics"] = record.metrics.model_dump(mode="json", exclude_defaults=True)
    if row is None:
        session.add(TrainingRoundRow(**values))
    else:
        for name, value in values.items():
            setattr(row, name, value)
    session.flush()


def training_round(session: Session, round_index: int) -> TrainingRound | None:
    row = session.scalars(select(TrainingRoundRow).filter_by(round_index=round_index)).first()
    return None if row is None else TrainingRound.model_validate(row)


def lineage(session: Session, name: str) -> list[TrainingRound]:
    """The rounds that produced `name`, newest first, back to the base model: each round's
    record names its parent version and (its data cursor) the groups it trained on."""
    policy_row(session, name)
    chain: list[TrainingRound] = []
    seen: set[str] = set()
    while name not in seen:
        seen.add(name)
        row = session.scalars(select(TrainingRoundRow).filter_by(policy_out=name)).first()
        if row is None:
            break
        chain.append(TrainingRound.model_validate(row))
        name = row.policy_in
    return chain


def next_round_index(session: Session) -> int:
    """One past the last finished round, so an interrupted round is resumed, not skipped."""
    finished = TrainingRoundRow.status.in_(("done", "skipped", "failed"))
    last = session.scalar(select(func.max(TrainingRoundRow.round_index)).where(finished))
    return (last or 0) + 1


def training_rounds(session: Session, last: int = 5) -> list[TrainingRound]:
    query = select(TrainingRoundRow).order_by(TrainingRoundRow.round_index.desc()).limit(last)
    return [TrainingRound.model_validate(row) for row in reversed(session.scalars(query).all())]
