"""The work queue: collection batches split into items that workers claim under leases.

1. `enqueue` is idempotent on the natural key (round, purpose, policy version, task): a re-run
   enqueues nothing twice, and finished items stay finished.
2. `claim` takes up to `limit` items that are queued, or claimed under a lease that has passed,
   in one atomic statement: PostgreSQL picks them with `FOR UPDATE SKIP LOCKED`, so concurrent
   workers skip each other's rows instead of waiting; SQLite has no row locks, so the claim runs
   in a `BEGIN IMMEDIATE` transaction (`claiming`) and is one `UPDATE ... RETURNING`.
3. A worker renews its leases while it works; a worker that dies stops renewing, and its items
   go back to whoever claims next. Results are written by natural key, so an item collected
   twice (a lease that ran out under a slow worker) is still stored once.
4. A worker whose group failed gives the item back (`give_back`), saying whose failure it
   was: the task's own (its verifier, environment or sandbox raised or hung: always counted) or
   the server's (counted only when the server was answering meanwhile: an outage is nobody's
   failure). It is not claimable again before its backoff ends. An item that fails
   `max_failures` times is `failed`, with its last error and whose it was; the flow that waits
   on its batch reports it. `requeue_failed` gives a batch's failed items another chance (a
   re-run).
5. A claim that ends with its worker gone (a lease that ran out, a process found dead) is
   `abandoned`. An item whose workers keep dying on it (a verifier that takes the process
   down) is failed as the task's fault at its `max_abandoned`-th such claim, so no task can
   take every worker down in turn.
6. Times are Unix seconds from the worker's clock; machines sharing a queue keep NTP time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Engine,
    Update,
    and_,
    case,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.orm import Session

from memory.database import insert_for, transaction
from memory.models import WorkItemRow
from memory.records import Batch, Setback, WorkItem, WorkState

MAX_ABANDONED = 3  # claims an item may outlive its worker before it fails as the task's fault


@contextmanager
def claiming(engine: Engine) -> Iterator[Session]:
    """A transaction for `claim`: on SQLite it takes the write lock up front."""
    with transaction(engine) as session:
        if engine.dialect.name == "sqlite":
            session.execute(text("BEGIN IMMEDIATE"))
        yield session


def enqueue(session: Session, items: list[WorkItem]) -> int:
    """Add the items not queued before; returns how many were new."""
    if not items:
        return 0
    rows = [_columns(item) for item in items]
    statement = insert_for(session, WorkItemRow).values(rows).on_conflict_do_nothing()
    return len(session.execute(statement.returning(WorkItemRow.id)).all())


def _columns(item: WorkItem) -> dict[str, Any]:
    values = item.model_dump(exclude={"id", "schema_version"})
    return values | {"plan": json.loads(item.plan)}


def claim(
    session: Session,
    owner: str,
    limit: int,
    lease_s: float,
    batch: Batch | None = None,
    now: float | None = None,
    max_abandoned: int = MAX_ABANDONED,
) -> list[WorkItem]:
    """Claim up to `limit` claimable items (of `batch`, if given).
    An expired claim counts as abandoned; an item abandoned `max_abandoned` times fails."""
    now = time.time() if now is None else now
    expired = and_(WorkItemRow.state == "claimed", WorkItemRow.lease_expires_at < now)
    _fail_abandoned(session, expired, max_abandoned)
    claimable = or_(
        and_(
            WorkItemRow.state == "queued",
            or_(WorkItemRow.not_before.is_(None), WorkItemRow.not_before <= now),
        ),
        expired,
    )
    chosen = select(WorkItemRow.id).where(claimable).order_by(WorkItemRow.id).limit(limit)
    if batch is not None:
        chosen = chosen.where(*_in_batch(batch))
    if session.get_bind().dialect.name == "postgresql":
        chosen = chosen.with_for_update(skip_locked=True)
    statement = (
        update(WorkItemRow)
        .where(WorkItemRow.id.in_(chosen.scalar_subquery()))
        .values(
            state="claimed",
            owner=owner,
            lease_expires_at=now + lease_s,
            claims=WorkItemRow.claims + 1,
            abandoned=WorkItemRow.abandoned + case((WorkItemRow.state == "claimed", 1), else_=0),
        )
        .returning(WorkItemRow)
    )
    rows = session.execute(statement).scalars().all()
    return sorted((WorkItem.model_validate(row) for row in rows), key=lambda item: item.task_id)


def renew(
    session: Session, owner: str, item_ids: list[int], lease_s: float, now: float | None = None
) -> int:
    """Extend the leases `owner` still holds; returns how many it still held."""
    now = time.time() if now is None else now
    statement = (
        update(WorkItemRow)
        .where(
            WorkItemRow.id.in_(item_ids),
            WorkItemRow.owner == owner,
            WorkItemRow.state == "claimed",
        )
        .values(lease_expires_at=now + lease_s)
    )
    return _rowcount(session, statement)


def complete(session: Session, item_id: int) -> bool:
    """Mark an item done; False if it was done already (by another worker, after a lease ran
    out)."""
    statement = (
        update(WorkItemRow)
        .where(WorkItemRow.id == item_id, WorkItemRow.state != "done")
        .values(state="done", lease_expires_at=None)
    )
    return bool(_rowcount(session, statement))


def give_back(
    session: Session, item_id: int, owner: str, setback: Setback, now: float | None = None
) -> WorkState | None:
    """Return an item `owner` could not collect, with why (`Setback`); its new state (None if
    `owner` no longer held it)."""
    now = time.time() if now is None else now
    row = session.get(WorkItemRow, item_id, with_for_update=True)
    if row is None or row.state != "claimed" or row.owner != owner:
        return None
    row.failures += int(setback.counted)
    row.error, row.fault = setback.error[:2000], setback.fault
    row.owner, row.lease_expires_at = None, None
    if row.failures >= setback.max_failures:
        row.state, row.not_before = "failed", None
    else:
        row.state, row.not_before = "queued", now + setback.retry_after_s
    session.flush()
    return row.state  # type: ignore[return-value]


def requeue_failed(session: Session, batch: Batch) -> int:
    """Give a batch's failed items a fresh start; returns how many."""
    statement = (
        update(WorkItemRow)
        .where(*_in_batch(batch), WorkItemRow.state == "failed")
        .values(state="queued", failures=0, abandoned=0, not_before=None, fault=None)
    )
    return _rowcount(session, statement)


