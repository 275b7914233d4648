"""The database: open one by URL, migrate it by one explicit step, and run transactions on it.

1. `open_store(url)` opens a database whose schema is this code's, and refuses one that is not,
   with one line: an older one names the step that upgrades it (`flywheel migrate`), a newer
   one says the code is too old. An empty database is created at the current schema, under the
   migration lock. SQLite (WAL) is the default; PostgreSQL works with the same code, by URL.
2. `migrate(url)` upgrades a database to this code's schema (alembic), under a lock that
   every migrating process takes first: a PostgreSQL advisory lock, or a file lock beside a
   SQLite file. A process that waited on the lock finds the work done and does nothing. Only
   `flywheel migrate` and `flywheel run` (on its own store) migrate; workers, the gateway and
   every other command only open.
3. `transaction(engine)` is the one way to write: the caller owns it, store functions only
   flush. A database that cannot be reached or is locked is one `StoreError` line, and nothing
   of the transaction is applied.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from memory.errors import StoreError

MIGRATIONS = Path(__file__).parent / "migrations"
SQLITE_BUSY_MS = 30_000  # how long a write waits for another writer's lock on SQLite
ADVISORY_LOCK = 0x666C7977  # PostgreSQL's migration lock key ("flyw")


def head() -> str:
    """The schema revision this code needs."""
    revision = ScriptDirectory.from_config(_config()).get_current_head()
    assert revision is not None
    return revision


def open_store(url: str) -> Engine:
    """An engine on a database at this code's schema (an empty one is created at it), or
    `StoreError` with a one-line reason."""
    parsed = _parse(url)
    with _errors(parsed):
        engine = _engine(parsed)
        current = revision(engine)
        if current is None:
            current = _create(engine)
    _check(parsed, current)
    return engine


@cache
def shared_engine(url: str) -> Engine:
    """One engine per database for the life of the process, shared by whoever asks."""
    return open_store(url)


def migrate(url: str, target: str | None = None) -> tuple[str | None, str]:
    """Upgrade the database at `url` to `target` (this code's schema by default), under the
    migration lock; the revisions before and after."""
    parsed = _parse(url)
    with _errors(parsed):
        engine = _engine(parsed)
        try:
            with _lock(engine):
                before = revision(engine)  # read under the lock: another may have just migrated
                _check_not_newer(parsed, before)
                after = _upgrade(engine, target or "head")
        finally:
            engine.dispose()
    return before, after


def _create(engine: Engine) -> str | None:
    """Under the lock, create the schema of an empty database; the revision then (None for a
    database that holds tables that are not a flywheel's)."""
    with _lock(engine):
        current = revision(engine)  # another process may have created it meanwhile
        if current is None and _empty(engine):
            current = _upgrade(engine, "head")
    return current


def _upgrade(engine: Engine, target: str) -> str:
    config = _config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, target)
        reached = MigrationContext.configure(connection).get_current_revision()
    assert reached is not None
    return reached


def revision(engine: Engine) -> str | None:
    """The database's schema revision; None for one never migrated."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


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


def insert_for(session: Session, table: Any) -> Any:
    dialect = session.get_bind().dialect.name
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


def _parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StoreError(f"invalid database URL {url!r}") from exc
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise StoreError(f"unsupported database {parsed.get_backend_name()!r} (sqlite, postgresql)")
    return parsed


@contextmanager
def _errors(parsed: URL) -> Iterator[None]:
    try:
        yield
    except (SQLAlchemyError, OSError) as exc:
        reason = _reason(exc) if isinstance(exc, SQLAlchemyError) else str(exc)
        raise StoreError(f"cannot open database {parsed.render_as_string()}: {reason}") from exc


def _engine(parsed: URL) -> Engine:
    file = _sqlite_file(parsed)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, pool_pre_ping=True)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _check(parsed: URL, current: str | None) -> None:
    _check_not_newer(parsed, current)
    if current != head():
        where = parsed.render_as_string()
        raise StoreError(
            f"database {where} is at schema {current or 'none'}, and this flywheel needs "
            f"{head()}: run `flywheel migrate --db {where}`"
        )


def _check_not_newer(parsed: URL, current: str | None) -> None:
    known = {script.revision for script in ScriptDirectory.from_config(_config()).walk_revisions()}
    if current is not None and current not in known:
        raise StoreError(
            f"database {parsed.render_as_string()} is at schema {current}, newer than this "
            f"flywheel knows (up to {head()}): upgrade flywheel"
        )


def _empty(engine: Engine) -> bool:
    return not inspect(engine).get_table_names()


@contextmanager
def _lock(engine: Engine) -> Iterator[None]:
    """The migration lock: PostgreSQL's advisory lock, or a file lock beside a SQLite file
    (an in-memory database is one process's own)."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as connection:
            _advisory(connection, "pg_advisory_lock")
            try:
                yield
            finally:
                _advisory(connection, "pg_advisory_unlock")
        return
    file = _sqlite_file(engine.url)
    if file is None:
        yield
        return
    with open(file.with_name(file.name + ".migrate-lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _advisory(connection: Connection, function: str) -> None:
    connection.execute(text(f"SELECT {function}(:key)"), {"key": ADVISORY_LOCK})
    connection.commit()


def _sqlite_file(parsed: URL) -> Path | None:
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def _reason(exc: SQLAlchemyError) -> str:
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:300]


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
    cursor.close()
