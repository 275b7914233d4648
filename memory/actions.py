"""What people did to the flywheel from its page: rate, hold out or forget a session, promote or
roll back a version. Each action is recorded with who took it (`actor`), what it touched and
what came of it (`detail`: the gate's answer, the turns it reached)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from memory.models import ActionRow
from memory.records import Action


def record_action(session: Session, action: Action) -> None:
    session.add(ActionRow(**action.model_dump(exclude={"schema_version", "created_at"})))
    session.flush()


def actions(session: Session, limit: int = 50) -> list[Action]:
    """The latest actions, newest first."""
    query = select(ActionRow).order_by(ActionRow.id.desc()).limit(limit)
    return [Action.model_validate(row) for row in session.scalars(query)]
