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
   attempt with its reason, never raised). The environment is the task set's own code: each
   call runs under the deadline in force (`verifiers.guard`), and one that raises or hangs ends
   the episode as the task's fault (`Attempt.faulted`).
4. With EAD (`Annealing` in the sampling settings) each turn is sampled at the temperature the
   schedule gives the episode's next token: one temperature per turn, the per-step
   approximation of annealing over tokens.
5. The attempt: the transcript as messages, one `Sample` (the prompt's ids; then every turn and
   reply; its text numbers the turns and replies, for reviewers), the replies as forced spans,
   and the environment's verdict as reward.
6. With library lessons (a guided slot when the library is on), each step is shown the task's
   lessons that fit what it observes (SLEA-RL's step-level retrieval, `agents.lessons`).
7. Reflect-then-retry (R3L): a retry replays the parent's turns before the reflection's
   `retry_from_step` verbatim (the same token ids, the same actions into a replayed
   environment) and plays on with the principle in the system prompt. The replayed tokens are
   the pivot, and the parent's bare prompt makes the distill copy, as for one-step tasks.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from agents import lessons as library_lessons
from agents.errors import PolicyError
from agents.policy import Endpoint, PolicyClient
from memory.records import STEP_LESSONS, Attempt, Sample, SamplingSettings
from verifiers import guard
from verifiers.episode import Environment
from verifiers.errors import TaskFault
from verifiers.verdict import Verdict

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
    policy: Endpoint,
    env: Environment,
    sampling: SamplingSettings,
    index: int,
    lessons: Sequence[str] = (),
) -> Attempt:
    """One episode from the environment's opening; with library `lessons`, the ones that fit
    each step are shown there (`agents.lessons`)."""
    base: dict[str, Any] = {
        "sample_index": index, "kind": "base", "policy_version": policy.model, "sampling": sampling
    }  # fmt: skip
    try:
        messages = await _opening(env)
    except TaskFault as fault:
        return Attempt.faulted(str(fault), **base, messages=[])
    trace = _Trace(candidates=lessons)
    if lessons:
        base.update(kind="guided", context=STEP_LESSONS)
        trace.shown = library_lessons.at_opening(library_lessons.observed(messages), lessons)
        messages = library_lessons.in_system(messages, trace.shown)
    try:
        prompt = await policy.client.tokenize(policy.model, messages)
    except PolicyError as exc:
        return Attempt.failed(str(exc), **base, messages=messages)
    return await _play(policy, env, sampling, base, prompt, messages, trace)


async def retry_episode(
    client: PolicyClient,
    fresh: Environment,
    parent: Attempt,
    principle: str,
    from_turn: int,
    sampling: SamplingSettings,
) -> Attempt:
    """R3L for episodes: replay the parent's first `from_turn` turns verbatim (token ids and
    actions), then play on with the principle as guidance in the system prompt. The replayed
    tokens are the pivot (never trained); the bare prompt is the parent's, for the distill copy."""
    assert parent.sample is not None
    turns = [m for m in parent.messages if m["role"] == "assistant"]
    from_turn = max(0, min(from_turn, len(turns) - 1))
    pivot = 0 if from_turn == 0 else parent.forced_spans[from_turn - 1][1]
    try:
        opening = await _opening(fresh)
    except TaskFault as fault:
        return Attempt.faulted(str(fault), **_retry_record(parent, principle, pivot, sampling),
                               messages=[])  # fmt: skip
    guided = [
        {
            "role": "system",
            "content": f"{opening[0]['content']}\n\nGuidance from an earlier try: {principle}",
        },
        *opening[1:],
    ]
    replayed = parent.messages[len(opening) : _turn_position(parent.messages, from_turn)]
    base = _retry_record(parent, principle, pivot, sampling)
    try:
        prompt = await client.tokenize(parent.policy_version, guided)
    except PolicyError as exc:
        return Attempt.failed(str(exc), **base, messages=guided)
    trace = _Trace(
        ids=parent.sample.completion_token_ids[:pivot],
        logprobs=parent.sample.logprobs[:pivot],
        forced=[span for span in parent.forced_spans if span[1] <= pivot],
        texts=[m.get("content") or "" for m in replayed if m["role"] == "assistant"],
    )
    actions = [_action(m) for m in turns[:from_turn]]
    try:
        env = await guard.run(_label(fresh, "replay"), fresh.replay, actions)
    except TaskFault as fault:
        return Attempt.faulted(str(fault), **base, messages=guided)
    policy = Endpoint(client, parent.policy_version)
    retry = await _play(policy, env, sampling, base, prompt, [*guided, *replayed], trace)
    return retry.model_copy(
        update={"improved": retry.error is None and retry.reward > parent.reward}
    )


