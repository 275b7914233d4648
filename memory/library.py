"""The experience library (EDGE's utility and co-evolving bank): lessons of every kind in one
table. Lessons are retrieved per task (`memory.retrieval`), and an episode's steps are shown
the task's lessons that fit what each observes (SLEA-RL, `agents.lessons`; its step-level
advantages are `trainer.steps`).

A lesson (`Lesson`) is a stored library item; an agent proposes one as a `LessonDraft`. The
tables and columns keep their first names (`experience_entry`, `experience_evidence`,
`experience_use`, `entry_id`).

1. Admission, once per library update: drafts are validated first (a bad one refuses the
   whole update, nothing written); at most `rate_limit[zone]` new lessons per update; a draft
   whose fingerprint (its normalised words) already exists in its scope refines that lesson: the
   longer text is kept, evidence adds up, utility is never reset. Each source (an attempt that
   produced the draft) counts once: re-curating the same round adds no evidence.
2. Capacity per level (scope, scope key, zone): over capacity, the lowest-ranked unprotected
   lesson is trimmed, rank = utility + c * sqrt(ln(1 + N) / (1 + n)) with N the exposures in the
   level and n the lesson's (an exploration bonus for rarely shown lessons). A lesson is protected
   until it has been shown `protect_exposures` times; if every lesson of a full level is protected,
   the draft is refused.
3. Utility is EDGE's with/without gain, shared by every kind of lesson: for a group whose guided
   half saw a lesson, gain = success rate with guidance - without, and u <- 0.9 u + 0.1 gain.
4. Hard pruning: a lesson shown at least `min_exposures` times whose utility is below
   `prune_below` after `negative_windows` negative gains in a row is pruned.
5. Every change is a library event holding the lesson's fields before and after.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from memory.errors import NotFound, StoreError
from memory.models import (
    LessonEvidenceRow,
    LessonRow,
    LessonUseRow,
    LibraryEventRow,
)
from memory.records import Lesson, LessonDraft, LibraryEvent, Zone, describe

Embed = Callable[[list[str]], list[bytes]]
TRACKED = ("text", "source", "evidence", "utility", "exposures", "negative_windows", "status")


def _per_zone(do: int, avoid: int) -> dict[Zone, int]:
    return {"do": do, "avoid": avoid}


class LibrarySettings(BaseModel):
    """EDGE's experience library: on or off, how many lessons a prompt shows, and how lessons
    are admitted, credited and pruned."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        False,
        description="grow an experience library from insights and improved retries; its "
        "lessons replace the worked example in the guided slots (EDGE)",
    )
    k: int = Field(4, ge=1, description="lessons per prompt, within 800 characters")
    rate_limit: dict[Zone, int] = Field(default_factory=lambda: _per_zone(10, 5))
    capacity: dict[Zone, int] = Field(default_factory=lambda: _per_zone(100, 50))
    decay: float = Field(0.9, ge=0.0, le=1.0)
    exploration: float = Field(0.5, ge=0.0)
    protect_exposures: int = Field(3, ge=0)
    min_exposures: int = Field(5, ge=1)
    prune_below: float = 0.0
    negative_windows: int = Field(3, ge=1)


class Admission(BaseModel):
    """What one update did: lessons added, merged into and trimmed, and drafts refused."""

    added: list[int] = Field(default_factory=list)
    merged: list[int] = Field(default_factory=list)
    trimmed: list[int] = Field(default_factory=list)
    refused: list[tuple[str, str]] = Field(default_factory=list)  # (text, reason)


def fingerprint(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:32]


def admit(
    session: Session,
    drafts: Sequence[LessonDraft | dict[str, Any]],
    settings: LibrarySettings,
    embed: Embed | None = None,
) -> Admission:
    """One library update: merge duplicates, add new lessons within the rate limit and the
    capacity of their level."""
    validated = _validated(drafts)
    report = Admission()
    new = {"do": 0, "avoid": 0}
    counted = _counted_sources(session, [d.source for d in validated])
    for draft in validated:
        if draft.source and draft.source[:300] in counted:
            report.refused.append((draft.text, "evidence already counted"))
            continue
        existing = _find(session, draft)
        if existing is not None:
            _merge(session, existing, draft)
            report.merged.append(existing.id)
            lesson_id: int | None = existing.id
        elif new[draft.zone] >= settings.rate_limit[draft.zone]:
            report.refused.append((draft.text, "rate limit"))
            lesson_id = None
        elif (trimmed := _make_room(session, draft, settings)) is None:
            report.refused.append((draft.text, "level full of protected lessons"))
            lesson_id = None
        else:
            report.trimmed += trimmed
            lesson_id = _add(session, draft, embed)
            report.added.append(lesson_id)
            new[draft.zone] += 1
        if lesson_id is not None and draft.source:
            session.add(LessonEvidenceRow(lesson_id=lesson_id, source=draft.source[:300]))
            counted.add(draft.source[:300])
    session.flush()
    return report


