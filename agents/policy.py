"""The policy client: one chat call to an OpenAI-compatible vLLM server, returned as a `Sample`.

1. vLLM's `return_token_ids` and `logprobs` give the exact prompt ids, completion ids and
   behaviour logprobs, so training sees what was sampled.
2. Retries, by kind of failure. A fast, transient failure (a refused or reset connection, a
   500/502/503/504, a 429) costs the server nothing, so the call is made again here, twice at
   most, after 0.5 s and 2 s. A timeout or a stall is never sent again from here (the server
   may still be working on it, and a resend would pile onto a slow server): the group goes back
   to the work queue, which retries it with backoff. Each call carries an idempotency key.
3. Every call runs under the watchdog (`agents.watchdog`): a deadline sized to the server's
   measured speed and queue, and a stall watch on its token counters.
4. Failures are one line: `ServerUnavailable` when the server could not answer (never an
   attempt's answer), `PolicyError` when it refused this request (recorded on the attempt).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
import openai
from openai import AsyncOpenAI

from agents.errors import AgentError, PolicyError, ServerUnavailable
from agents.watchdog import Watchdog, WatchdogSettings
from memory.records import Sample, SamplingSettings

CONNECT_TIMEOUT_S = 10.0
SERVER_KEY_ENV = "FLYWHEEL_SERVER_KEY"  # the model servers' own key, as `serving.access` reads it
RETRY_DELAYS_S = (0.5, 2.0)
# Statuses that say nothing about the request itself: the server, its model or our access.
UNAVAILABLE = frozenset({401, 403, 404, 408, 429})
TRANSIENT = frozenset({429, 500, 502, 503, 504})
T = TypeVar("T")


class _Transient(ServerUnavailable):
    """A failure worth one more try at once: nothing the server was working on was lost."""


@dataclass(frozen=True)
class Endpoint:
    """A model behind a client: the policy (the model being trained), or the reviewer that
    writes reflections and judgements (the policy itself unless another OpenAI-compatible
    endpoint is configured)."""

    client: PolicyClient
    model: str


class PolicyClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        watchdog: WatchdogSettings | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        """`api_key`: by default the model servers' own key (`serving.access`), if set."""
        self._root = base_url.rstrip("/")
        settings = watchdog or WatchdogSettings()
        api_key = api_key or os.environ.get(SERVER_KEY_ENV) or "EMPTY"
        self._http = http_client or httpx.AsyncClient(
            timeout=httpx.Timeout(settings.ceiling_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
            headers={"Authorization": f"Bearer {api_key}"},  # the watchdog's probes too
        )
        self.watchdog = Watchdog(self._http, self._root, settings)
        self._tokenized: dict[str, list[int]] = {}
        self._client = AsyncOpenAI(
            base_url=f"{self._root}/v1",
            api_key=api_key,
            timeout=settings.ceiling_s,
            max_retries=0,
            http_client=self._http,  # type: ignore[arg-type]  # openai types it as its vendored httpx
        )

    @property
    def url(self) -> str:
        return self._root

    async def healthy(self, timeout_s: float = 10.0) -> bool:
        """Whether the server answers its health check (at once, even under load)."""
        try:
            response = await self._http.get(f"{self._root}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        await self._client.close()
        await self._http.aclose()

    async def tokenize(self, model: str, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids the server would sample `messages` under (vLLM's /tokenize)."""
        return await self._tokenize({"messages": messages, "add_generation_prompt": True}, model)

    async def tokenize_open_turn(self, model: str, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of `messages` whose last (assistant) message is left open, as if sampled."""
        body = {
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
        }
        return await self._tokenize(body, model)

    async def tokenize_closed_turn(self, model: str, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of `messages` as a finished conversation: its last turn closed by the
        template's end-of-turn token."""
        return await self._tokenize({"messages": messages, "add_generation_prompt": False}, model)

    async def tokenize_text(self, model: str, text: str) -> list[int]:
        """The ids of plain `text`, without special tokens (vLLM's /tokenize)."""
        return await self._tokenize({"prompt": text, "add_special_tokens": False}, model)

    async def _tokenize(self, body: dict[str, Any], model: str) -> list[int]:
        """Tokenisation is deterministic per model: each distinct request goes out once."""
        key = json.dumps({"model": model, **body}, sort_keys=True)
        if key not in self._tokenized:
            self._tokenized[key] = await self._post_tokenize({"model": model, **body})
        return list(self._tokenized[key])

    async def _post_tokenize(self, body: dict[str, Any]) -> list[int]:
        return await self._with_retries(lambda: self._tokenize_once(body))

    async def _tokenize_once(self, body: dict[str, Any]) -> list[int]:
        try:
            response = await self.watchdog.guard(
                lambda: self._http.post(f"{self._root}/tokenize", json=body), max_tokens=0
            )
        except httpx.TimeoutException as exc:
            raise ServerUnavailable(f"{self._root}: tokenize: {_describe(exc)}") from exc
        except httpx.HTTPError as exc:
            raise _Transient(f"{self._root}: tokenize: {_describe(exc)}") from exc
        status = response.status_code
        if status in TRANSIENT:
            raise _Transient(f"{self._root}/tokenize answered {status}")
        if status >= 500 or status in UNAVAILABLE:
            raise ServerUnavailable(f"{self._root}/tokenize answered {status}")
        try:
            response.raise_for_status()
            return list(response.json()["tokens"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise PolicyError(f"tokenize failed: {_first_line(str(exc))}") from exc

    async def continue_turn(
        self,
        model: str,
        messages: list[dict[str, Any]],
        prefix: str,
        sampling: SamplingSettings,
        stop: list[str] | None = None,
    ) -> Sample:
        """Continue an assistant turn that starts with `prefix`; a stop string is kept in the
        output, so the text and ids are exactly what was sampled."""
        turn = [*messages, {"role": "assistant", "content": prefix}]
        body = {
            "continue_final_message": True,
            "add_generation_prompt": False,
            "include_stop_str_in_output": True,
        }
        return await self.sample(model, turn, sampling, extra_body=body, stop=stop)

    async def complete_ids(
        self,
        model: str,
        prompt_ids: list[int],
        sampling: SamplingSettings,
        stop: list[str] | None = None,
    ) -> Sample:
        """Continue exactly `prompt_ids` (the completions API takes token ids), so a turn
        resumed after earlier sampled tokens sees those very tokens, not a re-tokenisation. The
        sample's prompt is the one the server reports it ran (a server that adds or drops a
        token shows it there), so callers can check it is the one they sent."""
        response = await self._call(
            lambda: self._client.completions.create(
                model=model,
                prompt=prompt_ids,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=1,
                stop=stop,
                extra_body={"return_token_ids": True, "include_stop_str_in_output": True},
                extra_headers={"Idempotency-Key": uuid.uuid4().hex},
            ),
            sampling.max_tokens,
            len(prompt_ids),
        )
        if not response.choices:
            raise self._not_vllm("no choices")
        choice = response.choices[0]
        token_ids = getattr(choice, "token_ids", None)
        if token_ids is None:
            raise self._not_vllm("no token ids")
        logprobs = list(choice.logprobs.token_logprobs or []) if choice.logprobs else []
        if len(logprobs) != len(token_ids):
            raise self._not_vllm(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        ran = getattr(choice, "prompt_token_ids", None)
        if ran is None:
            raise self._not_vllm("no prompt token ids")
        return Sample(
            text=choice.text,
            prompt_token_ids=list(ran),
            completion_token_ids=list(token_ids),
            logprobs=[float(lp) for lp in logprobs],
            finish_reason=choice.finish_reason or "unknown",
        )

    async def sample(
        self,
        model: str,
        messages: list[dict[str, Any]],
        sampling: SamplingSettings,
        response_format: dict[str, Any] | None = None,
        extra_body: dict[str, Any] | None = None,
        stop: list[str] | None = None,
    ) -> Sample:
        """One completion; `response_format` asks the server for schema-constrained JSON."""
        extra: dict[str, Any] = {"response_format": response_format} if response_format else {}
        if stop:
            extra["stop"] = stop
        response = await self._call(
            lambda: self._client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=True,
                extra_body={"return_token_ids": True, **(extra_body or {})},
                extra_headers={"Idempotency-Key": uuid.uuid4().hex},
                **extra,
            ),
            sampling.max_tokens,
            prompt_estimate(messages),
        )
        return self._to_sample(response)

    async def _call(self, call: Any, max_tokens: int, prompt_tokens: int) -> Any:
        async def once() -> Any:
            try:
                return await self.watchdog.guard(call, max_tokens, prompt_tokens)
            except openai.APIError as exc:
                raise self._failure(exc) from exc

        return await self._with_retries(once)

    async def _with_retries(self, once: Callable[[], Awaitable[T]]) -> T:
        """`once()`, made again after a transient failure, at most `len(RETRY_DELAYS_S)` times."""
        for delay in RETRY_DELAYS_S:
            try:
                return await once()
            except _Transient:
                await anyio.sleep(delay)
        return await once()

    def _failure(self, exc: openai.APIError) -> AgentError:
        """Whether a failed call says something about the request, or only about the server,
        and whether trying it once more at once is worth it."""
        if isinstance(exc, openai.APITimeoutError):
            return ServerUnavailable(f"{self._root}: {type(exc).__name__}: {_describe(exc)}")
        if isinstance(exc, openai.APIConnectionError):
            return _Transient(f"{self._root}: {type(exc).__name__}: {_describe(exc)}")
        status = getattr(exc, "status_code", 0)
        if status in TRANSIENT:
            return _Transient(f"{self._root} answered {status}: {_describe(exc)}")
        if status >= 500 or status in UNAVAILABLE:
            return ServerUnavailable(f"{self._root} answered {status}: {_describe(exc)}")
        return PolicyError(f"{type(exc).__name__}: {_first_line(str(exc))}")

    def _not_vllm(self, what: str) -> ServerUnavailable:
        return ServerUnavailable(
            f"{self._root} returned {what}: is it a vLLM server (return_token_ids, logprobs)?"
        )

    def _to_sample(self, response: Any) -> Sample:
        if not response.choices:
            raise self._not_vllm("no choices")
        choice = response.choices[0]
        prompt_ids = getattr(response, "prompt_token_ids", None)
        token_ids = getattr(choice, "token_ids", None)
        if prompt_ids is None or token_ids is None:
            raise self._not_vllm("no token ids")
        content = choice.logprobs.content if choice.logprobs is not None else None
        logprobs = [entry.logprob for entry in content or []]
        if len(logprobs) != len(token_ids):
            raise self._not_vllm(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        return Sample(
            text=choice.message.content or "",
            prompt_token_ids=list(prompt_ids),
            completion_token_ids=list(token_ids),
            logprobs=logprobs,
            finish_reason=choice.finish_reason or "unknown",
        )


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no message)"])[0][:300]


def _describe(exc: Exception) -> str:
    """The most specific one-line reason: httpx hides it in the cause of openai's error."""
    cause = exc.__cause__
    detail = _first_line(str(cause)) if cause is not None and str(cause) else ""
    return detail or _first_line(str(exc)) or type(exc).__name__


def prompt_estimate(messages: list[dict[str, Any]]) -> int:
    """About how many tokens `messages` take, for a deadline: four characters a token, and a
    few for each turn's markers (no tokenizer call on the way to every request)."""
    return sum(len(str(m.get("content") or "")) // 4 + 4 for m in messages)
