"""RULER-style judging: the reviewer scores the episodes of one group against each other, for
captured agent traffic that has no verifier and no feedback.

1. The reviewer sees the task and every episode's transcript (numbered, each cut to
   `TRANSCRIPT_CHARS`), never a reference, and returns one score in [0, 1] per episode as
   schema-constrained JSON, at temperature 0: relative scores are what group advantages need,
   so a group judged all alike teaches nothing, as it should.
2. A reply that is not valid JSON with exactly one score per episode is a `PolicyError` (the
   group stays unrated and waits for feedback or the next look).
"""

from __future__ import annotations

import json
from typing import Any

from agents.errors import PolicyError
from agents.policy import Endpoint
from memory.records import Attempt, SamplingSettings

JUDGE_SYSTEM = (
    "You compare several attempts at the same task. Score each from 0 to 1 for how well it "
    "achieves the task, compared with the others: correct and complete scores high, wrong, "
    "unfinished or off-task scores low. Reply as JSON."
)
TRANSCRIPT_CHARS = 1500
JUDGE_TOKENS = 24  # per episode: a score and its separator


def transcript(episode: Attempt) -> str:
    """An episode as text: each message after the system prompt, with its role; tool calls as
    JSON."""
    return conversation(episode.messages)[-TRANSCRIPT_CHARS:]


def conversation(messages: list[dict[str, Any]]) -> str:
    """Messages as text, each after the system prompt with its role; tool calls as JSON."""
    lines = []
    for message in messages:
        if message.get("role") == "system":
            continue
        content = message.get("tool_calls") or message.get("content") or ""
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
        lines.append(f"{message.get('role')}: {text}")
    return "\n".join(lines)


def score_format(count: int) -> dict[str, Any]:
    scores = {"type": "number", "minimum": 0, "maximum": 1}
    schema = {
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": scores, "minItems": count, "maxItems": count}
        },
        "required": ["scores"],
    }
    return {"type": "json_schema", "json_schema": {"name": "scores", "schema": schema}}


async def judge(reviewer: Endpoint, question: str, episodes: list[Attempt]) -> list[float]:
    """One score in [0, 1] per episode, relative to the others."""
    shown = "\n\n".join(f"Attempt {i}:\n{transcript(e)}" for i, e in enumerate(episodes, 1))
    messages = [
        {"role": "system", "content": JUDGE_SYSTEM},
        {"role": "user", "content": f"Task: {question}\n\n{shown}"},
    ]
    sampling = SamplingSettings(temperature=0.0, max_tokens=16 + JUDGE_TOKENS * len(episodes))
    sample = await reviewer.client.sample(
        reviewer.model, messages, sampling, response_format=score_format(len(episodes))
    )
    try:
        scores = [float(s) for s in json.loads(sample.text)["scores"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise PolicyError(f"the judge's reply is not a list of scores: {exc}") from exc
    if len(scores) != len(episodes) or not all(0.0 <= s <= 1.0 for s in scores):
        raise PolicyError(f"the judge gave {len(scores)} scores for {len(episodes)} episodes")
    return scores