def _retry_record(
    parent: Attempt, principle: str, pivot: int, sampling: SamplingSettings
) -> dict[str, Any]:
    assert parent.sample is not None
    return {
        "sample_index": parent.sample_index,
        "kind": "retry",
        "policy_version": parent.policy_version,
        "sampling": sampling,
        "context": "hint",
        "guidance": principle,
        "parent_index": parent.sample_index,
        "bare_prompt_token_ids": parent.sample.prompt_token_ids,
        "pivot_tokens": pivot,
    }


class _Trace:
    """The token sequence after the prompt: sampled turns and forced replies, and the library
    lessons the episode's steps were shown."""

    def __init__(
        self,
        ids: list[int] | None = None,
        logprobs: list[float] | None = None,
        forced: list[tuple[int, int]] | None = None,
        texts: list[str] | None = None,
        candidates: Sequence[str] = (),
    ) -> None:
        self.ids, self.logprobs = list(ids or []), list(logprobs or [])
        self.forced, self.texts = list(forced or []), list(texts or [])
        self.generated = 0
        self.candidates = tuple(candidates)  # library lessons the steps choose from
        self.shown: list[str] = []  # the ones shown so far, in order


def _turn(sampling: SamplingSettings, trace: _Trace) -> SamplingSettings:
    """A turn's sampling: with EAD, the temperature the schedule gives the episode's next token
    (one temperature per turn: the per-step approximation)."""
    if sampling.annealing is None:
        return sampling
    return sampling.model_copy(
        update={"temperature": sampling.annealing.temperature(trace.generated)}
    )


async def _play(
    policy: Endpoint,
    env: Environment,
    sampling: SamplingSettings,
    base: dict[str, Any],
    prompt: list[int],
    messages: list[dict[str, Any]],
    trace: _Trace,
) -> Attempt:
    try:
        return await _played(policy, env, sampling, base, prompt, messages, trace)
    except TaskFault as fault:
        return Attempt.faulted(str(fault), **base, messages=messages)


async def _played(
    policy: Endpoint,
    env: Environment,
    sampling: SamplingSettings,
    base: dict[str, Any],
    prompt: list[int],
    messages: list[dict[str, Any]],
    trace: _Trace,
) -> Attempt:
    client, model = policy.client, policy.model
    reason = ""
    while len(trace.texts) < env.max_steps:
        try:
            turn = await client.complete_ids(model, prompt + trace.ids, _turn(sampling, trace))
        except PolicyError as exc:
            return Attempt.failed(str(exc), **base, messages=messages)
        trace.ids += turn.completion_token_ids
        trace.logprobs += turn.logprobs
        trace.generated += len(turn.completion_token_ids)
        trace.texts.append(turn.text)
        action = _action({"role": "assistant", "content": turn.text})
        observation = await guard.run(_label(env, "step"), env.step, action)
        messages = [*messages, action]
        if observation.done:
            messages = [*messages, *observation.messages]  # for the record; nothing follows
            break
        if turn.finish_reason == "length":
            reason = "turn cut at the token limit"
            break
        replies, shown = _with_step_lessons(list(observation.messages), trace)
        try:
            reply = await _reply_ids(policy, messages, replies)
        except PolicyError as exc:
            return Attempt.failed(str(exc), **base, messages=messages)
        if turn.completion_token_ids and reply and turn.completion_token_ids[-1] == reply[0]:
            reply = reply[1:]  # the sampled end-of-turn token is already in place
        if len(prompt) + len(trace.ids) + len(reply) + sampling.max_tokens > MAX_SEQUENCE:
            reason = "episode too long for the context"
            break
        trace.forced.append((len(trace.ids), len(trace.ids) + len(reply)))
        trace.ids += reply
        trace.logprobs += [0.0] * len(reply)
        trace.shown += shown
        messages = [*messages, *replies]
    verdict = await guard.run(_label(env, "verdict"), env.verdict)
    return _attempt(verdict, base, messages, prompt, trace, reason)


