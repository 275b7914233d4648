"""How a version trained on captured traffic is judged: on the agent's own work, never on a
built-in task set.

1. The user's evaluation (`evaluation = "module:function"`), when given: called as
   `function(base_url, model, api_key)` for the candidate and for the serving version, both by
   name on the model server (`api_key`: the server's own, `serving.access`). It runs the
   user's agent, unmodified, on their held-out tasks and returns one score per task, in the
   same order both times. The scorecard is the mean paired
   difference (`score margin`), with Student's 95% interval over the tasks.
2. Otherwise, held-out captured sessions (kept out of training when they arrived,
   `memory.sessions.held_out_turns`): at each logged assistant turn both versions continue the
   very prompt ids the server saw then (greedy), and the judge (the reviewer, else the serving
   version itself) compares the two replies blind, in an order drawn per turn
   (`agents.pairwise`). A session's margin is its turns' mean (+1 a win, -1 a loss, 0 a tie);
   the scorecard (`win margin`) is the mean over sessions with Student's 95% interval, so a
   long session weighs as one. A turn the judge could not decide is left out.
   A held-out session whose feedback sent a reference is scored by its own reward source, as
   its siblings would be: at its last turn both versions' answers are verified against the
   reference by the task set's verifier, and its margin is the candidate's reward minus the
   serving version's. No judge's taste enters where the user said what is right.
3. The gate (`serving.promotion`) promotes on a margin only when its interval is above zero. A
   server that fails while judging fails the stage: no scorecard is recorded from it.
"""

from __future__ import annotations

import inspect
import logging
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from agents import pairwise
from agents.collector import first_failure
from agents.errors import PolicyError, ServerUnavailable
from agents.policy import Endpoint, PolicyClient
from flows.errors import FlowError
from flows.settings import RunSettings
from flows.stages import reviewer_endpoint
from memory import sessions, store
from memory.records import Attempt, SamplingSettings, Scorecard
from reports.intervals import mean_interval
from serving import access, capture
from verifiers import plugin
from verifiers.catalog import averify

log = logging.getLogger(__name__)
IN_FLIGHT = 8  # turns compared at once


async def agent_card(
    settings: RunSettings, server_url: str, candidate: str, serving: str
) -> Scorecard:
    """The candidate's margin over the serving version on the agent's own held-out work."""
    if settings.evaluation:
        return await user_card(settings.evaluation, server_url, candidate, serving)
    return await sessions_card(settings, server_url, candidate, serving)


async def user_card(spec: str, server_url: str, candidate: str, serving: str) -> Scorecard:
    evaluate = plugin.function(spec, "evaluation")
    base_url = f"{server_url.rstrip('/')}/v1"
    mine = await _scores(evaluate, spec, (base_url, candidate, access.key() or "EMPTY"))
    theirs = await _scores(evaluate, spec, (base_url, serving, access.key() or "EMPTY"))
    if len(mine) != len(theirs) or len(mine) < 2:
        raise FlowError(
            f"evaluation {spec!r} gave {len(mine)} scores for {candidate} and {len(theirs)} for "
            f"{serving}: it must score the same held-out tasks (at least 2), in the same order"
        )
    value, low, high = mean_interval([a - b for a, b in zip(mine, theirs, strict=True)])
    return Scorecard(
        evaluation=f"your evaluation {spec}"[:300], figure="score margin", value=value,
        n=len(mine), low=low, high=high, against=serving,
    )  # fmt: skip


async def _scores(
    evaluate: Callable[..., Any], spec: str, call: tuple[str, str, str]
) -> list[float]:
    """One score per held-out task from the user's evaluation, called with `call` (base URL,
    model, key); any failure of theirs (their agent meeting a server that is down included)
    ends the stage in one line, never a score."""
    model = call[1]
    try:
        if inspect.iscoroutinefunction(evaluate):
            found = await evaluate(*call)
        else:
            found = await anyio.to_thread.run_sync(evaluate, *call)
        scores = [float(score) for score in found]
    except Exception as exc:  # noqa: BLE001 - the user's own code, reported in one line
        raise FlowError(
            f"evaluation {spec!r} failed on {model}: {type(exc).__name__}: {exc}"
        ) from exc
    if not all(math.isfinite(score) for score in scores):
        raise FlowError(f"evaluation {spec!r} gave a score that is not a finite number")
    return scores


async def sessions_card(
    settings: RunSettings, server_url: str, candidate: str, serving: str
) -> Scorecard:
    with store.transaction(store.shared_engine(settings.db_url)) as session:
        verified, held_out = sessions.held_out_split(session, settings.gate.turns)
    policy = PolicyClient(server_url)
    judge = reviewer_endpoint(settings) or Endpoint(policy, serving)
    try:
        duel = Duel(Endpoint(policy, candidate), Endpoint(policy, serving), judge)
        judged = await compare(held_out, duel)
        scored = await compare_verified(verified, duel, settings.taskset)
    finally:
        await policy.aclose()
        if judge.client is not policy:
            await judge.client.aclose()
    return card(judged, judge.model, serving, (settings.taskset, scored))


