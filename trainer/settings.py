"""Training-round hyperparameters: one typed object, importable without torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class TrainSettings(BaseModel):
    """Hyperparameters of a round. Defaults are sized for SmolLM2-135M on 2 CPU cores."""

    model_config = ConfigDict(frozen=True)

    learning_rate: float = 1e-4
    lora_rank: int = 16
    lora_alpha: int = 32
    epochs: int = 2
    batch_size: int = 8
    max_length: int = 512
    is_cap: float = 2.0
    seed: int = 0
    device: str = "auto"
