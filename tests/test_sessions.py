"""Agent traffic as episodes: a session's captured turns stitched token-exactly, episodes of a task
grouped, rewarded by session feedback, and capture opted out by header or key. The upstream is a
scripted vLLM with a toy chat template: each message renders as its role's marker, its
characters and an end-of-turn token, and the generation prompt is the assistant's marker."""

import json
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from agents.policy import Endpoint
from memory import store
from memory.records import UNRATED, Attempt, Sample
from memory.sessions import episode_groups, episodes, held_out_turns, session_turns, stitch
from serving import capture, probe
from serving.gateway import GatewaySettings, create_app
from serving.promotion import Gate
from tests.helpers import client_for, make_group, scripted, seed_promoted
from trainer.dataset import IGNORE, build_rows
from trainer.settings import TrainSettings

ROLES = {"system": 100, "user": 101, "assistant": 102, "tool": 103}
END = 2


def render(messages: list[dict]) -> list[int]:
    ids: list[int] = []
    for message in messages:
        ids += [ROLES[message["role"]], *map(ord, message["content"]), END]
    return ids


def toy_vllm(answers: dict[str, str], exact: bool = True):
    """Answers the text that `answers` gives for the last user message; with `exact` off it
    renders earlier assistant turns with a space after them (not the tokens it sampled)."""

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        messages = body["messages"]
        if messages[0]["content"] == probe.PROMPT:
            choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
            return httpx.Response(200, json={"model": body["model"], "choices": [choice]})
        if not exact:
            messages = [
                {**m, "content": m["content"] + " "} if m["role"] == "assistant" else m
                for m in messages
            ]
        text = answers[messages[-1]["content"]]
        completion = [*map(ord, text), END]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
            "token_ids": completion,
            "logprobs": {"content": [{"token": "x", "logprob": -0.5} for _ in completion]},
        }
        prompt = render(messages) + [ROLES["assistant"]]
        answer = {"model": body["model"], "prompt_token_ids": prompt, "choices": [choice]}
        return httpx.Response(200, json=answer)

    return upstream


ANSWERS = {"add 2 and 3": "call add", "tool says 5": "5", "again": "6"}


def mine(name: str) -> str:
    """A session or task name as the store files it for the tests' default key."""
    return capture.owned(capture.owner("user-key"), name)


@pytest.fixture
def capturing(tiny_model_path: Path, tmp_path: Path):
    def make(exact: bool = True, taskset: str | None = None, held_out_share: float = 0.0):
        engine = store.open_store(f"sqlite:///{tmp_path / f'sessions-{exact}-{taskset}.db'}")
        seed_promoted(engine, tiny_model_path.name)
        settings = GatewaySettings(
            upstreams=["http://up"],
            base_model_path=tiny_model_path,
            adapters_root=tmp_path,
            capture=True,
            user_keys=frozenset({"user-key", "private-key", "other-key"}),
            uncaptured_keys=frozenset({"private-key"}),
            taskset=taskset,
            gate=Gate(held_out_share=held_out_share),
        )
        app = create_app(settings, engine, transport=httpx.MockTransport(toy_vllm(ANSWERS, exact)))
        return TestClient(app, headers={"Authorization": "Bearer user-key"}), engine

    return make


def converse(client: TestClient, headers: dict, last: str = "tool says 5", **extra) -> list:
    """Two turns: a question, then a tool result after the model's call."""
    messages = [{"role": "user", "content": "add 2 and 3"}]
    replies = []
    for follow_up in (None, last):
        if follow_up is not None:
            messages += [replies[-1], {"role": "tool", "content": follow_up}]
        body = {"model": "policy", "messages": messages, **extra}
        response = client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200
        replies.append(response.json()["choices"][0]["message"])
    return [*messages, replies[-1]]


