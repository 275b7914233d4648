"""Typed, frozen records that cross package boundaries. Rows leave the store as these.

Every record carries a schema version. A `Sample` is exactly what the server returned, so training
uses the sampled token ids and their behaviour logprobs, never re-tokenised text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

AttemptKind = Literal[
    "base", "guided", "retry", "reflection", "insight", "revision", "nudge", "hint"
]
FULL_REWARD = 1.0  # the verifier's reward for a complete, correct answer
UNRATED = "captured, no feedback yet"  # the reason on captured traffic before any score
POLICY_FAILED = "policy call failed"  # the reason of an attempt whose call the server refused
TASK_FAULT = "task fault"  # the reason of an attempt the task set's own code failed
FIRST_KINDS: tuple[AttemptKind, ...] = ("base", "guided")  # one per slot, as first sampled
ROLLOUT_KINDS: tuple[AttemptKind, ...] = (*FIRST_KINDS, "retry", "nudge")  # at the task itself
VERIFIED_KINDS: tuple[AttemptKind, ...] = (*ROLLOUT_KINDS, "revision")  # answers with a verdict
LossType = Literal["policy", "pivot", "forced"]
GroupPurpose = Literal["train", "eval", "capture"]
AdvantageMode = Literal["grpo", "r3l", "filtered", "rltldr"]


def describe(error: ValidationError, names: Mapping[str, str] | None = None, kind: str = "") -> str:
    """A validation error as one line: where (by its name in `names`, e.g. a CLI flag, else
    `kind` and the field's path), then what is wrong."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    label = (names or {}).get(where) or " ".join(filter(None, (kind, where))) or "record"
    return f"{label}: {first['msg'].removeprefix('Value error, ')}"


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, from_attributes=True)
    schema_version: int = 1


class Sample(Record):
    """One completion as sampled: the prompt and completion token ids and their logprobs."""

    text: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = Field(max_length=30)

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        if len(self.logprobs) != len(self.completion_token_ids):
            raise ValueError("logprobs and completion token ids differ in length")
        return self


class Annealing(Record):
    """EAD's temperature schedule over the tokens of an attempt: token k is sampled at
    max(1 + t_max - e^(k / decay_tokens), t_min), held for `span_tokens` tokens at a time
    (a request's temperature is fixed), and once at t_min for the rest of the answer."""

    model_config = ConfigDict(frozen=True, from_attributes=True, extra="forbid")  # a setting too

    t_max: float = Field(1.2, gt=0.0)
    t_min: float = Field(0.1, ge=0.0)
    decay_tokens: float = Field(40.0, gt=0.0)
    span_tokens: int = Field(8, ge=1)

    def temperature(self, k: int) -> float:
        return round(max(1.0 + self.t_max - math.exp(k / self.decay_tokens), self.t_min), 3)

    def spans(self, max_tokens: int) -> list[tuple[int, int, float]]:
        """(first token, end, temperature) of each request that samples `max_tokens` tokens."""
        spans, start = [], 0
        while start < max_tokens:
            temperature = self.temperature(start)
            end = (
                max_tokens
                if temperature <= self.t_min
                else min(start + self.span_tokens, max_tokens)
            )
            spans.append((start, end, temperature))
            start = end
        return spans


class SamplingSettings(Record):
    temperature: float
    max_tokens: int
    top_p: float = 1.0
    strategy_temperature: float | None = None
    annealing: Annealing | None = None  # EAD: the schedule replaces `temperature`


ScoreFigure = Literal["pass@1", "win margin", "score margin"]


