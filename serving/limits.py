"""What one caller may send the gateway: bodies up to a size, requests at a rate, per key.

1. A body longer than `max_body_bytes` is refused with 413 before it is read in full: by its
   Content-Length when it states one, else as its chunks arrive.
2. Each key (or, on an open gateway, each client address) has a token bucket of `burst`
   requests that refills at `rate_per_s`; a request that finds it empty is refused with 429 and
   a `Retry-After` header. `/health` is never limited.
3. A pure ASGI middleware: nothing is buffered for requests that pass, so streaming is kept.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
UNLIMITED = ("/health",)


class RequestLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_body_bytes: int = Field(1 << 20, ge=1, description="the largest request body (413)")
    rate_per_s: float = Field(20.0, gt=0, description="requests a key may make per second")
    burst: int = Field(60, ge=1, description="requests a key may make at once (429 past it)")


class TooLarge(Exception):  # noqa: N818 - a signal inside the middleware, not an error type
    pass


class Limited:
    """The middleware (see the module docstring)."""

    def __init__(self, app: App, limits: RequestLimits) -> None:
        self.app, self.limits = app, limits
        self.buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, at)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED:
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        wait = self._take(_caller(scope, headers))
        if wait > 0:
            message = f"too many requests from this key: retry in {wait:.1f} s"
            await _answer(send, 429, message, {"retry-after": str(math.ceil(wait))})
            return
        stated = headers.get("content-length", "")
        if stated.isdigit() and int(stated) > self.limits.max_body_bytes:
            await _answer(send, 413, self._too_large())
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen, started = 0, False

        async def counting() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limits.max_body_bytes:
                    raise TooLarge
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting, sending)
        except TooLarge:
            if not started:
                await _answer(send, 413, self._too_large())

    def _take(self, caller: str) -> float:
        """Take a token from the caller's bucket; 0, or the seconds until one is free."""
        now = time.monotonic()
        tokens, at = self.buckets.get(caller, (float(self.limits.burst), now))
        tokens = min(float(self.limits.burst), tokens + (now - at) * self.limits.rate_per_s)
        if tokens < 1.0:
            self.buckets[caller] = (tokens, now)
            return (1.0 - tokens) / self.limits.rate_per_s
        self.buckets[caller] = (tokens - 1.0, now)
        return 0.0

    def _too_large(self) -> str:
        return f"request body over {self.limits.max_body_bytes} bytes"


def _caller(scope: Scope, headers: dict[str, str]) -> str:
    authorization = headers.get("authorization", "")
    if authorization.startswith("Bearer ") and authorization[7:].strip():
        return "key:" + authorization[7:].strip()
    client = scope.get("client") or ("unknown", 0)
    return f"address:{client[0]}"


async def _answer(
    send: Send, status: int, message: str, extra: dict[str, str] | None = None
) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
