"""Settings for `flywheel run`: one typed object, from defaults, a TOML file, then flags."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agents.outcome import OutcomeSettings
from agents.settings import CollectSettings, GroupSize, GuidedFraction, Temperature
from flows.errors import FlowError
from memory.library import LibrarySettings
from memory.records import describe
from serving.promotion import Gate
from trainer.settings import TrainSettings

DEFAULT_WORKDIR = Path(".flywheel")
MOVED = {  # settings of 0.2 that moved into a table
    "group_size": "collect.group_size",
    "temperature": "collect.temperature",
    "max_tokens": "collect.max_tokens",
    "guided_fraction": "collect.guided_fraction",
    "sge": "collect.strategy.enabled",
    "strategy": "collect.strategy",
    "reflect_retry": "collect.retry.enabled",
    "reflection": "collect.retry.reflection",
    "insights": "collect.insights",
    "anneal": "collect.anneal.enabled",
    "annealing": "collect.anneal.schedule",
    "revise": "collect.revise.enabled",
    "revisions": "collect.revise.revisions",
    "revise_temperature": "collect.revise.temperature",
    "revise_partial": "collect.revise.partial",
    "revise_blind": "collect.revise.blind",
    "nudge": "collect.nudge",
    "guard": "collect.guard",
    "library_k": "library.k",
    "library": "library.enabled",  # a switch then, a table now (the table is no move)
}


class RunCollect(CollectSettings):
    """A run's collection: groups of at least two, sampled below the API's default temperature,
    half of each shown a worked example; the rest as `CollectSettings` has it."""

    group_size: Annotated[GroupSize, Field(ge=2)] = 4
    temperature: Temperature = 0.7
    guided_fraction: GuidedFraction = 0.5


class RunSettings(BaseModel):
    """What one `flywheel run` does. Defaults (the policy alone) finish in about 5 minutes on 2
    CPU cores; `make run` adds a reviewer and `examples/reviewer.toml` (about 9; both with the
    models built and the servers started: bench/results/run.json)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rounds: int = Field(3, ge=1, description="flywheel rounds")
    minutes: float | None = Field(
        None,
        gt=0,
        description="a time budget: a round starts only while the minutes left cover the last "
        "round's length (the baseline counts; the server's start does not)",
    )
    tasks: int = Field(64, ge=1, description="train tasks per round, drawn fresh each round")
    overlap: bool = Field(
        False,
        description="collect the next round while this one trains (from the version serving "
        "then), so the model server does not wait for the trainer; off: rounds alternate",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="with overlap, a round trains on groups sampled at most this many "
        "promotions before the version it trains from (importance-corrected against their "
        "sampling logprobs); older groups are left out and counted",
    )
    eval_tasks: int = Field(64, ge=1, description="held-out tasks, never trained on")
    taskset: str = Field(
        "arithmetic", description="task set: a name, gym:NAME, or a plugin's module:attribute"
    )
    source: Literal["generated", "captured", "mixed"] = Field(
        "generated",
        description="where flywheel serve's rounds get train groups: generated tasks, captured "
        "agent traffic (rated episodes of a task, from the gateway with capture on), or both",
    )
    judge: bool = Field(
        False,
        description="score captured episodes that have no feedback by the reviewer ranking "
        "the episodes of a task against each other (RULER); needs a reviewer",
    )
    siblings: bool = Field(
        True,
        description="a captured session whose task was met once gets group_size - 1 siblings "
        "sampled from its last turn, scored as it was (its verifier's reference, or the judge)",
    )
    evaluation: str | None = Field(
        None,
        description="your evaluation of your agent, module:function, called as "
        "function(base_url, model, api_key) for a candidate and for the serving version: it "
        "runs the agent on held-out tasks and returns one score per task. Judges versions "
        "trained on captured traffic; without it, held-out captured sessions are compared "
        "blind by the judge",
    )
    db_url: str = f"sqlite:///{DEFAULT_WORKDIR}/flywheel.db"
    workdir: Path = DEFAULT_WORKDIR
    collect: RunCollect = Field(
        RunCollect(), description="how train groups are sampled, each method in a table of its own"
    )
    reviewer_url: str | None = Field(
        None, description="an endpoint for reflections and judgements; none: the policy itself"
    )
    reviewer_model: str | None = Field(None, description="the reviewer endpoint's model name")
    reviewer: str | None = Field(
        None,
        description="a reviewer model served beside the policy on cores of its own "
        "(qwen2.5-coder-0.5b, qwen2.5-coder-1.5b or a model folder); flywheel run only",
    )
    outcome: OutcomeSettings = OutcomeSettings()
    library: LibrarySettings = LibrarySettings()
    concurrency: int = Field(64, ge=1, description="requests in flight to the model server")
    replicas: list[str] = Field(
        default_factory=list,
        description="more model servers serving the same versions (LoRA only): each new "
        "version is loaded on every one before it is evaluated, and collection spreads over them",
    )
    weights: Literal["merged", "lora"] = Field(
        "merged",
        description="how new versions are served: merged weights reloaded in place (the base "
        "model's speed), or LoRA adapters; flywheel serve uses lora",
    )
    keep_merged: int = Field(
        3, ge=1, description="merged folders kept besides the serving and rollback versions"
    )
    outage_s: float = Field(
        300.0, gt=0, description="how long the model server may stay down before a run stops"
    )
    stage_timeout_s: float = Field(
        7200.0, gt=0, description="a stage (collect, train, swap, ...) running longer fails"
    )
    train: TrainSettings = TrainSettings()
    gate: Gate = Gate()

    @model_validator(mode="after")
    def _consistent(self) -> RunSettings:
        if (self.reviewer_url is None) != (self.reviewer_model is None):
            raise ValueError("reviewer_url and reviewer_model go together")
        if self.reviewer is not None and self.reviewer_url is not None:
            raise ValueError("name a reviewer to serve (reviewer) or a running one (reviewer_url)")
        if self.judge and self.reviewer is None and self.reviewer_url is None:
            raise ValueError("judge needs a reviewer: --reviewer-url and --reviewer-model")
        if self.train.mode == "rltldr" and not self.collect.insights:
            raise ValueError("train.mode rltldr trains insights: set collect.insights = true")
        if self.replicas and self.weights != "lora":
            raise ValueError("replicas serve versions as LoRA adapters: set weights to lora")
        return self

    @property
    def adapters_root(self) -> Path:
        return self.workdir / "adapters"

    @property
    def merged_root(self) -> Path:
        return self.workdir / "merged"

    def eval_settings(self) -> CollectSettings:
        """Held-out evaluation: one greedy sample per task, no guidance in context."""
        collect = self.collect
        return CollectSettings(
            group_size=1, temperature=0.0, max_tokens=collect.max_tokens, guard=collect.guard
        )


def load_run_settings(
    config: Path | None, overrides: dict[str, Any], labels: dict[str, str] | None = None
) -> RunSettings:
    """Defaults, then the TOML file, then `overrides` (dotted keys like "train.mode").

    Raises `FlowError` with one line naming the bad setting (by its label, e.g. a CLI flag).
    """
    values: dict[str, Any] = {}
    if config is not None:
        try:
            values = tomllib.loads(config.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise FlowError(f"cannot read config {config}: not UTF-8 text ({exc.reason})") from exc
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise FlowError(f"cannot read config {config}: {exc}") from exc
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = values
        for depth, parent in enumerate(parents):
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                table = ".".join(parents[: depth + 1])
                raise FlowError(f"setting {table}: expected a table of settings, not {node!r}")
        node[leaf] = value
    moved = [
        old for old in MOVED
        if old in values and not (old == "library" and isinstance(values[old], dict))
    ]  # fmt: skip
    if moved:
        raise FlowError(f"setting {moved[0]}: moved to {MOVED[moved[0]]}")
    try:
        return RunSettings.model_validate(values)
    except ValidationError as exc:
        raise FlowError(describe(exc, labels, kind="setting")) from None
