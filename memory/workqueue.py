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
4. A worker whose group failed for want of a server gives the item back (`give_back`): not
   claimable again before its backoff ends, and counted as a failure only when the server was
   answering meanwhile (an outage is nobody's failure). An item that fails `max_failures` times
   is `failed`: its batch ends, and the flow that waits on it reports the item's last error.
   `requeue_failed` gives a batch's failed items another chance (a re-run).
5. Times are Unix seconds from the worker's clock; machines sharing a queue keep NTP time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Update, and_, func, or_, select, text, update
from sqlalchemy.orm import Session

from memory.database import insert_for, transaction
from memory.models import WorkItemRow
from memory.records import GroupPurpose, WorkItem, WorkState


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
    rows = [item.model_dump(exclude={"id", "schema_version"}) for item in items]
    statement = insert_for(session, WorkItemRow).values(rows).on_conflict_do_nothing()
    return len(session.execute(statement.returning(WorkItemRow.id)).all())


def claim(
    session: Session,
    owner: str,
    limit: int,
    lease_s: float,
    batch: tuple[int, GroupPurpose, str] | None = None,
    now: float | None = None,
) -> list[WorkItem]:
    """Claim up to `limit` claimable items (of `batch` = (round, purpose, version), if given)."""
    now = time.time() if now is None else now
    claimable = or_(
        and_(
            WorkItemRow.state == "queued",
            or_(WorkItemRow.not_before.is_(None), WorkItemRow.not_before <= now),
        ),
        and_(WorkItemRow.state == "claimed", WorkItemRow.lease_expires_at < now),
    )
    chosen = select(WorkItemRow.id).where(claimable).order_by(WorkItemRow.id).limit(limit)
    if batch is not None:
        round_index, purpose, version = batch
        chosen = chosen.where(
            WorkItemRow.round_index == round_index,
            WorkItemRow.purpose == purpose,
            WorkItemRow.policy_version == version,
        )
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
    session: Session,
    item_id: int,
    owner: str,
    error: str,
    *,
    counted: bool,
    retry_after_s: float,
    max_failures: int,
    now: float | None = None,
) -> WorkState | None:
    """Return an item `owner` could not collect; its new state (None if `owner` no longer held
    it). `counted` failures add up to `max_failures`, after which the item is `failed`."""
    now = time.time() if now is None else now
    row = session.get(WorkItemRow, item_id, with_for_update=True)
    if row is None or row.state != "claimed" or row.owner != owner:
        return None
    row.failures += int(counted)
    row.error = error[:2000]
    row.owner, row.lease_expires_at = None, None
    if row.failures >= max_failures:
        row.state, row.not_before = "failed", None
    else:
        row.state, row.not_before = "queued", now + retry_after_s
    session.flush()
    return row.state  # type: ignore[return-value]


def requeue_failed(session: Session, round_index: int, purpose: GroupPurpose, version: str) -> int:
    """Give a batch's failed items a fresh start; returns how many."""
    statement = (
        update(WorkItemRow)
        .where(
            WorkItemRow.round_index == round_index,
            WorkItemRow.purpose == purpose,
            WorkItemRow.policy_version == version,
            WorkItemRow.state == "failed",
        )
        .values(state="queued", failures=0, not_before=None)
    )
    return _rowcount(session, statement)


def failed(
    session: Session, round_index: int, purpose: GroupPurpose, version: str
) -> list[WorkItem]:
    """A batch's failed items, each with its last error."""
    query = select(WorkItemRow).where(
        WorkItemRow.round_index == round_index,
        WorkItemRow.purpose == purpose,
        WorkItemRow.policy_version == version,
        WorkItemRow.state == "failed",
    )
    return [WorkItem.model_validate(row) for row in session.scalars(query.order_by(WorkItemRow.id))]


def release(session: Session, owners: list[str]) -> int:
    """Put back what `owners` claimed (workers known to be dead); returns how many."""
    statement = (
        update(WorkItemRow)
        .where(WorkItemRow.owner.in_(owners), WorkItemRow.state == "claimed")
        .values(state="queued", owner=None, lease_expires_at=None)
    )
    return _rowcount(session, statement)


def claim_holders(session: Session) -> list[str]:
    """The owners holding claims now (expired or not)."""
    query = select(WorkItemRow.owner).where(WorkItemRow.state == "claimed").distinct()
    return [owner for owner in session.scalars(query) if owner]


def progress(
    session: Session, round_index: int, purpose: GroupPurpose, version: str
) -> dict[WorkState, int]:
    """How many items of a batch are in each state."""
    query = (
        select(WorkItemRow.state, func.count())
        .where(
            WorkItemRow.round_index == round_index,
            WorkItemRow.purpose == purpose,
            WorkItemRow.policy_version == version,
        )
        .group_by(WorkItemRow.state)
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
