"""Capture: gateway traffic recorded as trajectories, so real usage feeds the flywheel.

A captured chat completion is stored as a one-attempt group (purpose `capture`) with the exact
prompt and completion token ids and logprobs the server sampled, reward 0 until feedback or a
verifier score arrives (`record_feedback`). The fields the gateway added to the upstream request
to get those ids are removed from the caller's response unless the caller asked for them.
"""

from __future__ import annotations

import uuid
from typing import Any

from memory.records import Attempt, Group, Sample, SamplingSettings

CAPTURE_HEADER = "X-Flywheel-Capture-Id"


def prepare_request(body: dict[str, Any]) -> dict[str, bool]:
    """Ask the upstream for token ids and logprobs; returns what the caller asked for itself."""
    asked = {"logprobs": bool(body.get("logprobs")), "ids": bool(body.get("return_token_ids"))}
    body["logprobs"] = True
    body["return_token_ids"] = True
    return asked


def captured_group(body: dict[str, Any], response: dict[str, Any]) -> Group | None:
    """The trajectory in a completed chat response, or None if it lacks token ids."""
    choices = response.get("choices") or []
    prompt_ids = response.get("prompt_token_ids")
    if not choices or prompt_ids is None or choices[0].get("token_ids") is None:
        return None
    choice = choices[0]
    content = (choice.get("logprobs") or {}).get("content") or []
    messages = body.get("messages") or []
    question = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    sample = Sample(
        text=(choice.get("message") or {}).get("content") or "",
        prompt_token_ids=prompt_ids,
        completion_token_ids=choice["token_ids"],
        logprobs=[entry["logprob"] for entry in content],
        finish_reason=choice.get("finish_reason") or "unknown",
    )
    attempt = Attempt(
        sample_index=0,
        policy_version=body["model"],
        messages=messages,
        sampling=SamplingSettings(
            temperature=float(body.get("temperature", 1.0)),
            max_tokens=int(body.get("max_tokens") or 0),
            top_p=float(body.get("top_p", 1.0)),
        ),
        sample=sample,
        reward=0.0,
        correct=False,
        format_ok=False,
        answer=None,
        reason="captured, no feedback yet",
    )
    return Group(
        round_index=0,
        purpose="capture",
        task_id=f"capture:{uuid.uuid4().hex}",
        taskset="gateway",
        question=str(question),
        policy_version=body["model"],
        size=1,
        attempts=[attempt],
    )


def strip_unasked(response: dict[str, Any], asked: dict[str, bool]) -> dict[str, Any]:
    if not asked["ids"]:
        response.pop("prompt_token_ids", None)
    for choice in response.get("choices") or []:
        if not asked["ids"]:
            choice.pop("token_ids", None)
        if not asked["logprobs"]:
            choice["logprobs"] = None
    return response
