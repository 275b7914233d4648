"""Gateway logic against a scripted upstream (httpx.MockTransport): auth, alias, routes, gate."""

import json
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from memory import store
from memory.records import PolicyVersion
from serving import probe
from serving.gateway import GatewaySettings, create_app
from tests.helpers import seed_promoted, wait_until

USER, ADMIN = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}


@pytest.fixture
def gateway(tiny_model_path: Path, tmp_path: Path):
    engine = store.open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    base = tiny_model_path.name
    seed_promoted(engine, base, 0.5)
    seen: list[dict] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["messages"][0]["content"] == probe.PROMPT:  # the gateway's own health probes
            return httpx.Response(200, json=reply(body["model"]))
        seen.append({"url": str(request.url), **body})
        if body.get("stream"):
            chunks = [f'data: {{"model": "{body["model"]}", "n": {i}}}\n\n' for i in range(3)]
            return httpx.Response(
                200,
                content="".join(chunks) + "data: [DONE]\n\n",
                headers={"content-type": "text/event-stream"},
            )
        return httpx.Response(200, json=reply(body["model"]))

    settings = GatewaySettings(
        upstreams=["http://up-1", "http://up-2"],
        base_model_path=tiny_model_path,
        adapters_root=tmp_path / "adapters",
        user_keys=frozenset({"user-key"}),
        admin_keys=frozenset({"admin-key"}),
    )
    app = create_app(settings, engine, transport=httpx.MockTransport(upstream))
    with TestClient(app) as client:
        yield client, seen, engine, base


