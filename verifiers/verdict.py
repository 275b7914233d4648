"""A verdict: what the verifier concluded about one completion."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

FULL_REWARD = 1.0  # a complete, correct answer; the same value as memory.records.FULL_REWARD


class Verdict(BaseModel):
    """Score and reasons for one completion.

    `correct` is correctness under lenient extraction (used for pass@1); `format_ok` says the
    answer came in the task set's required format; `reward` is what training sees; `feedback`
    says what passed and what failed, a line each, for reflections and insights.
    """

    model_config = ConfigDict(frozen=True)
    schema_version: int = 1

    reward: float
    correct: bool
    format_ok: bool
    answer: str | None
    reason: str
    feedback: tuple[str, ...] = ()

    def scores(self) -> dict[str, Any]:
        """What an attempt records of this verdict besides its reason (which the caller may
        extend): reward, correctness, format, answer and the private feedback."""
        return {
            "reward": self.reward,
            "correct": self.correct,
            "format_ok": self.format_ok,
            "answer": self.answer,
            "feedback": list(self.feedback),
        }
