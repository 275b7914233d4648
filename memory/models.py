"""SQLAlchemy tables. The schema itself is created by the Alembic migrations in `migrations/`.

Natural keys carry unique constraints so that every write is an idempotent upsert: a group is
(round, purpose, task, policy version); an attempt is (group, sample index, kind).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy import UniqueConstraint as Unique
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def _now() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class PolicyVersionRow(Base):
    __tablename__ = "policy_version"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    base_model: Mapped[str] = mapped_column(String(500))
    parent: Mapped[str | None] = mapped_column(String(200))
    adapter_path: Mapped[str | None] = mapped_column(Text)
    weights_path: Mapped[str | None] = mapped_column(Text)
    round_index: Mapped[int] = mapped_column(Integer, default=0)
    promoted: Mapped[bool] = mapped_column(Boolean, default=False)
    promoted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    eval_pass_at_1: Mapped[float | None] = mapped_column(Float)
    scorecards: Mapped[list[Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class TrainingRoundRow(Base):
    __tablename__ = "training_round"

    id: Mapped[int] = mapped_column(primary_key=True)
    round_index: Mapped[int] = mapped_column(Integer, unique=True)
    method: Mapped[str] = mapped_column(String(50))
    policy_in: Mapped[str] = mapped_column(String(200))
    policy_out: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20))
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(default=dict)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    group_ids: Mapped[list[Any] | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class RolloutGroupRow(Base):
    __tablename__ = "rollout_group"
    __table_args__ = (Unique("round_index", "purpose", "task_id", "policy_version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    round_index: Mapped[int] = mapped_column(Integer, index=True)
    purpose: Mapped[str] = mapped_column(String(20))
    task_id: Mapped[str] = mapped_column(String(200))
    taskset: Mapped[str] = mapped_column(String(100))
    question: Mapped[str] = mapped_column(Text)
    policy_version: Mapped[str] = mapped_column(String(200))
    size: Mapped[int] = mapped_column(Integer)
    complete: Mapped[bool] = mapped_column(Boolean, default=False)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    plan: Mapped[dict[str, Any] | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)

    attempts: Mapped[list[AttemptRow]] = relationship(
        back_populates="group", order_by="AttemptRow.sample_index"
    )


class AttemptRow(Base):
    __tablename__ = "attempt"
    __table_args__ = (Unique("group_id", "sample_index", "kind"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    group_id: Mapped[int] = mapped_column(ForeignKey("rollout_group.id", ondelete="CASCADE"))
    sample_index: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(30))
    policy_version: Mapped[str] = mapped_column(String(200))
    messages: Mapped[list[Any]] = mapped_column()
    sampling: Mapped[dict[str, Any]] = mapped_column()
    completion: Mapped[str | None] = mapped_column(Text)
    prompt_token_ids: Mapped[list[Any] | None] = mapped_column()
    finish_reason: Mapped[str | None] = mapped_column(String(30))
    reward: Mapped[float] = mapped_column(Float)
    correct: Mapped[bool] = mapped_column(Boolean)
    format_ok: Mapped[bool] = mapped_column(Boolean)
    answer: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    context: Mapped[str] = mapped_column(String(50), default="bare")
    guidance: Mapped[str | None] = mapped_column(Text)
    bare_prompt_token_ids: Mapped[list[Any] | None] = mapped_column()
    parent_index: Mapped[int | None] = mapped_column(Integer)
    pivot_tokens: Mapped[int] = mapped_column(Integer, default=0)
    improved: Mapped[bool | None] = mapped_column(Boolean)
    shaped_reward: Mapped[float | None] = mapped_column(Float)
    shaping: Mapped[dict[str, Any] | None] = mapped_column()
    strategy_id: Mapped[int | None] = mapped_column(ForeignKey("strategy.id"), index=True)
    turns: Mapped[int] = mapped_column(Integer, default=1)
    generated_tokens: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)

    group: Mapped[RolloutGroupRow] = relationship(back_populates="attempts")
    strategy: Mapped[StrategyRow | None] = relationship()
    segments: Mapped[list[SegmentRow]] = relationship(order_by="SegmentRow.segment_index")
    verdict: Mapped[VerdictRow | None] = relationship()


class StrategyRow(Base):
    """A distinct strategy text (SGE) of a task set; attempts sampled under it point here."""

    __tablename__ = "strategy"
    __table_args__ = (Unique("taskset", "fingerprint"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    taskset: Mapped[str] = mapped_column(String(100))
    fingerprint: Mapped[str] = mapped_column(String(32))
    text: Mapped[str] = mapped_column(Text)


class StepRow(Base):
    """One turn of an attempt: observation, action, reward, and whether it was replayed."""

    __tablename__ = "step"
    __table_args__ = (Unique("attempt_id", "step_index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempt.id", ondelete="CASCADE"))
    step_index: Mapped[int] = mapped_column(Integer)
    observation: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(Text)
    replayed: Mapped[bool] = mapped_column(Boolean, default=False)
    reward: Mapped[float | None] = mapped_column(Float)
    outcome: Mapped[float] = mapped_column(Float)
    temperature: Mapped[float | None] = mapped_column(Float)
    strategy_temperature: Mapped[float | None] = mapped_column(Float)


class SegmentRow(Base):
    """A span of an attempt's completion tokens with one loss type; ids and behaviour logprobs
    packed as little-endian int32 and float64 (`memory.trajectory`)."""

    __tablename__ = "segment"
    __table_args__ = (Unique("attempt_id", "segment_index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempt.id", ondelete="CASCADE"))
    segment_index: Mapped[int] = mapped_column(Integer)
    step_index: Mapped[int] = mapped_column(Integer)
    start: Mapped[int] = mapped_column(Integer)
    loss: Mapped[str] = mapped_column(String(10))
    token_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    temperature: Mapped[float | None] = mapped_column(Float)
    weight: Mapped[float] = mapped_column(Float)
    advantage: Mapped[float | None] = mapped_column(Float)


class VerdictRow(Base):
    """The verifier's output for an attempt; `feedback` is private and never prompted."""

    __tablename__ = "verdict"

    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(
        ForeignKey("attempt.id", ondelete="CASCADE"), unique=True
    )
    verifier: Mapped[str] = mapped_column(String(100))
    score: Mapped[float] = mapped_column(Float)
    correct: Mapped[bool] = mapped_column(Boolean)
    format_ok: Mapped[bool] = mapped_column(Boolean)
    feedback: Mapped[list[Any]] = mapped_column()