def _counted_sources(session: Session, sources: list[str]) -> set[str]:
    """The sources (evidence) among these that some lesson already counts."""
    wanted = [source[:300] for source in sources if source]
    if not wanted:
        return set()
    query = select(LessonEvidenceRow.source).where(LessonEvidenceRow.source.in_(wanted))
    return set(session.scalars(query))


def record_use(
    session: Session, group_id: int, lesson_ids: list[int], similarities: list[float]
) -> None:
    """The lessons shown to a group's guided attempts, in rank order."""
    for rank, (lesson_id, similarity) in enumerate(zip(lesson_ids, similarities, strict=True)):
        session.add(
            LessonUseRow(lesson_id=lesson_id, group_id=group_id, rank=rank, similarity=similarity)
        )
        row = session.get(LessonRow, lesson_id)
        if row is not None:
            row.exposures += 1
    session.flush()


def credit(session: Session, group_id: int, gain: float, settings: LibrarySettings) -> list[int]:
    """Credit the group's with/without gain to every lesson it used; returns the lessons pruned."""
    pruned = []
    uses = session.scalars(
        select(LessonUseRow).where(LessonUseRow.group_id == group_id, LessonUseRow.gain.is_(None))
    )
    for use in uses:  # a use not credited yet: crediting a group twice changes nothing
        use.gain = gain
        row = session.get(LessonRow, use.lesson_id)
        assert row is not None
        before = _fields(row)
        row.utility = settings.decay * row.utility + (1 - settings.decay) * gain
        row.negative_windows = row.negative_windows + 1 if gain < 0 else 0
        _log(session, row, "credit", before)
        if _prunable(row, settings):
            before = _fields(row)
            row.status = "pruned"
            _log(session, row, "prune", before)
            pruned.append(row.id)
    session.flush()
    return pruned


def lessons(session: Session, status: str = "active") -> list[Lesson]:
    rows = session.scalars(
        select(LessonRow).where(LessonRow.status == status).order_by(LessonRow.id)
    )
    return [Lesson.model_validate(row) for row in rows]


def embeddings(session: Session, lesson_ids: list[int]) -> dict[int, bytes]:
    query = select(LessonRow.id, LessonRow.embedding).where(
        LessonRow.id.in_(lesson_ids), LessonRow.embedding.is_not(None)
    )
    return {lesson_id: vector for lesson_id, vector in session.execute(query) if vector is not None}


def events(session: Session, lesson_id: int) -> list[LibraryEvent]:
    rows = session.scalars(
        select(LibraryEventRow)
        .where(LibraryEventRow.lesson_id == lesson_id)
        .order_by(LibraryEventRow.id)
    )
    return [LibraryEvent.model_validate(row) for row in rows]


def uses(session: Session, lesson_id: int) -> list[tuple[int, float | None]]:
    """(group id, gain) for every group the lesson was shown to, in the order it was shown."""
    query = (
        select(LessonUseRow.group_id, LessonUseRow.gain)
        .where(LessonUseRow.lesson_id == lesson_id)
        .order_by(LessonUseRow.id)
    )
    return [(group_id, gain) for group_id, gain in session.execute(query)]


def used_in(session: Session, group_ids: list[int]) -> dict[int, int]:
    """Lesson id -> how many of these groups it was shown to."""
    query = (
        select(LessonUseRow.lesson_id, func.count())
        .where(LessonUseRow.group_id.in_(group_ids))
        .group_by(LessonUseRow.lesson_id)
    )
    return {lesson_id: n for lesson_id, n in session.execute(query)}


