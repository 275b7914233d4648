"""Reflect-then-retry (R3L): a reflection on a failed attempt, then a retry from its pivot.

1. The reflector (the policy itself unless another endpoint is configured) sees the task, the
   attempt and the verifier's feedback, never the reference answer, and returns JSON:
   summary, root cause, outcome class, a reusable principle and `retry_from_step`. The call
   asks the server for JSON that fits the schema; the reply is still validated, and an
   invalid one is recorded with its reason and leads to no retry.
2. A reflection that calls the attempt a success leads to no retry either. The schema sent for
   an attempt the verifier did not fully reward leaves "success" out, so a weak reflector
   cannot contradict the verifier.
3. The retry replays the first `retry_from_step` steps verbatim and inserts the principle at the
   pivot. A single-turn answer is one step, so its pivot is 0 and the principle goes into the
   system prompt (`agents.context.hint_messages`). The retry keeps the bare prompt's ids so
   training can use its distill copy, and records whether it improved on its parent.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.context import Messages
from agents.errors import PolicyError
from agents.policy import Reviewer
from memory.records import Attempt, SamplingSettings, describe

REFLECT_SYSTEM = (
    "You review one attempt at a task. Reply with a JSON object only, with the keys: "
    '"summary" (one sentence), "root_cause" (why it went wrong; ask why until you reach the '
    'cause), "outcome" ("success", "success_but_inefficient" or "failure"), "principle" (one '
    'reusable rule that would have avoided the mistake) and "retry_from_step" (0 to redo the '
    "whole answer)."
)
REFLECT_MAX_TOKENS = 200
Reply = TypeVar("Reply", bound=BaseModel)
FULL_REWARD = 1.0


class Reflection(BaseModel):
    """A validated reflection (R3L's JSON)."""

    model_config = ConfigDict(frozen=True)

    summary: str = Field(min_length=1, max_length=300)
    root_cause: str = Field(min_length=1, max_length=300)
    outcome: Literal["success", "success_but_inefficient", "failure"]
    principle: str = Field(min_length=3, max_length=200)
    retry_from_step: int = Field(0, ge=0)


def reflection_format(attempt: Attempt) -> dict[str, Any]:
    """The JSON schema the server must follow when reflecting on `attempt`."""
    schema = Reflection.model_json_schema()
    if attempt.reward < FULL_REWARD:
        schema["properties"]["outcome"]["enum"] = ["success_but_inefficient", "failure"]
    return {"type": "json_schema", "json_schema": {"name": "reflection", "schema": schema}}


def review_messages(system: str, question: str, attempt: Attempt) -> Messages:
    """A reviewer's prompt (reflection or judgement): the task, the attempt and the verifier's
    verdict, never the reference answer."""
    text = attempt.sample.text if attempt.sample else ""
    feedback = f"The verifier gave reward {attempt.reward:g}: {attempt.reason}."
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Task: {question}\n\nAttempt: {text}\n\n{feedback}"},
    ]


def parse_reply(record: type[Reply], text: str, what: str) -> Reply | str:
    """A reviewer's JSON reply as `record`, or a one-line reason it is invalid."""
    try:
        return record.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg}"
    except ValidationError as exc:
        return f"invalid {what}: {describe(exc)}"


def parse_reflection(text: str) -> Reflection | str:
    return parse_reply(Reflection, text, "reflection")


async def reflect(
    reviewer: Reviewer, question: str, attempt: Attempt
) -> tuple[Attempt, Reflection | None]:
    """Reflect on `attempt`; the reflection is returned as an attempt of kind "reflection"."""
    client, model = reviewer.client, reviewer.model
    messages = review_messages(REFLECT_SYSTEM, question, attempt)
    sampling = SamplingSettings(temperature=0.3, max_tokens=REFLECT_MAX_TOKENS)
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
        sample = await client.sample(
            model, messages, sampling, response_format=reflection_format(attempt)
        )
    except PolicyError as exc:
        failed = Attempt(**record, sample=None, format_ok=False, reason="reflection failed")
        return failed.model_copy(update={"error": str(exc)}), None
    parsed = parse_reflection(sample.text)
    valid = isinstance(parsed, Reflection)
    reason = "valid reflection" if valid else parsed
    if valid and sample.finish_reason == "length":
        reason += ", truncated"
    reflection = Attempt(
        **record,
        sample=sample,
        format_ok=valid,
        reason=reason,
        generated_tokens=len(sample.completion_token_ids),
    )
    return reflection, parsed if valid else None


def wants_retry(attempt: Attempt, reflection: Reflection | None) -> bool:
    """R3L: retry an attempt short of full reward whose reflection is valid and does not call
    it a success."""
    return (
        reflection is not None and reflection.outcome != "success" and attempt.reward < FULL_REWARD
    )
