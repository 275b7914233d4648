"""Multi-turn environments: the records they exchange and the contract they keep.

An environment is built from a seed, so it is fully determined by (seed, actions so far):
`replay(actions[:k])` rebuilds the state after step k, which is what reflect-then-retry needs to
resume from a pivot. `step` never raises on model output: a malformed, forbidden or repeated
action ends the episode with a status and no reward. `verdict` scores from the environment's own
state, never from what the model or a tool result says about it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol, Self

from pydantic import BaseModel, ConfigDict

from verifiers.verdict import Verdict


class EpisodeStatus(StrEnum):
    RUNNING = "running"
    SOLVED = "solved"
    FINISHED = "finished"  # the agent ended the episode; the verdict says how well
    INVALID = "invalid"
    REPEATED = "repeated"
    STEP_LIMIT = "step-limit"


class Observation(BaseModel):
    """What the agent sees after a step: messages to append, and whether the episode ended."""

    model_config = ConfigDict(frozen=True)
    schema_version: int = 1

    messages: tuple[dict[str, Any], ...]
    status: EpisodeStatus = EpisodeStatus.RUNNING
    reason: str = ""

    @property
    def done(self) -> bool:
        return self.status is not EpisodeStatus.RUNNING


class Environment(Protocol):
    max_steps: int

    def reset(self) -> list[dict[str, Any]]:
        """The opening messages (system and user) of a fresh episode."""
        ...

    def step(self, action: dict[str, Any]) -> Observation:
        """Apply one assistant message (content and optional OpenAI tool_calls)."""
        ...

    def verdict(self) -> Verdict: ...

    def replay(self, actions: list[dict[str, Any]]) -> Self:
        """A fresh copy of this environment with `actions` applied."""
        ...
