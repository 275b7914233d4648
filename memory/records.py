"""Typed, frozen records that cross package boundaries. Rows leave the store as these.

Every record carries a schema version. A `Sample` is exactly what the server returned, so training
uses the sampled token ids and their behaviour logprobs, never re-tokenised text.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AttemptKind = Literal["base"]
GroupPurpose = Literal["train", "eval", "capture"]


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, from_attributes=True)
    schema_version: int = 1


class Sample(Record):
    """One completion as sampled: the prompt and completion token ids and their logprobs."""

    text: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        if len(self.logprobs) != len(self.completion_token_ids):
            raise ValueError("logprobs and completion token ids differ in length")
        return self


class SamplingSettings(Record):
    temperature: float
    max_tokens: int
    top_p: float = 1.0


class PolicyVersion(Record):
    """A servable policy: the base model, or a LoRA adapter trained in some round."""

    name: str
    base_model: str
    parent: str | None = None
    adapter_path: str | None = None
    round_index: int = 0
    promoted: bool = False
    promoted_at: datetime | None = None
    eval_pass_at_1: float | None = None


class Attempt(Record):
    """One rollout of one task: the messages, what was sampled, and the verifier's verdict.

    A failed rollout (server error, timeout) is data: `error` says why and reward is 0.
    """

    sample_index: int
    kind: AttemptKind = "base"
    policy_version: str
    messages: list[dict[str, Any]]
    sampling: SamplingSettings
    sample: Sample | None
    reward: float
    correct: bool
    format_ok: bool
    answer: str | None
    reason: str
    error: str | None = None


class Group(Record):
    """All attempts of one task under one policy version in one round: the GRPO unit."""

    round_index: int
    purpose: GroupPurpose
    task_id: str
    taskset: str
    question: str
    policy_version: str
    size: int = Field(ge=1)
    attempts: list[Attempt]

    @property
    def complete(self) -> bool:
        """Trainable only when every slot holds an attempt and none failed for infrastructure."""
        indices = {a.sample_index for a in self.attempts}
        no_errors = all(a.error is None for a in self.attempts)
        return indices == set(range(self.size)) and no_errors


class TrainingRound(Record):
    round_index: int
    method: str
    policy_in: str
    policy_out: str | None
    status: Literal["running", "done", "failed", "skipped"]
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)


class AliasEvent(Record):
    alias: str
    action: Literal["promote", "rollback", "refuse"]
    from_version: str | None
    to_version: str | None
    reason: str = ""
