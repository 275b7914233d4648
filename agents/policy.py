"""The policy client: one chat call to an OpenAI-compatible vLLM server, returned as a `Sample`.

1. vLLM's `return_token_ids` and `logprobs` give the exact prompt ids, completion ids and
   behaviour logprobs, so training sees what was sampled.
2. The openai client owns retries (twice, on timeouts and 5xx); nothing above it retries again.
   Each call carries an idempotency key; the store's natural keys make a retried turn land once.
3. Every failure becomes `PolicyError` with a one-line reason for the attempt that asked.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI

from agents.errors import PolicyError
from memory.records import Sample, SamplingSettings

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Reviewer:
    """Who writes reflections and judgements: the policy itself unless another
    OpenAI-compatible endpoint is configured."""

    client: PolicyClient
    model: str


class PolicyClient:
    def __init__(
        self,
        base_url: str,
        api_key: str = "EMPTY",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 2,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._root = base_url.rstrip("/")
        self._http = http_client or httpx.AsyncClient(timeout=timeout_s)
        self._tokenized: dict[str, list[int]] = {}
        self._client = AsyncOpenAI(
            base_url=f"{self._root}/v1",
            api_key=api_key,
            timeout=timeout_s,
            max_retries=max_retries,
            http_client=self._http,
        )

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
        try:
            response = await self._http.post(f"{self._root}/tokenize", json=body)
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
        resumed after earlier sampled tokens sees those very tokens, not a re-tokenisation."""
        try:
            response = await self._client.completions.create(
                model=model,
                prompt=prompt_ids,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=1,
                stop=stop,
                extra_body={"return_token_ids": True, "include_stop_str_in_output": True},
                extra_headers={"Idempotency-Key": uuid.uuid4().hex},
            )
        except openai.APIError as exc:
            raise PolicyError(f"{type(exc).__name__}: {_first_line(str(exc))}") from exc
        if not response.choices:
            raise PolicyError("server returned no choices")
        choice = response.choices[0]
        token_ids = getattr(choice, "token_ids", None)
        if token_ids is None:
            raise PolicyError("server returned no token ids (is it vLLM with return_token_ids?)")
        logprobs = list(choice.logprobs.token_logprobs or []) if choice.logprobs else []
        if len(logprobs) != len(token_ids):
            raise PolicyError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        return Sample(
            text=choice.text,
            prompt_token_ids=list(prompt_ids),
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
        try:
            response = await self._client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=True,
                extra_body={"return_token_ids": True, **(extra_body or {})},
                extra_headers={"Idempotency-Key": uuid.uuid4().hex},
                **extra,  # type: ignore[arg-type]
            )
        except openai.APIError as exc:
            raise PolicyError(f"{type(exc).__name__}: {_first_line(str(exc))}") from exc
        return _to_sample(response)


def _to_sample(response: Any) -> Sample:
    if not response.choices:
        raise PolicyError("server returned no choices")
    choice = response.choices[0]
    prompt_ids = getattr(response, "prompt_token_ids", None)
    token_ids = getattr(choice, "token_ids", None)
    if prompt_ids is None or token_ids is None:
        raise PolicyError("server returned no token ids (is it vLLM with return_token_ids?)")
    content = choice.logprobs.content if choice.logprobs is not None else None
    logprobs = [entry.logprob for entry in content or []]
    if len(logprobs) != len(token_ids):
        raise PolicyError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
    return Sample(
        text=choice.message.content or "",
        prompt_token_ids=list(prompt_ids),
        completion_token_ids=list(token_ids),
        logprobs=logprobs,
        finish_reason=choice.finish_reason or "unknown",
    )


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no message)"])[0][:300]