def reply(model: str, text: str = "ok") -> dict:
    message = {"role": "assistant", "content": text}
    return {"model": model, "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def chat(model: str = "policy", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_keys(gateway) -> None:
    client, seen, _, _ = gateway
    assert client.post("/v1/chat/completions", json=chat()).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/v1/chat/completions", json=chat(), headers=wrong).status_code == 401
    assert client.post("/v1/chat/completions", json=chat(), headers=USER).status_code == 200
    assert client.post("/v1/chat/completions", json=chat(), headers=ADMIN).status_code == 200
    assert client.get("/admin/state").status_code == 401
    assert client.get("/admin/state", headers=USER).status_code == 403
    assert client.post("/admin/rollback", headers=USER).status_code == 403
    assert client.get("/admin/state", headers=ADMIN).status_code == 200
    assert len(seen) == 2, "rejected requests never reach an upstream"


def test_alias_is_rewritten_and_upstreams_alternate(gateway) -> None:
    client, seen, _, base = gateway
    for _ in range(2):
        response = client.post("/v1/chat/completions", json=chat(), headers=USER)
        assert response.json()["model"] == base
    assert [s["model"] for s in seen] == [base, base]
    assert {s["url"].split("/v1")[0] for s in seen} == {"http://up-1", "http://up-2"}
    unknown = client.post("/v1/chat/completions", json=chat("other"), headers=USER)
    assert unknown.status_code == 404
    assert client.post("/v1/completions", content=b"{not json", headers=USER).status_code == 400


def test_only_allowlisted_routes_are_proxied(gateway) -> None:
    client, seen, _, _ = gateway
    for route in (
        "/v1/embeddings",
        "/v1/load_lora_adapter",
        "/metrics",
        "/tokenize",
        "/v1/../v1/load_lora_adapter",
        "/admin/../v1/unload_lora_adapter",
    ):
        assert client.post(route, json=chat(), headers=ADMIN).status_code in (404, 405)
    assert seen == []


def test_streaming_is_relayed(gateway) -> None:
    client, _, _, base = gateway
    with client.stream(
        "POST", "/v1/chat/completions", json=chat(stream=True), headers=USER
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    assert text.count("data: ") == 4 and f'"model": "{base}"' in text


def test_adapter_paths_are_confined(gateway, tmp_path: Path) -> None:
    client, _, _, _ = gateway
    for path in ("/etc", str(tmp_path / "adapters" / ".." / "gw.db"), "../../etc/passwd"):
        response = client.post("/admin/adapters", json={"name": "x1", "path": path}, headers=ADMIN)
        assert response.status_code == 400
        assert "outside the checkpoint root" in response.json()["error"]["message"]
    bad_name = client.post("/admin/adapters", json={"name": "../x", "path": "/"}, headers=ADMIN)
    assert bad_name.status_code == 422


def test_promotion_goes_through_the_gate(gateway) -> None:
    client, seen, engine, base = gateway
    with store.transaction(engine) as session:
        for name, score in (("v-none", None), ("v-low", 0.25), ("v-good", 0.75)):
            store.save_policy_version(session, PolicyVersion(name=name, base_model=base))
            if score is not None:
                store.record_evaluation(session, name, score)
    refused = client.post("/admin/promote", json={"version": "v-none"}, headers=ADMIN)
    assert refused.status_code == 409 and "no held-out evaluation" in refused.json()["reason"]
    low = client.post("/admin/promote", json={"version": "v-low"}, headers=ADMIN)
    assert low.status_code == 409 and "below 0.500" in low.json()["reason"]
    assert (
        client.post("/admin/promote", json={"version": "v-good"}, headers=ADMIN).status_code == 200
    )
    assert client.get("/health").json()["target"] == "v-good"
    back = client.post("/admin/rollback", headers=ADMIN)
    assert back.status_code == 200 and back.json()["to_version"] == base
    assert client.get("/health").json()["target"] == base
    with store.transaction(engine) as session:
        actions = [e.action for e in store.alias_events(session, "policy")]
    assert actions == ["refuse", "refuse", "promote", "rollback"]


def test_alias_follows_promotions_made_in_the_store(gateway) -> None:
    client, seen, engine, base = gateway
    with store.transaction(engine) as session:
        store.save_policy_version(session, PolicyVersion(name="v-flow", base_model=base))
        store.record_evaluation(session, "v-flow", 0.9)
        store.set_promoted(session, "v-flow", True)
    assert client.get("/health").json()["target"] == base
    assert client.post("/admin/sync", headers=ADMIN).json()["target"] == "v-flow"
    client.post("/v1/chat/completions", json=chat(), headers=USER)
    assert seen[-1]["model"] == "v-flow"


CAPTURED_CHOICE = {
    "index": 0,
    "finish_reason": "stop",
    "token_ids": [7, 8],
    "message": {"role": "assistant", "content": "four"},
    "logprobs": {"content": [{"token": "f", "logprob": -0.1}, {"token": "our", "logprob": -0.2}]},
}


def capturing_upstream(sent: list[dict]):
    """A scripted vLLM that returns token ids and logprobs, streamed or not."""

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["messages"][0]["content"] == probe.PROMPT:
            return httpx.Response(200, json=reply(body["model"]))
        sent.append(body)
        if not body.get("stream"):
            answer = {"model": body["model"], "prompt_token_ids": [1, 2, 3]}
            return httpx.Response(200, json=answer | {"choices": [CAPTURED_CHOICE]})
        first = {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {}}]}
        pieces = [
            {"delta": {"content": "fo"}, "token_ids": [7], "finish_reason": None,
             "logprobs": {"content": [{"token": "f", "logprob": -0.1}]}},
            {"delta": {"content": "ur"}, "token_ids": [8], "finish_reason": "stop",
             "logprobs": {"content": [{"token": "our", "logprob": -0.2}]}},
        ]  # fmt: skip
        chunks = [first, *({"choices": [{"index": 0, **p}]} for p in pieces)]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text, headers={"content-type": "text/event-stream"})

    return upstream


