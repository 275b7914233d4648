"""Training-round hyperparameters: one typed object, importable without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from memory.records import AdvantageMode


class TrainSettings(BaseModel):
    """Hyperparameters of a round. Defaults are sized for SmolLM2-135M on 2 CPU cores."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: AdvantageMode = Field(
        "filtered",
        description="advantage mode of each training round: grpo, r3l, filtered (r - mean, "
        "rows filtered to a positive ratio: RLTLDR without its insights) or rltldr (the same "
        "and the insights the run collected, as SFT rows)",
    )
    amplification: float = Field(3.0, ge=0.0, description="R3L's alpha")
    positive_ratio: float = Field(
        0.75, gt=0.0, lt=1.0, description="the positive-ratio filter of filtered and rltldr"
    )
    insight_weight: float = Field(0.5, ge=0.0, description="RLTLDR's lambda on insight SFT")
    distill_guided: bool = True
    distill_negatives: bool = Field(
        False, description="also train failed guided samples under the bare prompt"
    )
    learning_rate: float = Field(3e-4, gt=0.0, description="LoRA learning rate")
    lora_rank: int = 16
    lora_alpha: int = 32
    epochs: int = Field(1, ge=1, description="passes over a round's rows")
    batch_size: int = Field(8, ge=1, description="rows an optimizer step learns from")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="rows a forward and backward pass takes at once, the step's gradients summed "
        "over its micro-batches and its loss still the token mean of the whole batch: the same "
        "step in less memory, as activations grow with the rows a pass holds (unset: the whole "
        "batch at once)",
    )
    batch_order: Literal["length", "random"] = Field(
        "random",
        description="random: the trainer shuffles the rows; length: batches of rows of near "
        "length, in a random order (7% padding, a 10% shorter round, but each batch's token "
        "mean then weighs short rows more, and it is not shown to learn as well)",
    )
    max_length: int = 512
    is_cap: float = 2.0
    clip: float | None = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="PPO's trust region on sampled tokens: no gradient to a token already "
        "pushed past 1 +- clip from its sampling probability in its advantage's direction",
    )
    shaping_gamma: float = Field(0.1, gt=0.0, description="HeRL's gamma on off-policy rows")
    revision_bonus: float = Field(0.05, ge=0.0, description="HeRL's bonus to a revised attempt")
    revision_weight: Literal["shaped", "distill"] = Field(
        "shaped",
        description="how a verified revision is weighted: HeRL's shaped off-policy weight, or "
        "as a distill copy (its advantage alone, like a guided success under the bare prompt)",
    )
    step_weight: float = Field(
        0.0,
        ge=0.0,
        description="SLEA-RL's w: in a group of episodes, each turn's tokens add w times the "
        "turn's step advantage (its discounted return against the group's turns that met a "
        "similar observation); 0: off, 1: the paper's",
    )
    step_gamma: float = Field(0.95, gt=0.0, le=1.0, description="SLEA-RL's discount per turn")
    seed: int = 0
    device: str = "auto"
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="auto: bfloat16 on a GPU, float32 on a CPU (bfloat16 trains 1.6x faster on "
        "a CPU that computes it natively, but the default run then ended 0.05 lower)",
    )
    processes: int = Field(
        1,
        ge=1,
        description="processes a round trains in, one per GPU: above 1, the round runs under "
        "torchrun and TRL's trainer (through accelerate) splits each batch across them",
    )
    save_steps: int = Field(10, ge=0, description="trainer state saved every N steps; 0: never")

    @model_validator(mode="after")
    def _micro_batches_fill_a_batch(self) -> TrainSettings:
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size {self.micro_batch_size} does not divide "
                f"batch_size {self.batch_size}"
            )
        return self

    @property
    def micro_batches(self) -> int:
        """Passes an optimizer step takes: the batch in micro-batches."""
        return self.batch_size // self.pass_size

    @property
    def pass_size(self) -> int:
        """The rows one forward and backward pass holds: a micro-batch, else the whole batch."""
        return self.micro_batch_size or self.batch_size