def test_a_sessions_turns_are_stitched_into_the_servers_rendering_of_the_transcript(
    capturing,
) -> None:
    client, engine = capturing()
    with client:
        transcript = converse(client, {"X-Flywheel-Session": "s1", "X-Flywheel-Task": "sum"})
        converse(client, {"X-Flywheel-Task": "sum"}, last="again", user="s2")  # `user` ties too
        scored = client.post("/v1/feedback", json={"session": "s1", "score": 1.0})
        assert scored.status_code == 200 and scored.json()["turns"] == 2
        assert client.post("/v1/feedback", json={"session": "s2", "score": 0.0}).status_code == 200
        assert client.post("/v1/feedback", json={"session": "nope", "score": 1}).status_code == 404
        assert client.post("/v1/feedback", json={"score": 1.0}).status_code == 422
    with store.transaction(engine) as session:
        (group,) = episode_groups(session)
    assert group.task_id == f"task:{mine('sum')}" and group.plan.sessions == [
        mine("s1"),
        mine("s2"),
    ]
    first, second = group.attempts
    assert (first.reward, second.reward, first.turns) == (1.0, 0.0, 2)
    sample = first.sample
    assert sample is not None
    # The episode's ids are exactly the server's rendering of the whole transcript.
    assert sample.prompt_token_ids + sample.completion_token_ids == render(transcript)
    # The tool result between the turns, with its markers, is forced, never trained.
    (span,) = first.forced_spans
    between = sample.completion_token_ids[span[0] : span[1]]
    assert between == [ROLES["tool"], *map(ord, "tool says 5"), END, ROLES["assistant"]]
    assert sample.logprobs[span[0] : span[1]] == [0.0] * len(between)
    (row, _) = build_rows([group], TrainSettings(mode="grpo", max_length=256))
    trained = row.labels[len(sample.prompt_token_ids) :]
    assert trained[span[0] : span[1]] == [IGNORE] * len(between)
    assert trained[: span[0]] == sample.completion_token_ids[: span[0]]


def test_an_answer_the_server_renders_otherwise_becomes_untrained_context(capturing) -> None:
    client, engine = capturing(exact=False)
    with client:
        transcript = converse(client, {"X-Flywheel-Session": "s1", "X-Flywheel-Task": "sum"})
    with store.transaction(engine) as session:
        episode = episodes(session)[mine("s1")]
    assert isinstance(episode, Attempt) and episode.sample is not None
    sample = episode.sample
    rendered = render([m | {"content": m["content"] + " "} if m["role"] == "assistant" else m
                       for m in transcript[:-1]]) + [ROLES["assistant"]]  # fmt: skip
    answer = [*map(ord, "5"), END]
    # The server's rendering of the first answer ("call add ") stands in for what it sampled,
    # and only the last answer is trained.
    assert sample.prompt_token_ids + sample.completion_token_ids == rendered + answer
    assert episode.forced_spans == [(0, len(sample.completion_token_ids) - len(answer))]
    assert sample.logprobs == [0.0] * (len(sample.logprobs) - len(answer)) + [-0.5] * len(answer)


def test_a_session_whose_earlier_prompt_changed_is_not_stitched() -> None:
    def turn(prompt: list[int], answer: list[int]) -> Attempt:
        return make_group([1.0], completion_len=len(answer)).attempts[0].model_copy(
            update={"sample": Sample(text="t", prompt_token_ids=prompt,
                                     completion_token_ids=answer, logprobs=[-0.5] * len(answer),
                                     finish_reason="stop")}
        )  # fmt: skip

    turns = [turn([1, 2, 3], [4, 5]), turn([1, 9, 3, 4, 5, 6], [7])]
    assert stitch(turns) == "turn 2's prompt does not begin with the turns before it"
    assert isinstance(stitch([turns[0], turn([1, 2, 3, 4, 5, 6], [7])]), Attempt)


def test_capture_is_opted_out_by_header_or_key(capturing) -> None:
    client, engine = capturing()
    with client:
        converse(client, {"X-Flywheel-Session": "a", "X-Flywheel-Capture": "off"})
        converse(client, {"X-Flywheel-Session": "b", "Authorization": "Bearer private-key"})
        converse(client, {"X-Flywheel-Session": "c"})
    with store.transaction(engine) as session:
        assert set(episodes(session)) == {mine("c")}


def test_an_unrated_episode_or_a_lone_one_makes_no_group(capturing) -> None:
    client, engine = capturing()
    with client:
        converse(client, {"X-Flywheel-Session": "s1", "X-Flywheel-Task": "sum"})
        converse(client, {"X-Flywheel-Session": "s2", "X-Flywheel-Task": "sum"})
        client.post("/v1/feedback", json={"session": "s1", "score": 1.0})
    with store.transaction(engine) as session:
        assert episode_groups(session) == []
        (group,) = episode_groups(session, min_episodes=1)
    assert [a.reward for a in group.attempts] == [1.0]


