"""Settings for `flywheel run`: one typed object, built by the CLI and passed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agents.collector import CollectSettings
from serving.promotion import Gate
from trainer.settings import TrainSettings

DEFAULT_WORKDIR = Path(".flywheel")


class RunSettings(BaseModel):
    """What one `flywheel run` does. Defaults finish in about 15 minutes on 2 CPU cores."""

    model_config = ConfigDict(frozen=True)

    rounds: int = Field(3, ge=1)
    tasks: int = Field(32, ge=1, description="train tasks per round")
    group_size: int = Field(4, ge=2)
    eval_tasks: int = Field(64, ge=1, description="held-out tasks, never trained on")
    taskset: str = "arithmetic"
    db_url: str = f"sqlite:///{DEFAULT_WORKDIR}/flywheel.db"
    workdir: Path = DEFAULT_WORKDIR
    temperature: float = Field(0.7, ge=0.0)
    max_tokens: int = Field(128, ge=1)
    concurrency: int = Field(64, ge=1, description="requests in flight to the model server")
    train: TrainSettings = TrainSettings()
    gate: Gate = Gate()

    @property
    def checkpoint_root(self) -> Path:
        return self.workdir / "adapters"

    def collect_settings(self) -> CollectSettings:
        return CollectSettings(
            group_size=self.group_size, temperature=self.temperature, max_tokens=self.max_tokens
        )

    def eval_settings(self) -> CollectSettings:
        """Held-out evaluation: one greedy sample per task, no guidance in context."""
        return CollectSettings(group_size=1, temperature=0.0, max_tokens=self.max_tokens)
