"""The store: open a database by URL, and read and write records in the caller's transaction.

1. `open_store(url)` creates the database if needed and migrates it to the latest schema.
   SQLite (WAL) is the default; PostgreSQL works with the same code, chosen by URL.
2. Write functions take a session and only flush: the caller owns the transaction.
3. Writes are idempotent upserts on natural keys, so a re-run after a crash never duplicates:
   an attempt, once stored, is final.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    JSON,
    Engine,
    bindparam,
    case,
    create_engine,
    event,
    func,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, selectinload

from memory import trajectory
from memory.errors import NotFound, StoreError
from memory.library import fingerprint
from memory.models import (
    AliasEventRow,
    AttemptRow,
    OutcomeCountRow,
    PolicyVersionRow,
    ReflectionRow,
    RolloutGroupRow,
    SegmentRow,
    StepRow,
    StrategyRow,
    TrainingRoundRow,
    VerdictRow,
)
from memory.records import (
    AliasEvent,
    Attempt,
    Group,
    GroupPurpose,
    PolicyVersion,
    Segment,
    Step,
    StrategyStats,
    TrainingRound,
)

MIGRATIONS = Path(__file__).parent / "migrations"
SQLITE_BUSY_MS = 30_000  # how long a write waits for another writer's lock on SQLite
_ATTEMPTS = selectinload(RolloutGroupRow.attempts)
_ATTEMPT_PARTS = (
    _ATTEMPTS.selectinload(AttemptRow.segments),
    _ATTEMPTS.selectinload(AttemptRow.verdict),
    _ATTEMPTS.selectinload(AttemptRow.strategy),
)


def open_store(url: str) -> Engine:
    """An engine on a migrated database, or `StoreError` with a one-line reason."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StoreError(f"invalid database URL {url!r}") from exc
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise StoreError(f"unsupported database {parsed.get_backend_name()!r} (sqlite, postgresql)")
    try:
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, pool_pre_ping=True)
        if engine.dialect.name == "sqlite":
            event.listen(engine, "connect", _sqlite_pragmas)
        _migrate(engine)
    except (SQLAlchemyError, OSError) as exc:
        reason = _reason(exc) if isinstance(exc, SQLAlchemyError) else str(exc)
        raise StoreError(f"cannot open database {parsed.render_as_string()}: {reason}") from exc
    return engine


@contextmanager
def transaction(engine: Engine) -> Iterator[Session]:
    """A session in one transaction, committed at the end or rolled back on any error. A
    database that cannot be reached or is locked becomes one `StoreError` line; nothing of the
    transaction is applied."""
    try:
        with Session(engine, expire_on_commit=False) as session, session.begin():
            yield session
    except (OperationalError, InterfaceError) as exc:
        raise StoreError(f"database error: {_reason(exc)}") from exc


def _reason(exc: SQLAlchemyError) -> str:
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:300]


def save_group(session: Session, group: Group) -> int:
    """Upsert a group and its attempts by natural key; returns the group id."""
    return save_groups(session, [group])[0][0]


def save_new_group(session: Session, group: Group) -> tuple[int, bool]:
    """Upsert a group and its attempts; returns the group id and whether the group is new."""
    return save_groups(session, [group])[0]


def save_groups(session: Session, groups: list[Group]) -> list[tuple[int, bool]]:
    """Upsert groups and their attempts by natural key, a few batched statements for all of
    them; returns each group's id and whether it is new. A new group's statistics come from the
    group given; an old one may hold other attempts, so it is re-read."""
    if not groups:
        return []
    table = RolloutGroupRow.__table__
    natural = (table.c.round_index, table.c.purpose, table.c.task_id, table.c.policy_version)
    rows = [_group_columns(group) for group in groups]
    statement = insert_for(session, table).on_conflict_do_nothing()
    ids = {
        tuple(key): id_
        for id_, *key in session.execute(statement.returning(table.c.id, *natural), rows)
    }
    new = set(ids.values())
    for group in groups:
        key = _group_key(group)
        if key not in ids:
            query = select(table.c.id).where(*(c == v for c, v in zip(natural, key, strict=True)))
            ids[key] = session.scalars(query).one()
    _save_attempts(session, [(ids[_group_key(g)], g) for g in groups if g.attempts])
    session.flush()
    for group in groups:
        if ids[_group_key(group)] not in new:
            _refresh_group_stats(session, ids[_group_key(group)])
    return [(ids[_group_key(g)], ids[_group_key(g)] in new) for g in groups]


def _group_key(group: Group) -> tuple[Any, ...]:
    return (group.round_index, group.purpose, group.task_id, group.policy_version)


