"""Insights (RLTLDR): the reviewer's one-sentence lesson from a failed attempt, shared with the
batch.

1. The reviewer writes it in a fresh context: it sees the task, the attempt and the verifier's
   feedback (never the reference answer) and returns schema-constrained JSON: summary,
   feedback, wrong step, correction and a single-sentence insight.
2. `InsightBoard` is one batch's shared state: its running success rate and its newest insights
   (at most 16). An attempt is conditioned on the insights only while the batch's success rate
   is at most 50%.
3. The insight is stored as an attempt of kind "insight" whose sample is the insight's tokens
   (as the server tokenises them) after the bare prompt: the row that RLTLDR's insight SFT
   trains, given only the task.
4. `sequential_attempts` is RLTLDR's group: attempts one after another, each failure judged
   into an insight for the board, which later attempts may see.
5. `insight_advantage` is RLTLDR's own check that insights help: the success rate of first
   attempts that saw insights minus that of first attempts with nothing in context (it must
   stay above zero).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field

from agents.attempt import bare_prompt_ids
from agents.context import bare_messages
from agents.errors import PolicyError
from agents.policy import Endpoint
from agents.reflection import parse_reply, review_messages
from agents.settings import CollectSettings
from agents.slots import first_attempt
from memory.records import FULL_REWARD, INSIGHTS, Attempt, Group, Sample, SamplingSettings
from verifiers.task import Task

JUDGE_SYSTEM = (
    "You judge one attempt at a task, using the verifier's feedback. Reply with a JSON object "
    'only, with the keys: "summary", "feedback", "wrong_step", "correction" and "insight": one '
    "short sentence that would help on similar tasks, without giving this task's answer."
)
JUDGE_MAX_TOKENS = 200
MAX_INSIGHTS = 16
CONDITION_BELOW = 0.5


class Judgement(BaseModel):
    model_config = ConfigDict(frozen=True)

    summary: str = Field(min_length=1, max_length=300)
    feedback: str = Field(min_length=1, max_length=300)
    wrong_step: str = Field(max_length=300)
    correction: str = Field(max_length=300)
    insight: str = Field(min_length=3, max_length=160)


JUDGE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "judgement", "schema": Judgement.model_json_schema()},
}


class InsightBoard:
    """One batch's running success rate and newest insights."""

    def __init__(self, capacity: int = MAX_INSIGHTS) -> None:
        self.insights: deque[str] = deque(maxlen=capacity)
        self.attempts = 0
        self.successes = 0

    def record(self, attempt: Attempt) -> None:
        self.attempts += 1
        self.successes += int(attempt.correct)

    def add(self, insight: str) -> None:
        if insight not in self.insights:
            self.insights.append(insight)

    def conditioning(self) -> list[str]:
        """The insights to show the next attempt: all of them while the batch struggles."""
        struggling = self.attempts == 0 or self.successes / self.attempts <= CONDITION_BELOW
        return list(self.insights) if struggling else []


async def write_insight(
    reviewer: Endpoint,
    policy: Endpoint,
    question: str,
    attempt: Attempt,
    bare_prompt: list[int],
) -> Attempt:
    """The reviewer's insight on `attempt`, as an "insight" attempt (with `error` set when the
    call failed).

    The insight's ids come from the policy's server: they are trained on the policy.
    """
    client, model = reviewer.client, reviewer.model
    messages = review_messages(JUDGE_SYSTEM, question, attempt)
    sampling = SamplingSettings(temperature=0.3, max_tokens=JUDGE_MAX_TOKENS)
    record: dict[str, Any] = {
        "sample_index": attempt.sample_index,
        "kind": "insight",
        "policy_version": model,
        "messages": messages,
        "sampling": sampling,
        "parent_index": attempt.sample_index,
        "context": "judge",
        "reward": 0.0,
        "correct": False,
        "answer": None,
        "bare_prompt_token_ids": bare_prompt,
    }
    try:
        reply = await client.sample(model, messages, sampling, response_format=JUDGE_FORMAT)
        parsed = parse_reply(Judgement, reply.text, "judgement")
        record["generated_tokens"] = len(reply.completion_token_ids)
        if isinstance(parsed, str):
            return Attempt(**record, sample=None, format_ok=False, reason=parsed)
        ids = await policy.client.tokenize_text(policy.model, parsed.insight)
    except PolicyError as exc:
        return Attempt(
            **record, sample=None, format_ok=False, reason="judge failed", error=str(exc)
        )
    sample = Sample(
        text=parsed.insight,
        prompt_token_ids=bare_prompt,
        completion_token_ids=ids,
        logprobs=[0.0] * len(ids),
        finish_reason="stop",
    )
    return Attempt(
        **record | {"guidance": parsed.insight},
        sample=sample,
        format_ok=True,
        reason="valid insight",
    )


async def sequential_attempts(
    policy: Endpoint,
    reviewer: Endpoint,
    task: Task,
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
    board: InsightBoard,
) -> list[Attempt]:
    """RLTLDR: attempts one after another, each failure judged into an insight for the board."""
    attempts: list[Attempt] = []
    judged: list[Attempt] = []
    for index in range(settings.group_size):
        async with limiter:
            attempt = await first_attempt(policy, task, settings, index, board.conditioning())
        board.record(attempt)
        attempts.append(attempt)
        if attempt.sample is None or attempt.reward >= FULL_REWARD:
            continue
        bare = bare_messages(task, settings.system(task))
        bare_ids = await bare_prompt_ids(attempts, policy, bare)
        if bare_ids is None:
            continue
        async with limiter:
            insight = await write_insight(reviewer, policy, task.question, attempt, bare_ids)
        judged.append(insight)
        if insight.guidance:
            board.add(insight.guidance)
    return attempts + judged


class InsightCheck(BaseModel):
    """First attempts that saw the batch's insights against those with nothing in context."""

    model_config = ConfigDict(frozen=True)

    with_insights: float
    seen: int
    without: float
    bare: int

    @property
    def advantage(self) -> float:
        return self.with_insights - self.without


def insight_advantage(groups: list[Group]) -> InsightCheck | None:
    """RLTLDR's diagnostic over a round's groups; None unless both kinds of attempt exist."""
    seen = [a.correct for g in groups for a in g.first_attempts if a.context == INSIGHTS]
    bare = [a.correct for g in groups for a in g.bare_attempts]
    if not seen or not bare:
        return None
    return InsightCheck(
        with_insights=sum(seen) / len(seen), seen=len(seen),
        without=sum(bare) / len(bare), bare=len(bare),
    )  # fmt: skip
