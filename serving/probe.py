"""The generation probe: a real 1-token greedy generation, the only proof that a model is served.

A dead engine can still answer `/health` and `/v1/models` (vLLM issue 39863), and an adapter can
be registered yet fail to generate; every liveness check, canary and readiness wait in the
project asks this one question, blocking (`generation`) or async (`agenerate`).
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict

PROMPT = "What is 2 + 3?"
ROUTE = "/v1/chat/completions"


class Probe(BaseModel):
    """What one probe found: `ok`, else the HTTP status (None when nothing answered) and why."""

    model_config = ConfigDict(frozen=True)

    ok: bool
    status: int | None = None
    reason: str = ""
    text: str = ""


def generation(client: httpx.Client, model: str) -> Probe:
    """Ask `model` for one greedy token through `client` (its base URL is the server)."""
    try:
        response = client.post(ROUTE, json=_body(model))
    except httpx.HTTPError as exc:
        return _unanswered(exc)
    return _read(response)


async def agenerate(client: httpx.AsyncClient, server: str, model: str, timeout_s: float) -> Probe:
    """`generation` for async callers, against the server at URL `server`."""
    try:
        response = await client.post(server + ROUTE, json=_body(model), timeout=timeout_s)
    except httpx.HTTPError as exc:
        return _unanswered(exc)
    return _read(response)


def _body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 1,
        "temperature": 0.0,
    }


def _unanswered(exc: httpx.HTTPError) -> Probe:
    return Probe(ok=False, reason=f"{type(exc).__name__}: {exc}".strip(": ")[:200])


def _read(response: httpx.Response) -> Probe:
    status = response.status_code
    if status != 200:
        detail = response.text.strip().splitlines()[0][:200] if response.text.strip() else ""
        return Probe(ok=False, status=status, reason=f"{status} {detail}".strip())
    try:
        text = response.json()["choices"][0]["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError):
        reason = f"answered with no completion: {response.text[:80]!r}"
        return Probe(ok=False, status=200, reason=reason)
    return Probe(ok=True, status=200, text=str(text))
