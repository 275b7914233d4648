"""A task: one verifiable problem, with the private reference answer kept beside it."""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict

Split = Literal["train", "eval"]


class Task(BaseModel):
    """A frozen task record. `answer` is for the verifier only and never enters a prompt."""

    model_config = ConfigDict(frozen=True)
    schema_version: int = 1

    task_id: str
    taskset: str
    split: Split
    question: str
    answer: str


def task_id(taskset: str, question: str) -> str:
    """A task's id: its task set and a hash of its question, so the same question is one task."""
    return f"{taskset}:{hashlib.sha256(question.encode()).hexdigest()[:16]}"
