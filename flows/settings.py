"""Settings for `flywheel run`: one typed object, from defaults, a TOML file, then flags."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agents.outcome import OutcomeSettings
from agents.settings import CollectSettings
from agents.strategy import StrategySettings
from flows.errors import FlowError
from memory.records import Annealing, describe
from serving.promotion import Gate
from trainer.settings import TrainSettings
from verifiers.guard import Guard

DEFAULT_WORKDIR = Path(".flywheel")


class RunSettings(BaseModel):
    """What one `flywheel run` does. Defaults (the policy alone) finish in about 9 minutes on 2
    CPU cores; `make run` adds a reviewer and `examples/reviewer.toml` (about 17)."""

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
    group_size: int = Field(4, ge=2, description="attempts per task (a GRPO group)")
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
    temperature: float = Field(0.7, ge=0.0, description="sampling temperature of train attempts")
    max_tokens: int = Field(128, ge=1)
    guided_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="share of each group sampled with a worked example"
    )
    sge: bool = Field(False, description="strategy first, then the answer (SGE)")
    strategy: StrategySettings = StrategySettings()
    reflect_retry: bool = Field(False, description="reflect on failed attempts and retry (R3L)")
    reflection: Literal["full", "brief"] = Field(
        "brief",
        description="what a reflection holds: the principle alone (brief: a quarter of the "
        "reviewer's tokens, and more tasks solved), or summary, root cause, outcome and principle",
    )
    insights: bool = Field(False, description="sequential attempts with judged insights (RLTLDR)")
    anneal: bool = Field(
        False,
        description="sample first attempts with the temperature annealed over their tokens, "
        "from 1.2 to 0.1 (EAD)",
    )
    annealing: Annealing = Annealing()
    revise: bool = Field(
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
    revise_temperature: float = Field(
        0.3, ge=0.0, description="HeRL: the temperature of the reviewer's revisions"
    )
    revise_partial: bool = Field(
        False,
        description="HeRL: also revise a group some of whose first attempts reached full "
        "reward (its best attempt that did not); a verified revision then joins the successes",
    )
    revise_blind: bool = Field(
        False,
        description="HeRL: the reviewer is not shown the failed attempt and answers the task "
        "afresh (a small reviewer tends to copy the wrong answer it is shown)",
    )
    nudge: bool = Field(
        False,
        description="the reviewer writes a hint for a group that all failed, the policy tries "
        "again with it, and its successes are distilled into the bare prompt (NudgeRL)",
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
    library: bool = Field(
        False,
        description="grow an experience library from insights and improved retries; its "
        "lessons replace the worked example in the guided slots (EDGE)",
    )
    library_k: int = Field(4, ge=1, description="lessons per prompt, within 800 characters")
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
    guard: Guard = Field(
        Guard(),
        description="limits on the task set's own code (verifier, environment, sandbox): a "
        "call past deadline_s, or one that raises, is the task's failure; answers longer than "
        "max_chars are wrong unread",
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
        if self.replicas and self.weights != "lora":
            raise ValueError("replicas serve versions as LoRA adapters: set weights to lora")
        if self.anneal and self.sge:
            raise ValueError("anneal and sge both set an attempt's temperatures: choose one")
        return self

    @property
    def checkpoint_root(self) -> Path:
        return self.workdir / "adapters"

    @property
    def merged_root(self) -> Path:
        return self.workdir / "merged"

    def collect_settings(self) -> CollectSettings:
        return CollectSettings(
            group_size=self.group_size,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            guided_fraction=self.guided_fraction,
            reflect_retry=self.reflect_retry,
            reflection=self.reflection,
            insights=self.insights,
            revise=self.revise,
            revisions=self.revisions,
            revise_temperature=self.revise_temperature,
            revise_partial=self.revise_partial,
            revise_blind=self.revise_blind,
            nudge=self.nudge,
            annealing=self.annealing if self.anneal else None,
            strategy=self.strategy if self.sge else None,
            guard=self.guard,
        )

    def eval_settings(self) -> CollectSettings:
        """Held-out evaluation: one greedy sample per task, no guidance in context."""
        return CollectSettings(
            group_size=1, temperature=0.0, max_tokens=self.max_tokens, guard=self.guard
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
    try:
        return RunSettings.model_validate(values)
    except ValidationError as exc:
        raise FlowError(describe(exc, labels, kind="setting")) from None