def test_feedback_with_a_reference_is_scored_by_the_task_sets_verifier(capturing) -> None:
    client, engine = capturing(taskset="arithmetic")
    with client:
        converse(client, {"X-Flywheel-Session": "right"})  # its last answer: "5"
        converse(client, {"X-Flywheel-Session": "wrong"})
        scored = {
            sid: client.post("/v1/feedback", json={"session": sid, "reference": ref}).json()
            for sid, ref in (("right", "5"), ("wrong", "7"))
        }
        unknown = client.post("/v1/feedback", json={"session": "nobody", "reference": "5"})
        both = client.post("/v1/feedback", json={"session": "right", "score": 1, "reference": "5"})
        huge = client.post("/v1/feedback", json={"session": "right", "reference": "1+" * 5000})
    assert huge.status_code == 422 and "at most 200 characters" in huge.text
    assert scored["right"]["score"] == 0.5  # correct, but untagged
    assert scored["right"]["reason"] == "verified: correct, last number (untagged)"
    assert scored["wrong"]["score"] == 0.0 and scored["wrong"]["turns"] == 2
    assert unknown.status_code == 404 and both.status_code == 422
    with store.transaction(engine) as session:
        rewards = {sid: [g.attempts[0].reward for g in turns]
                   for sid, turns in session_turns(session).items()}  # fmt: skip
    assert rewards == {mine("right"): [0.5, 0.5], mine("wrong"): [0.0, 0.0]}
    plain, _ = capturing()  # no task set: a reference cannot be scored
    with plain:
        converse(plain, {"X-Flywheel-Session": "s"})
        refused = plain.post("/v1/feedback", json={"session": "s", "reference": "5"})
    assert refused.status_code == 400 and "no verifier" in refused.json()["error"]["message"]


def test_stitch_refuses_an_empty_session() -> None:
    assert stitch([]) == "a turn has no sample"


def test_a_round_adopts_rated_episode_groups_once_and_keeps_their_lineage(capturing) -> None:
    from memory.sessions import adopt

    client, engine = capturing()
    with client:
        converse(client, {"X-Flywheel-Session": "s1", "X-Flywheel-Task": "sum"})
        converse(client, {"X-Flywheel-Session": "s2", "X-Flywheel-Task": "sum"}, last="again")
        for sid, score in (("s1", 1.0), ("s2", 0.0)):
            client.post("/v1/feedback", json={"session": sid, "score": score})
    with store.transaction(engine) as session:
        (adopted,) = adopt(session, round_index=3, policy_version="v2")
        assert adopt(session, round_index=3, policy_version="v2") == []  # taken once
    with store.transaction(engine) as session:
        (stored,) = store.load_groups(session, "train", 3, "v2", complete_only=True)
        assert episode_groups(session) == []
    assert stored.id == adopted.id and stored.plan.sessions == [mine("s1"), mine("s2")]
    assert [a.turns for a in stored.attempts] == [2, 2]
    assert [a.sample for a in stored.attempts] == [a.sample for a in adopted.attempts]
    assert stored.attempts[0].forced_spans == adopted.attempts[0].forced_spans
    rows = build_rows([stored], TrainSettings(mode="grpo", max_length=256))
    assert [r.reward for r in rows] == [1.0, 0.0]


def test_a_session_is_exported_and_forgotten_from_the_command_line(
    capturing, tmp_path: Path, capsys
) -> None:
    from cli.main import main
    from memory.sessions import adopt

    client, engine = capturing()
    with client:
        for sid in ("s1", "s2"):
            converse(client, {"X-Flywheel-Session": sid, "X-Flywheel-Task": "sum"})
            client.post("/v1/feedback", json={"session": sid, "score": float(sid == "s1")})
    with store.transaction(engine) as session:
        adopt(session, round_index=1, policy_version="v1")
    db = str(engine.url)
    out = tmp_path / "s1.jsonl"
    assert main(["export", "--session", mine("s1"), "--out", str(out), "--db", db]) == 0
    head, *turns = [json.loads(line) for line in out.read_text().splitlines()]
    assert head["turns"] == 2 and head["reward"] == 1.0 and len(turns) == 2
    assert head["sample"]["prompt_token_ids"] == turns[0]["sample"]["prompt_token_ids"]
    assert main(["forget", "--session", mine("s1"), "--db", db]) == 0
    assert "2 captured turns and 1 train groups deleted" in capsys.readouterr().out
    with store.transaction(engine) as session:
        assert set(episodes(session)) == {mine("s2")}
        assert store.load_groups(session, "train") == []
    assert main(["forget", "--session", mine("s1"), "--db", db]) == 2
    assert capsys.readouterr().err == f"flywheel: error: unknown session {mine('s1')!r}\n"