def _with_step_lessons(
    replies: list[dict[str, Any]], trace: _Trace
) -> tuple[list[dict[str, Any]], list[str]]:
    """The environment's replies, followed by the lessons new to this step if any; and those
    lessons (shown once the reply is in the sequence)."""
    if not trace.candidates:
        return replies, []
    observed = library_lessons.observed(replies)
    new = library_lessons.at_step(observed, trace.candidates, trace.shown)
    return ([*replies, library_lessons.step_message(new)] if new else replies), new


def _attempt(
    verdict: Verdict,
    base: dict[str, Any],
    messages: list[dict[str, Any]],
    prompt: list[int],
    trace: _Trace,
    cut: str,
) -> Attempt:
    lines = []
    for number, text in enumerate(trace.texts):
        lines.append(f"Turn {number}: {text.strip()}")
        if reply := _reply_text(messages, number):
            lines.append(f"Reply: {reply}")
    reason = verdict.reason + (f"; {cut}" if cut else "")
    if verdict.feedback:
        reason += f"; {verdict.feedback[-1]}"
    sample = Sample(
        text="\n".join(lines),
        prompt_token_ids=prompt,
        completion_token_ids=trace.ids,
        logprobs=trace.logprobs,
        finish_reason="stop",
    )
    if trace.shown:
        base = {**base, "guidance": "\n".join(trace.shown)}
    return Attempt(
        **base,
        messages=messages,
        sample=sample,
        forced_spans=trace.forced,
        generated_tokens=trace.generated,
        turns=max(1, len(trace.texts)),
        reason=reason,
        **verdict.scores(),
    )


def _label(env: Environment, call: str) -> str:
    return f"environment {type(env).__name__}: {call}"


async def _opening(env: Environment) -> list[dict[str, Any]]:
    messages = await guard.run(_label(env, "reset"), env.reset)
    tools = getattr(env, "tools", None)
    if tools is None:
        return messages
    described = await guard.run(_label(env, "tools"), tools)
    system = f"{messages[0]['content']}\n\n{tool_prompt(described)}"
    return [{"role": "system", "content": system}, *messages[1:]]


def _action(message: dict[str, Any]) -> dict[str, Any]:
    action = {"role": "assistant", "content": message.get("content") or ""}
    if calls := parse_tool_calls(action["content"]):
        action["tool_calls"] = calls
    return action


def _reply_text(messages: list[dict[str, Any]], turn: int) -> str:
    """What came back after assistant turn `turn`: the messages up to the next turn."""
    start = _turn_position(messages, turn) + 1
    following = []
    for message in messages[start:]:
        if message["role"] == "assistant":
            break
        following.append(str(message.get("content") or ""))
    return " | ".join(following)


def _turn_position(messages: list[dict[str, Any]], turn: int) -> int:
    """The index in `messages` of assistant turn `turn`."""
    seen = -1
    for position, message in enumerate(messages):
        if message["role"] == "assistant":
            seen += 1
            if seen == turn:
                return position
    return len(messages)


async def _reply_ids(
    policy: Endpoint, transcript: list[dict[str, Any]], replies: list[dict[str, Any]]
) -> list[int]:
    """The ids that follow an assistant turn: its end marker, the replies, a new turn's start."""
    client, model, flat = policy.client, policy.model, [_plain(m) for m in transcript]
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
