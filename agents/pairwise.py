"""Blind pairwise comparison: the judge reads a conversation up to an assistant turn and two
replies to it, and says which is better or that neither is.

1. The judge sees "Reply 1" and "Reply 2" only, never which version wrote which; the caller
   decides the order at random, per turn, so a judge that favours a position favours neither
   version.
2. The answer is constrained to one of `1`, `2` or `tie` (vLLM's structured outputs: a choice,
   which, unlike a JSON schema, leaves no room for padding) at temperature 0; anything else is
   a `PolicyError`, and the turn is left out rather than guessed.
"""

from __future__ import annotations

from typing import Any

from agents.errors import PolicyError
from agents.policy import Endpoint
from agents.ruler import conversation
from memory.records import SamplingSettings

COMPARE_SYSTEM = (
    "You compare two replies to the same conversation. Decide which reply continues it "
    "better: correct, helpful and on task, with the right tool call where one is needed. If "
    "neither is better, say tie. Reply 1, 2 or tie."
)
CONVERSATION_CHARS = 2000  # the end of the conversation is kept
REPLY_CHARS = 1000
CHOICES = ("1", "2", "tie")


async def compare(judge: Endpoint, messages: list[dict[str, Any]], first: str, second: str) -> int:
    """+1 when the judge prefers `first`, -1 when it prefers `second`, 0 for a tie."""
    shown = conversation(messages)[-CONVERSATION_CHARS:]
    prompt = (
        f"Conversation:\n{shown}\n\nReply 1:\n{first[:REPLY_CHARS]}\n\n"
        f"Reply 2:\n{second[:REPLY_CHARS]}\n\nWhich reply is better?"
    )
    messages = [
        {"role": "system", "content": COMPARE_SYSTEM},
        {"role": "user", "content": prompt},
    ]
    sample = await judge.client.sample(
        judge.model, messages, SamplingSettings(temperature=0.0, max_tokens=4),
        extra_body={"structured_outputs": {"choice": list(CHOICES)}},
    )  # fmt: skip
    better = sample.text.strip().lower()
    if better not in CHOICES:
        raise PolicyError(f"the judge chose {sample.text[:40]!r}, not 1, 2 or tie")
    return {"1": 1, "2": -1, "tie": 0}[better]
