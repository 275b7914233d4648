"""Gateway logic against a scripted upstream (httpx.MockTransport): auth, alias, routes, gate."""

import json
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from memory import store
from memory.records import PolicyVersion
from serving.gateway import GatewaySettings, create_app
from tests.conftest import seed_promoted

USER, ADMIN = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}


@pytest.fixture
def gateway(tiny_model_path: Path, tmp_path: Path):
    engine = store.open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    base = tiny_model_path.name
    seed_promoted(engine, base, 0.5)
    seen: list[dict] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append({"url": str(request.url), **body})
        if body.get("stream"):
            chunks = [f'data: {{"model": "{body["model"]}", "n": {i}}}\n\n' for i in range(3)]
            return httpx.Response(
                200,
                content="".join(chunks) + "data: [DONE]\n\n",
                headers={"content-type": "text/event-stream"},
            )
        return httpx.Response(200, json={"model": body["model"], "choices": []})

    settings = GatewaySettings(
        upstreams=["http://up-1", "http://up-2"],
        base_model_path=tiny_model_path,
        checkpoint_root=tmp_path / "adapters",
        user_keys=frozenset({"user-key"}),
        admin_keys=frozenset({"admin-key"}),
    )
    app = create_app(settings, engine, transport=httpx.MockTransport(upstream))
    with TestClient(app) as client:
        yield client, seen, engine, base


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


def test_capture_records_trajectories_and_feedback(tiny_model_path: Path, tmp_path: Path) -> None:
    engine = store.open_store(f"sqlite:///{tmp_path / 'capture.db'}")
    base = tiny_model_path.name
    seed_promoted(engine, base)
    sent: list[dict] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        return httpx.Response(
            200,
            json={
                "model": body["model"],
                "prompt_token_ids": [1, 2, 3],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "token_ids": [7, 8],
                        "message": {"role": "assistant", "content": "four"},
                        "logprobs": {
                            "content": [
                                {"token": "f", "logprob": -0.1},
                                {"token": "our", "logprob": -0.2},
                            ]
                        },
                    }
                ],
            },
        )

    settings = GatewaySettings(
        upstreams=["http://up"],
        base_model_path=tiny_model_path,
        checkpoint_root=tmp_path,
        capture=True,
    )
    app = create_app(settings, engine, transport=httpx.MockTransport(upstream))
    with TestClient(app) as client:
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
    with store.transaction(engine) as session:
        (group,) = store.load_groups(session, "capture")
    attempt = group.attempts[0]
    assert group.task_id == capture_id and group.question == "hi"
    assert attempt.sample.prompt_token_ids == [1, 2, 3]
    assert attempt.sample.completion_token_ids == [7, 8]
    assert attempt.sample.logprobs == [-0.1, -0.2]
    assert attempt.sampling.temperature == 0.3
    assert attempt.reward == 1.0 and attempt.reason == "user feedback"


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