class ReflectionRow(Base):
    """A reflection or insight, its JSON fields, and whether it led to a better retry."""

    __tablename__ = "reflection"

    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(
        ForeignKey("attempt.id", ondelete="CASCADE"), unique=True
    )
    kind: Mapped[str] = mapped_column(String(20))
    target_index: Mapped[int | None] = mapped_column(Integer)
    valid: Mapped[bool] = mapped_column(Boolean)
    fields: Mapped[dict[str, Any]] = mapped_column()
    led_to_success: Mapped[bool | None] = mapped_column(Boolean)


class OutcomeCountRow(Base):
    """How often each final answer (its key) has been seen for a task, over all training."""

    __tablename__ = "outcome_count"
    __table_args__ = (Unique("task_id", "answer_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[str] = mapped_column(String(200))
    answer_key: Mapped[str] = mapped_column(String(200))
    count: Mapped[int] = mapped_column(Integer, default=0)


class AliasEventRow(Base):
    """Every move of a serving alias: promote, rollback, or a gate refusal."""

    __tablename__ = "alias_event"

    id: Mapped[int] = mapped_column(primary_key=True)
    alias: Mapped[str] = mapped_column(String(100), index=True)
    action: Mapped[str] = mapped_column(String(20))
    from_version: Mapped[str | None] = mapped_column(String(200))
    to_version: Mapped[str | None] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class ActionRow(Base):
    """A person's action on the flywheel from its page, and who took it."""

    __tablename__ = "action"

    id: Mapped[int] = mapped_column(primary_key=True)
    actor: Mapped[str] = mapped_column(String(100))
    action: Mapped[str] = mapped_column(String(30))
    target: Mapped[str] = mapped_column(String(400))
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now, index=True)


class WorkItemRow(Base):
    """A task of a collection batch, queued for workers; claimed under a lease."""

    __tablename__ = "work_item"
    __table_args__ = (Unique("round_index", "purpose", "policy_version", "task_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    round_index: Mapped[int] = mapped_column(Integer)
    purpose: Mapped[str] = mapped_column(String(20))
    policy_version: Mapped[str] = mapped_column(String(200))
    task_id: Mapped[str] = mapped_column(String(200))
    plan: Mapped[dict[str, Any]] = mapped_column()
    state: Mapped[str] = mapped_column(String(20), default="queued", index=True)
    owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    claims: Mapped[int] = mapped_column(Integer, default=0)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    not_before: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    fault: Mapped[str | None] = mapped_column(String(10))
    abandoned: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class LessonRow(Base):
    """The experience library: every kind of guidance, by scope and zone."""

    __tablename__ = "experience_entry"
    __table_args__ = (Unique("scope", "scope_key", "zone", "fingerprint"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(20))
    scope: Mapped[str] = mapped_column(String(20))
    scope_key: Mapped[str] = mapped_column(String(200))
    zone: Mapped[str] = mapped_column(String(10))
    text: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(Text, default="")
    fingerprint: Mapped[str] = mapped_column(String(32))
    embedding: Mapped[bytes | None] = mapped_column(LargeBinary)
    evidence: Mapped[int] = mapped_column(Integer, default=1)
    utility: Mapped[float] = mapped_column(Float, default=0.0)
    exposures: Mapped[int] = mapped_column(Integer, default=0)
    negative_windows: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(10), default="active", index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class LessonUseRow(Base):
    """A lesson shown in the prompt of a group's attempts: where it was used."""

    __tablename__ = "experience_use"
    __table_args__ = (Unique("entry_id", "group_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    lesson_id: Mapped[int] = mapped_column("entry_id", ForeignKey("experience_entry.id"))
    group_id: Mapped[int] = mapped_column(ForeignKey("rollout_group.id"))
    rank: Mapped[int] = mapped_column(Integer)
    similarity: Mapped[float | None] = mapped_column(Float)
    gain: Mapped[float | None] = mapped_column(Float)


class LessonEvidenceRow(Base):
    """Each piece of evidence a lesson was built from, once: re-curating a round adds none."""

    __tablename__ = "experience_evidence"

    id: Mapped[int] = mapped_column(primary_key=True)
    lesson_id: Mapped[int] = mapped_column(
        "entry_id", ForeignKey("experience_entry.id"), index=True
    )
    source: Mapped[str] = mapped_column(String(300), unique=True)


class LibraryEventRow(Base):
    """Every change to the library, with the lesson's fields before and after."""

    __tablename__ = "library_event"

    id: Mapped[int] = mapped_column(primary_key=True)
    lesson_id: Mapped[int] = mapped_column(
        "entry_id", ForeignKey("experience_entry.id"), index=True
    )
    action: Mapped[str] = mapped_column(String(20))
    before: Mapped[dict[str, Any]] = mapped_column()
    after: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
