"""Reading groups back: by batch, by id, with their steps and token segments; and what comes
after collection (the advantages a round gave, feedback on captured traffic)."""

from __future__ import annotations

from typing import cast

from sqlalchemy import (
    Select,
    Table,
    bindparam,
    select,
    update,
)
from sqlalchemy.orm import Session

from memory.errors import NotFound, StoreError
from memory.models import (
    AttemptRow,
    RolloutGroupRow,
    SegmentRow,
    StepRow,
    VerdictRow,
)
from memory.records import (
    FIRST_KINDS,
    FULL_REWARD,
    Group,
    GroupPurpose,
    Segment,
    Step,
)
from memory.rows import (
    ATTEMPT_PARTS,
    group_record,
    refresh_group_stats,
    retag,
    row_plan,
    segment_record,
    step_record,
)


def load_groups(
    session: Session,
    purpose: GroupPurpose,
    round_index: int | None = None,
    policy_version: str | None = None,
    complete_only: bool = False,
) -> list[Group]:
    query = select(RolloutGroupRow).filter_by(purpose=purpose).order_by(RolloutGroupRow.id)
    if round_index is not None:
        query = query.filter_by(round_index=round_index)
    if policy_version is not None:
        query = query.filter_by(policy_version=policy_version)
    if complete_only:
        query = query.filter_by(complete=True)
    rows = session.scalars(query.options(*ATTEMPT_PARTS))
    return [group_record(row) for row in rows]


def solved_groups(session: Session, purpose: GroupPurpose, limit: int) -> list[Group]:
    """The newest `limit` groups of a purpose that one of their first attempts solved, oldest
    first: what a policy's own examples are drawn from, however long the history."""
    solved = select(AttemptRow.group_id).where(
        AttemptRow.kind.in_(FIRST_KINDS), AttemptRow.correct.is_(True)
    )
    query = (
        select(RolloutGroupRow)
        .filter_by(purpose=purpose)
        .where(RolloutGroupRow.id.in_(solved))
        .order_by(RolloutGroupRow.id.desc())
        .limit(limit)
    )
    rows = list(session.scalars(query.options(*ATTEMPT_PARTS)))
    return [group_record(row) for row in reversed(rows)]


def groups_by_id(session: Session, group_ids: list[int]) -> list[Group]:
    """The groups of a data cursor, in cursor order; `StoreError` if one is gone."""
    query = select(RolloutGroupRow).where(RolloutGroupRow.id.in_(group_ids))
    rows = {row.id: row for row in session.scalars(query.options(*ATTEMPT_PARTS))}
    missing = [gid for gid in group_ids if gid not in rows]
    if missing:
        raise StoreError(f"groups {missing[:5]} of the round's cursor are missing")
    return [group_record(rows[gid]) for gid in group_ids]


def group_tasks(session: Session, group_ids: list[int]) -> dict[int, str]:
    """Group id -> task id, in id order, for the groups that exist."""
    query = select(RolloutGroupRow.id, RolloutGroupRow.task_id).where(
        RolloutGroupRow.id.in_(group_ids)
    )
    return dict(sorted(session.execute(query).tuples().all()))


def attempt_steps(session: Session, group_id: int, sample_index: int, kind: str) -> list[Step]:
    """The stored steps of one attempt, in order."""
    attempt = select(AttemptRow.id).filter_by(
        group_id=group_id, sample_index=sample_index, kind=kind
    )
    query = select(StepRow).where(StepRow.attempt_id.in_(attempt)).order_by(StepRow.step_index)
    return [step_record(row) for row in session.scalars(query)]


def attempt_segments(
    session: Session, group_id: int, sample_index: int, kind: str
) -> list[Segment]:
    """The stored token segments of one attempt, in order."""
    return group_segments(session, [group_id]).get((group_id, sample_index, kind), [])


def group_segments(
    session: Session, group_ids: list[int]
) -> dict[tuple[int, int, str], list[Segment]]:
    """The segments of every attempt of these groups, by (group id, sample index, kind)."""
    query = (
        select(AttemptRow.group_id, AttemptRow.sample_index, AttemptRow.kind, SegmentRow)
        .join(SegmentRow, SegmentRow.attempt_id == AttemptRow.id)
        .where(AttemptRow.group_id.in_(group_ids))
        .order_by(SegmentRow.attempt_id, SegmentRow.segment_index)
    )
    found: dict[tuple[int, int, str], list[Segment]] = {}
    for group_id, index, kind, row in session.execute(query):
        found.setdefault((group_id, index, kind), []).append(segment_record(row))
    return found


