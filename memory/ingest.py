"""Bulk ingest: groups with their attempts, steps, token segments, verdicts, reflections and
strategies, written in one pass per table.

1. Groups are upserted by natural key (round, purpose, task, policy version); attempts are
   inserted once (`ON CONFLICT DO NOTHING ... RETURNING`), so a re-run after a crash never
   duplicates, and an attempt, once stored, is final.
2. Only the attempts just inserted get their parts, written with COPY on PostgreSQL and one
   `executemany` on SQLite; a batch that fails part-way writes nothing (the caller's
   transaction).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, cast

import psycopg
from sqlalchemy import (
    JSON,
    Table,
    select,
)
from sqlalchemy.orm import Session

from memory import trajectory
from memory.database import insert_for
from memory.library import fingerprint
from memory.models import (
    AttemptRow,
    Base,
    ReflectionRow,
    RolloutGroupRow,
    SegmentRow,
    StepRow,
    StrategyRow,
    VerdictRow,
)
from memory.records import (
    VERIFIED_KINDS,
    Attempt,
    Group,
)
from memory.rows import (
    attempt_columns,
    group_columns,
    group_key,
    json_fields,
    refresh_group_stats,
    segment_columns,
    step_columns,
)


def save_group(session: Session, group: Group) -> int:
    """Upsert a group and its attempts by natural key; returns the group id."""
    return save_groups(session, [group])[0][0]


def save_groups(session: Session, groups: list[Group]) -> list[tuple[int, bool]]:
    """Upsert groups and their attempts by natural key, a few batched statements for all of
    them; returns each group's id and whether it is new. A new group's statistics come from the
    group given; an old one may hold other attempts, so it is re-read."""
    if not groups:
        return []
    table = RolloutGroupRow.__table__
    natural = (table.c.round_index, table.c.purpose, table.c.task_id, table.c.policy_version)
    rows = [group_columns(group) for group in groups]
    statement = insert_for(session, table).on_conflict_do_nothing()
    ids = {
        tuple(key): id_
        for id_, *key in session.execute(statement.returning(table.c.id, *natural), rows)
    }
    new = set(ids.values())
    for group in groups:
        key = group_key(group)
        if key not in ids:
            query = select(table.c.id).where(*(c == v for c, v in zip(natural, key, strict=True)))
            ids[key] = session.scalars(query).one()
    _save_attempts(session, [(ids[group_key(g)], g) for g in groups if g.attempts])
    session.flush()
    for group in groups:
        if ids[group_key(group)] not in new:
            refresh_group_stats(session, ids[group_key(group)])
    return [(ids[group_key(g)], ids[group_key(g)] in new) for g in groups]


def _save_attempts(session: Session, groups: list[tuple[int, Group]]) -> None:
    """Insert the attempts not stored yet, then the steps, segments, verdicts and reflections of
    those just inserted: an attempt and its parts are written once, together."""
    rows = []
    for group_id, group in groups:
        strategies = _strategy_ids(session, group.taskset, [a.strategy for a in group.attempts])
        rows += [
            {"group_id": group_id, **without_nul(attempt_columns(a, strategies))}
            for a in group.attempts
        ]
    if not rows:
        return
    new = _insert_attempts(session, rows)
    parts: dict[type[Base], list[dict[str, Any]]] = {SegmentRow: [], StepRow: [], VerdictRow: []}
    parts[ReflectionRow] = []
    for group_id, group in groups:
        for attempt in group.attempts:
            attempt_id = new.get((group_id, attempt.sample_index, attempt.kind))
            if attempt_id is not None:
                _attempt_parts(attempt_id, attempt, group.taskset, parts)
    for model, values in parts.items():
        if values:
            _bulk_insert(session, cast(Table, model.__table__), values)


def _insert_attempts(session: Session, rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], int]:
    """Insert attempts, skipping those already stored; the new ones' ids by natural key. On
    PostgreSQL one prepared statement is pipelined over the rows (no giant query to parse)."""
    table = AttemptRow.__table__
    returning = (table.c.id, table.c.group_id, table.c.sample_index, table.c.kind)
    if session.get_bind().dialect.name != "postgresql":
        statement = insert_for(session, table).on_conflict_do_nothing().returning(*returning)
        return {tuple(key): id_ for id_, *key in session.execute(statement, rows)}
    created = datetime.now(UTC)
    names, values = _driver_rows(table, [{**row, "created_at": created} for row in rows])
    query = (
        f"INSERT INTO attempt ({', '.join(names)}) VALUES ({', '.join(['%s'] * len(names))}) "
        "ON CONFLICT DO NOTHING RETURNING id, group_id, sample_index, kind"
    )
    new = {}
    with cast(psycopg.Cursor[Any], session.connection().connection.cursor()) as cursor:
        cursor.executemany(query, list(values), returning=True)
        while True:
            for id_, *key in cursor.fetchall():
                new[tuple(key)] = id_
            if not cursor.nextset():
                break
    return new


def _driver_rows(table: Any, rows: list[dict[str, Any]]) -> tuple[list[str], Iterator[list[Any]]]:
    """The quoted column names of `rows` (all with the same keys) and their values as the
    driver takes them, JSON columns serialised."""
    columns = list(rows[0])
    as_json = [isinstance(table.c[name].type, JSON) for name in columns]
    values = (
        [
            json.dumps(v) if j and v is not None else v
            for v, j in zip(row.values(), as_json, strict=True)
        ]
        for row in rows
    )
    return [f'"{name}"' for name in columns], values


def without_nul(value: Any) -> Any:
    """`value` with every NUL character in its text replaced by U+FFFD: PostgreSQL's text and
    JSON cannot hold NUL, and a model can sample it. Token ids keep what was sampled."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {key: without_nul(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_nul(item) for item in value]
    return value


