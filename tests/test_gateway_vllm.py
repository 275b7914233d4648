"""The gateway in front of a real vLLM server (tiny model): hot-swap under load, corrupt adapters
rejected while traffic flows, auth, rollback."""

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from memory import store
from memory.records import PolicyVersion
from serving.adapters import loaded_models
from serving.gateway import GatewaySettings, create_app, running
from serving.limits import RequestLimits
from tests.helpers import free_port, make_group, random_adapter, seed_promoted, tiny_vllm
from trainer.round import train_round
from trainer.settings import TrainSettings

pytestmark = pytest.mark.vllm
ADMIN = {"Authorization": "Bearer admin-key"}
QV = ["q_proj", "v_proj"]
USER = {"Authorization": "Bearer user-key"}


def corrupt_copies(good: Path, root: Path) -> dict[str, Path]:
    variants = {}
    for kind in ("truncated", "bad-config", "rank-too-high", "no-matching-modules"):
        target = root / f"corrupt-{kind}"
        shutil.copytree(good, target)
        variants[kind] = target
    weights = variants["truncated"] / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (variants["bad-config"] / "adapter_config.json").write_text("{not json")
    config = json.loads((good / "adapter_config.json").read_text())
    (variants["rank-too-high"] / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    renamed = variants["no-matching-modules"] / "adapter_model.safetensors"
    tensors = load_file(renamed)
    save_file({k.replace("layers.", "blocks."): v for k, v in tensors.items()}, renamed)
    variants["missing"] = root / "no-such-adapter"
    return variants


def keyed_settings(upstreams: list[str], model: Path, root: Path) -> GatewaySettings:
    """The gateway of these tests: a user key and an admin key, adapters under `root`, no rate
    limit to speak of."""
    return GatewaySettings(
        upstreams=upstreams,
        base_model_path=model,
        adapters_root=root,
        user_keys=frozenset({"user-key"}),
        admin_keys=frozenset({"admin-key"}),
        # Load tests: the steady traffic of `Load` must not meet the per-key rate limit.
        limits=RequestLimits(rate_per_s=10_000, burst=10_000),
    )


def answering_versions(url: str, count: int) -> set[str]:
    """The versions that answer `count` sequential alias requests."""
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=url, headers=USER, timeout=60) as client:
        return {
            client.post("/v1/chat/completions", json=body).json()["model"] for _ in range(count)
        }