def _group_columns(group: Group) -> dict[str, Any]:
    rewards = [a.reward for a in group.first_attempts]
    return {
        "round_index": group.round_index,
        "purpose": group.purpose,
        "task_id": group.task_id,
        "policy_version": group.policy_version,
        "taskset": group.taskset,
        "question": group.question,
        "size": group.size,
        "plan": group.plan or None,
        "complete": group.complete,
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if rewards else None,
    }


def _save_attempts(session: Session, groups: list[tuple[int, Group]]) -> None:
    """Insert the attempts not stored yet, then the steps, segments, verdicts and reflections of
    those just inserted: an attempt and its parts are written once, together."""
    rows = []
    for group_id, group in groups:
        strategies = _strategy_ids(session, group.taskset, [a.strategy for a in group.attempts])
        rows += [{"group_id": group_id, **_attempt_columns(a, strategies)} for a in group.attempts]
    if not rows:
        return
    new = _insert_attempts(session, rows)
    parts: dict[type, list[dict[str, Any]]] = {SegmentRow: [], StepRow: [], VerdictRow: []}
    parts[ReflectionRow] = []
    for group_id, group in groups:
        for attempt in group.attempts:
            attempt_id = new.get((group_id, attempt.sample_index, attempt.kind))
            if attempt_id is not None:
                _attempt_parts(attempt_id, attempt, group.taskset, parts)
    for model, values in parts.items():
        if values:
            _bulk_insert(session, model.__table__, values)


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
    with session.connection().connection.cursor() as cursor:
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


def _bulk_insert(session: Session, table: Any, rows: list[dict[str, Any]]) -> None:
    """Many rows of one table in the caller's transaction, straight to the driver: COPY on
    PostgreSQL, one `executemany` on SQLite. Every row has the same keys."""
    names, values = _driver_rows(table, rows)
    cursor = session.connection().connection.cursor()
    if session.get_bind().dialect.name == "postgresql":
        with cursor.copy(f"COPY {table.name} ({', '.join(names)}) FROM STDIN") as copy:
            for row in values:
                copy.write_row(row)
    else:
        marks = ", ".join("?" * len(names))
        statement = f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({marks})"
        cursor.executemany(statement, values)
    cursor.close()


def _attempt_parts(
    attempt_id: int, attempt: Attempt, taskset: str, parts: dict[type, list[dict[str, Any]]]
) -> None:
    for piece in trajectory.segments(attempt):
        parts[SegmentRow].append({"attempt_id": attempt_id, **_segment_columns(piece)})
    for step in trajectory.steps(attempt):
        parts[StepRow].append({"attempt_id": attempt_id, **_step_columns(step)})
    if attempt.sample is None or attempt.error is not None:
        return
    if attempt.kind in ("base", "guided", "retry"):
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
                "fields": _json_fields(attempt.sample.text) if attempt.format_ok else {},
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


def strategy_stats(session: Session, taskset: str | None = None) -> list[StrategyStats]:
    """Success rate per strategy over first attempts, most tried first."""
    first = AttemptRow.kind.in_(("base", "guided")) & AttemptRow.error.is_(None)
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


def attempt_steps(session: Session, group_id: int, sample_index: int, kind: str) -> list[Step]:
    """The stored steps of one attempt, in order."""
    attempt = select(AttemptRow.id).filter_by(
        group_id=group_id, sample_index=sample_index, kind=kind
    )
    query = select(StepRow).where(StepRow.attempt_id.in_(attempt)).order_by(StepRow.step_index)
    return [_step_record(row) for row in session.scalars(query)]


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
        found.setdefault((group_id, index, kind), []).append(_segment_record(row))
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
        table = SegmentRow.__table__
        statement = (
            update(table)
            .where(table.c.attempt_id == bindparam("attempt"), table.c.loss == "policy")
            .values(advantage=bindparam("advantage"))
        )
        session.execute(statement, values)


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
    rows = session.scalars(query.options(*_ATTEMPT_PARTS))
    return [_group_record(row) for row in rows]


def groups_by_id(session: Session, group_ids: list[int]) -> list[Group]:
    """The groups of a data cursor, in cursor order; `StoreError` if one is gone."""
    query = select(RolloutGroupRow).where(RolloutGroupRow.id.in_(group_ids))
    rows = {row.id: row for row in session.scalars(query.options(*_ATTEMPT_PARTS))}
    missing = [gid for gid in group_ids if gid not in rows]
    if missing:
        raise StoreError(f"groups {missing[:5]} of the round's cursor are missing")
    return [_group_record(rows[gid]) for gid in group_ids]


def group_tasks(session: Session, group_ids: list[int]) -> dict[int, str]:
    """Group id -> task id, in id order, for the groups that exist."""
    query = select(RolloutGroupRow.id, RolloutGroupRow.task_id).where(
        RolloutGroupRow.id.in_(group_ids)
    )
    return dict(sorted(session.execute(query).tuples().all()))


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


