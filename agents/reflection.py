"""Reflect-then-retry (R3L): a reflection on a failed attempt, then a retry from its pivot.

1. The reflector (the policy itself unless another endpoint is configured) sees the task, the
   attempt and the verifier's verdict and feedback lines, never the reference answer, and
   returns JSON: summary, root cause, outcome class, a reusable principle and
   `retry_from_step` ("full"), or only the principle, and the step for an episode ("brief":
   about a quarter of the tokens). The call asks the server for JSON that fits the schema; the
   reply is still validated, and an invalid one is recorded with its reason and leads to no
   retry.
2. A reflection that calls the attempt a success leads to no retry either. The schema sent for
   an attempt the verifier did not fully reward leaves "success" out, so a weak reflector
   cannot contradict the verifier. A principle the verifier accepts as the answer itself (the
   reflector was asked not to state it) is recorded as such and leads to no retry, as a
   strategy or a hint that states the answer is refused: a retry would copy the reviewer's
   answer, not find one.
3. The retry replays the first `retry_from_step` steps verbatim, with the principle in the
   system prompt (`agents.context.hint_messages`). An episode replays its turns
   (`agents.episode.retry_episode`); a one-step answer of several lines, shown to the reviewer
   with its lines numbered, keeps its lines before that step token for token and continues
   (`agents.pivot.step_retry`); a one-line answer starts afresh (pivot 0). The retry keeps the
   bare prompt's ids so training can use its distill copy, and records whether it improved on
   its parent.
4. `reflect_and_retry` runs this for every unguided attempt of a group short of full reward,
   concurrently; the reflections and retries join the group as extra attempts.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.context import Messages, hint_messages
from agents.episode import retry_episode
from agents.errors import PolicyError
from agents.pivot import numbered_working, step_retry, working_steps
from agents.policy import Endpoint
from agents.settings import CollectSettings
from agents.strategy import states_answer
from memory.records import FULL_REWARD, Attempt, SamplingSettings, describe
from verifiers.catalog import astart, is_episodic
from verifiers.task import Task

REFLECT_SYSTEM = (
    "You review one attempt at a task. Reply with a JSON object only, with the keys: "
    '"summary" (one sentence), "root_cause" (why it went wrong; ask why until you reach the '
    'cause), "outcome" ("success", "success_but_inefficient" or "failure"), "principle" (one '
    'reusable rule that would have avoided the mistake) and "retry_from_step" (0 to redo the '
    "whole answer)."
)
BRIEF_SYSTEM = (
    "You review one failed attempt at a task. Reply with a JSON object only, with the key "
    '"principle": one short rule, under 20 words, that would have avoided the mistake, without '
    "giving this task's answer."
)
BRIEF_STEP = (
    ' Add the key "retry_from_step": the number of the first step that went wrong (0 to redo '
    "everything)."
)
REFLECT_MAX_TOKENS = 200
BRIEF_MAX_TOKENS = 64
Reply = TypeVar("Reply", bound=BaseModel)
Steps = Literal["turns", "lines"] | None  # what an attempt's steps are, if it has several


class Reflection(BaseModel):
    """A validated reflection (R3L's JSON)."""

    model_config = ConfigDict(frozen=True)

    summary: str = Field(min_length=1, max_length=300)
    root_cause: str = Field(min_length=1, max_length=300)
    outcome: Literal["success", "success_but_inefficient", "failure"]
    principle: str = Field(min_length=3, max_length=200)
    retry_from_step: int = Field(0, ge=0)


class BriefReflection(BaseModel):
    """A principle alone (and for an episode, the step to retry from): asked only about an
    attempt short of full reward, so its outcome is a failure."""

    model_config = ConfigDict(frozen=True)

    principle: str = Field(min_length=3, max_length=200)
    retry_from_step: int = Field(0, ge=0)

    @property
    def outcome(self) -> Literal["failure"]:
        return "failure"


AnyReflection = Reflection | BriefReflection


def reflection_format(attempt: Attempt, brief: bool = False, steps: bool = True) -> dict[str, Any]:
    """The JSON schema the server must follow when reflecting on `attempt` (`steps`: whether
    the attempt has steps to retry from)."""
    schema = (BriefReflection if brief else Reflection).model_json_schema()
    if brief:
        if not steps:
            del schema["properties"]["retry_from_step"]
        schema["required"] = list(schema["properties"])
    elif attempt.reward < FULL_REWARD:
        schema["properties"]["outcome"]["enum"] = ["success_but_inefficient", "failure"]
    return {"type": "json_schema", "json_schema": {"name": "reflection", "schema": schema}}


def review_messages(
    system: str,
    question: str,
    attempt: Attempt,
    instructions: str | None = None,
    shown: str | None = None,
) -> Messages:
    """A reviewer's prompt (reflection or judgement): the task (with the instructions the
    policy was given, if any), the attempt (its text, or `shown`) and the verifier's verdict,
    never the reference answer."""
    text = shown if shown is not None else attempt.sample.text if attempt.sample else ""
    feedback = f"The verifier gave reward {attempt.reward:g}: {attempt.reason}."
    if attempt.feedback:
        feedback += "\nIts feedback:\n" + "\n".join(f"- {line}" for line in attempt.feedback)
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": review_prompt(question, text, feedback, instructions)},
    ]