def judge_client(reply: str, seen: list) -> Endpoint:
    def reviewer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        return scripted(body, reply, [3])

    return Endpoint(client_for(reviewer), "judge-model")


def test_the_judge_scores_a_groups_episodes_against_each_other(capturing) -> None:
    import anyio

    from agents.errors import PolicyError
    from agents.ruler import judge

    client, engine = capturing()
    with client:
        converse(client, {"X-Flywheel-Session": "s1", "X-Flywheel-Task": "sum"})
        converse(client, {"X-Flywheel-Session": "s2", "X-Flywheel-Task": "sum"}, last="again")
    with store.transaction(engine) as session:
        assert episode_groups(session) == []
        (group,) = episode_groups(session, rated=False)
    seen: list = []
    scores = anyio.run(judge, judge_client('{"scores": [0.9, 0.1]}', seen), "sum", group.attempts)
    assert scores == [0.9, 0.1]
    (asked,) = seen
    shown = asked["messages"][1]["content"]
    assert "Attempt 1:" in shown and "Attempt 2:" in shown and "tool: again" in shown
    schema = asked["response_format"]["json_schema"]["schema"]["properties"]["scores"]
    assert schema["minItems"] == schema["maxItems"] == 2 and asked["temperature"] == 0.0
    for reply in ('{"scores": [0.9]}', "not json", '{"scores": [2, 0]}'):
        with pytest.raises(PolicyError):
            anyio.run(judge, judge_client(reply, []), "sum", group.attempts)


def test_judged_episodes_are_rated_and_adopted(capturing, monkeypatch) -> None:
    import anyio

    from flows import stages
    from flows.settings import RunSettings
    from memory.sessions import adopt

    client, engine = capturing()
    with client:
        converse(client, {"X-Flywheel-Session": "s1", "X-Flywheel-Task": "sum"})
        converse(client, {"X-Flywheel-Session": "s2", "X-Flywheel-Task": "sum"}, last="again")
    settings = RunSettings(
        db_url=str(engine.url), source="captured", judge=True,
        reviewer_url="http://judge", reviewer_model="judge-model",
    )  # fmt: skip
    judge = judge_client('{"scores": [1, 0]}', [])
    monkeypatch.setattr(stages, "reviewer_endpoint", lambda _: judge)
    assert anyio.run(stages.judge_captured, settings) == 2
    with store.transaction(engine) as session:
        (group,) = adopt(session, round_index=1, policy_version="v1")
    assert [a.reward for a in group.attempts] == [1.0, 0.0]
    assert group.attempts[0].reason == "judged against its group"


def test_a_session_belongs_to_the_key_that_opened_it(capturing) -> None:
    """Another key's feedback never reaches this key's session or turns; its own session of
    the same name is another session; nothing is captured without a key."""
    client, engine = capturing()
    other = {"Authorization": "Bearer other-key"}
    with client:
        converse(client, {"X-Flywheel-Session": "s1", "X-Flywheel-Task": "sum"})
        turn = client.post("/v1/chat/completions", json=chat_body()).headers[capture.CAPTURE_HEADER]
        by_session = client.post(
            "/v1/feedback", json={"session": "s1", "score": 1.0}, headers=other
        )
        by_turn = client.post("/v1/feedback", json={"id": turn, "score": 1.0}, headers=other)
        converse(client, {"X-Flywheel-Session": "s1", "X-Flywheel-Task": "sum", **other})
        own = client.post("/v1/feedback", json={"session": "s1", "score": 1.0}, headers=other)
    assert by_session.status_code == 404 and by_turn.status_code == 404
    assert own.status_code == 200 and own.json()["turns"] == 2
    with store.transaction(engine) as session:
        turns = session_turns(session)
    assert set(turns) == {mine("s1"), capture.owned(capture.owner("other-key"), "s1")}
    assert all(g.attempts[0].reason == UNRATED for g in turns[mine("s1")])


def test_capture_without_keys_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capture records training data, so it needs API keys"):
        GatewaySettings(
            upstreams=["http://up"], base_model_path=tiny_model_path, adapters_root=tmp_path,
            capture=True,
        )  # fmt: skip