def attempt_time_span(session: Session, purpose: GroupPurpose, round_index: int) -> float:
    """Seconds between the first and the last stored attempt of a round's groups."""
    query = (
        select(func.min(AttemptRow.created_at), func.max(AttemptRow.created_at))
        .join(RolloutGroupRow, AttemptRow.group_id == RolloutGroupRow.id)
        .where(RolloutGroupRow.purpose == purpose, RolloutGroupRow.round_index == round_index)
    )
    first, last = session.execute(query).one()
    return (last - first).total_seconds() if first and last else 0.0


def record_feedback(session: Session, task_id: str, score: float, reason: str) -> None:
    """Attach a score (user feedback or a later verifier) to a captured trajectory."""
    group = session.scalars(
        select(RolloutGroupRow).filter_by(purpose="capture", task_id=task_id)
    ).first()
    if group is None or not group.attempts:
        raise NotFound(f"unknown capture id {task_id!r}")
    attempt = group.attempts[0]
    attempt.reward = score
    attempt.correct = score >= 1.0
    attempt.reason = reason
    verdict = attempt.verdict or VerdictRow(attempt_id=attempt.id, feedback=[], format_ok=True)
    verdict.verifier, verdict.score, verdict.correct = "feedback", score, attempt.correct
    session.add(verdict)
    session.flush()
    _refresh_group_stats(session, group.id)


def save_policy_version(session: Session, version: PolicyVersion) -> None:
    values = version.model_dump(exclude={"schema_version"})
    statement = insert_for(session, PolicyVersionRow).values(**values)
    session.execute(statement.on_conflict_do_nothing())
    session.flush()


def record_evaluation(session: Session, name: str, pass_at_1: float) -> None:
    _policy_row(session, name).eval_pass_at_1 = pass_at_1
    session.flush()


def set_promoted(session: Session, name: str, promoted: bool) -> None:
    """Promote (newest promotion serves) or un-promote a version."""
    row = _policy_row(session, name)
    row.promoted = promoted
    row.promoted_at = datetime.now(UTC) if promoted else None
    session.flush()


def policy_version(session: Session, name: str) -> PolicyVersion:
    return PolicyVersion.model_validate(_policy_row(session, name))


def promoted_policy(session: Session) -> PolicyVersion | None:
    """The most recently promoted version: it serves and samples the next round."""
    history = promoted_history(session)
    return history[0] if history else None


def save_training_round(session: Session, record: TrainingRound) -> None:
    """Insert or update the round's record (one per round index)."""
    row = session.scalars(
        select(TrainingRoundRow).filter_by(round_index=record.round_index)
    ).first()
    values = record.model_dump(exclude={"schema_version"})
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
    _policy_row(session, name)
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


def record_alias_event(session: Session, event: AliasEvent) -> None:
    session.add(AliasEventRow(**event.model_dump(exclude={"schema_version"})))
    session.flush()


def alias_events(session: Session, alias: str) -> list[AliasEvent]:
    query = select(AliasEventRow).filter_by(alias=alias).order_by(AliasEventRow.id)
    return [AliasEvent.model_validate(row) for row in session.scalars(query)]


def promoted_history(session: Session) -> list[PolicyVersion]:
    """Promoted versions, newest promotion first; the head serves, the next is the fallback."""
    query = select(PolicyVersionRow).filter_by(promoted=True)
    order = (PolicyVersionRow.promoted_at.desc(), PolicyVersionRow.id.desc())
    rows = session.scalars(query.order_by(*order))
    return [PolicyVersion.model_validate(row) for row in rows]


def policy_versions(session: Session) -> list[PolicyVersion]:
    rows = session.scalars(select(PolicyVersionRow).order_by(PolicyVersionRow.id))
    return [PolicyVersion.model_validate(row) for row in rows]


def training_rounds(session: Session, last: int = 5) -> list[TrainingRound]:
    query = select(TrainingRoundRow).order_by(TrainingRoundRow.round_index.desc()).limit(last)
    return [TrainingRound.model_validate(row) for row in reversed(session.scalars(query).all())]


def attempt_counts(session: Session) -> dict[str, int]:
    """Stored attempts per group purpose (train, eval, capture)."""
    query = (
        select(RolloutGroupRow.purpose, func.count(AttemptRow.id))
        .join(AttemptRow, AttemptRow.group_id == RolloutGroupRow.id)
        .group_by(RolloutGroupRow.purpose)
    )
    return {purpose: count for purpose, count in session.execute(query)}


def _migrate(engine: Engine) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
    cursor.close()


def insert_for(session: Session, table: Any) -> Any:
    dialect = session.get_bind().dialect.name
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


