"""steps, token segments, strategies, verdicts, reflections, evidence; group plans

Completion token ids and logprobs move from the attempt into packed segments by loss type, and
strategy texts into their own table. Existing attempts are converted: each becomes one step,
its segments cut at its forced spans and its pivot. The cutting, packing and fingerprinting
are written out here rather than imported from `memory`, so this migration converts the same
way however that code changes later.

Revision ID: 0007
Revises: 0006
"""

import hashlib
import json
import re
import sys
from array import array
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _attempt_id() -> sa.Column:
    return sa.Column(
        "attempt_id", sa.Integer(), sa.ForeignKey("attempt.id", ondelete="CASCADE"), nullable=False
    )


def upgrade() -> None:
    # The old token columns are parked in a side table first: on SQLite, dropping columns
    # rebuilds the attempt table, which would cascade into any table that references it.
    op.execute(
        "CREATE TABLE attempt_0006 AS SELECT id, completion_token_ids, logprobs, forced_spans,"
        " strategy FROM attempt"
    )
    op.create_table(
        "strategy",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("taskset", sa.String(100), nullable=False),
        sa.Column("fingerprint", sa.String(32), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.UniqueConstraint("taskset", "fingerprint"),
    )
    with op.batch_alter_table("attempt") as batch:
        for column in ("completion_token_ids", "logprobs", "forced_spans", "strategy"):
            batch.drop_column(column)
        batch.add_column(sa.Column("strategy_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("turns", sa.Integer(), nullable=False, server_default="1"))
        batch.create_foreign_key("fk_attempt_strategy", "strategy", ["strategy_id"], ["id"])
        batch.create_index("ix_attempt_strategy_id", ["strategy_id"])
    with op.batch_alter_table("rollout_group") as batch:
        batch.add_column(sa.Column("plan", sa.JSON(), nullable=True))
    _create_tables()
    _convert(op.get_bind())
    op.drop_table("attempt_0006")


def downgrade() -> None:
    raise NotImplementedError("0007 moves token ids into segments; restore a backup instead")


def _create_tables() -> None:
    op.create_table(
        "step",
        sa.Column("id", sa.Integer(), primary_key=True),
        _attempt_id(),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("observation", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("replayed", sa.Boolean(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("outcome", sa.Float(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("strategy_temperature", sa.Float(), nullable=True),
        sa.UniqueConstraint("attempt_id", "step_index"),
    )
    op.create_table(
        "segment",
        sa.Column("id", sa.Integer(), primary_key=True),
        _attempt_id(),
        sa.Column("segment_index", sa.Integer(), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("start", sa.Integer(), nullable=False),
        sa.Column("loss", sa.String(10), nullable=False),
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("advantage", sa.Float(), nullable=True),
        sa.UniqueConstraint("attempt_id", "segment_index"),
    )
    op.create_table(
        "verdict",
        sa.Column("id", sa.Integer(), primary_key=True),
        _attempt_id(),
        sa.Column("verifier", sa.String(100), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("correct", sa.Boolean(), nullable=False),
        sa.Column("format_ok", sa.Boolean(), nullable=False),
        sa.Column("feedback", sa.JSON(), nullable=False),
        sa.UniqueConstraint("attempt_id"),
    )
    op.create_table(
        "reflection",
        sa.Column("id", sa.Integer(), primary_key=True),
        _attempt_id(),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("target_index", sa.Integer(), nullable=True),
        sa.Column("valid", sa.Boolean(), nullable=False),
        sa.Column("fields", sa.JSON(), nullable=False),
        sa.Column("led_to_success", sa.Boolean(), nullable=True),
        sa.UniqueConstraint("attempt_id"),
    )
    op.create_table(
        "experience_evidence",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("entry_id", sa.Integer(), sa.ForeignKey("experience_entry.id"), nullable=False),
        sa.Column("source", sa.String(300), nullable=False),
        sa.UniqueConstraint("source"),
    )
    op.create_index("ix_experience_evidence_entry_id", "experience_evidence", ["entry_id"])


def _convert(bind: sa.Connection) -> None:
    """Existing attempts into steps, segments, verdicts, reflections and strategy links."""
    meta = sa.MetaData()
    names = ("attempt", "rollout_group", "strategy", "step", "segment")
    tables = {name: sa.Table(name, meta, autoload_with=bind) for name in names}
    parked = ("completion_token_ids", "logprobs", "forced_spans", "strategy")  # JSON text or values
    tables["attempt_0006"] = sa.Table(
        "attempt_0006", meta, sa.Column("id", sa.Integer), *(sa.Column(n, sa.Text) for n in parked)
    )
    tables |= {name: sa.Table(name, meta, autoload_with=bind) for name in ("verdict", "reflection")}
    attempt, old, group = tables["attempt"], tables["attempt_0006"], tables["rollout_group"]
    query = (
        sa.select(attempt, group.c.taskset, *(c for c in old.c if c.name != "id"))
        .join(group, attempt.c.group_id == group.c.id)
        .join(old, old.c.id == attempt.c.id)
    )
    strategies: dict[tuple[str, str], int] = {}
    for row in bind.execute(query).mappings().all():
        _convert_attempt(bind, tables, row, strategies)


def _convert_attempt(
    bind: sa.Connection, tables: dict[str, sa.Table], row: Any, strategies: dict[Any, int]
) -> None:
    attempt_id, kind = row["id"], row["kind"]
    if row["strategy"]:
        key = (row["taskset"], _fingerprint(row["strategy"]))
        if key not in strategies:
            values = {"taskset": key[0], "fingerprint": key[1], "text": row["strategy"]}
            inserted = bind.execute(tables["strategy"].insert().values(**values))
            strategies[key] = inserted.inserted_primary_key[0]
        attempt = tables["attempt"]
        change = attempt.update().where(attempt.c.id == attempt_id)
        bind.execute(change.values(strategy_id=strategies[key]))
    ids = _json(row["completion_token_ids"])
    if ids is None:
        return
    logprobs = _json(row["logprobs"]) or [0.0] * len(ids)
    spans = [tuple(span) for span in _json(row["forced_spans"]) or []]
    sampling = _json(row["sampling"]) or {}
    for index, (start, end, loss) in enumerate(_pieces(len(ids), spans, row["pivot_tokens"])):
        bind.execute(
            tables["segment"]
            .insert()
            .values(
                attempt_id=attempt_id,
                segment_index=index,
                step_index=0,
                start=start,
                loss=loss,
                token_ids=_pack("i", ids[start:end]),
                logprobs=_pack("d", logprobs[start:end]),
                temperature=None if loss == "forced" else sampling.get("temperature"),
                weight=1.0 if loss == "policy" else 0.0,
            )
        )
    messages = _json(row["messages"]) or []
    users = [m for m in messages if m.get("role") == "user"]
    bind.execute(
        tables["step"]
        .insert()
        .values(
            attempt_id=attempt_id,
            step_index=0,
            observation=str(users[-1].get("content") or "") if users else "",
            action=row["completion"] or "",
            replayed=False,
            reward=row["reward"],
            outcome=row["reward"],
            temperature=sampling.get("temperature"),
            strategy_temperature=sampling.get("strategy_temperature"),
        )
    )
    if kind in ("base", "guided", "retry") and row["error"] is None:
        bind.execute(
            tables["verdict"]
            .insert()
            .values(
                attempt_id=attempt_id,
                verifier=row["taskset"],
                score=row["reward"],
                correct=row["correct"],
                format_ok=row["format_ok"],
                feedback=[],
            )
        )
    if kind in ("reflection", "insight"):
        bind.execute(
            tables["reflection"]
            .insert()
            .values(
                attempt_id=attempt_id,
                kind=kind,
                target_index=row["parent_index"],
                valid=row["format_ok"],
                fields=_fields(row["completion"]) if row["format_ok"] else {},
                led_to_success=row["improved"],
            )
        )


def _pieces(length: int, spans: list[tuple[int, int]], pivot: int) -> list[tuple[int, int, str]]:
    cuts = {0, length, *(point for span in spans for point in span)}
    if not any(start < pivot < end for start, end in spans):
        cuts.add(min(pivot, length))
    bounds = sorted(cuts)
    pieces = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        if any(s <= start and end <= e for s, e in spans):
            pieces.append((start, end, "forced"))
        else:
            pieces.append((start, end, "pivot" if end <= pivot else "policy"))
    return pieces


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _fields(text: str | None) -> dict[str, Any]:
    try:
        fields = json.loads(text or "")
    except json.JSONDecodeError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _pack(code: str, values: list[Any]) -> bytes:
    packed = array(code, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _fingerprint(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:32]