def chat_body() -> dict:
    return {"model": "policy", "messages": [{"role": "user", "content": "add 2 and 3"}]}


def test_a_held_out_session_judges_versions_and_never_trains(capturing) -> None:
    names = [f"s{i}" for i in range(12)]
    kept = {mine(n) for n in names if capture.held_out(mine(n), 0.5)}
    assert 0 < len(kept) < len(names)  # the names split both ways at this share
    client, engine = capturing(held_out_share=0.5)
    with client:
        for name in names:
            converse(client, {"X-Flywheel-Session": name, "X-Flywheel-Task": "sum"})
            client.post("/v1/feedback", json={"session": name, "score": 1.0}).raise_for_status()
    with store.transaction(engine) as session:
        (group,) = episode_groups(session)
        judged = held_out_turns(session, limit=100)
        few = held_out_turns(session, limit=3)
    assert set(group.plan.sessions) == {mine(n) for n in names} - kept
    assert set(judged) == kept and all(len(turns) == 2 for turns in judged.values())
    assert all(t.sample and t.sample.prompt_token_ids for turns in judged.values() for t in turns)
    assert sum(len(turns) for turns in few.values()) == 3


def test_a_held_out_session_with_a_reference_is_verified_not_judged(capturing) -> None:
    """Where the user said what was right, the gate verifies both versions' answers at the
    session's last turn against it (the candidate's reward minus the serving version's); the
    judge sees only sessions without one."""
    import anyio

    from flows import scorecards
    from memory.sessions import held_out_split

    names = [f"s{i}" for i in range(12)]
    client, engine = capturing(taskset="arithmetic", held_out_share=0.5)
    with client:
        for name in names:
            converse(client, {"X-Flywheel-Session": name, "X-Flywheel-Task": name})
            feedback = (
                {"session": name, "reference": "5"}
                if name < "s6"
                else {"session": name, "score": 1.0}
            )
            client.post("/v1/feedback", json=feedback).raise_for_status()
    with store.transaction(engine) as session:
        verified, rest = held_out_split(session, limit=100)
        judged = held_out_turns(session, limit=100)
    kept = {mine(n) for n in names if capture.held_out(mine(n), 0.5)}
    assert set(verified) == {mine(n) for n in names if n < "s6"} & kept and verified
    turns = session_turns_of(engine)
    for sid, (turn, question, reference) in verified.items():  # the last turn, its reference
        assert turn == turns[sid][-1].attempts[0] and reference == "5" and "add" in question
    assert set(verified) < set(judged) and set(rest) == set(judged) - set(verified)

    def versions(request: httpx.Request) -> httpx.Response:  # the candidate says 5, serving 7
        return completions_server(["5"] if b'"candidate"' in request.content else ["7"], [])(
            request
        )

    policy = client_for(versions)
    duel = scorecards.Duel(Endpoint(policy, "candidate"), Endpoint(policy, "serving"),
                           Endpoint(policy, "judge"))  # fmt: skip
    margins = anyio.run(scorecards.compare_verified, verified, duel, "arithmetic")
    assert margins == {sid: [0.5] for sid in verified}  # untagged right sum: half reward, vs 0
    card = scorecards.card({}, "judge", "serving", ("arithmetic", margins))
    assert card.evaluation == f"{len(margins)} held-out sessions verified by arithmetic"
    assert card.value == 0.5


def session_turns_of(engine) -> dict:
    with store.transaction(engine) as session:
        return session_turns(session)


def tokenizing_policy(texts: list[str], seen: list[dict]) -> Endpoint:
    """The policy's server: completions continuing any prompt with the next of `texts`, and
    plain text tokenised a character a token."""
    answers = completions_server(texts, seen)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/tokenize"):
            text = json.loads(request.content)["prompt"]
            return httpx.Response(200, json={"tokens": [ord(c) for c in text]})
        return answers(request)

    return Endpoint(client_for(handle), "v1")


