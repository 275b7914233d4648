"""How one batch is collected: the one settings object of agents/, built by flows and passed
down (a worker receives it in each work item's plan)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agents.strategy import StrategySettings
from memory.records import Annealing
from verifiers.catalog import system_prompt
from verifiers.guard import Guard
from verifiers.task import Task


class CollectSettings(BaseModel):
    """How one batch is sampled."""

    model_config = ConfigDict(frozen=True)

    group_size: int = 4
    temperature: float = 1.0
    max_tokens: int = 128
    system_prompt: str | None = None  # None: the task set's own
    guided_fraction: float = Field(0.0, ge=0.0, le=1.0)
    reflect_retry: bool = False
    reflection: Literal["full", "brief"] = "brief"  # brief: the principle alone
    insights: bool = False
    annealing: Annealing | None = None  # EAD: first attempts' temperature over their tokens
    revise: bool = False  # HeRL: the reviewer revises a group's best failure (agents.revision)
    revisions: int = Field(1, ge=1)  # HeRL: the reviewer's draws of one revision
    revise_temperature: float = Field(0.3, ge=0.0)  # HeRL: the reviewer's temperature
    revise_partial: bool = False  # HeRL: also revise a group that only partly failed
    revise_blind: bool = False  # HeRL: the reviewer answers afresh, not shown the failure
    nudge: bool = False  # NudgeRL: a reviewer's hint for a group that all failed (agents.nudge)
    strategy: StrategySettings | None = None
    guard: Guard = Guard()  # the deadline and input limit on the task set's own code
    lessons: tuple[str, ...] = ()  # library lessons for the guided slots, not the demo

    def system(self, task: Task) -> str:
        return self.system_prompt or system_prompt(task.taskset)

    def guided_slots(self) -> int:
        return round(self.group_size * self.guided_fraction)