class Scorecard(Record):
    """A version's figure from one evaluation, with its size and 95% interval.

    `evaluation` names what judged it: held-out tasks of a task set (`pass@1`, the share it
    solved), the agent's own held-out sessions, the candidate's answers and the serving
    version's compared blind by a judge (`win margin`: wins minus losses per turn, in [-1, 1]),
    or the user's evaluation of both on the same held-out tasks (`score margin`: the mean
    difference of their scores). A margin is against `against`, the version serving then."""

    evaluation: str = Field(max_length=300)
    figure: ScoreFigure
    value: float
    n: int = Field(ge=0)
    low: float
    high: float
    against: str | None = None

    @property
    def margin(self) -> bool:
        return self.figure != "pass@1"

    def line(self) -> str:
        """One line: `held-out tasks of arithmetic: pass@1 0.420 (95% 0.303 to 0.546, n 64)`."""
        sign = "+" if self.margin else ""
        over = f" over {self.against}" if self.against else ""
        return (
            f"{self.evaluation}: {self.figure}{over} {self.value:{sign}.3f} (95% "
            f"{self.low:{sign}.3f} to {self.high:{sign}.3f}, n {self.n})"
        )


class PolicyVersion(Record):
    """A servable policy: the base model, or a LoRA adapter trained in some round, with its
    merged weights (a full model folder) when the run serves merged versions."""

    name: str
    base_model: str
    parent: str | None = None
    adapter_path: str | None = None
    weights_path: str | None = None
    round_index: int = 0
    promoted: bool = False
    promoted_at: datetime | None = None
    eval_pass_at_1: float | None = None
    scorecards: list[Scorecard] = Field(default_factory=list)

    @field_validator("scorecards", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return value or []


EXPERIENCE = "experience"  # a one-step attempt's context when library lessons were in its prompt
STEP_LESSONS = "step_lessons"  # an episode's context when lessons were shown at its steps
INSIGHTS = "insights"  # a first attempt's context when its batch's insights were in its prompt
OWN_EXAMPLE = "own_example"  # a first attempt's context when its worked example was the policy's
LIBRARY_CONTEXTS = (EXPERIENCE, STEP_LESSONS)  # the contexts that show library lessons


class Attempt(Record):
    """One rollout of one task: the messages, what was sampled, and the verifier's verdict.

    A rollout that failed by its own doing (a request the server refused as bad) is data:
    `error` says why and reward is 0. A server that could not answer is never an attempt.

    `context` names the guidance that was in the prompt ("bare" when none); a guided attempt
    keeps `bare_prompt_token_ids`, the prompt without guidance, so training can distil it into
    the bare prompt, except an episode shown lessons at its steps (`STEP_LESSONS`): its guidance
    sits inside the sequence, so it trains as sampled. A retry points at the attempt it retries
    (`parent_index`) and at the pivot: `pivot_tokens` completion tokens replayed verbatim from
    the parent, never trained on; `forced_spans` are other (start, end) completion spans the
    policy did not sample. Kinds "reflection" and "insight" hold the policy's own text about
    another attempt, which `improved` marks when it led to a better retry. `shaped_reward` and
    its terms (`shaping`) are kept apart from the verifier's `reward`. An episode of `turns`
    turns has one step per turn: a turn's sampled reply and the environment's forced reply after
    it. `feedback` is the verifier's private output (what passed and what failed), stored apart
    and never prompted.
    """

    sample_index: int
    kind: AttemptKind = "base"
    policy_version: str = Field(max_length=200)
    messages: list[dict[str, Any]]
    sampling: SamplingSettings
    sample: Sample | None
    reward: float
    correct: bool
    format_ok: bool
    answer: str | None
    reason: str
    error: str | None = None
    context: str = Field("bare", max_length=50)
    guidance: str | None = None
    bare_prompt_token_ids: list[int] | None = None
    parent_index: int | None = None
    pivot_tokens: int = Field(0, ge=0)
    forced_spans: list[tuple[int, int]] = Field(default_factory=list)
    generated_tokens: int = Field(0, ge=0, description="tokens the server generated, all calls")
    improved: bool | None = None
    shaped_reward: float | None = None
    shaping: dict[str, float] | None = None
    strategy: str | None = None
    turns: int = Field(1, ge=1)
    feedback: list[str] = Field(default_factory=list)

    @classmethod
    def failed(cls, error: str, **fields: Any) -> Attempt:
        """An attempt whose policy call failed: recorded with the reason, reward 0."""
        values: dict[str, Any] = {"sample": None, "reward": 0.0, "correct": False}
        values |= {"format_ok": False}
        values |= {"answer": None, "reason": POLICY_FAILED, "error": error}
        return cls(**values | fields)

    @classmethod
    def faulted(cls, error: str, **fields: Any) -> Attempt:
        """An attempt the task set's own code failed on (its verifier, environment or sandbox
        raised or passed its deadline): recorded with the reason, reward 0. Its group goes back
        to the queue as the task's failure."""
        return cls.failed(error, **fields | {"reason": TASK_FAULT})

    @property
    def task_fault(self) -> bool:
        return self.error is not None and self.reason == TASK_FAULT

    @field_validator("forced_spans", mode="before")
    @classmethod
    def _no_spans(cls, value: Any) -> Any:
        return [span for span in value or [] if span[0] != span[1]]  # an empty span masks nothing

    @model_validator(mode="after")
    def _spans_fit(self) -> Attempt:
        """Forced spans are sorted, disjoint and inside the completion; so is the pivot."""
        if self.sample is None:
            return self
        length, end = len(self.sample.completion_token_ids), 0
        for start, stop in self.forced_spans:
            if not end <= start <= stop <= length:
                raise ValueError(f"forced span {(start, stop)} is out of order or past {length}")
            end = stop
        if self.pivot_tokens > length:
            raise ValueError(f"pivot {self.pivot_tokens} is past the completion ({length})")
        return self

    @property
    def guided(self) -> bool:
        return self.context != "bare"

    @property
    def distillable(self) -> bool:
        """Guided, with all its guidance in the prompt: the bare prompt can stand in for it."""
        return self.guided and self.context != STEP_LESSONS

    @property
    def train_reward(self) -> float:
        """The reward training uses: shaped when exploration bonuses were applied, else raw."""
        return self.reward if self.shaped_reward is None else self.shaped_reward

    @property
    def answer_key(self) -> str:
        """The outcome key for outcome counting: the normalised final answer."""
        return " ".join((self.answer or "<none>").split()).lower()[:200]


class GroupPlan(Record):
    """What a group was collected under, stored with it as one JSON object (`stored`).

    A collected group keeps its worker's settings as the worker wrote them (`sampling`,
    `outcome`: memory keeps them for the record and reads neither) and the library lessons its
    guided slots showed (`experience_ids`, with their `similarities` to the task). A captured
    turn keeps the gateway's tags: its `session` and `task`, each filed under its `owner` (the
    key's fingerprint), whether it is `held_out`, the `reference` its feedback sent; later, the
    round that trained on it (`trained_in`), how many `siblings` were sampled for it, or the
    session it is a sibling of (`sibling_of`). A group of captured episodes lists their
    `sessions`. Keys a plan stored by an older version may hold are ignored.
    """

    model_config = ConfigDict(
        frozen=True, from_attributes=True, extra="ignore", populate_by_name=True
    )

    sampling: dict[str, JsonValue] | None = None
    outcome: dict[str, JsonValue] | None = None
    experience_ids: list[int] = Field(default_factory=list)
    similarities: list[float] = Field(default_factory=list)
    session: str | None = None
    task: str | None = None
    owner: str | None = None
    reference: str | None = None
    held_out: bool = False
    trained_in: int | None = Field(None, alias="round")
    siblings: int | None = None
    sibling_of: str | None = None
    sessions: list[str] = Field(default_factory=list)

    def stored(self) -> dict[str, JsonValue] | None:
        """The JSON the store keeps: the fields set, none when there are none."""
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=True) or None