def completions_server(texts: list[str], seen: list[dict]):
    """A completions endpoint that continues any prompt ids with the next of `texts`."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        text = texts[(len(seen) - 1) % len(texts)]
        ids = [*map(ord, text), END]
        logprobs = {"token_logprobs": [-0.3] * len(ids), "tokens": ["x"] * len(ids),
                    "text_offset": [0] * len(ids), "top_logprobs": [None] * len(ids)}  # fmt: skip
        choice = {"index": 0, "text": text, "finish_reason": "stop", "token_ids": ids,
                  "prompt_token_ids": body.get("prompt"), "logprobs": logprobs}  # fmt: skip
        reply = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"]}
        return httpx.Response(200, json=reply | {"choices": [choice]})

    return handle


def test_a_task_met_once_gets_siblings_from_its_last_turn_scored_as_it_was(capturing) -> None:
    import anyio

    from flows import siblings
    from flows.settings import RunSettings
    from memory.sessions import adopt, forget, stitch_turns

    client, engine = capturing(taskset="arithmetic")
    with client:
        converse(client, {"X-Flywheel-Session": "once", "X-Flywheel-Task": "sum"})  # says "5"
        converse(client, {"X-Flywheel-Session": "by-hand"})  # a person's score: no siblings
        converse(client, {"X-Flywheel-Session": "unscored"})  # nothing to score siblings by
        client.post("/v1/feedback", json={"session": "once", "reference": "5"}).raise_for_status()
        client.post("/v1/feedback", json={"session": "by-hand", "score": 1}).raise_for_status()
    with store.transaction(engine) as session:
        assert episode_groups(session) == []  # met once: no group
        (original,) = [
            stitch_turns(t) for s, t in session_turns(session).items() if s == mine("once")
        ]
    seen: list[dict] = []
    settings = RunSettings(db_url=str(engine.url), source="captured")
    policy = Endpoint(client_for(completions_server(["5", "7"], seen)), "v1")
    assert anyio.run(siblings.grow_with, settings, policy) == 3
    assert anyio.run(siblings.grow_with, settings, policy) == 0  # once per session
    last_prompt = original.sample.prompt_token_ids + original.sample.completion_token_ids
    answered = original.sample.completion_token_ids[: -len("5") - 1]
    assert all(body["prompt"] == last_prompt[: len(body["prompt"])] for body in seen)
    assert [len(b["prompt"]) for b in seen] == [
        len(original.sample.prompt_token_ids) + len(answered)
    ] * 3
    with store.transaction(engine) as session:
        (group,) = adopt(session, round_index=1, policy_version="v1")
    assert group.plan.sessions == [mine("once"), *(f"{mine('once')}~{k}" for k in (1, 2, 3))]
    assert [a.reward for a in group.attempts] == [0.5, 0.5, 0.0, 0.5]  # the same verifier
    assert {a.reason for a in group.attempts[1:]} == {
        "verified: correct, last number (untagged)",
        "verified: wrong answer, last number (untagged)",
    } or len({a.reason for a in group.attempts[1:]}) == 2
    for sibling in group.attempts[1:]:  # the session's turns, then its own last answer
        assert sibling.forced_spans == original.forced_spans and sibling.turns == 2
        assert sibling.sample.completion_token_ids[: len(answered)] == answered
    with store.transaction(engine) as session:
        assert forget(session, mine("once")) == (2 + 3, 1)  # its turns, its siblings, the group
        assert set(session_turns(session)) == {mine("by-hand"), mine("unscored")}


def test_a_busy_server_ends_a_check_s_siblings_and_the_rest_wait_for_the_next(
    capturing, monkeypatch
) -> None:
    """Siblings share the server with live traffic, which their client's deadlines do not
    see: no answer in time from a server that is up stops this check's growing (the training
    check goes on to train on what is ready), and the sessions left get their siblings at the
    next check. A server that is down still fails the check."""
    import anyio

    from agents.errors import ServerUnavailable
    from flows import siblings
    from flows.settings import RunSettings

    client, engine = capturing(taskset="arithmetic")
    with client:
        for name in ("first", "second"):
            converse(client, {"X-Flywheel-Session": name, "X-Flywheel-Task": name})
            client.post("/v1/feedback", json={"session": name, "reference": "5"})
    settings = RunSettings(db_url=str(engine.url), source="captured")
    answers = completions_server(["5", "7"], [])
    up = {"health": 200}

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/health"):
            return httpx.Response(up["health"])
        return answers(request)

    policy = Endpoint(client_for(server), "v1")
    sample = siblings._siblings

    async def crowded(*args, **kwargs):
        raise ServerUnavailable("http://policy gave no answer in 76 s (8 requests in flight)")

    monkeypatch.setattr(siblings, "_siblings", crowded)
    assert anyio.run(siblings.grow_with, settings, policy) == 0  # no raise: nothing lost
    up["health"] = 503
    with pytest.raises(ServerUnavailable, match="no answer"):
        anyio.run(siblings.grow_with, settings, policy)
    up["health"] = 200
    monkeypatch.setattr(siblings, "_siblings", sample)
    assert anyio.run(siblings.grow_with, settings, policy) == 6  # both, at the next check
    with store.transaction(engine) as session:
        assert len(episode_groups(session)) == 2


def test_an_unrated_session_met_once_is_judged_with_its_siblings(capturing, monkeypatch) -> None:
    import anyio

    from flows import siblings, stages
    from flows.settings import RunSettings
    from memory.sessions import adopt

    client, engine = capturing()
    with client:
        converse(client, {"X-Flywheel-Session": "alone"})  # no task tag: a task of its own
    settings = RunSettings(
        db_url=str(engine.url), source="captured", judge=True, collect={"group_size": 3},
        reviewer_url="http://judge", reviewer_model="judge-model",
    )  # fmt: skip
    policy = Endpoint(client_for(completions_server(["6", "5"], [])), "v1")
    assert anyio.run(siblings.grow_with, settings, policy) == 2
    judged: list[dict] = []
    judge = judge_client('{"scores": [0.2, 0.9, 0.4]}', judged)
    monkeypatch.setattr(stages, "reviewer_endpoint", lambda _: judge)
    assert anyio.run(stages.judge_captured, settings) == 3  # one ranking of all three
    (asked,) = judged
    assert asked["messages"][-1]["content"].count("Attempt ") == 3
    with store.transaction(engine) as session:
        (group,) = adopt(session, round_index=1, policy_version="v1")
    assert group.task_id == f"task:{mine('alone')}"
    assert [a.reward for a in group.attempts] == [0.2, 0.9, 0.4]


def test_a_session_no_answer_of_the_policy_got_right_gets_the_reviewers_verified_answer(
    capturing,
) -> None:
    """HeRL on lone sessions: the session said "5" untagged (half reward), its siblings worse;
    the reviewer reads the transcript as text and answers; its first draw is wrong, its second
    right, and that one joins the session's group as a revision in the policy's ids, closed by
    the session's own end-of-turn token, revising the first slot."""
    import anyio

    from agents.settings import ReviseSettings
    from flows import siblings
    from flows.settings import RunSettings
    from memory.sessions import adopt
    from trainer.dataset import build_rows, winning_revision
    from trainer.settings import TrainSettings

    client, engine = capturing(taskset="arithmetic")
    with client:
        converse(client, {"X-Flywheel-Session": "once", "X-Flywheel-Task": "sum"})  # says "5"
        client.post("/v1/feedback", json={"session": "once", "reference": "5"}).raise_for_status()

    asked: list[dict] = []
    drafts = iter(["<answer>6</answer>", "<answer>5</answer>"])

    def reviewer_server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append(body)
        return scripted(body, next(drafts), [3])

    herl = ReviseSettings(enabled=True, revisions=2, temperature=0.5)
    settings = RunSettings(db_url=str(engine.url), source="captured", collect={"revise": herl})
    policy = tokenizing_policy(["7", "9", "8"], [])
    reviewer = Endpoint(client_for(reviewer_server), "judge-model")
    assert anyio.run(siblings.grow_with, settings, policy, reviewer) == 4  # 3 siblings, 1 answer
    first = asked[0]["messages"][-1]["content"]
    assert first.startswith(siblings.REVIEW) and "user: " in first  # the transcript as text
    assert len(asked) == 2 and asked[0]["temperature"] == 0.5  # until a draw passed
    with store.transaction(engine) as session:
        (group,) = adopt(session, round_index=1, policy_version="v1")
    assert group.size == 4 and group.complete  # the policy's own four answers in the slots
    revision = winning_revision(group)
    assert revision is not None and revision.kind == "revision" and revision.sample_index == 4
    assert revision.policy_version == "judge-model" and revision.reward == 1.0
    assert revision.parent_index == 0 and revision.improved
    own_end = group.attempts[0].sample.completion_token_ids[-1]
    assert revision.sample.completion_token_ids[-len("<answer>5</answer>") - 1 :] == [
        *map(ord, "<answer>5</answer>"),
        own_end,
    ]  # the reviewer's text in the policy's ids, closed as the session's own answer was
    assert group.plan.sessions[-1] == f"{mine('once')}~4"  # lineage reaches the reviewer's too
    rows = build_rows([group], TrainSettings(mode="grpo"))
    (written,) = [row for row in rows if row.off_policy]  # trained as HeRL trains a revision
    assert max(written.advantages) > 0 and written.context == "revision"