def canary_body(model: str) -> dict:
    """Temperature-0 canary traffic: its text tells which weights answered, not only its label."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "2+2?"}],
        "max_tokens": 8,
        "temperature": 0.0,
    }


def greedy_text(server: str, model: str) -> str:
    response = httpx.post(f"{server}/v1/chat/completions", json=canary_body(model), timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


class Load:
    """Steady concurrent chat traffic through the gateway: failures, and for each success the
    moment it was sent and the version that answered."""

    def __init__(self, url: str, workers: int = 4) -> None:
        self.url, self.workers = url, workers
        self.stop = threading.Event()
        self.progress = threading.Condition()
        self.errors: list[str] = []
        self.answers: list[tuple[float, str, str]] = []  # (sent, version, text)
        self.threads = [threading.Thread(target=self._run) for _ in range(workers)]

    def _run(self) -> None:
        body = canary_body("policy")
        with httpx.Client(base_url=self.url, headers=USER, timeout=60) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    response = client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if response.status_code != 200:
                    self.errors.append(f"{response.status_code} {response.text[:100]}")
                    continue
                answer = response.json()
                text = answer["choices"][0]["message"]["content"]
                with self.progress:
                    self.answers.append((sent, answer["model"], text))
                    self.progress.notify_all()

    def wait_for(self, count: int) -> None:
        """Block until `count` requests have succeeded in all."""
        with self.progress:
            done = self.progress.wait_for(lambda: len(self.answers) >= count, timeout=120)
        assert done, f"fewer than {count} answers in 120 s; errors: {self.errors[:3]}"

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def test_hot_swap_under_load(tiny_server: str, tiny_model_path: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    # Random weights strong enough to change the tiny model's greedy answer.
    torch.manual_seed(0)
    good = random_adapter(tiny_model_path, root, "policy-r1-gw", std=1.0)
    corrupt = corrupt_copies(good, root)
    engine = store.open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    base = tiny_model_path.name
    seed_promoted(engine, base, 0.1)
    with store.transaction(engine) as session:
        store.save_policy_version(
            session,
            PolicyVersion(
                name="policy-r1-gw",
                base_model=base,
                parent=base,
                adapter_path=str(good),
                round_index=1,
            ),
        )
        store.record_evaluation(session, "policy-r1-gw", 0.2)
    settings = keyed_settings([tiny_server], tiny_model_path, root)
    with running(create_app(settings, engine), port=free_port()) as url:
        admin = httpx.Client(base_url=url, headers=ADMIN, timeout=120)
        assert httpx.post(f"{url}/v1/chat/completions", json={}).status_code == 401
        with Load(url) as load:
            for kind, path in corrupt.items():
                response = admin.post(
                    "/admin/adapters", json={"name": f"bad-{kind}", "path": str(path)}
                )
                assert response.status_code == 400, (kind, response.status_code, response.text)
            assert (
                admin.post(
                    "/admin/adapters", json={"name": "policy-r1-gw", "path": str(good)}
                ).status_code
                == 200
            )
            promoted = admin.post("/admin/promote", json={"version": "policy-r1-gw"})
            assert promoted.status_code == 200, promoted.text
            # The alias is resolved when a request starts: every request sent after the
            # switch returned goes to the new version, while the load keeps flowing.
            assert answering_versions(url, 4) == {"policy-r1-gw"}
            load.wait_for(16)
            rolled_back = admin.post("/admin/rollback")
            assert rolled_back.status_code == 200, rolled_back.text
            assert answering_versions(url, 4) == {base}
            load.wait_for(len(load.answers) + 8)
        assert load.errors == []
        assert {model for _, model, _ in load.answers} == {base, "policy-r1-gw"}
        texts = {v: greedy_text(tiny_server, v) for v in (base, "policy-r1-gw")}
        assert texts[base][:1] != texts["policy-r1-gw"][:1], "the adapter must change the text"
        # The answers of each version start as that version's greedy text, not the other's: the
        # switch is in the weights that answered, not only in the label. (A random model's logits
        # are near-flat: an answer's first token may flip with the batch it was sampled in.)
        for version, text in texts.items():
            other = next(t for v, t in texts.items() if v != version)
            firsts = [t[:1] for _, model, t in load.answers if model == version]
            own, others = firsts.count(text[:1]), firsts.count(other[:1])
            assert own >= 0.7 * len(firsts) and others <= 0.1 * len(firsts), (version, firsts)
        served = httpx.get(f"{tiny_server}/v1/models").json()["data"]
        assert not any(m["id"].startswith("bad-") for m in served)


def test_old_versions_are_unloaded_beyond_the_limit(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    groups = [make_group([1.0, 0.0], task_id="t")]
    first = Path(
        train_round(
            groups,
            base_model=tiny_model_path,
            parent_adapter=None,
            adapters_root=root,
            name="evict-1",
            settings=TrainSettings(epochs=1, mode="grpo"),
        ).adapter_path
    )
    for i in (2, 3, 4):
        shutil.copytree(first, root / f"evict-{i}")
    engine = store.open_store(f"sqlite:///{tmp_path / 'evict.db'}")
    seed_promoted(engine, tiny_model_path.name, 0.1)
    settings = GatewaySettings(
        upstreams=[tiny_server],
        base_model_path=tiny_model_path,
        adapters_root=root,
        admin_keys=frozenset({"admin-key"}),
        keep_versions=3,
    )
    with running(create_app(settings, engine), port=free_port()) as url:
        admin = httpx.Client(base_url=url, headers=ADMIN, timeout=120)
        for i in (1, 2, 3, 4):
            body = {"name": f"evict-{i}", "path": str(root / f"evict-{i}")}
            assert admin.post("/admin/adapters", json=body).status_code == 200
        state = admin.get("/admin/state").json()
    assert state["versions"] == ["evict-2", "evict-3", "evict-4"]
    served = {m["id"] for m in httpx.get(f"{tiny_server}/v1/models").json()["data"]}
    assert "evict-1" not in served and {"evict-2", "evict-3", "evict-4"} <= served


BALANCE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_balance",
        "description": "The balance of an account.",
        "parameters": {
            "type": "object",
            "properties": {"account": {"type": "string"}},
            "required": ["account"],
        },
    },
}


def forced(text: str, call: str = '{"name": "get_balance", "arguments": ') -> bool:
    """Whether `text` is the start of a Hermes call of the tool, or holds it whole: the random
    model often spells the forced call a character a token, so `max_tokens` can end it anywhere."""
    body = text.removeprefix("<tool_call>").lstrip()
    return (
        text.startswith("<tool_call>")
        and len(body) > 10
        and (call.startswith(body) or body.startswith(call))
    )


def test_an_openai_client_calls_tools_through_the_gateway(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """`tools` with tool_choice auto, required and named, through the gateway: accepted, and a
    forced choice constrains the reply to a call of that tool (the random model then fills the
    arguments until `max_tokens`, so it is read from the text); a conversation
    that carries tool calls and their results renders and is answered."""
    import openai

    engine = store.open_store(f"sqlite:///{tmp_path / 'tools.db'}")
    seed_promoted(engine, tiny_model_path.name)
    settings = keyed_settings([tiny_server], tiny_model_path, tmp_path / "adapters")
    with running(create_app(settings, engine), port=free_port()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="user-key", max_retries=0)
        ask = [{"role": "user", "content": "What is the balance of account a?"}]
        common = {"model": "policy", "messages": ask, "tools": [BALANCE_TOOL], "max_tokens": 48}
        auto = client.chat.completions.create(**common, tool_choice="auto")
        assert auto.choices[0].message.role == "assistant"
        named = {"type": "function", "function": {"name": "get_balance"}}
        for choice in ("required", named):
            answer = client.chat.completions.create(**common, tool_choice=choice).choices[0]
            calls, text = answer.message.tool_calls, answer.message.content or ""
            assert [c.function.name for c in calls or []] == ["get_balance"] or forced(text), answer
        call = {"id": "call-1", "type": "function",
                "function": {"name": "get_balance", "arguments": '{"account": "a"}'}}  # fmt: skip
        follow = [
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call-1", "content": "42"},
        ]
        after = client.chat.completions.create(**{**common, "messages": follow})
        assert after.choices[0].message.role == "assistant"


def test_a_swap_reaches_every_replica_or_none_moves_the_alias(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Two real replicas behind the gateway, the second pinned to a core of its own and taking
    LoRA ranks up to 8 only: a rank-16 version loads on one replica and not the other, and the
    alias stays; a rank-8 version loads on both, and the alias moves with no request dropped."""
    root = tmp_path / "adapters"
    wide = random_adapter(tiny_model_path, root, "policy-r1-wide", modules=QV)  # rank 16
    narrow = random_adapter(tiny_model_path, root, "policy-r2-narrow", std=1.0)  # rank 8
    engine = store.open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    base = tiny_model_path.name
    seed_promoted(engine, base, 0.1)
    with store.transaction(engine) as session:
        for index, (name, path) in enumerate([("policy-r1-wide", wide),
                                              ("policy-r2-narrow", narrow)], start=1):  # fmt: skip
            store.save_policy_version(
                session,
                PolicyVersion(name=name, base_model=base, parent=base, adapter_path=str(path),
                              round_index=index),
            )  # fmt: skip
            store.record_evaluation(session, name, 0.2 + index / 10)
    with tiny_vllm(tiny_model_path, tmp_path / "replica", cpus="1", max_lora_rank=8) as replica:
        replicas = [tiny_server, replica.url]
        settings = keyed_settings(replicas, tiny_model_path, root)
        with running(create_app(settings, engine), port=free_port()) as url:
            admin = httpx.Client(base_url=url, headers=ADMIN, timeout=120)
            with Load(url) as load:
                refused = admin.post("/admin/promote", json={"version": "policy-r1-wide"})
                assert refused.status_code >= 400, refused.text
                assert answering_versions(url, 4) == {base}  # the alias did not move
                with store.transaction(engine) as session:
                    assert store.promoted_policy(session).name == base
                load.wait_for(8)
                promoted = admin.post("/admin/promote", json={"version": "policy-r2-narrow"})
                assert promoted.status_code == 200, promoted.text
                assert answering_versions(url, 4) == {"policy-r2-narrow"}
                load.wait_for(len(load.answers) + 8)
            assert load.errors == []
            for upstream in replicas:  # each replica serves the new version itself
                assert "policy-r2-narrow" in loaded_models(upstream)
                assert greedy_text(upstream, "policy-r2-narrow")
            assert "policy-r1-wide" not in loaded_models(replica.url)