def test_capture_records_trajectories_streamed_or_not_and_feedback(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    engine = store.open_store(f"sqlite:///{tmp_path / 'capture.db'}")
    seed_promoted(engine, tiny_model_path.name)
    sent: list[dict] = []
    settings = GatewaySettings(
        upstreams=["http://up"],
        base_model_path=tiny_model_path,
        adapters_root=tmp_path,
        capture=True,
        user_keys=frozenset({"user-key"}),
    )
    app = create_app(settings, engine, transport=httpx.MockTransport(capturing_upstream(sent)))
    with TestClient(app, headers=USER) as client:
        response = client.post("/v1/chat/completions", json=chat(temperature=0.3))
        assert response.status_code == 200
        assert sent[0]["return_token_ids"] is True and sent[0]["logprobs"] is True
        payload = response.json()
        assert "prompt_token_ids" not in payload, "fields the caller did not ask for are removed"
        assert payload["choices"][0]["logprobs"] is None
        capture_id = response.headers["X-Flywheel-Capture-Id"]
        ok = client.post("/v1/feedback", json={"id": capture_id, "score": 1.0})
        assert ok.status_code == 200
        unknown = client.post("/v1/feedback", json={"id": "capture:nope", "score": 1.0})
        assert unknown.status_code == 404
        nulls = client.post("/v1/chat/completions", json=chat(temperature=None, top_p=None))
        assert nulls.status_code == 200 and "X-Flywheel-Capture-Id" in nulls.headers
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as streamed:
            streamed_id = streamed.headers["X-Flywheel-Capture-Id"]
            lines, stored_when_done = [], None
            for line in streamed.iter_lines():
                if line == "data: [DONE]":  # the caller is done: feedback may follow at once
                    with store.transaction(engine) as session:
                        found = store.load_groups(session, "capture")
                    stored_when_done = streamed_id in {g.task_id for g in found}
                elif line.startswith("data: {"):
                    lines.append(line)
    assert stored_when_done is True
    assert all("token_ids" not in line and '"logprob"' not in line for line in lines)
    assert "".join(json.loads(x[6:])["choices"][0]["delta"].get("content", "") for x in lines) == (
        "four"
    )
    with store.transaction(engine) as session:
        groups = {g.task_id: g for g in store.load_groups(session, "capture")}
    assert set(groups) == {capture_id, nulls.headers["X-Flywheel-Capture-Id"], streamed_id}
    for task_id in (capture_id, streamed_id):
        group = groups[task_id]
        attempt = group.attempts[0]
        assert group.question == "hi" and attempt.sample.text == "four"
        assert attempt.sample.prompt_token_ids == [1, 2, 3]
        assert attempt.sample.completion_token_ids == [7, 8]
        assert attempt.sample.logprobs == [-0.1, -0.2]
    assert groups[capture_id].attempts[0].sampling.temperature == 0.3
    assert groups[capture_id].attempts[0].reward == 1.0
    assert groups[capture_id].attempts[0].reason == "user feedback"
    null_sampling = groups[nulls.headers["X-Flywheel-Capture-Id"]].attempts[0].sampling
    assert (null_sampling.temperature, null_sampling.top_p) == (1.0, 1.0)


def test_a_promotion_whose_adapter_fails_leaves_the_store_unchanged(gateway, tmp_path) -> None:
    client, _, engine, base = gateway
    with store.transaction(engine) as session:
        store.save_policy_version(
            session,
            PolicyVersion(
                name="v-broken", base_model=base, adapter_path=str(tmp_path / "adapters" / "gone")
            ),
        )
        store.record_evaluation(session, "v-broken", 0.9)
    response = client.post("/admin/promote", json={"version": "v-broken"}, headers=ADMIN)
    assert response.status_code == 400 and "not found" in response.json()["error"]["message"]
    assert client.get("/health").json()["target"] == base
    with store.transaction(engine) as session:
        assert store.promoted_policy(session).name == base
        assert store.alias_events(session, "policy") == []


class Upstreams:
    """Scripted upstreams whose failures a test switches on: `refuse` (connection refused),
    `broken` (answers 500, probes included), `odd` (answers every request with these bytes)
    and `cut` (the answer breaks off half-way)."""

    def __init__(self) -> None:
        self.refuse: set[str] = set()
        self.broken: set[str] = set()
        self.odd: dict[str, bytes] = {}
        self.cut = False
        self.served: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, body = request.url.host, json.loads(request.content)
        if host in self.refuse:
            raise httpx.ConnectError("connection refused", request=request)
        if host in self.broken:
            return httpx.Response(500, json={"error": {"message": "engine dead"}})
        if host in self.odd:
            return httpx.Response(200, content=self.odd[host])
        if body["messages"][0]["content"] != probe.PROMPT:
            self.served.append(host)
        if self.cut and body["messages"][0]["content"] != probe.PROMPT:
            return httpx.Response(200, stream=CutStream(), headers=_stream_type(body))
        return httpx.Response(200, json=reply(body["model"]))


def _stream_type(body: dict) -> dict:
    kind = "text/event-stream" if body.get("stream") else "application/json"
    return {"content-type": kind}


class CutStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"choices": [{"index": 0, "delta": {"content": "par"}}]}\n\n'
        raise httpx.ReadError("connection reset by peer")


