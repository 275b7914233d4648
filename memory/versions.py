"""Policy versions and the alias: which versions exist, their held-out scores, which one is
promoted (the newest promotion serves), and the log of alias decisions."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    select,
)
from sqlalchemy.orm import Session

from memory.database import insert_for
from memory.errors import NotFound
from memory.models import (
    AliasEventRow,
    PolicyVersionRow,
)
from memory.records import (
    AliasEvent,
    PolicyVersion,
    Scorecard,
)


def save_policy_version(session: Session, version: PolicyVersion) -> None:
    values = version.model_dump(exclude={"schema_version"})
    statement = insert_for(session, PolicyVersionRow).values(**values)
    session.execute(statement.on_conflict_do_nothing())
    session.flush()


def record_evaluation(session: Session, name: str, pass_at_1: float) -> None:
    policy_row(session, name).eval_pass_at_1 = pass_at_1
    session.flush()


def record_scorecard(session: Session, name: str, card: Scorecard) -> None:
    """Keep the version's figure from one evaluation (replacing an earlier card of the same
    evaluation); a pass@1 card is also the version's held-out pass@1."""
    row = policy_row(session, name)
    kept = [c for c in row.scorecards or [] if c.get("evaluation") != card.evaluation]
    row.scorecards = [*kept, card.model_dump(mode="json", exclude={"schema_version"})]
    if card.figure == "pass@1":
        row.eval_pass_at_1 = card.value
    session.flush()


def set_promoted(session: Session, name: str, promoted: bool) -> None:
    """Promote (newest promotion serves) or un-promote a version."""
    row = policy_row(session, name)
    row.promoted = promoted
    row.promoted_at = datetime.now(UTC) if promoted else None
    session.flush()


def policy_version(session: Session, name: str) -> PolicyVersion:
    return PolicyVersion.model_validate(policy_row(session, name))


def promoted_policy(session: Session) -> PolicyVersion | None:
    """The most recently promoted version: it serves and samples the next round."""
    history = promoted_history(session)
    return history[0] if history else None


def promoted_history(session: Session) -> list[PolicyVersion]:
    """Promoted versions, newest promotion first; the head serves, the next is the fallback."""
    query = select(PolicyVersionRow).filter_by(promoted=True)
    order = (PolicyVersionRow.promoted_at.desc(), PolicyVersionRow.id.desc())
    rows = session.scalars(query.order_by(*order))
    return [PolicyVersion.model_validate(row) for row in rows]


def policy_versions(session: Session) -> list[PolicyVersion]:
    rows = session.scalars(select(PolicyVersionRow).order_by(PolicyVersionRow.id))
    return [PolicyVersion.model_validate(row) for row in rows]


def record_alias_event(session: Session, event: AliasEvent) -> None:
    session.add(AliasEventRow(**event.model_dump(exclude={"schema_version"})))
    session.flush()


def alias_events(session: Session, alias: str) -> list[AliasEvent]:
    query = select(AliasEventRow).filter_by(alias=alias).order_by(AliasEventRow.id)
    return [AliasEvent.model_validate(row) for row in session.scalars(query)]


def policy_row(session: Session, name: str) -> PolicyVersionRow:
    row = session.scalars(select(PolicyVersionRow).filter_by(name=name)).first()
    if row is None:
        raise NotFound(f"unknown policy version {name!r}")
    return row


def set_weights_path(session: Session, name: str, path: str | None) -> None:
    """Record (or forget, with None) where a version's merged weights are."""
    policy_row(session, name).weights_path = path
    session.flush()