def test_no_reviewer_answer_where_the_policy_got_one_right(capturing) -> None:
    import anyio

    from agents.settings import ReviseSettings
    from flows import siblings
    from flows.settings import RunSettings

    client, engine = capturing(taskset="arithmetic")
    with client:
        converse(client, {"X-Flywheel-Session": "once", "X-Flywheel-Task": "sum"})
        client.post("/v1/feedback", json={"session": "once", "reference": "5"}).raise_for_status()
    asked: list[dict] = []
    settings = RunSettings(
        db_url=str(engine.url), source="captured", collect={"revise": ReviseSettings(enabled=True)}
    )
    policy = Endpoint(client_for(completions_server(["<answer>5</answer>"], [])), "v1")
    assert anyio.run(siblings.grow_with, settings, policy, judge_client("5", asked)) == 3
    assert asked == []  # a sibling was right: the policy has its own success to learn from


def test_the_reviewers_answer_is_kept_when_it_beats_the_policys_best_short_of_full_reward(
    capturing,
) -> None:
    """Where the task set gives an untagged right answer half reward, the reviewer's untagged
    right answer (0.5) still beats the policy's wrong ones (0): kept, not counted correct. Where
    the session's own answer was already as good, the reviewer's is not kept."""
    import anyio

    from agents.settings import ReviseSettings
    from flows import siblings
    from flows.settings import RunSettings
    from memory.sessions import adopt

    client, engine = capturing(taskset="arithmetic")
    with client:
        for name, reference in (("wrong", "6"), ("half", "5")):  # the session says "5"
            converse(client, {"X-Flywheel-Session": name, "X-Flywheel-Task": name})
            body = {"session": name, "reference": reference}
            client.post("/v1/feedback", json=body).raise_for_status()

    def reviewer_server(request: httpx.Request) -> httpx.Response:
        return scripted(json.loads(request.content), "6", [3])  # untagged

    herl = ReviseSettings(enabled=True, revisions=1)
    settings = RunSettings(db_url=str(engine.url), source="captured", collect={"revise": herl})
    policy = tokenizing_policy(["7", "9", "8"], [])
    reviewer = Endpoint(client_for(reviewer_server), "judge-model")
    assert anyio.run(siblings.grow_with, settings, policy, reviewer) == 3 + 3 + 1
    with store.transaction(engine) as session:
        groups = {g.task_id: g for g in adopt(session, round_index=1, policy_version="v1")}
    kept = [a for a in groups[f"task:{mine('wrong')}"].attempts if a.kind == "revision"]
    assert [(a.reward, a.correct) for a in kept] == [(0.5, False)]
    assert not any(a.kind == "revision" for a in groups[f"task:{mine('half')}"].attempts)


