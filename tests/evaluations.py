"""Users' evaluations, as `flows.scorecards.user_card` calls them: `function(base_url, model,
api_key)` returns one score per held-out task."""

from __future__ import annotations

import httpx

CALLS: list[tuple[str, str]] = []


async def by_name(base_url: str, model: str, api_key: str) -> list[float]:
    """A trained version ("policy-r...") solves all eight tasks, the base two of them."""
    CALLS.append((base_url, model))
    return [1.0] * 8 if model.startswith("policy-r") else [0.0] * 6 + [1.0] * 2


def broken(base_url: str, model: str, api_key: str) -> list[float]:
    raise httpx.ConnectError("the agent's server is down")


def uneven(base_url: str, model: str, api_key: str) -> list[float]:
    return [1.0, 0.0, 1.0] if model.startswith("policy-r") else [1.0, 0.0]


def not_a_number(base_url: str, model: str, api_key: str) -> list[float]:
    return [float("nan"), 1.0]


def served_by_name(base_url: str, model: str, api_key: str) -> list[float]:
    """`by_name`'s scores, once the model server has answered a chat under `model` (the
    candidate is evaluated by its own name, before any alias points at it)."""
    reply = httpx.post(
        f"{base_url}/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60,
    )
    reply.raise_for_status()
    assert reply.json()["model"] == model
    CALLS.append((base_url, model))
    return [1.0] * 8 if model.startswith("policy-r") else [0.0] * 6 + [1.0] * 2
