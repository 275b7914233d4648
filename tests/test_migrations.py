"""Schema changes go through one explicit, locked step. Every earlier revision, holding data,
upgrades to the current one on both databases with nothing lost; a store behind or ahead of the
code is refused with one line; processes that migrate at once do the work once."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import (  # noqa: I001
    JSON,
    Boolean,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    create_engine,
    func,
    insert,
    select,
    text,
)

from cli.main import main
from memory import database, store
from memory.errors import StoreError

REVISIONS = [f"{n:04d}" for n in range(1, int(database.head()))]
DICT_COLUMNS = {
    "sampling",
    "plan",
    "hyperparameters",
    "metrics",
    "before",
    "after",
    "fields",
    "shaping",
}
JSONS = {"sampling": {"temperature": 1.0, "max_tokens": 8},
         "messages": [{"role": "user", "content": "q"}], "prompt_token_ids": [1, 2],
         "completion_token_ids": [7, 8, 9], "logprobs": [-0.5, -0.5, -0.5]}  # fmt: skip
NAMED = {"purpose": "train", "kind": "base", "state": "queued", "status": "done",
         "action": "promote", "loss_type": "policy", "finish_reason": "stop", "scope": "task",
         "zone": "do", "fault": "task", "context": "bare", "loss": "policy"}  # fmt: skip


def seed(url: str) -> dict[str, int]:
    """One row in every table the schema has now, each column given a plausible value; the
    row counts."""
    engine = create_engine(url)
    metadata = MetaData()
    metadata.reflect(engine)
    with engine.begin() as connection:
        for table in metadata.sorted_tables:
            if table.name == "alembic_version":
                continue
            connection.execute(insert(table).values({c.name: _value(c) for c in table.columns}))
        counts = {
            table.name: connection.scalar(select(func.count()).select_from(table))
            for table in metadata.sorted_tables
        }
    engine.dispose()
    return counts


def _value(column):  # noqa: ANN001, ANN202 - any reflected column
    kind = column.type
    if column.name in NAMED and isinstance(kind, String):
        return NAMED[column.name]
    if isinstance(kind, Boolean):
        return False
    if isinstance(kind, Integer):
        return 0 if column.name == "pivot_tokens" else 1
    if isinstance(kind, Float):
        return 0.5
    if isinstance(kind, DateTime):
        return dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    if isinstance(kind, LargeBinary):
        return b""
    if isinstance(kind, JSON):
        return JSONS.get(column.name, {} if column.name in DICT_COLUMNS else [])
    if isinstance(kind, String) and getattr(kind, "length", None):
        return "x"[: kind.length]
    return "x"


def rows(url: str) -> dict[str, int]:
    engine = create_engine(url)
    metadata = MetaData()
    metadata.reflect(engine)
    with engine.connect() as connection:
        counts = {
            table.name: connection.scalar(select(func.count()).select_from(table))
            for table in metadata.sorted_tables
        }
    engine.dispose()
    return counts


@pytest.mark.parametrize("revision", REVISIONS)
def test_every_earlier_revision_with_data_upgrades_with_nothing_lost(
    db_url: str, revision: str
) -> None:
    database.migrate(db_url, target=revision)
    before = seed(db_url)
    with pytest.raises(StoreError, match=f"at schema {revision}.*run `flywheel migrate"):
        store.open_store(db_url)
    assert database.migrate(db_url) == (revision, database.head())
    after = rows(db_url)
    for table, count in before.items():
        if table != "alembic_version" and table in after:
            assert after[table] >= count, table
    with store.transaction(store.open_store(db_url)) as session:  # the data reads back
        assert len(store.load_groups(session, "train")) == before.get("rollout_group", 0)
        store.policy_versions(session)


def test_a_store_newer_than_the_code_is_refused_with_one_line(db_url: str, capsys) -> None:
    engine = store.open_store(db_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(StoreError, match="at schema 9999, newer than this flywheel"):
        store.open_store(db_url)
    assert main(["migrate", "--db", db_url]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flywheel: error:") and "upgrade flywheel" in err and "\n" not in err


def test_migrate_reports_what_it_did_and_is_idempotent(tmp_path: Path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    database.migrate(url, target="0005")
    assert main(["migrate", "--db", url]) == 0
    assert f"0005 -> {database.head()}" in capsys.readouterr().out
    assert main(["migrate", "--db", url]) == 0
    assert f"already at {database.head()}" in capsys.readouterr().out


def test_processes_that_migrate_at_once_do_it_once(db_url: str, tmp_path: Path) -> None:
    database.migrate(db_url, target="0001")
    seed(db_url)
    script = "import sys; from memory import database; print(database.migrate(sys.argv[1]))"
    processes = [
        subprocess.Popen([sys.executable, "-c", script, db_url], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    head = database.head()
    assert sorted(outputs).count(f"('0001', '{head}')") == 1  # one did the work
    assert sorted(outputs).count(f"('{head}', '{head}')") == 3  # the others found it done
