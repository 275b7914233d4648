"""The database: open one by URL, migrated to the latest schema, and run transactions on it.

1. `open_store(url)` creates the database if needed and migrates it (alembic). SQLite (WAL) is
   the default; PostgreSQL works with the same code, chosen by URL.
2. `transaction(engine)` is the one way to write: the caller owns it, store functions only
   flush. A database that cannot be reached or is locked is one `StoreError` line, and nothing
   of the transaction is applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    Engine,
    create_engine,
    event,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from memory.errors import StoreError

MIGRATIONS = Path(__file__).parent / "migrations"


SQLITE_BUSY_MS = 30_000  # how long a write waits for another writer's lock on SQLite


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