class Group(Record):
    """All attempts of one task under one policy version in one round: the GRPO unit, with the
    `plan` it was collected under."""

    id: int | None = None
    round_index: int
    purpose: GroupPurpose
    task_id: str = Field(max_length=200)
    taskset: str = Field(max_length=100)
    question: str
    policy_version: str = Field(max_length=200)
    size: int = Field(ge=1)
    attempts: list[Attempt]
    plan: GroupPlan = Field(default_factory=lambda: GroupPlan())

    @field_validator("plan", mode="before")
    @classmethod
    def _no_plan(cls, value: Any) -> Any:
        return {} if value is None else value

    @property
    def complete(self) -> bool:
        """Trainable only when every slot holds a first attempt and none failed for
        infrastructure. Retries, reflections and insights are extras on top of the slots."""
        firsts = self.first_attempts
        indices = {a.sample_index for a in firsts}
        no_errors = all(a.error is None for a in firsts)
        return indices == set(range(self.size)) and no_errors

    @property
    def fault(self) -> str | None:
        """The first task fault among the attempts (see `Attempt.faulted`), if any."""
        return next((a.error for a in self.attempts if a.task_fault), None)

    @property
    def first_attempts(self) -> list[Attempt]:
        """One attempt per slot, as first sampled (no retries or reflections)."""
        return [a for a in self.attempts if a.kind in FIRST_KINDS]

    @property
    def bare_attempts(self) -> list[Attempt]:
        """First attempts with nothing in context: the ones metrics are reported on."""
        return [a for a in self.first_attempts if not a.guided]