def failed(session: Session, batch: Batch | None = None) -> list[WorkItem]:
    """Failed items, each with its last error and whose it was: a batch's, or (without one)
    every batch's."""
    query = select(WorkItemRow).where(WorkItemRow.state == "failed")
    if batch is not None:
        query = query.where(*_in_batch(batch))
    return [WorkItem.model_validate(row) for row in session.scalars(query.order_by(WorkItemRow.id))]


def release(
    session: Session, owners: list[str], *, dead: bool, max_abandoned: int = MAX_ABANDONED
) -> int:
    """Put back what `owners` claimed; returns how many. The claims of `dead` workers count as
    abandoned (an item abandoned `max_abandoned` times fails); a worker that stops on its own
    (an outage, the end of its batch) abandons nothing."""
    held = and_(WorkItemRow.owner.in_(owners), WorkItemRow.state == "claimed")
    if dead:
        _fail_abandoned(session, held, max_abandoned)
    statement = (
        update(WorkItemRow)
        .where(held)
        .values(
            state="queued",
            owner=None,
            lease_expires_at=None,
            abandoned=WorkItemRow.abandoned + int(dead),
        )
    )
    return _rowcount(session, statement)


def _fail_abandoned(session: Session, held: ColumnElement[bool], max_abandoned: int) -> None:
    """Fail the items among the abandoned claims `held` selects whose workers keep dying on
    them: this would be the `max_abandoned`-th."""
    statement = (
        update(WorkItemRow)
        .where(held, WorkItemRow.abandoned + 1 >= max_abandoned)
        .values(
            state="failed",
            fault="task",
            owner=None,
            lease_expires_at=None,
            abandoned=WorkItemRow.abandoned + 1,
            error=f"{max_abandoned} workers stopped while collecting it (the task's code may "
            "take its process down)",
        )
    )
    session.execute(statement)


def _in_batch(batch: Batch) -> list[ColumnElement[bool]]:
    return [
        WorkItemRow.round_index == batch.round_index,
        WorkItemRow.purpose == batch.purpose,
        WorkItemRow.policy_version == batch.policy_version,
    ]


def claim_holders(session: Session) -> list[str]:
    """The owners holding claims now (expired or not)."""
    query = select(WorkItemRow.owner).where(WorkItemRow.state == "claimed").distinct()
    return [owner for owner in session.scalars(query) if owner]


def progress(session: Session, batch: Batch) -> dict[WorkState, int]:
    """How many items of a batch are in each state."""
    query = (
        select(WorkItemRow.state, func.count()).where(*_in_batch(batch)).group_by(WorkItemRow.state)
    )
    counts: dict[WorkState, int] = {"queued": 0, "claimed": 0, "done": 0, "failed": 0}
    counts.update({state: n for state, n in session.execute(query)})  # type: ignore[misc]
    return counts


def queue_depth(session: Session) -> int:
    """Items waiting or claimed, over all batches."""
    query = select(func.count()).where(WorkItemRow.state.in_(("queued", "claimed")))
    return session.scalar(query) or 0


def _rowcount(session: Session, statement: Update) -> int:
    """Rows an UPDATE changed."""
    result = cast(CursorResult[Any], session.execute(statement))
    return result.rowcount or 0