async def compare_verified(
    verified: dict[str, tuple[Attempt, str, str]], duel: Duel, taskset: str
) -> dict[str, list[float]]:
    """Each session's last turn answered by both versions and verified against its reference:
    the candidate's reward minus the serving version's, by session."""
    margins: dict[str, list[float]] = {sid: [] for sid in verified}

    async def one(sid: str, turn: Attempt, question: str, reference: str) -> None:
        task = capture.reference_task(taskset, question, reference)
        answers = await duel.answers(sid, turn)
        if answers is not None:
            mine, theirs = [(await averify(task, text)).reward for text in answers]
            margins[sid].append(mine - theirs)

    try:
        async with anyio.create_task_group() as group:
            for sid, (turn, question, reference) in verified.items():
                group.start_soon(one, sid, turn, question, reference)
    except* ServerUnavailable as outage:
        raise first_failure(outage) from None
    return margins


async def compare(held_out: dict[str, list[Attempt]], duel: Duel) -> dict[str, list[int]]:
    """Every held-out turn answered by both versions and judged: the candidate's results (+1,
    0, -1) by session."""
    margins: dict[str, list[int]] = {sid: [] for sid in held_out}
    try:
        async with anyio.create_task_group() as group:
            for sid, turns in held_out.items():
                for index, turn in enumerate(turns):
                    group.start_soon(duel.turn, sid, index, turn, margins[sid])
    except* ServerUnavailable as outage:  # the stage fails on it alone, as every stage does
        raise first_failure(outage) from None
    return margins


def card(
    margins: Mapping[str, Sequence[float]], judge: str, serving: str,
    verified: tuple[str, Mapping[str, Sequence[float]]] = ("", {}),
) -> Scorecard:  # fmt: skip
    """The win margin over sessions (each its turns' mean), with Student's 95% interval:
    `margins` judged by `judge`, and `verified`'s margins scored by its task set's verifier."""
    taskset, scored = verified
    per_session = [statistics.fmean(m) for m in (*margins.values(), *scored.values()) if m]
    turns = sum(len(m) for m in margins.values())
    what = f"{turns} held-out turns of {len(margins)} captured sessions, judged blind by {judge}"
    if scored:
        by = f"{len(scored)} held-out sessions verified by {taskset}"
        what = f"{by}, {what}" if margins else by
    if len(per_session) < 2:  # no spread to go by: the margin is anywhere it can be
        value = per_session[0] if per_session else 0.0
        return Scorecard(evaluation=what[:300], figure="win margin", value=value,
                         n=len(per_session), low=-1.0, high=1.0, against=serving)  # fmt: skip
    value, low, high = mean_interval(per_session)
    return Scorecard(evaluation=what[:300], figure="win margin", value=value,
                     n=len(per_session), low=max(low, -1.0), high=min(high, 1.0),
                     against=serving)  # fmt: skip


class Duel:
    """Both versions answer one logged turn; the judge compares them blind."""

    def __init__(self, candidate: Endpoint, serving: Endpoint, judge: Endpoint) -> None:
        self.candidate, self.serving, self.judge = candidate, serving, judge
        self.limiter = anyio.Semaphore(IN_FLIGHT)

    async def turn(self, sid: str, index: int, turn: Attempt, into: list[int]) -> None:
        """Append the candidate's result on this turn (+1, 0, -1), unless the judge could not
        decide or the server refused the prompt as bad."""
        answers = await self.answers(sid, turn)
        if answers is None:
            return
        mine, theirs = answers
        flip = random.Random(f"{self.candidate.model}|{sid}|{index}").random() < 0.5
        shown = (theirs, mine) if flip else (mine, theirs)
        async with self.limiter:
            try:
                said = await pairwise.compare(self.judge, turn.messages, *shown)
            except PolicyError as exc:
                log.warning("held-out turn %d of %s left out: %s", index + 1, sid, exc)
                return
        into.append(-said if flip else said)

    async def answers(self, sid: str, turn: Attempt) -> tuple[str, str] | None:
        """The candidate's and the serving version's greedy answers to the turn's logged
        prompt ids; None where the server refused the prompt as bad."""
        assert turn.sample is not None
        sampling = SamplingSettings(temperature=0.0, max_tokens=sessions.replay_tokens(turn))
        prompt = turn.sample.prompt_token_ids
        async with self.limiter:
            try:
                mine = await self.candidate.client.complete_ids(
                    self.candidate.model, prompt, sampling
                )
                theirs = await self.serving.client.complete_ids(
                    self.serving.model, prompt, sampling
                )
            except PolicyError as exc:
                log.warning("a held-out turn of %s left out: %s", sid, exc)
                return None
        return mine.text, theirs.text