class RoundMetrics(Record):
    """What a round measured, stored with it: its data (`stale_groups` sampled by an older
    version, `dropped_groups` too old to train), its training (the trainer's figures: rows,
    tokens, loss, KL to the sampling policy, seconds; `starts`, how often training began on its
    groups), how it was judged (`scorecards`, the held-out `eval_pass_at_1` when a task set
    judged it), or why it was skipped (`reason`).
    Keys stored by an older version are ignored."""

    model_config = ConfigDict(frozen=True, from_attributes=True, extra="ignore")

    stale_groups: int = 0
    dropped_groups: int = 0
    adapter_path: str | None = None
    rows: int = 0
    train_tokens: int = 0
    loss_first: float | None = None
    loss_last: float | None = None
    train_seconds: float = 0.0
    seconds: float = 0.0
    resumed_from_step: int = 0
    starts: int = 0  # times training began on the recorded groups (a killed round resumes)
    contexts: dict[str, int] = Field(default_factory=dict)
    kl_first: float | None = None
    kl_last: float | None = None
    outside_share: float | None = None
    steps: int = 0
    padded_share: float | None = None
    processes: int = 1
    scorecards: list[Scorecard] = Field(default_factory=list)
    eval_pass_at_1: float | None = None
    reason: str = ""


class TrainingRound(Record):
    """A round's record; `group_ids` is its data cursor, committed before training starts, so a
    killed round resumes on exactly the same groups."""

    round_index: int
    method: str
    policy_in: str
    policy_out: str | None
    status: Literal["running", "done", "failed", "skipped"]
    hyperparameters: dict[str, JsonValue] = Field(default_factory=dict)
    metrics: RoundMetrics = Field(default_factory=lambda: RoundMetrics())
    group_ids: list[int] = Field(default_factory=list)

    @field_validator("group_ids", mode="before")
    @classmethod
    def _no_cursor(cls, value: Any) -> Any:
        return [] if value is None else value


class AliasEvent(Record):
    alias: str
    action: Literal["promote", "rollback", "refuse"]
    from_version: str | None
    to_version: str | None
    reason: str = ""


class CapturedSession(Record):
    """One captured session as a page lists it: its turns, when, its task, whether it is held
    out or trained (the round that adopted it), and its last turn's reward and reason."""

    name: str
    task: str | None
    turns: int
    first_at: datetime
    last_at: datetime
    held_out: bool
    round_index: int | None
    reward: float | None = None
    reason: str = ""


class Action(Record):
    """A person's action from the page (memory.actions)."""

    actor: str
    action: Literal["rate", "hold out", "forget", "promote", "rollback"]
    target: str
    detail: str = ""
    created_at: datetime | None = None


WorkState = Literal["queued", "claimed", "done", "failed"]
Fault = Literal["task", "server"]  # whose failure a given-back item last met