def review_prompt(question: str, text: str, verdict: str, instructions: str | None) -> str:
    """What a reviewer is shown of one attempt: the task, the attempt's text and the verdict."""
    task = (
        f"Task: {question}"
        if instructions is None
        else f"Instructions: {instructions}\n\nTask: {question}"
    )
    return f"{task}\n\nAttempt: {text}\n\n{verdict}"


def parse_reply(record: type[Reply], text: str, what: str) -> Reply | str:
    """A reviewer's JSON reply as `record`, or a one-line reason it is invalid."""
    try:
        return record.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg}"
    except ValidationError as exc:
        return f"invalid {what}: {describe(exc)}"


def parse_reflection(text: str, brief: bool = False) -> AnyReflection | str:
    if brief:
        return parse_reply(BriefReflection, text, "reflection")
    return parse_reply(Reflection, text, "reflection")


async def reflect(
    reviewer: Endpoint, question: str, attempt: Attempt, brief: bool = False, steps: Steps = None
) -> tuple[Attempt, AnyReflection | None]:
    """Reflect on `attempt` (`brief`: the principle alone; `steps`: an episode's turns or a
    working's lines, numbered, whose step to retry from is asked too); the reflection is
    returned as an attempt of kind "reflection"."""
    client, model = reviewer.client, reviewer.model
    system = (BRIEF_SYSTEM + (BRIEF_STEP if steps else "")) if brief else REFLECT_SYSTEM
    lines = numbered_working(attempt.sample.text) if steps == "lines" and attempt.sample else None
    messages = review_messages(system, question, attempt, shown=lines)
    limit = BRIEF_MAX_TOKENS if brief else REFLECT_MAX_TOKENS
    sampling = SamplingSettings(temperature=0.3, max_tokens=limit)
    record = {
        "sample_index": attempt.sample_index,
        "kind": "reflection",
        "policy_version": model,
        "messages": messages,
        "sampling": sampling,
        "parent_index": attempt.sample_index,
        "context": "reflector",
        "reward": 0.0,
        "correct": False,
        "answer": None,
    }
    try:
        answer_format = reflection_format(attempt, brief, steps is not None)
        sample = await client.sample(model, messages, sampling, response_format=answer_format)
    except PolicyError as exc:
        failed = Attempt(**record, sample=None, format_ok=False, reason="reflection failed")
        return failed.model_copy(update={"error": str(exc)}), None
    parsed = parse_reflection(sample.text, brief)
    valid = None if isinstance(parsed, str) else parsed
    reason = "valid reflection" if valid is not None else str(parsed)
    if valid is not None and sample.finish_reason == "length":
        reason += ", truncated"
    reflection = Attempt(
        **record,
        sample=sample,
        format_ok=valid is not None,
        reason=reason,
        generated_tokens=len(sample.completion_token_ids),
    )
    return reflection, valid


def wants_retry(attempt: Attempt, reflection: AnyReflection | None) -> bool:
    """R3L: retry an attempt short of full reward whose reflection is valid and does not call
    it a success."""
    return (
        reflection is not None and reflection.outcome != "success" and attempt.reward < FULL_REWARD
    )


async def reflect_and_retry(
    policy: Endpoint,
    reviewer: Endpoint,
    task: Task,
    attempts: list[Attempt],
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
) -> list[Attempt]:
    """Reflections and retries for the unguided attempts of a group short of full reward: a
    retry with the principle as a hint, or for an episode, a replay from the reflection's
    step."""
    failed = [
        a for a in attempts if not a.guided and a.sample and a.reward < FULL_REWARD and not a.error
    ]
    sampling = SamplingSettings(temperature=settings.temperature, max_tokens=settings.max_tokens)
    episodic = is_episodic(task.taskset)
    extras: list[Attempt] = []

    def steps(parent: Attempt) -> Steps:
        if episodic:
            return "turns"
        several = parent.sample and len(working_steps(parent.sample.text)) > 1
        return "lines" if settings.retry.pivot and several else None

    async def retry(parent: Attempt, reflection: AnyReflection, kind: Steps) -> Attempt:
        principle, step = reflection.principle, reflection.retry_from_step
        if episodic:
            fresh = await astart(task)
            return await retry_episode(policy.client, fresh, parent, principle, step, sampling)
        messages = hint_messages(task, settings.system(task), principle)
        step = step if kind else 0
        return await step_retry(policy, task, messages, parent, principle, step, sampling)

    async def one(parent: Attempt) -> None:
        brief, kind = settings.retry.reflection == "brief", steps(parent)
        async with limiter:
            reflection_attempt, reflection = await reflect(
                reviewer, task.question, parent, brief, kind
            )
        if not wants_retry(parent, reflection):
            extras.append(reflection_attempt)
            return
        assert reflection is not None
        if not episodic and await states_answer(task, reflection.principle):
            leaked = {"format_ok": False, "reason": "the reflection states the answer"}
            extras.append(reflection_attempt.model_copy(update=leaked))
            return
        async with limiter:
            retried = await retry(parent, reflection, kind)
        extras.extend(
            [reflection_attempt.model_copy(update={"improved": retried.improved}), retried]
        )

    async with anyio.create_task_group() as tg:
        for parent in failed:
            tg.start_soon(one, parent)
    return sorted(extras, key=lambda a: (a.sample_index, a.kind))
