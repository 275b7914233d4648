"""How one batch is collected: the one settings object of agents/, built by flows and passed
down (a worker receives it in each work item's plan)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agents.strategy import StrategySettings
from memory.records import Annealing
from verifiers.catalog import system_prompt
from verifiers.guard import Guard
from verifiers.task import Task

GroupSize = Annotated[int, Field(ge=1, description="attempts per task (a GRPO group)")]
Temperature = Annotated[float, Field(ge=0.0, description="sampling temperature of train attempts")]
GuidedFraction = Annotated[
    float, Field(ge=0.0, le=1.0, description="share of each group sampled with a worked example")
]


class RetrySettings(BaseModel):
    """R3L: a failed attempt is reflected on, and retried from the point where it failed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="reflect on failed attempts and retry (R3L)")
    reflection: Literal["full", "brief"] = Field(
        "brief",
        description="what a reflection holds: the principle alone (brief: a quarter of the "
        "reviewer's tokens, and more tasks solved), or summary, root cause, outcome and principle",
    )
    pivot: bool = Field(
        True,
        description="a one-step answer of several lines is retried from the first step the "
        "reflection finds wrong, its earlier lines kept token for token; off: from scratch",
    )


class ReviseSettings(BaseModel):
    """HeRL: the reviewer revises the best attempt of a failed group (`agents.revision`), and
    a revision the verifier passes is trained off-policy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        False,
        description="the reviewer revises the best attempt of a group that all failed, and a "
        "revision the verifier passes is trained off-policy (HeRL)",
    )
    revisions: int = Field(
        1,
        ge=1,
        description="HeRL: the reviewer draws this many revisions of a failed group's best "
        "attempt, and the best one the verifier passes is trained",
    )
    temperature: float = Field(0.3, ge=0.0, description="HeRL: the reviewer's temperature")
    partial: bool = Field(
        False,
        description="HeRL: also revise a group some of whose first attempts reached full "
        "reward (its best attempt that did not); a verified revision then joins the successes",
    )
    blind: bool = Field(
        False,
        description="HeRL: the reviewer is not shown the failed attempt and answers the task "
        "afresh (a small reviewer tends to copy the wrong answer it is shown)",
    )


class AnnealSettings(BaseModel):
    """EAD: first attempts sampled with the temperature annealed over their tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        False,
        description="sample first attempts with the temperature annealed over their tokens, "
        "from 1.2 to 0.1 (EAD)",
    )
    schedule: Annealing = Annealing()


class CollectSettings(BaseModel):
    """How one batch is sampled, each method's settings in a table of their own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: GroupSize = 4
    temperature: Temperature = 1.0
    max_tokens: int = Field(128, ge=1)
    system_prompt: str | None = None  # None: the task set's own
    guided_fraction: GuidedFraction = 0.0
    strategy: StrategySettings = StrategySettings()  # SGE (agents.strategy)
    retry: RetrySettings = RetrySettings()  # R3L (agents.reflection)
    insights: bool = Field(False, description="sequential attempts with judged insights (RLTLDR)")
    anneal: AnnealSettings = AnnealSettings()  # EAD (agents.annealing)
    revise: ReviseSettings = ReviseSettings()  # HeRL (agents.revision)
    nudge: bool = Field(
        False,
        description="the reviewer writes a hint for a group that all failed, the policy tries "
        "again with it, and its successes are distilled into the bare prompt (NudgeRL)",
    )
    guard: Guard = Field(
        Guard(),
        description="limits on the task set's own code (verifier, environment, sandbox): a "
        "call past deadline_s, or one that raises, is the task's failure; answers longer than "
        "max_chars are wrong unread",
    )
    lessons: tuple[str, ...] = ()  # library lessons for the guided slots, not the demo
    own_examples: bool = Field(
        False,
        description="the guided slots show the policy's own verified answer to the most similar "
        "task it already solved (in earlier rounds, or earlier in the batch), instead of the "
        "task set's worked example",
    )
    example: tuple[str, str] | None = None  # the guided slots' example; None: the task set's

    @model_validator(mode="after")
    def _one_schedule(self) -> CollectSettings:
        if self.anneal.enabled and self.strategy.enabled:
            raise ValueError("anneal and sge both set an attempt's temperatures: choose one")
        return self

    @property
    def annealing(self) -> Annealing | None:
        """EAD's schedule, when it is on."""
        return self.anneal.schedule if self.anneal.enabled else None

    def system(self, task: Task) -> str:
        return self.system_prompt or system_prompt(task.taskset)

    def guided_slots(self) -> int:
        return round(self.group_size * self.guided_fraction)