def lesson(session: Session, lesson_id: int) -> Lesson:
    row = session.get(LessonRow, lesson_id)
    if row is None:
        raise NotFound(f"no lesson {lesson_id}")
    return Lesson.model_validate(row)


def _validated(drafts: Sequence[LessonDraft | dict[str, Any]]) -> list[LessonDraft]:
    try:
        validated = [
            c if isinstance(c, LessonDraft) else LessonDraft.model_validate(c) for c in drafts
        ]
        return [d.model_copy(update={"text": " ".join(d.text.split())}) for d in validated]
    except ValidationError as exc:
        raise StoreError(f"lesson refused: {describe(exc)}") from exc


def _find(session: Session, draft: LessonDraft) -> LessonRow | None:
    return session.scalar(
        select(LessonRow).filter_by(
            scope=draft.scope,
            scope_key=draft.scope_key,
            zone=draft.zone,
            fingerprint=fingerprint(draft.text),
        )
    )


def _merge(session: Session, row: LessonRow, draft: LessonDraft) -> None:
    before = _fields(row)
    if len(draft.text) > len(row.text):
        row.text = draft.text
    row.evidence += 1
    if draft.source and draft.source not in row.source:
        row.source = f"{row.source}; {draft.source}".strip("; ")[:2000]
    if row.status == "pruned":  # fresh evidence revives it, with the utility it had
        row.status = "active"
    _log(session, row, "merge", before)


def _add(session: Session, draft: LessonDraft, embed: Embed | None) -> int:
    row = LessonRow(
        **draft.model_dump(exclude={"schema_version"}),
        fingerprint=fingerprint(draft.text),
        embedding=embed([draft.text])[0] if embed else None,
        evidence=1,
        utility=0.0,
        exposures=0,
        negative_windows=0,
        status="active",
    )
    session.add(row)
    session.flush()
    _log(session, row, "add", {})
    return row.id


def _make_room(session: Session, draft: LessonDraft, settings: LibrarySettings) -> list[int] | None:
    """Trim the draft's level down to capacity - 1; the trimmed ids, or None if only
    protected lessons remain."""
    level = list(
        session.scalars(
            select(LessonRow).filter_by(
                scope=draft.scope,
                scope_key=draft.scope_key,
                zone=draft.zone,
                status="active",
            )
        )
    )
    excess = len(level) - settings.capacity[draft.zone] + 1
    if excess <= 0:
        return []
    total = sum(row.exposures for row in level)
    unprotected = [row for row in level if row.exposures >= settings.protect_exposures]
    if len(unprotected) < excess:
        return None
    ranked = sorted(unprotected, key=lambda row: _rank(row, total, settings))
    trimmed = []
    for row in ranked[:excess]:
        before = _fields(row)
        row.status = "pruned"
        _log(session, row, "trim", before)
        trimmed.append(row.id)
    return trimmed


def _rank(row: LessonRow, total: int, settings: LibrarySettings) -> float:
    return row.utility + settings.exploration * math.sqrt(math.log(1 + total) / (1 + row.exposures))


def _prunable(row: LessonRow, settings: LibrarySettings) -> bool:
    return (
        row.exposures >= settings.min_exposures
        and row.utility < settings.prune_below
        and row.negative_windows >= settings.negative_windows
    )


def _fields(row: LessonRow) -> dict[str, Any]:
    return {name: getattr(row, name) for name in TRACKED}


def _log(session: Session, row: LessonRow, action: str, before: dict[str, Any]) -> None:
    session.add(LibraryEventRow(lesson_id=row.id, action=action, before=before, after=_fields(row)))


def size(session: Session) -> int:
    return session.scalar(select(func.count()).where(LessonRow.status == "active")) or 0


def size_history(session: Session) -> list[tuple[datetime, int]]:
    """(time, active lessons) after every add, trim, prune or revival, oldest first."""
    rows = session.execute(
        select(LibraryEventRow.created_at, LibraryEventRow.action, LibraryEventRow.before)
        .where(LibraryEventRow.action.in_(("add", "trim", "prune", "merge")))
        .order_by(LibraryEventRow.id)
    )
    history, active = [], 0
    for created_at, action, before in rows:
        revived = action == "merge" and before.get("status") == "pruned"
        if action == "merge" and not revived:
            continue
        active += 1 if action in ("add", "merge") else -1
        history.append((created_at, active))
    return history
