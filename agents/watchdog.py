"""The watchdog: deadlines sized to the server's measured speed, and stalls caught by the server's
own token counters rather than by a fixed timeout.

1. While requests are in flight, the first request to wait `poll_s` reads the server's
   `/metrics` (vLLM's prompt and generation token counters), at most once per `poll_s` for all
   requests together. Counters that moved: the server is working, and its generation rate is
   measured. Counters that have not moved for `stall_s` while requests wait: the server is
   stalled, and every waiting request ends with `ServerUnavailable`.
2. A request's deadline is the time the server needs, at the measured rate, for every token in
   flight with it (prompts included), times `slack`, kept within [`floor_s`, `ceiling_s`]. It
   is sized when the request starts and grows, at each look at the counters, with the requests
   that joined it since (they share the server's batch), so a full batch on a slow server is
   not cut off at the floor. A busy server gets the time its queue needs; a dead one is found
   by the stall watch in about `stall_s`. The rate counts prompt and generated tokens alike:
   long prompts with short answers (EAD's spans send the whole prompt again for a few tokens)
   get the time their prompts take, where counting generated tokens alone cut them off.
3. A request that ends early closes its connection, and vLLM aborts a request whose client has
   gone, so nothing abandoned keeps the server busy. Nothing is sent again from here: the work
   queue retries whole groups, with backoff, so retries never pile onto a slow server.
4. A server without `/metrics` (not vLLM) is watched by the deadline alone.
5. A deadline cut short by `ceiling_s` (the queue in flight needed more, at the measured rate)
   raises `ServerBusy` when it passes: load, not the task's failure. A request alone, or one
   that outlived a deadline its queue did not explain, raises a plain `ServerUnavailable`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import httpx
from pydantic import BaseModel, ConfigDict, Field

from agents.errors import ServerBusy, ServerUnavailable

T = TypeVar("T")
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


class WatchdogSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_s: float = Field(5.0, gt=0, description="how often the token counters are read")
    stall_s: float = Field(60.0, gt=0, description="no token for this long: stalled")
    floor_s: float = Field(60.0, gt=0, description="the shortest request deadline")
    ceiling_s: float = Field(1800.0, gt=0, description="the longest request deadline")
    slack: float = Field(3.0, ge=1.0, description="deadline over the expected queue time")
    assumed_rate: float = Field(4.0, gt=0, description="tokens/s before any is measured")


class Watchdog:
    """Guards the calls of one client to one server (see the module docstring)."""

    def __init__(self, http: httpx.AsyncClient, root: str, settings: WatchdogSettings) -> None:
        self.settings = settings
        self._http, self._root = http, root
        self._in_flight = 0
        self._tokens_ahead = 0
        self._checked = 0.0
        self._counters: tuple[float, float] | None = None
        self._moved = time.monotonic()
        self._read_at = 0.0
        self._rate: float | None = None
        self._lock = anyio.Lock()

    @property
    def rate(self) -> float | None:
        """The server's measured rate, prompt and generated tokens/s (None before any)."""
        return self._rate

    def deadline(self, tokens: int) -> float:
        """Seconds a request of `tokens` (its prompt and `max_tokens`) may take with what is in
        flight now."""
        s = self.settings
        return min(max(s.floor_s, s.slack * self._expected_s(tokens)), s.ceiling_s)

    def _expected_s(self, tokens: int) -> float:
        """Seconds the server needs for what is in flight and `tokens` more, at its rate."""
        return (self._tokens_ahead + tokens) / (self._rate or self.settings.assumed_rate)

    async def guard(
        self, call: Callable[[], Awaitable[T]], max_tokens: int, prompt_tokens: int = 0
    ) -> T:
        """`call()` under its deadline and the stall watch; `ServerUnavailable` on either."""
        tokens = max_tokens + prompt_tokens
        deadline = self.deadline(tokens)
        if self._in_flight == 0:
            self._moved = time.monotonic()  # an idle server generates nothing: not a stall
        self._in_flight += 1
        self._tokens_ahead += tokens
        try:
            with anyio.fail_after(self.settings.ceiling_s):
                return await self._watched(call, time.monotonic(), deadline)
        except TimeoutError:
            raise self._no_answer(self.settings.ceiling_s) from None
        finally:
            self._in_flight -= 1
            self._tokens_ahead -= tokens

    def _no_answer(self, waited_s: float) -> ServerUnavailable:
        """A passed deadline: `ServerBusy` where the queue it shared needed more than the
        ceiling allows (load); else the request was slow on its own."""
        crowd, s = self._in_flight, self.settings
        message = f"{self._root} gave no answer in {waited_s:.0f} s ({crowd} requests in flight)"
        if crowd > 1 and s.slack * self._expected_s(0) >= s.ceiling_s:
            return ServerBusy(message, crowd)
        return ServerUnavailable(message)

    async def _watched(
        self, call: Callable[[], Awaitable[T]], started: float, deadline: float
    ) -> T:
        result: list[T] = []

        async def run() -> None:
            result.append(await call())
            scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                scope = tg.cancel_scope
                tg.start_soon(run)
                await self._watch(started, deadline)
        except BaseExceptionGroup as group:  # one task failed; the other was cancelled
            raise group.exceptions[0]  # noqa: B904 - its own cause is the one to keep
        return result[0]

    async def _watch(self, started: float, deadline: float) -> None:
        """Until the request ends: a passed deadline or a stall raised, the counters read (the
        ceiling bounds it all, a slow read of the counters included)."""
        while True:
            left = started + deadline - time.monotonic()
            await anyio.sleep(max(min(self.settings.poll_s, left), 0.0))
            async with self._lock:
                now = time.monotonic()
                deadline = max(deadline, self.deadline(0))  # the queue it shares now
                if now - started >= deadline:
                    raise self._no_answer(deadline)
                if now - self._checked >= self.settings.poll_s:
                    self._checked = now
                    await self._read(now)
                idle = now - self._moved
                if self._counters is not None and idle > self.settings.stall_s:
                    raise ServerUnavailable(
                        f"{self._root} stalled: no token in {idle:.0f} s "
                        f"with {self._in_flight} requests in flight"
                    )

    async def _read(self, now: float) -> None:
        try:
            response = await self._http.get(f"{self._root}/metrics", timeout=self.settings.poll_s)
        except httpx.HTTPError:
            return  # a slow or refused read proves nothing; the requests fail on their own
        counters = parse_counters(response.text) if response.status_code == 200 else None
        if counters is None:
            return
        if self._counters is not None:
            elapsed = now - self._read_at
            rate = (sum(counters) - sum(self._counters)) / max(elapsed, 1e-3)
            if rate > 0 and elapsed < 3 * self.settings.poll_s:  # not across an idle gap
                self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate
            if counters != self._counters:
                self._moved = now
        self._counters, self._read_at = counters, now


def parse_counters(metrics: str) -> tuple[float, float] | None:
    """vLLM's (prompt, generation) token totals, summed over engines, from Prometheus text."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    seen = False
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[-1])
            seen = True
    return (totals[COUNTERS[0]], totals[COUNTERS[1]]) if seen else None