def _attempt_columns(attempt: Attempt, strategies: dict[str, int]) -> dict[str, Any]:
    sample = attempt.sample
    return {
        "sample_index": attempt.sample_index,
        "kind": attempt.kind,
        "policy_version": attempt.policy_version,
        "messages": attempt.messages,
        "sampling": attempt.sampling.model_dump(),
        "completion": sample.text if sample else None,
        "prompt_token_ids": sample.prompt_token_ids if sample else None,
        "finish_reason": sample.finish_reason if sample else None,
        "reward": attempt.reward,
        "correct": attempt.correct,
        "format_ok": attempt.format_ok,
        "answer": attempt.answer,
        "reason": attempt.reason,
        "error": attempt.error,
        "context": attempt.context,
        "guidance": attempt.guidance,
        "bare_prompt_token_ids": attempt.bare_prompt_token_ids,
        "parent_index": attempt.parent_index,
        "pivot_tokens": attempt.pivot_tokens,
        "improved": attempt.improved,
        "shaped_reward": attempt.shaped_reward,
        "shaping": attempt.shaping,
        "strategy_id": strategies.get(attempt.strategy or ""),
        "turns": attempt.turns,
        "generated_tokens": attempt.generated_tokens,
    }


def _segment_columns(piece: Segment) -> dict[str, Any]:
    return {
        "segment_index": piece.index,
        "step_index": piece.step_index,
        "start": piece.start,
        "loss": piece.loss,
        "token_ids": trajectory.pack_ids(piece.token_ids),
        "logprobs": trajectory.pack_floats(piece.logprobs),
        "temperature": piece.temperature,
        "weight": piece.weight,
        "advantage": piece.advantage,
    }


def _segment_record(row: SegmentRow) -> Segment:
    return Segment(
        index=row.segment_index,
        step_index=row.step_index,
        start=row.start,
        loss=row.loss,  # type: ignore[arg-type]
        token_ids=trajectory.unpack_ids(row.token_ids),
        logprobs=trajectory.unpack_floats(row.logprobs),
        temperature=row.temperature,
        weight=row.weight,
        advantage=row.advantage,
    )


def _step_columns(step: Step) -> dict[str, Any]:
    values = step.model_dump(exclude={"schema_version", "index", "strategy"})
    return {"step_index": step.index, **values}


def _step_record(row: StepRow) -> Step:
    return Step(
        index=row.step_index,
        observation=row.observation,
        action=row.action,
        replayed=row.replayed,
        reward=row.reward,
        outcome=row.outcome,
        temperature=row.temperature,
        strategy_temperature=row.strategy_temperature,
    )


def _json_fields(text: str) -> dict[str, Any]:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _refresh_group_stats(session: Session, group_id: int) -> None:
    row = session.get(RolloutGroupRow, group_id)
    assert row is not None
    session.refresh(row, ["attempts"])
    group = _group_record(row)
    rewards = [a.reward for a in group.first_attempts]
    row.complete = group.complete
    row.reward_mean = statistics.fmean(rewards) if rewards else None
    row.reward_std = statistics.pstdev(rewards) if rewards else None
    session.flush()


def _group_record(row: RolloutGroupRow) -> Group:
    return Group(
        id=row.id,
        round_index=row.round_index,
        purpose=row.purpose,  # type: ignore[arg-type]
        task_id=row.task_id,
        taskset=row.taskset,
        question=row.question,
        policy_version=row.policy_version,
        size=row.size,
        attempts=[_attempt_record(a) for a in row.attempts],
        plan=row.plan or {},
    )


def _attempt_record(row: AttemptRow) -> Attempt:
    sample, pieces = None, [_segment_record(piece) for piece in row.segments]
    if row.prompt_token_ids is not None and row.finish_reason is not None:
        sample = trajectory.joined(
            row.prompt_token_ids, row.completion or "", row.finish_reason, pieces
        )
    return Attempt.model_validate(
        {
            "sample_index": row.sample_index,
            "kind": row.kind,
            "policy_version": row.policy_version,
            "messages": row.messages,
            "sampling": row.sampling,
            "sample": sample,
            "reward": row.reward,
            "correct": row.correct,
            "format_ok": row.format_ok,
            "answer": row.answer,
            "reason": row.reason,
            "error": row.error,
            "context": row.context,
            "guidance": row.guidance,
            "bare_prompt_token_ids": row.bare_prompt_token_ids,
            "parent_index": row.parent_index,
            "pivot_tokens": row.pivot_tokens,
            "improved": row.improved,
            "shaped_reward": row.shaped_reward,
            "shaping": row.shaping,
            "strategy": row.strategy.text if row.strategy else None,
            "forced_spans": trajectory.forced_spans(pieces),
            "generated_tokens": row.generated_tokens,
            "turns": row.turns,
            "feedback": row.verdict.feedback if row.verdict else [],
        }
    )


def _policy_row(session: Session, name: str) -> PolicyVersionRow:
    row = session.scalars(select(PolicyVersionRow).filter_by(name=name)).first()
    if row is None:
        raise NotFound(f"unknown policy version {name!r}")
    return row