@pytest.fixture
def flaky(tiny_model_path: Path, tmp_path: Path):
    engine = store.open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    seed_promoted(engine, tiny_model_path.name, 0.5)
    upstreams = Upstreams()
    settings = GatewaySettings(
        upstreams=["http://up-1", "http://up-2"],
        base_model_path=tiny_model_path,
        adapters_root=tmp_path / "adapters",
        admin_keys=frozenset({"admin-key"}),
        sync_interval_s=0.05,
    )
    app = create_app(settings, engine, transport=httpx.MockTransport(upstreams))
    with TestClient(app) as client:
        yield client, upstreams, engine


def test_an_unknown_version_is_404_on_promote(flaky) -> None:
    client, _, _ = flaky
    response = client.post("/admin/promote", json={"version": "v-nope"}, headers=ADMIN)
    assert response.status_code == 404
    assert "unknown policy version 'v-nope'" in response.json()["error"]["message"]


def test_an_upstream_that_fails_mid_answer_is_502_or_an_error_event(flaky) -> None:
    client, upstreams, _ = flaky
    upstreams.cut = True
    plain = client.post("/v1/chat/completions", json=chat())
    assert plain.status_code == 502 and "failed mid-answer" in plain.json()["error"]["message"]
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[0].startswith('data: {"choices"')
    assert '"code": 502' in events[-2] and events[-1] == "data: [DONE]"
    inflight = client.get("/admin/state", headers=ADMIN).json()["inflight"]
    assert set(inflight.values()) <= {0}  # both answers were counted out


def test_an_upstream_that_fails_leaves_the_rotation_and_comes_back(flaky) -> None:
    client, upstreams, _ = flaky
    upstreams.refuse.add("up-1")
    for _ in range(4):  # a refused connection is retried on the other upstream at once
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    assert upstreams.served == ["up-2"] * 4
    state = client.get("/admin/state", headers=ADMIN).json()
    assert state["down"] == ["http://up-1"]
    upstreams.refuse.clear()
    upstreams.broken.add("up-2")  # answers, but its probes fail
    wait_until(lambda: client.get("/admin/state", headers=ADMIN).json()["down"] == ["http://up-2"])
    upstreams.served.clear()
    for _ in range(3):
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    assert upstreams.served == ["up-1"] * 3
    upstreams.refuse.add("up-1")
    response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 503 and "no model server" in response.json()["error"]["message"]
    upstreams.refuse.clear()
    upstreams.broken.clear()
    wait_until(lambda: client.get("/admin/state", headers=ADMIN).json()["down"] == [])


