"""The experience library (EDGE, SLEA-RL): one table for every kind of guidance.

1. Admission, once per library update: candidates are validated first (a bad one refuses the
   whole update, nothing written); at most `rate_limit[zone]` new entries per update; a candidate
   whose fingerprint (its normalised words) already exists in its scope refines that entry: the
   longer text is kept, evidence adds up, utility is never reset. Each source (an attempt that
   produced the candidate) counts once: re-curating the same round adds no evidence.
2. Capacity per level (scope, scope key, zone): over capacity, the lowest-ranked unprotected
   entry is trimmed, rank = utility + c * sqrt(ln(1 + N) / (1 + n)) with N the exposures in the
   level and n the entry's (an exploration bonus for rarely shown entries). An entry is protected
   until it has been shown `protect_exposures` times; if every entry of a full level is protected,
   the candidate is refused.
3. Utility is EDGE's with/without gain, shared by every kind of entry: for a group whose guided
   half saw an entry, gain = success rate with guidance - without, and u <- 0.9 u + 0.1 gain.
4. Hard pruning: an entry shown at least `min_exposures` times whose utility is below
   `prune_below` after `negative_windows` negative gains in a row is pruned.
5. Every change is a library event holding the entry's fields before and after.
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
    ExperienceEntryRow,
    ExperienceEvidenceRow,
    ExperienceUseRow,
    LibraryEventRow,
)
from memory.records import ExperienceEntry, Guidance, LibraryEvent, Zone, describe

Embed = Callable[[list[str]], list[bytes]]
TRACKED = ("text", "source", "evidence", "utility", "exposures", "negative_windows", "status")


def _per_zone(do: int, avoid: int) -> dict[Zone, int]:
    return {"do": do, "avoid": avoid}


class LibrarySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rate_limit: dict[Zone, int] = Field(default_factory=lambda: _per_zone(10, 5))
    capacity: dict[Zone, int] = Field(default_factory=lambda: _per_zone(100, 50))
    decay: float = Field(0.9, ge=0.0, le=1.0)
    exploration: float = Field(0.5, ge=0.0)
    protect_exposures: int = Field(3, ge=0)
    min_exposures: int = Field(5, ge=1)
    prune_below: float = 0.0
    negative_windows: int = Field(3, ge=1)


class Admission(BaseModel):
    """What one update did: entries added, merged into and trimmed, and candidates refused."""

    added: list[int] = Field(default_factory=list)
    merged: list[int] = Field(default_factory=list)
    trimmed: list[int] = Field(default_factory=list)
    refused: list[tuple[str, str]] = Field(default_factory=list)  # (text, reason)


def fingerprint(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:32]


def admit(
    session: Session,
    candidates: Sequence[Guidance | dict[str, Any]],
    settings: LibrarySettings,
    embed: Embed | None = None,
) -> Admission:
    """One library update: merge duplicates, add new entries within the rate limit and the
    capacity of their level."""
    guidance = _validated(candidates)
    report = Admission()
    new = {"do": 0, "avoid": 0}
    counted = _counted_sources(session, [c.source for c in guidance])
    for candidate in guidance:
        if candidate.source and candidate.source[:300] in counted:
            report.refused.append((candidate.text, "evidence already counted"))
            continue
        existing = _find(session, candidate)
        if existing is not None:
            _merge(session, existing, candidate)
            report.merged.append(existing.id)
            entry_id: int | None = existing.id
        elif new[candidate.zone] >= settings.rate_limit[candidate.zone]:
            report.refused.append((candidate.text, "rate limit"))
            entry_id = None
        elif (trimmed := _make_room(session, candidate, settings)) is None:
            report.refused.append((candidate.text, "level full of protected entries"))
            entry_id = None
        else:
            report.trimmed += trimmed
            entry_id = _add(session, candidate, embed)
            report.added.append(entry_id)
            new[candidate.zone] += 1
        if entry_id is not None and candidate.source:
            session.add(ExperienceEvidenceRow(entry_id=entry_id, source=candidate.source[:300]))
            counted.add(candidate.source[:300])
    session.flush()
    return report


def _counted_sources(session: Session, sources: list[str]) -> set[str]:
    """The sources (evidence) among these that some entry already counts."""
    wanted = [source[:300] for source in sources if source]
    if not wanted:
        return set()
    query = select(ExperienceEvidenceRow.source).where(ExperienceEvidenceRow.source.in_(wanted))
    return set(session.scalars(query))


def record_use(
    session: Session, group_id: int, entry_ids: list[int], similarities: list[float]
) -> None:
    """The entries shown to a group's guided attempts, in rank order."""
    for rank, (entry_id, similarity) in enumerate(zip(entry_ids, similarities, strict=True)):
        session.add(
            ExperienceUseRow(entry_id=entry_id, group_id=group_id, rank=rank, similarity=similarity)
        )
        row = session.get(ExperienceEntryRow, entry_id)
        if row is not None:
            row.exposures += 1
    session.flush()


def credit(session: Session, group_id: int, gain: float, settings: LibrarySettings) -> list[int]:
    """Credit the group's with/without gain to every entry it used; returns the entries pruned."""
    pruned = []
    uses = session.scalars(
        select(ExperienceUseRow).where(
            ExperienceUseRow.group_id == group_id, ExperienceUseRow.gain.is_(None)
        )
    )
    for use in uses:  # a use not credited yet: crediting a group twice changes nothing
        use.gain = gain
        row = session.get(ExperienceEntryRow, use.entry_id)
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