def set_advantages(
    session: Session, group_id: int, advantages: dict[tuple[int, str], float]
) -> None:
    """Record the advantage a training round gave each attempt (by sample index and kind) on its
    sampled (`policy`) segments, in one batched UPDATE."""
    query = select(AttemptRow.id, AttemptRow.sample_index, AttemptRow.kind).filter_by(
        group_id=group_id
    )
    values = [
        {"attempt": attempt_id, "advantage": advantages[(index, kind)]}
        for attempt_id, index, kind in session.execute(query)
        if (index, kind) in advantages
    ]
    if values:
        table = cast(Table, SegmentRow.__table__)
        statement = (
            update(table)
            .where(table.c.attempt_id == bindparam("attempt"), table.c.loss == "policy")
            .values(advantage=bindparam("advantage"))
        )
        session.execute(statement, values)


def record_feedback(
    session: Session, task_id: str, score: float, reason: str, owner: str | None = None
) -> None:
    """Attach a score (user feedback or a later verifier) to a captured trajectory; with
    `owner`, only to one that owner's key captured (another's is as unknown as none)."""
    group = _captured(session, task_id, owner)
    if group is None or not group.attempts:
        raise NotFound(f"unknown capture id {task_id!r}")
    _score(session, group, score, reason)


def record_session_feedback(
    session: Session, session_id: str, score: float, reason: str, reference: str | None = None
) -> int:
    """Score every captured turn of a session (the episode's reward), keeping the `reference`
    the verifier scored it against, if any (its siblings are verified against it too); the
    number of turns."""
    groups = session.scalars(captured_turns(session_id)).all()
    if not groups:
        raise NotFound(f"unknown session {session_id!r}")
    for group in groups:
        if reference is not None:
            retag(group, reference=reference)
        if group.attempts:
            _score(session, group, score, reason)
    return len(groups)


def captured_exchange(
    session: Session,
    session_id: str | None = None,
    capture_id: str | None = None,
    owner: str | None = None,
) -> tuple[str, str]:
    """A captured session's (or one turn's) question, its first user message, and its answer,
    the last turn's text: what a verifier scores. `NotFound` when there is none (or, with
    `owner`, none of that owner's)."""
    if session_id is not None:
        rows = list(session.scalars(captured_turns(session_id)))
    else:
        assert capture_id is not None
        found = _captured(session, capture_id, owner)
        rows = [found] if found is not None else []
    last = rows[-1].attempts[0] if rows and rows[-1].attempts else None
    if last is None or last.completion is None:
        raise NotFound(f"nothing captured for {session_id or capture_id!r}")
    return rows[0].question, last.completion


def _captured(session: Session, capture_id: str, owner: str | None) -> RolloutGroupRow | None:
    group = session.scalars(
        select(RolloutGroupRow).filter_by(purpose="capture", task_id=capture_id)
    ).first()
    if group is None or (owner is not None and row_plan(group).owner != owner):
        return None
    return group


def captured_turns(session_id: str) -> Select[RolloutGroupRow]:
    """The query of a session's captured turns, oldest first."""
    return (
        select(RolloutGroupRow)
        .where(RolloutGroupRow.purpose == "capture")
        .where(RolloutGroupRow.plan["session"].as_string() == session_id)
        .order_by(RolloutGroupRow.id)
    )


def _score(session: Session, group: RolloutGroupRow, score: float, reason: str) -> None:
    attempt = group.attempts[0]
    attempt.reward = score
    attempt.correct = score >= FULL_REWARD
    attempt.reason = reason
    verdict = attempt.verdict or VerdictRow(attempt_id=attempt.id, feedback=[], format_ok=True)
    verdict.verifier, verdict.score, verdict.correct = "feedback", score, attempt.correct
    session.add(verdict)
    session.flush()
    refresh_group_stats(session, group.id)