@pytest.mark.parametrize(
    "answer",
    [
        b"[1, 2]",
        b'"ok"',
        b"null",
        b'{"choices": "none"}',
        b'{"choices": [null]}',
        b'{"choices": [{"message": []}]}',
        b"\xff\xfe not json",
    ],  # fmt: skip
)
def test_an_upstream_s_odd_answer_takes_it_out_and_the_gateway_lives_on(flaky, answer) -> None:
    client, upstreams, _ = flaky
    upstreams.odd["up-1"] = answer
    wait_until(lambda: client.get("/admin/state", headers=ADMIN).json()["down"] == ["http://up-1"])
    upstreams.served.clear()
    for _ in range(2):
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    assert upstreams.served == ["up-2"] * 2
    del upstreams.odd["up-1"]
    wait_until(lambda: client.get("/admin/state", headers=ADMIN).json()["down"] == [])


def test_a_database_error_does_not_stop_the_alias_following_the_store(
    flaky, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy.exc import OperationalError

    client, _, engine = flaky
    real = store.promoted_policy
    failures = []

    def flaky_read(session):
        if len(failures) < 3:
            failures.append(1)
            raise OperationalError("SELECT", {}, Exception("server closed the connection"))
        return real(session)

    monkeypatch.setattr(store, "promoted_policy", flaky_read)
    wait_until(lambda: len(failures) == 3)
    with store.transaction(engine) as session:
        store.save_policy_version(session, PolicyVersion(name="v-next", base_model="b"))
        store.record_evaluation(session, "v-next", 0.9)
        store.set_promoted(session, "v-next", True)
    wait_until(lambda: client.get("/health").json()["target"] == "v-next")


def test_a_rollback_whose_version_cannot_be_served_changes_nothing(flaky, tmp_path) -> None:
    client, _, engine = flaky
    with store.transaction(engine) as session:
        store.save_policy_version(
            session,
            PolicyVersion(name="v-gone", base_model="b", adapter_path=str(tmp_path / "gone")),
        )
        store.record_evaluation(session, "v-gone", 0.9)
        store.set_promoted(session, "v-gone", True)
        store.save_policy_version(session, PolicyVersion(name="v-head", base_model="b"))
        store.record_evaluation(session, "v-head", 0.95)
        store.set_promoted(session, "v-head", True)
    response = client.post("/admin/rollback", headers=ADMIN)
    assert response.status_code == 400
    with store.transaction(engine) as session:
        assert store.promoted_policy(session).name == "v-head"
        assert store.alias_events(session, "policy") == []


def test_bodies_and_rates_are_limited_per_key(tiny_model_path: Path, tmp_path: Path) -> None:
    from serving.limits import RequestLimits

    engine = store.open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    seed_promoted(engine, tiny_model_path.name, 0.5)

    def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=reply(json.loads(request.content)["model"]))

    settings = GatewaySettings(
        upstreams=["http://up-1"], base_model_path=tiny_model_path,
        adapters_root=tmp_path / "adapters", user_keys=frozenset({"user-key", "other-key"}),
        limits=RequestLimits(max_body_bytes=2_000, rate_per_s=0.5, burst=3),
    )  # fmt: skip
    app = create_app(settings, engine, transport=httpx.MockTransport(upstream))
    with TestClient(app) as client:
        huge = chat(messages=[{"role": "user", "content": "x" * 5_000}])
        stated = client.post("/v1/chat/completions", json=huge, headers=USER)
        chunked = client.post(
            "/v1/chat/completions", content=iter([json.dumps(huge).encode()]), headers=USER
        )
        answers = [client.post("/v1/chat/completions", json=chat(), headers=USER)
                   for _ in range(3)]  # fmt: skip
        other = client.post("/v1/chat/completions", json=chat(), headers=OTHER)
        health = [client.get("/health").status_code for _ in range(10)]
    assert stated.status_code == 413 and "over 2000 bytes" in stated.json()["error"]["message"]
    assert chunked.status_code == 413
    assert [a.status_code for a in answers] == [200, 429, 429]  # the two 413s took tokens too
    assert int(answers[-1].headers["retry-after"]) >= 1
    assert other.status_code == 200 and set(health) == {200}  # each key has its own bucket


OTHER = {"Authorization": "Bearer other-key"}
