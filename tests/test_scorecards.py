"""A version trained on captured traffic is judged on the agent's own work: held-out sessions
compared blind by a judge, or the user's own evaluation; the gate promotes a margin only when
its 95% interval is above zero."""

from __future__ import annotations

import json
import re

import anyio
import httpx
import pytest

from agents.policy import Endpoint
from flows import scorecards
from flows.errors import FlowError
from memory import store
from memory.records import Attempt, PolicyVersion, Sample, SamplingSettings, Scorecard
from serving import promotion
from tests.helpers import client_for, completion

REPLIES = {"candidate": "the right answer", "serving": "a wrong answer"}


def turn(prompt: list[int]) -> Attempt:
    sample = Sample(text="logged", prompt_token_ids=prompt, completion_token_ids=[7],
                    logprobs=[-0.1], finish_reason="stop")  # fmt: skip
    return Attempt(
        sample_index=0, policy_version="serving", reason="captured",
        messages=[{"role": "user", "content": "what is 2 + 3?"}],
        sampling=SamplingSettings(temperature=0.7, max_tokens=0), sample=sample,
        reward=0.0, correct=False, format_ok=False, answer=None,
    )  # fmt: skip


def server(seen: list[dict]):
    """Each version continues a prompt with its own reply; the judge prefers the right answer
    wherever it is shown, and `seen` keeps what every request asked."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path.endswith("/completions") and "prompt" in body:
            logprobs = {"token_logprobs": [-0.2], "tokens": ["x"], "text_offset": [0],
                        "top_logprobs": [None]}  # fmt: skip
            choice = {"index": 0, "text": REPLIES[body["model"]], "finish_reason": "stop",
                      "token_ids": [9], "prompt_token_ids": body["prompt"],
                      "logprobs": logprobs}  # fmt: skip
            reply = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"]}
            return httpx.Response(200, json=reply | {"choices": [choice]})
        shown = body["messages"][-1]["content"]
        first = re.search(r"Reply 1:\n(.*)\n\nReply 2", shown, re.S)
        better = "1" if first and first.group(1) == REPLIES["candidate"] else "2"
        assert body["structured_outputs"] == {"choice": ["1", "2", "tie"]}
        return httpx.Response(200, json=completion(better, [5]))

    return handle


def test_held_out_turns_are_answered_by_both_versions_and_judged_blind_in_both_orders() -> None:
    seen: list[dict] = []
    policy = client_for(server(seen))
    duel = scorecards.Duel(
        Endpoint(policy, "candidate"), Endpoint(policy, "serving"), Endpoint(policy, "judge")
    )
    held_out = {f"s{i}": [turn([1, 2, i]), turn([1, 2, i, 4])] for i in range(8)}
    margins = anyio.run(scorecards.compare, held_out, duel)
    assert margins == {sid: [1, 1] for sid in held_out}
    continued = [b for b in seen if "prompt" in b]
    assert sorted(map(tuple, (b["prompt"] for b in continued))) == sorted(
        tuple(t.sample.prompt_token_ids) for ts in held_out.values() for t in ts for _ in (0, 1)
    )  # both versions continue the very ids logged, greedy
    assert {b["temperature"] for b in continued} == {0.0}
    judged = [b["messages"][-1]["content"] for b in seen if "messages" in b]
    shown_first = [j.index(REPLIES["candidate"]) < j.index(REPLIES["serving"]) for j in judged]
    assert len(judged) == 16 and 0 < sum(shown_first) < 16  # never always in one position
    assert all("candidate" not in j and "serving" not in j for j in judged)  # blind
    card = scorecards.card(margins, "judge", "serving")
    assert (card.figure, card.value, card.n, card.against) == ("win margin", 1.0, 8, "serving")
    assert card.low == card.high == 1.0


def test_a_margin_is_a_mean_over_sessions_with_students_interval() -> None:
    margins = {"a": [1, 1, 1, 1], "b": [-1], "c": [1, 0], "d": [1]}  # a long session weighs as one
    card = scorecards.card(margins, "judge", "serving")
    assert card.n == 4 and card.value == pytest.approx((1 - 1 + 0.5 + 1) / 4)
    assert card.low < 0 < card.value < card.high  # t with 3 degrees of freedom: wide
    alone = scorecards.card({"a": [1, 1], "b": []}, "judge", "serving")
    assert (alone.n, alone.low, alone.high) == (1, -1.0, 1.0)  # one session: no spread to go by
    assert scorecards.card({}, "judge", "serving").n == 0


@pytest.fixture
def engine(db_url: str):
    return store.open_store(db_url)


def versions(engine, cards: list[Scorecard]) -> None:
    with store.transaction(engine) as session:
        store.save_policy_version(session, PolicyVersion(name="serving", base_model="b"))
        store.set_promoted(session, "serving", True)
        store.save_policy_version(session, PolicyVersion(name="next", base_model="b"))
        for card in cards:
            store.record_scorecard(session, "next", card)


def margin(low: float, value: float = 0.2, against: str = "serving") -> Scorecard:
    return Scorecard(evaluation="held-out sessions", figure="win margin", value=value, n=20,
                     low=low, high=value + 0.1, against=against)  # fmt: skip


@pytest.mark.parametrize(
    ("card", "promoted", "reason"),
    [
        (margin(0.05), True, "passed the evaluation gate"),
        (margin(-0.01), False, "its 95% interval is not above 0.0"),
        (margin(0.0, value=0.0), False, "its 95% interval is not above 0.0"),  # a tie: never
        (margin(0.05, against="older"), False, "over older, but serving serves now"),
    ],
)
def test_the_gate_promotes_a_margin_only_when_its_interval_is_above_zero(
    engine, card: Scorecard, promoted: bool, reason: str
) -> None:
    versions(engine, [card])
    with store.transaction(engine) as session:
        event = promotion.promote(session, "next", promotion.Gate())
        recorded = store.policy_version(session, "next").scorecards
    assert (event.action == "promote", reason in event.reason) == (promoted, True), event.reason
    assert recorded == [card]  # which evaluation judged it, with its n and interval


def test_an_open_gate_lets_any_margin_through_and_a_higher_one_asks_more(engine) -> None:
    versions(engine, [margin(-1.0, value=0.0)])  # no held-out session yet: all it can be
    with store.transaction(engine) as session:
        assert promotion.refusal(session, store.policy_version(session, "next"),
                                 promotion.Gate(min_gain=-1.0)) is None  # fmt: skip
        asked = promotion.refusal(session, store.policy_version(session, "next"),
                                  promotion.Gate(min_gain=0.1))  # fmt: skip
    assert asked is not None and "not above 0.1" in asked


def test_a_version_judged_by_both_must_pass_both(engine) -> None:
    tasks = Scorecard(evaluation="held-out tasks of arithmetic", figure="pass@1", value=0.1,
                      n=64, low=0.05, high=0.2)  # fmt: skip
    versions(engine, [tasks, margin(0.05)])
    with store.transaction(engine) as session:
        store.record_evaluation(session, "serving", 0.3)
        event = promotion.promote(session, "next", promotion.Gate())
        assert store.policy_version(session, "next").eval_pass_at_1 == 0.1
    assert event.action == "refuse" and "held-out pass@1 0.100 is below 0.300" in event.reason


def test_the_users_evaluation_judges_by_paired_scores_on_its_own_tasks() -> None:
    spec = "tests.evaluations:by_name"
    card = anyio.run(scorecards.user_card, spec, "http://models:8000", "policy-r1", "policy")
    assert (card.figure, card.n, card.against) == ("score margin", 8, "policy")
    assert card.value == pytest.approx(0.75) and 0 < card.low < 0.75 < card.high
    assert card.evaluation == f"your evaluation {spec}"
    from tests import evaluations

    assert evaluations.CALLS[-2:] == [("http://models:8000/v1", "policy-r1"),
                                      ("http://models:8000/v1", "policy")]  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        (
            "tests.evaluations:broken",
            "failed on policy-r1: ConnectError: the agent's server is down",
        ),
        ("tests.evaluations:uneven", "gave 3 scores for policy-r1 and 2 for policy"),
        ("tests.evaluations:nowhere", "has no callable 'nowhere'"),
        ("tests.evaluations:not_a_number", "not a finite number"),
    ],
)
def test_an_evaluation_that_fails_ends_the_stage_in_one_line(spec: str, error: str) -> None:
    from verifiers.errors import VerifierError

    with pytest.raises((FlowError, VerifierError), match=re.escape(error)):
        anyio.run(scorecards.user_card, spec, "http://models:8000", "policy-r1", "policy")


@pytest.mark.vllm
def test_held_out_sessions_are_judged_on_a_real_server(
    tiny_server: str, tiny_model_path, tmp_path
) -> None:
    """Two held-out sessions captured from the real server: both versions continue each logged
    prompt there, the serving version judges (no reviewer) with schema-constrained JSON, and
    the scorecard counts the sessions it decided."""
    from flows.settings import RunSettings
    from memory import store
    from serving import capture

    engine = store.open_store(f"sqlite:///{tmp_path / 'held.db'}")
    name = tiny_model_path.name
    with store.transaction(engine) as session:
        for number in (1, 2):
            body = {"model": name, "messages": [{"role": "user", "content": f"add {number} and 2"}],
                    "max_tokens": 8, "temperature": 0.0}  # fmt: skip
            capture.prepare_request(body)
            response = httpx.post(f"{tiny_server}/v1/chat/completions", json=body, timeout=120)
            tagged = {"session": f"k:s{number}", "task": "k:sum", "held_out": True}
            group = capture.captured_group(body, response.raise_for_status().json(), f"c{number}",
                                           tagged)  # fmt: skip
            assert group is not None
            store.save_group(session, group)
    settings = RunSettings(db_url=str(engine.url))
    card = anyio.run(scorecards.sessions_card, settings, tiny_server, name, name)
    assert card.figure == "win margin" and card.against == name
    assert card.evaluation.endswith(f"judged blind by {name}")
    assert card.n == 2 and -1.0 <= card.low <= card.value <= card.high <= 1.0
