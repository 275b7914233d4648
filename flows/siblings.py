"""Groups from single sessions: an agent that meets each task once still gives groups to learn
from.

1. Which sessions: those whose task was met by fewer than two sessions
   (`memory.sessions.lone_sessions`); a session with no task tag is a task of its own.
2. Which turn: the last one only. Its logged prompt ids hold every earlier turn and every tool
   result as they happened, so `collect.group_size - 1` siblings sampled there by the serving
   version continue the very context the session's own answer had, and each is a whole episode (the
   session's earlier turns, then its own last answer). An earlier turn would need the tool
   results its sibling's own calls would have got; the logged ones fit only a sibling that
   calls the same tools with the same arguments, so earlier turns get no siblings.
3. Scored by the session's own reward source, so a group never mixes two: where the session was
   verified against a reference (`/v1/feedback {session, reference}`), each sibling is
   verified against the same reference by the task set's verifier; where it is unrated and
   the judge is on, the judge ranks it and its siblings together (`stages.judge_captured`). A
   session a person scored by hand gets none: nothing can score its siblings as that person
   would.
4. Siblings are sampled at the session's temperature (1.0 where it was greedy, which would
   repeat the answer) and stored as sessions of the same task tied to it (`sibling_of`), so
   `flywheel lineage` and `forget` reach them. Up to 8 sessions are served at once (one
   sibling after another within each), beside the live traffic the same server answers. A
   request that gets no answer in time from a server that is up (its `/health` answers: it is
   busy with that traffic, which the deadlines of the siblings' client do not see) ends this
   check's growing, not the check: the sessions done are stored, the rest wait for the next
   check, and the round trains on what is ready. A server that is down raises, and the
   siblings of the sessions not yet done are not stored.
5. With HeRL on (`--revise 1`) and a reviewer, a verified session none of whose answers (its
   own, its siblings') reached full reward gets the reviewer's answer at that turn: the
   reviewer reads the transcript as text (the tools' results included) and writes the
   assistant's reply, up to `collect.revise.revisions` draws (fewer once one reaches full
   reward); the best, if the verifier scores it above every answer of the policy's, is stored
   as one more sibling, of kind `revision` (the reviewer's work, not the policy's), its text
   in the policy's ids closed by the end-of-turn token the session's own turns stopped on.
   Its group trains it as HeRL trains a revision, in place of a failed answer
   (`trainer.dataset`). A policy that never answers a turn right (the agent's screen in
   docs/experiments.md) has nothing to learn from its own answers; this is what it learns from.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio

from agents.errors import PolicyError, ServerUnavailable
from agents.policy import Endpoint, PolicyClient
from flows.settings import RunSettings
from flows.stages import reviewer_endpoint
from memory import sessions, store
from memory.records import FULL_REWARD, UNRATED, Attempt, Group, Sample, SamplingSettings
from serving import capture
from verifiers.catalog import averify
from verifiers.errors import TaskFault

log = logging.getLogger(__name__)
SESSIONS_AT_ONCE = 8  # sessions whose siblings are sampled at once, beside the live traffic
REVIEW = (
    "Below is a conversation between a user and an assistant that calls tools, with each "
    "tool's result. Write the assistant's next reply to the user, following the system "
    "message's instructions. Reply with that reply alone."
)


async def grow(settings: RunSettings, server_url: str, version: str) -> int:
    """Siblings for every lone session that can be scored as it was, sampled by `version` (and,
    with HeRL on, the reviewer's answers where none was right); how many were stored."""
    policy = PolicyClient(server_url)
    reviewer = reviewer_endpoint(settings) if settings.collect.revise.enabled else None
    try:
        return await grow_with(settings, Endpoint(policy, version), reviewer)
    finally:
        await policy.aclose()
        if reviewer is not None:
            await reviewer.client.aclose()


async def grow_with(
    settings: RunSettings, policy: Endpoint, reviewer: Endpoint | None = None
) -> int:
    """`grow`, sampling with `policy`, the reviewer's answers from `reviewer`."""
    db = store.shared_engine(settings.db_url)
    with store.transaction(db) as session:
        lone = sessions.lone_sessions(session)
    grown = 0
    limiter = anyio.CapacityLimiter(SESSIONS_AT_ONCE)
    busy: list[ServerUnavailable] = []

    async def one(sid: str, turns: list[Group]) -> None:
        nonlocal grown
        reference = _reference(turns, settings)
        if reference is None and not _judged(turns, settings):
            return
        async with limiter:
            if busy:
                return  # the server is behind: this session waits for the next check
            try:
                drawn, scores = await _siblings(settings, (policy, reviewer), turns, reference)
            except ServerUnavailable as exc:
                if not await _up(policy, reviewer):
                    raise
                busy.append(exc)
                return
        with store.transaction(db) as session:
            names = sessions.add_siblings(session, sid, [episode for episode, _ in drawn])
            for name, (score, reason) in zip(names, scores, strict=False):
                store.record_session_feedback(session, name, score, reason, reference)
        grown += len(names)

    try:
        async with anyio.create_task_group() as group:
            for sid, turns in lone.items():
                group.start_soon(one, sid, turns)
    except* Exception as failed:  # a server that failed: its own error, not a group of them
        raise failed.exceptions[0] from None
    if busy:
        log.warning("siblings stop for this check, the rest wait for the next: %s", busy[0])
    if grown:
        log.info("%d siblings sampled for %d lone sessions", grown, len(lone))
    return grown


async def _up(*endpoints: Endpoint | None) -> bool:
    """Whether every server answers its health check (a request that timed out on a server that
    is up met load, not an outage)."""
    return all([await e.client.healthy() for e in endpoints if e is not None])


async def _siblings(
    settings: RunSettings, endpoints: tuple[Endpoint, Endpoint | None], turns: list[Group],
    reference: str | None,
) -> tuple[list[tuple[Attempt, str]], list[tuple[float, str]]]:  # fmt: skip
    """A session's siblings (one after another, so each is its own draw), scored against
    `reference` where there is one, with the reviewer's answer where none was right."""
    policy, reviewer = endpoints
    drawn = [await _sibling(policy, turns) for _ in range(settings.collect.group_size - 1)]
    if reference is None:
        return drawn, []
    scores = [await _verified(settings, turns, answer, reference) for _, answer in drawn]
    best = max([turns[-1].attempts[0].reward, *(score for score, _ in scores)])
    if reviewer is not None and best < FULL_REWARD:
        revised = await _reviewed(settings, (policy, reviewer), turns, (reference, best))
        if revised is not None:
            drawn.append(revised[0])
            scores.append(revised[1])
    return drawn, scores


async def _reviewed(
    settings: RunSettings, endpoints: tuple[Endpoint, Endpoint], turns: list[Group],
    bar: tuple[str, float],
) -> tuple[tuple[Attempt, str], tuple[float, str]] | None:  # fmt: skip
    """The reviewer's best answer at the session's last turn, verified against the reference
    of `bar`, as an episode of kind `revision` with its score; None when no draw scored above
    the policy's best (the bar's score), or the answer cannot be put in the policy's ids."""
    reference, best = bar
    policy, reviewer = endpoints
    last = turns[-1].attempts[0]
    assert last.sample is not None
    end = _end_of_turn(turns)
    if end is None:
        return None  # no end-of-turn token of the policy's own to close the answer with
    revise = settings.collect.revise
    asked = [{"role": "user", "content": f"{REVIEW}\n\n{transcript(last.messages)}"}]
    sampling = SamplingSettings(
        temperature=revise.temperature, max_tokens=sessions.replay_tokens(last)
    )
    chosen: tuple[Sample, float, str] | None = None
    for _ in range(revise.revisions):
        try:
            written = await reviewer.client.sample(reviewer.model, asked, sampling)
        except PolicyError as exc:  # this draw's own failure; a server that is down raises
            log.warning("the reviewer's answer for a session failed: %s", exc)
            continue
        score, reason = await _verified(settings, turns, written.text, reference)
        if chosen is None or score > chosen[1]:
            chosen = (written, score, reason)
        if score >= FULL_REWARD:
            break
    if chosen is None or chosen[1] <= best:
        return None
    written, score, reason = chosen
    ids = await policy.client.tokenize_text(policy.model, written.text)
    completion = [*ids, end]
    sample = Sample(
        text=written.text, prompt_token_ids=last.sample.prompt_token_ids,
        completion_token_ids=completion, logprobs=[0.0] * len(completion), finish_reason="stop",
    )  # fmt: skip
    answer = last.model_copy(update={
        "sample": sample, "kind": "revision", "policy_version": reviewer.model, "reward": score,
        "correct": score >= FULL_REWARD, "reason": UNRATED, "sampling": sampling, "improved": True,
        "parent_index": 0, "context": "revision",
        "generated_tokens": len(written.completion_token_ids),
    })  # fmt: skip
    episode = sessions.stitch([g.attempts[0] for g in turns[:-1]] + [answer])
    assert isinstance(episode, Attempt), episode
    reviewed = episode.model_copy(update={"policy_version": reviewer.model})  # whose answer
    return (reviewed, written.text), (score, f"the reviewer's answer, {reason}")


def _end_of_turn(turns: list[Group]) -> int | None:
    """The token the policy ended a turn of this session on (the last one that stopped)."""
    for turn in reversed(turns):
        sample = turn.attempts[0].sample
        if sample is not None and sample.finish_reason == "stop" and sample.completion_token_ids:
            return sample.completion_token_ids[-1]
    return None


def transcript(messages: list[dict[str, Any]]) -> str:
    """A conversation as text a reviewer reads: each message by its role, an assistant's tool
    calls by name and arguments, a tool's result as what it returned."""
    lines = []
    for message in messages:
        role = message.get("role", "?")
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            lines.append(f"{role} calls {function.get('name')}({function.get('arguments')})")
        content = message.get("content")
        if content:
            text = content if isinstance(content, str) else json.dumps(content)
            lines.append(f"{'tool result' if role == 'tool' else role}: {text}")
    return "\n".join(lines)


def _reference(turns: list[Group], settings: RunSettings) -> str | None:
    """The reference a session was verified against, where the task set can verify again."""
    reference = turns[-1].plan.reference
    return reference if reference is not None and settings.taskset else None


def _judged(turns: list[Group], settings: RunSettings) -> bool:
    """Whether the judge will score the session, and so its siblings beside it."""
    return settings.judge and turns[-1].attempts[0].reason == UNRATED


async def _sibling(policy: Endpoint, turns: list[Group]) -> tuple[Attempt, str]:
    """The session with its last answer sampled again by `policy` from the logged prefix, and
    that answer."""
    last = turns[-1].attempts[0]
    assert last.sample is not None
    logged = last.sampling
    sampling = SamplingSettings(
        temperature=logged.temperature or 1.0,
        top_p=logged.top_p,
        max_tokens=sessions.replay_tokens(last),
    )
    sample = await policy.client.complete_ids(policy.model, last.sample.prompt_token_ids, sampling)
    again = last.model_copy(update={
        "sample": sample, "policy_version": policy.model, "reward": 0.0, "correct": False,
        "format_ok": False, "answer": None, "reason": UNRATED, "sampling": sampling,
    })  # fmt: skip
    episode = sessions.stitch([g.attempts[0] for g in turns[:-1]] + [again])
    assert isinstance(episode, Attempt), episode  # the session stitched, and only its end moved
    return episode, sample.text


async def _verified(
    settings: RunSettings, turns: list[Group], answer: str, reference: str
) -> tuple[float, str]:
    """The verifier's score of a sibling's last answer against the session's reference (0,
    with the fault as the reason, where the task set's own code fails on it)."""
    task = capture.reference_task(settings.taskset, turns[0].question, reference)
    try:
        verdict = await averify(task, answer)
    except TaskFault as fault:
        return 0.0, f"the verifier could not score this answer: {fault}"
    return verdict.reward, f"verified: {verdict.reason}"