def test_a_reviewer_draw_the_reviewer_refuses_is_skipped_and_the_next_one_kept(
    capturing,
) -> None:
    """A draw the reviewer answers with a 400 (the request's own failure) is that draw lost,
    not the whole training check: the next draw is verified and kept."""
    import anyio

    from agents.settings import ReviseSettings
    from flows import siblings
    from flows.settings import RunSettings

    client, engine = capturing(taskset="arithmetic")
    with client:
        converse(client, {"X-Flywheel-Session": "once", "X-Flywheel-Task": "sum"})  # says "5"
        client.post("/v1/feedback", json={"session": "once", "reference": "6"}).raise_for_status()

    asked: list[dict] = []

    def reviewer_server(request: httpx.Request) -> httpx.Response:
        asked.append(body := json.loads(request.content))
        if len(asked) == 1:
            return httpx.Response(400, json={"error": {"message": "prompt too long"}})
        return scripted(body, "<answer>6</answer>", [3])

    herl = ReviseSettings(enabled=True, revisions=2)
    settings = RunSettings(db_url=str(engine.url), source="captured", collect={"revise": herl})
    policy = tokenizing_policy(["7", "9", "8"], [])
    reviewer = Endpoint(client_for(reviewer_server), "judge-model")
    assert anyio.run(siblings.grow_with, settings, policy, reviewer) == 4
    assert len(asked) == 2