def _bulk_insert(session: Session, table: Any, rows: list[dict[str, Any]]) -> None:
    """Many rows of one table in the caller's transaction, straight to the driver: COPY on
    PostgreSQL, one `executemany` on SQLite. Every row has the same keys."""
    names, values = _driver_rows(table, without_nul(rows))
    cursor = session.connection().connection.cursor()
    if session.get_bind().dialect.name == "postgresql":
        with cursor.copy(f"COPY {table.name} ({', '.join(names)}) FROM STDIN") as copy:
            for row in values:
                copy.write_row(row)
    else:
        marks = ", ".join("?" * len(names))
        statement = f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({marks})"
        cursor.executemany(statement, list(values))
    cursor.close()


def _attempt_parts(
    attempt_id: int, attempt: Attempt, taskset: str, parts: dict[type, list[dict[str, Any]]]
) -> None:
    for piece in trajectory.segments(attempt):
        parts[SegmentRow].append({"attempt_id": attempt_id, **segment_columns(piece)})
    for step in trajectory.steps(attempt):
        parts[StepRow].append({"attempt_id": attempt_id, **step_columns(step)})
    if attempt.sample is None or attempt.error is not None:
        return
    if attempt.kind in VERIFIED_KINDS:
        parts[VerdictRow].append(
            {
                "attempt_id": attempt_id,
                "verifier": taskset,
                "score": attempt.reward,
                "correct": attempt.correct,
                "format_ok": attempt.format_ok,
                "feedback": attempt.feedback,
            }
        )
    elif attempt.kind in ("reflection", "insight"):
        parts[ReflectionRow].append(
            {
                "attempt_id": attempt_id,
                "kind": attempt.kind,
                "target_index": attempt.parent_index,
                "valid": attempt.format_ok,
                "fields": json_fields(attempt.sample.text) if attempt.format_ok else {},
                "led_to_success": attempt.improved,
            }
        )


def _strategy_ids(session: Session, taskset: str, texts: list[str | None]) -> dict[str, int]:
    """The strategy table's id of each distinct text (inserted when new)."""
    keys = {text: fingerprint(text) for text in texts if text}
    if not keys:
        return {}
    firsts = {key: text for text, key in reversed(keys.items())}  # a fingerprint's first text
    values = [{"taskset": taskset, "fingerprint": k, "text": t} for k, t in firsts.items()]
    session.execute(insert_for(session, StrategyRow).on_conflict_do_nothing(), values)
    query = select(StrategyRow.fingerprint, StrategyRow.id).where(
        StrategyRow.taskset == taskset, StrategyRow.fingerprint.in_(firsts)
    )
    ids = dict(session.execute(query).tuples().all())
    return {text: ids[key] for text, key in keys.items()}