def test_a_served_name_is_never_registered_again_with_other_weights(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Every registration is validated and confined, a served name's included: neither weights
    outside the checkpoint root nor another adapter can take a name already served."""
    root = tmp_path / "adapters"
    first = random_adapter(tiny_model_path, root, "policy-r7-a", std=1.0)
    other = random_adapter(tiny_model_path, root, "policy-r7-b", std=1.0)
    outside = random_adapter(tiny_model_path, tmp_path / "elsewhere", "policy-r7-c", std=1.0)
    engine = store.open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    seed_promoted(engine, tiny_model_path.name, 0.1)
    settings = keyed_settings([tiny_server], tiny_model_path, root)
    with running(create_app(settings, engine), port=free_port()) as url:
        admin = httpx.Client(base_url=url, headers=ADMIN, timeout=120)
        loaded = admin.post("/admin/adapters", json={"name": "v-served", "path": str(first)})
        assert loaded.status_code == 200, loaded.text
        again = admin.post("/admin/adapters", json={"name": "v-served", "path": str(first)})
        assert again.status_code == 200  # the same folder again: nothing changes
        escaped = admin.post("/admin/adapters", json={"name": "v-served", "path": str(outside)})
        assert escaped.status_code == 400 and "outside the checkpoint root" in escaped.text
        swapped = admin.post("/admin/adapters", json={"name": "v-served", "path": str(other)})
        assert swapped.status_code == 400 and "a new folder needs a new name" in swapped.text
        state = admin.get("/admin/state").json()
    assert state["versions"] == ["v-served"]


def test_a_model_server_with_its_own_key_is_reached_only_through_the_flywheel(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server answers /v1 only with its key, which it got by environment (not on its
    command line); the flywheel's clients (the policy client, adapter loads, the readiness
    probe, the gateway's proxy) all carry it, and a caller's own key never reaches it."""
    import anyio

    from agents.policy import PolicyClient
    from memory.records import SamplingSettings
    from serving.access import ENV
    from serving.adapters import ensure_loaded
    from workers.readiness import Readiness

    monkeypatch.delenv(ENV, raising=False)
    with tiny_vllm(tiny_model_path, tmp_path, api_key="server-secret") as server:
        chat = {"model": tiny_model_path.name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}  # fmt: skip
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat).status_code == 401
        wrong = {"Authorization": "Bearer user-key"}
        assert httpx.get(f"{server.url}/v1/models", headers=wrong).status_code == 401
        tokenize = {"model": tiny_model_path.name, "prompt": "hi"}
        for route in ("/tokenize", "/metrics", "/health"):  # vLLM's own guard leaves these open
            sent = (httpx.post(f"{server.url}{route}", json=tokenize) if route == "/tokenize"
                    else httpx.get(f"{server.url}{route}"))  # fmt: skip
            assert sent.status_code == 401, route
        keyed = {"Authorization": "Bearer server-secret"}
        assert httpx.post(f"{server.url}/tokenize", json=tokenize, headers=keyed).status_code == 200
        cmdline = Path(f"/proc/{server._process.pid}/cmdline").read_bytes()
        assert b"server-secret" not in cmdline
        assert server.alive()  # its own probes carry the key
        monkeypatch.setenv(ENV, "server-secret")
        sampling = SamplingSettings(temperature=0.0, max_tokens=2)

        async def sample() -> str:
            client = PolicyClient(server.url)
            try:
                return (await client.sample(tiny_model_path.name, chat["messages"], sampling)).text
            finally:
                await client.aclose()

        assert isinstance(anyio.run(sample), str)
        adapter = random_adapter(tiny_model_path, tmp_path / "adapters", "policy-r1-key")
        ensure_loaded(server.url, "policy-r1-key", adapter)
        engine = store.open_store(f"sqlite:///{tmp_path / 'key.db'}")
        seed_promoted(engine, tiny_model_path.name)
        ready = Readiness(engine, server.url, outage_s=30)
        anyio.run(ready.ensure, "policy-r1-key")
        settings = keyed_settings([server.url], tiny_model_path, tmp_path / "adapters")
        with running(create_app(settings, engine), port=free_port()) as url:
            body = {**chat, "model": "policy"}
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=USER, timeout=60)
        assert reply.status_code == 200 and reply.json()["model"] == tiny_model_path.name
