"""Bring your own agent, end to end on real vLLM: `examples/agent.py` (the plain openai client)
talks to the gateway of `flywheel serve --source captured`, feedback arrives per session, a round
trains on that traffic, the alias moves, and the agent's next request is answered by the new
version, whose lineage names the sessions that trained it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from sqlalchemy import Engine

from examples.agent import ADD, solve
from memory import store
from memory.records import Attempt
from serving import capture
from tests.helpers import start_serve, stop_serve

pytestmark = pytest.mark.vllm

USER = {"Authorization": "Bearer user-key"}


def test_an_agents_traffic_trains_the_version_that_answers_it_next(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    judged = ["--evaluation", "tests.evaluations:served_by_name", "--held-out-share", "0"]
    flags = ["--source", "captured", "--train-every", "3", "--min-groups", "1", *judged]
    run = start_serve(
        tiny_server, tiny_model_path, tmp_path, [*flags, "--eval-tasks", "2"],
        env={"FLYWHEEL_API_KEYS": "user-key"},
    )  # fmt: skip
    served, db, gateway_port, log_path = run.process, run.db, run.gateway_port, run.log
    gateway = f"http://127.0.0.1:{gateway_port}"
    engine = store.open_store(db)

    try:
        _wait(served, log_path, "gateway", lambda: _answers(f"{gateway}/health"))
        client = OpenAI(base_url=f"{gateway}/v1", api_key="user-key")
        base = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ).model
        for number, score in ((1, 1.0), (2, 0.0)):
            session = f"agent-{number}"
            headers = {"X-Flywheel-Session": session, "X-Flywheel-Task": "sum-2-3"}
            solve(client, "What is 2 + 3?", headers, turns=2, first="auto")
            feedback = {"session": session, "score": score}
            httpx.post(f"{gateway}/v1/feedback", json=feedback, headers=USER).raise_for_status()
        trained = _wait(served, log_path, "promoted round", lambda: _promoted_round(engine))
        with store.transaction(engine) as session:
            (round_record,) = store.lineage(session, trained)[:1]
            groups = store.groups_by_id(session, round_record.group_ids)
        owner = capture.owner("user-key")  # the agent's key: its sessions are filed under it
        assert [g.plan.sessions for g in groups] == [
            [capture.owned(owner, "agent-1"), capture.owned(owner, "agent-2")]
        ]
        assert [a.reward for a in groups[0].attempts] == [1.0, 0.0]
        with store.transaction(engine) as session:
            (card,) = store.policy_version(session, trained).scorecards
            arithmetic = store.load_groups(session, "eval", policy_version=trained)
        # judged on the agent's own work (the user's evaluation), never on the task set's
        assert (card.evaluation, card.figure) == (
            "your evaluation tests.evaluations:served_by_name",
            "score margin",
        )
        assert card.against == base and card.n == 8 and card.low > 0 and arithmetic == []

        def answered_by_new() -> bool:
            reply = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            return reply.model == trained

        _wait(served, log_path, "answer from the new version", answered_by_new, 60)
        assert trained != base
    finally:
        stop_serve(served, tmp_path)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _promoted_round(engine: Engine) -> str | None:
    with store.transaction(engine) as session:
        promoted = store.promoted_policy(session)
        rounds = store.training_rounds(session)
    done = [r.policy_out for r in rounds if r.status == "done"]
    return promoted.name if promoted is not None and promoted.name in done else None


@pytest.mark.slow
def test_a_streaming_tool_agent_is_stored_token_exactly_and_its_next_version_answers_it(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """`examples/agent.py` (streaming, a forced first tool call, tool results sent back) on the
    real SmolLM2 behind `flywheel serve --source captured`, its model server behind a key of its
    own. Each task is met once, so groups come from siblings of each session's last turn,
    verified against the reference the user sent; the round is judged by the agent's own
    evaluation, and the version it promotes answers the agent next."""
    from agents.policy import SERVER_KEY_ENV
    from examples.agent import converse, tasks
    from memory.sessions import episodes, session_turns
    from tests.helpers import tiny_vllm

    with tiny_vllm(smollm2_path, tmp_path, api_key="server-key") as server:
        judged = ["--evaluation", "tests.evaluations:served_by_name", "--held-out-share", "0"]
        flags = ["--source", "captured", "--train-every", "3", "--min-groups", "1", *judged]
        run = start_serve(
            server.url, smollm2_path, tmp_path, flags,
            env={"FLYWHEEL_API_KEYS": "user-key", SERVER_KEY_ENV: "server-key"},
        )  # fmt: skip
        served, engine = run.process, store.open_store(run.db)
        gateway = f"http://127.0.0.1:{run.gateway_port}"
        try:
            _wait(served, run.log, "gateway", lambda: _answers(f"{gateway}/health"))
            client = OpenAI(base_url=f"{gateway}/v1", api_key="user-key")
            calls, sessions, confirmed = 0, [], 0
            for task, question, _ in tasks(16, seed=5):
                if len(sessions) >= 4 and confirmed >= 2:
                    break
                session = f"agent-{task}"
                headers = {"X-Flywheel-Session": session, "X-Flywheel-Task": task}
                answer, made = converse(client, question, headers, turns=2, first="required")
                calls += made
                # the user confirms the answer it got (the 135M model's sums are rarely right,
                # and a group needs a reward spread to train): its last number is the reference.
                # An answer with no number gets a reference it cannot meet; the agent goes on
                # until two answers were confirmed, so some group has a spread.
                numbers = re.findall(r"\d+", answer)
                confirmed += bool(numbers)
                feedback = {"session": session, "reference": (numbers or ["0"])[-1]}
                httpx.post(f"{gateway}/v1/feedback", json=feedback, headers=USER).raise_for_status()
                sessions.append(capture.owned(capture.owner("user-key"), session))
            assert calls >= len(sessions) >= 4  # every first turn called the tool, streamed
            with store.transaction(engine) as session:
                stitched, turns = episodes(session), session_turns(session)
            for sid in sessions:
                episode, last = stitched[sid], turns[sid][-1].attempts[0].sample
                assert isinstance(episode, Attempt) and episode.turns == 2, episode
                assert episode.sample is not None and last is not None
                # token-exact: the very ids the server put in its last prompt, then sampled
                ids = episode.sample.prompt_token_ids + episode.sample.completion_token_ids
                assert ids == last.prompt_token_ids + last.completion_token_ids
                assert _tokenized(
                    server.url, "server-key", smollm2_path.name, episode.messages[:-1]
                ) == (
                    last.prompt_token_ids
                )  # and that prompt is the server's own rendering of the transcript
            trained = _wait(served, run.log, "promoted round", lambda: _promoted_round(engine), 900)
            with store.transaction(engine) as session:
                (round_record,) = store.lineage(session, trained)[:1]
                groups = store.groups_by_id(session, round_record.group_ids)
            assert groups and all(len(g.attempts) == 4 for g in groups)  # one and 3 siblings
            assert all(g.plan.sessions[0] in sessions for g in groups)

            def answered_by_new() -> bool:  # the gateway follows the store every few seconds
                hello = [{"role": "user", "content": "hi"}]
                reply = client.chat.completions.create(model="policy", messages=hello, max_tokens=2)
                return reply.model == trained

            _wait(served, run.log, "answer from the new version", answered_by_new, 60)
        finally:
            stop_serve(served, tmp_path)


def _wait(served: Any, log: Path, what: str, check: Callable[[], Any], seconds: float = 400) -> Any:
    deadline = time.monotonic() + seconds
    while not (found := check()):
        assert served.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {what}:\n{log.read_text()[-3000:]}"
        time.sleep(1)
    return found


def _tokenized(server: str, key: str, model: str, messages: list[dict[str, Any]]) -> list[int]:
    """The server's own rendering of a transcript, ready for the assistant's next turn (every
    route of a keyed model server asks for its key, /tokenize included)."""
    body = {"model": model, "messages": messages, "add_generation_prompt": True, "tools": [ADD]}
    headers = {"Authorization": f"Bearer {key}"}
    reply = httpx.post(f"{server}/tokenize", json=body, headers=headers, timeout=60)
    reply.raise_for_status()
    return list(reply.json()["tokens"])