class WorkItem(Record):
    """One task of one batch (round, purpose, policy version) waiting to be collected.

    `plan` is the collecting flow's own typed plan (the task and its sampling settings) as
    JSON text: the store keeps it, reads none of it, and hands it to whichever worker claims
    the item.
    `lease_expires_at` is a Unix time; a claim whose lease has passed may be taken again.
    An item given back after a failure is not claimed before `not_before`; `failures` counts
    the failures that happened while the server answered probes (an outage counts none), and
    `error` is the last one; `fault` says whose it was: the task's own (its verifier,
    environment or sandbox raised or hung) or the server's. `abandoned` counts claims that ended
    with their worker gone (a lease that ran out, a process found dead).
    """

    id: int | None = None
    round_index: int
    purpose: GroupPurpose
    policy_version: str = Field(max_length=200)
    task_id: str = Field(max_length=200)
    plan: str
    state: WorkState = "queued"
    owner: str | None = None
    lease_expires_at: float | None = None
    claims: int = 0
    failures: int = 0
    not_before: float | None = None
    error: str | None = None
    fault: Fault | None = None
    abandoned: int = 0

    @field_validator("plan", mode="before")
    @classmethod
    def _as_text(cls, value: Any) -> Any:
        """A plan read from the store's JSON column, as text again."""
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


class Batch(Record):
    """The tasks one round collects from one version: the work items of (round, purpose,
    version)."""

    round_index: int
    purpose: GroupPurpose
    policy_version: str = Field(max_length=200)


class Setback(Record):
    """Why a worker gives an item back, and what follows: `error` and whose `fault` it was;
    `counted` failures add up to `max_failures`, after which the item is failed; otherwise it
    waits `retry_after_s` before anyone claims it again."""

    error: str
    fault: Fault
    counted: bool
    retry_after_s: float = Field(ge=0)
    max_failures: int = Field(ge=1)


LessonKind = Literal["strategy", "principle", "insight", "warning", "hint"]
Scope = Literal["task", "task_type", "global"]
Zone = Literal["do", "avoid"]


class LessonDraft(Record):
    """A lesson as an agent proposes it, before the library admits it."""

    kind: LessonKind
    scope: Scope
    scope_key: str = ""  # the task id, the task set, or "" for global
    zone: Zone = "do"
    text: str = Field(min_length=1, max_length=2000)
    source: str = ""  # what produced it, e.g. "reflection of attempt 812"


class Lesson(Record):
    """A lesson of the experience library, with its evidence and its utility (the
    with/without gain of the groups whose guided half saw it)."""

    id: int
    kind: LessonKind
    scope: Scope
    scope_key: str
    zone: Zone
    text: str
    source: str
    fingerprint: str
    evidence: int
    utility: float
    exposures: int
    negative_windows: int
    status: Literal["active", "pruned"]
    created_at: datetime


class LibraryEvent(Record):
    """One change to the library: a lesson added, merged into, credited, pruned or trimmed."""

    lesson_id: int
    action: Literal["add", "merge", "credit", "prune", "trim"]
    before: dict[str, Any] = Field(default_factory=dict)
    after: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None


class Segment(Record):
    """A span of an attempt's completion tokens produced one way: sampled by the policy
    (`policy`, trained), replayed or forced as a prefix (`pivot`), or inserted by the agent or the
    environment (`forced`); masked spans carry weight 0. `advantage` is set by the training
    round that trained the span."""

    index: int
    step_index: int
    start: int = Field(ge=0)
    loss: LossType
    token_ids: list[int]
    logprobs: list[float]
    temperature: float | None = None
    weight: float
    advantage: float | None = None


class Step(Record):
    """One turn of an attempt: what the agent saw, what it did, and what came of it. A one-step
    task has one step; `replayed` marks a turn a retry copied from its parent."""

    index: int
    observation: str
    action: str
    replayed: bool = False
    reward: float | None = None
    outcome: float
    temperature: float | None = None
    strategy: str | None = None
    strategy_temperature: float | None = None


class StrategyStats(Record):
    """How first attempts fared under one strategy text (SGE), over all groups."""

    taskset: str
    text: str
    attempts: int
    successes: int
    mean_reward: float

    @property
    def success_rate(self) -> float:
        return self.successes / self.attempts if self.attempts else 0.0
