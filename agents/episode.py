"""Multi-turn episodes: the policy acts in an environment (verifiers' `Environment`) turn by turn.

1. Token-exact: an episode is one token sequence, the prompt, then each assistant turn and each
   environment reply. Every turn continues exactly the ids so far (the completions API takes
   ids), and a reply's ids, with the chat template's turn markers, are the difference of two
   /tokenize calls (the transcript with the assistant turn left open, and with the reply and a
   new assistant turn), so nothing sampled is ever re-tokenised. Replies are forced spans:
   recorded, never trained.
2. Tool calls use the OpenAI tools format. The tools are described in the system prompt and a
   model served without a tool parser writes calls as
   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes style); they are parsed
   into OpenAI `tool_calls` for the environment, which validates them.
3. The episode ends when the environment says so, when a turn is cut by the token limit, when
   the sequence would pass `max_sequence` tokens, or on a server error (recorded on the
   attempt with its reason, never raised).
4. The attempt: the transcript as messages, one `Sample` (the prompt's ids; then every turn and
   reply), the replies as forced spans, and the environment's verdict as reward.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from agents.errors import PolicyError
from agents.policy import PolicyClient
from memory.records import Attempt, Sample, SamplingSettings
from verifiers.episode import Environment, EpisodeStatus

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_SEQUENCE = 1800


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool["function"]) for tool in tools)
    return (
        "You can call these tools:\n"
        f"{listed}\n"
        'Call one by writing <tool_call>{"name": NAME, "arguments": {...}}</tool_call>; '
        "you may write several calls in one turn."
    )


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """OpenAI-format tool calls from Hermes-style blocks; a block that is not a JSON object
    with a name becomes a call the environment will refuse, not a silent drop."""
    calls = []
    for number, block in enumerate(TOOL_CALL.findall(text)):
        try:
            parsed = json.loads(block)
            name = str(parsed["name"])
            arguments = json.dumps(parsed.get("arguments", {}))
        except (json.JSONDecodeError, KeyError, TypeError):
            name, arguments = "<malformed>", block[:2000]
        calls.append(
            {
                "id": f"call_{number}_{uuid.uuid4().hex[:6]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return calls


async def run_episode(
    client: PolicyClient,
    env: Environment,
    model: str,
    sampling: SamplingSettings,
    index: int,
) -> Attempt:
    messages = env.reset()
    tools = getattr(env, "tools", None)
    if tools is not None:
        system = f"{messages[0]['content']}\n\n{tool_prompt(tools())}"
        messages = [{"role": "system", "content": system}, *messages[1:]]
    base = {"sample_index": index, "kind": "base", "policy_version": model, "sampling": sampling}
    try:
        prompt = await client.tokenize(model, messages)
    except PolicyError as exc:
        return Attempt.failed(str(exc), **base, messages=messages)
    ids: list[int] = []
    logprobs: list[float] = []
    forced: list[tuple[int, int]] = []
    texts: list[str] = []
    generated = 0
    reason = ""
    for _ in range(env.max_steps):
        try:
            turn = await client.complete_ids(model, prompt + ids, sampling)
        except PolicyError as exc:
            return Attempt.failed(str(exc), **base, messages=messages)
        ids += turn.completion_token_ids
        logprobs += turn.logprobs
        generated += len(turn.completion_token_ids)
        texts.append(turn.text)
        action = {"role": "assistant", "content": turn.text}
        if calls := parse_tool_calls(turn.text):
            action["tool_calls"] = calls
        observation = env.step(action)
        messages = [*messages, action]
        if turn.finish_reason == "length":
            reason = "turn cut at the token limit"
            break
        if observation.done:
            reason = observation.reason
            break
        try:
            reply = await _reply_ids(client, model, messages, list(observation.messages))
        except PolicyError as exc:
            return Attempt.failed(str(exc), **base, messages=messages)
        if turn.completion_token_ids and reply and turn.completion_token_ids[-1] == reply[0]:
            reply = reply[1:]  # the sampled end-of-turn token is already in place
        if len(prompt) + len(ids) + len(reply) + sampling.max_tokens > MAX_SEQUENCE:
            reason = "episode too long for the context"
            break
        forced.append((len(ids), len(ids) + len(reply)))
        ids += reply
        logprobs += [0.0] * len(reply)
        messages = [*messages, *observation.messages]
    verdict = env.verdict()
    sample = Sample(
        text="\n".join(texts),
        prompt_token_ids=prompt,
        completion_token_ids=ids,
        logprobs=logprobs,
        finish_reason="stop",
    )
    status = getattr(env, "status", EpisodeStatus.RUNNING)
    return Attempt(
        **base,
        messages=messages,
        sample=sample,
        forced_spans=forced,
        generated_tokens=generated,
        reward=verdict.reward,
        correct=verdict.correct,
        format_ok=verdict.format_ok,
        answer=verdict.answer,
        reason=f"{verdict.reason}"
        + (f"; {reason}" if reason and status is EpisodeStatus.RUNNING else ""),
    )


async def _reply_ids(
    client: PolicyClient,
    model: str,
    transcript: list[dict[str, Any]],
    replies: list[dict[str, Any]],
) -> list[int]:
    """The ids that follow an assistant turn: its end marker, the replies, a new turn's start."""
    flat = [_plain(m) for m in transcript]
    open_turn = await client.tokenize_open_turn(model, flat)
    full = await client.tokenize(model, flat + [_plain(m) for m in replies])
    if full[: len(open_turn)] != open_turn:
        raise PolicyError("the chat template does not extend the transcript: no token-exact reply")
    return full[len(open_turn) :]


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message as plain text for the chat template: tool replies become user-visible text."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"Tool result: {message['content']}"}
    return {"role": message["role"], "content": message.get("content") or ""}
