"""A verdict: what the verifier concluded about one completion."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Verdict(BaseModel):
    """Score and reasons for one completion.

    `correct` is correctness under lenient extraction (used for pass@1); `format_ok` says the
    answer came from exactly one non-empty answer-tag pair; `reward` is what training sees.
    """

    model_config = ConfigDict(frozen=True)
    schema_version: int = 1

    reward: float
    correct: bool
    format_ok: bool
    answer: str | None
    reason: str