def entries(session: Session, status: str = "active") -> list[ExperienceEntry]:
    rows = session.scalars(
        select(ExperienceEntryRow)
        .where(ExperienceEntryRow.status == status)
        .order_by(ExperienceEntryRow.id)
    )
    return [ExperienceEntry.model_validate(row) for row in rows]


def embeddings(session: Session, entry_ids: list[int]) -> dict[int, bytes]:
    query = select(ExperienceEntryRow.id, ExperienceEntryRow.embedding).where(
        ExperienceEntryRow.id.in_(entry_ids), ExperienceEntryRow.embedding.is_not(None)
    )
    return {entry_id: vector for entry_id, vector in session.execute(query) if vector is not None}


def events(session: Session, entry_id: int) -> list[LibraryEvent]:
    rows = session.scalars(
        select(LibraryEventRow)
        .where(LibraryEventRow.entry_id == entry_id)
        .order_by(LibraryEventRow.id)
    )
    return [LibraryEvent.model_validate(row) for row in rows]


def uses(session: Session, entry_id: int) -> list[tuple[int, float | None]]:
    """(group id, gain) for every group the entry was shown to, in the order it was shown."""
    query = (
        select(ExperienceUseRow.group_id, ExperienceUseRow.gain)
        .where(ExperienceUseRow.entry_id == entry_id)
        .order_by(ExperienceUseRow.id)
    )
    return [(group_id, gain) for group_id, gain in session.execute(query)]


def used_in(session: Session, group_ids: list[int]) -> dict[int, int]:
    """Entry id -> how many of these groups it was shown to."""
    query = (
        select(ExperienceUseRow.entry_id, func.count())
        .where(ExperienceUseRow.group_id.in_(group_ids))
        .group_by(ExperienceUseRow.entry_id)
    )
    return {entry_id: n for entry_id, n in session.execute(query)}


def entry(session: Session, entry_id: int) -> ExperienceEntry:
    row = session.get(ExperienceEntryRow, entry_id)
    if row is None:
        raise NotFound(f"no library entry {entry_id}")
    return ExperienceEntry.model_validate(row)


def _validated(candidates: Sequence[Guidance | dict[str, Any]]) -> list[Guidance]:
    try:
        guidance = [
            c if isinstance(c, Guidance) else Guidance.model_validate(c) for c in candidates
        ]
        return [g.model_copy(update={"text": " ".join(g.text.split())}) for g in guidance]
    except ValidationError as exc:
        raise StoreError(f"guidance refused: {describe(exc)}") from exc


def _find(session: Session, candidate: Guidance) -> ExperienceEntryRow | None:
    return session.scalar(
        select(ExperienceEntryRow).filter_by(
            scope=candidate.scope,
            scope_key=candidate.scope_key,
            zone=candidate.zone,
            fingerprint=fingerprint(candidate.text),
        )
    )


def _merge(session: Session, row: ExperienceEntryRow, candidate: Guidance) -> None:
    before = _fields(row)
    if len(candidate.text) > len(row.text):
        row.text = candidate.text
    row.evidence += 1
    if candidate.source and candidate.source not in row.source:
        row.source = f"{row.source}; {candidate.source}".strip("; ")[:2000]
    if row.status == "pruned":  # fresh evidence revives it, with the utility it had
        row.status = "active"
    _log(session, row, "merge", before)


def _add(session: Session, candidate: Guidance, embed: Embed | None) -> int:
    row = ExperienceEntryRow(
        **candidate.model_dump(exclude={"schema_version"}),
        fingerprint=fingerprint(candidate.text),
        embedding=embed([candidate.text])[0] if embed else None,
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


def _make_room(
    session: Session, candidate: Guidance, settings: LibrarySettings
) -> list[int] | None:
    """Trim the candidate's level down to capacity - 1; the trimmed ids, or None if only
    protected entries remain."""
    level = list(
        session.scalars(
            select(ExperienceEntryRow).filter_by(
                scope=candidate.scope,
                scope_key=candidate.scope_key,
                zone=candidate.zone,
                status="active",
            )
        )
    )
    excess = len(level) - settings.capacity[candidate.zone] + 1
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


def _rank(row: ExperienceEntryRow, total: int, settings: LibrarySettings) -> float:
    return row.utility + settings.exploration * math.sqrt(math.log(1 + total) / (1 + row.exposures))


def _prunable(row: ExperienceEntryRow, settings: LibrarySettings) -> bool:
    return (
        row.exposures >= settings.min_exposures
        and row.utility < settings.prune_below
        and row.negative_windows >= settings.negative_windows
    )


def _fields(row: ExperienceEntryRow) -> dict[str, Any]:
    return {name: getattr(row, name) for name in TRACKED}


def _log(session: Session, row: ExperienceEntryRow, action: str, before: dict[str, Any]) -> None:
    session.add(LibraryEventRow(entry_id=row.id, action=action, before=before, after=_fields(row)))


def size(session: Session) -> int:
    return session.scalar(select(func.count()).where(ExperienceEntryRow.status == "active")) or 0


def size_history(session: Session) -> list[tuple[datetime, int]]:
    """(time, active entries) after every add, trim, prune or revival, oldest first."""
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
