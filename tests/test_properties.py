"""Property tests (Hypothesis) where model text and user input meet the code: answer extraction
and verification, the settings loader, and the gateway's request bodies. Whatever comes in, the
answer is one line or a status, never a crash."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flows.errors import FlowError
from flows.settings import RunSettings, load_run_settings
from memory import store
from serving import probe
from serving.gateway import GatewaySettings, create_app
from serving.limits import RequestLimits
from tests.helpers import seed_promoted
from verifiers import reasoning
from verifiers.answer import extract_answer

# Derandomized: CI runs the same 200 examples a test as a laptop does (new ones come from
# changing the strategies, or a local run with the `derandomize` off).
QUICK = settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
TASK = reasoning.eval_tasks("arithmetic", 1)[0]
pieces = st.sampled_from(
    ["<answer>", "</answer>", "<ANSWER>", "```", "=", " = 7.", "7", "-3", "\x00", "\n", " ", "x"]
)
texts = st.lists(st.one_of(pieces, st.text(max_size=12)), max_size=30).map("".join)


@QUICK
@given(texts)
@example("<answer>=``````=</answer>")  # a fence inside the answer is dropped, not the answer
def test_any_text_extracts_to_at_most_one_answer_and_verifies_in_bounds(text: str) -> None:
    started = time.monotonic()
    found = extract_answer(text)
    if found.format_ok:
        assert found.answer and found.answer.strip()
        assert "<answer>" not in found.answer.lower()  # one answer, never a tag or a list
    verdict = reasoning.verify(TASK, text)
    assert 0.0 <= verdict.reward <= 1.0 and "\n" not in verdict.reason
    assert time.monotonic() - started < 1.0


@QUICK
@given(st.lists(st.text(max_size=8), min_size=2, max_size=4))
def test_several_or_empty_answers_earn_nothing(candidates: list[str]) -> None:
    listed = " ".join(f"<answer>{c}</answer>" for c in [TASK.answer, *candidates])
    assert reasoning.verify(TASK, listed).reward == 0.0
    assert reasoning.verify(TASK, "<answer></answer>" * len(candidates)).reward == 0.0


scalars = st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats() | st.text(max_size=8)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
nested = [
    *("train.mode", "collect.anneal.schedule.t_max", "collect.guard.deadline_s", "gate.min_gain"),
    *("train.nope", "annealing.t_max", "collect.revise.enabled"),
]
keys = st.sampled_from([*RunSettings.model_fields, *nested, "nope"])


@QUICK
@given(st.dictionaries(keys, values, max_size=4), st.dictionaries(keys, values, max_size=3))
def test_any_config_and_flags_load_or_fail_in_one_line(
    config: dict[str, Any], flags: dict[str, Any]
) -> None:
    path = Path("/tmp") / "flywheel-property.toml"
    path.write_text(
        "\n".join(f"{k.split('.')[0]} = {json.dumps(str(v))}" for k, v in config.items())
    )
    try:
        loaded = load_run_settings(path, flags)
    except FlowError as error:
        assert "\n" not in str(error) and str(error)
    else:
        assert isinstance(loaded, RunSettings)


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("gateway")
    engine = store.open_store(f"sqlite:///{folder / 'gw.db'}")
    seed_promoted(engine, tiny_model_path.name, 0.5)

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        model = body.get("model") if isinstance(body, dict) else None
        message = {"role": "assistant", "content": "ok"}
        return httpx.Response(
            200, json={"model": model, "choices": [{"index": 0, "message": message}]}
        )

    settings_ = GatewaySettings(
        upstreams=["http://up-1"], base_model_path=tiny_model_path,
        adapters_root=folder / "adapters", user_keys=frozenset({"u"}),
        admin_keys=frozenset({"a"}), capture=True, taskset="arithmetic",
        limits=RequestLimits(rate_per_s=10_000, burst=10_000),  # every example reaches a route
    )  # fmt: skip
    app = create_app(settings_, engine, transport=httpx.MockTransport(upstream))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    assert probe.PROMPT  # the module's probes answered throughout


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/feedback", "/admin/promote",
          "/admin/adapters", "/admin/rollback"]  # fmt: skip
bodies = st.one_of(
    values,
    st.fixed_dictionaries({"model": st.sampled_from(["policy", "x", 7]), "messages": values}),
    st.fixed_dictionaries({"session": st.text(max_size=8), "score": values, "reference": values}),
    st.fixed_dictionaries({"version": values, "name": values, "path": values}),
)


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(st.sampled_from(ROUTES), bodies, st.sampled_from(["u", "a"]), st.booleans())
@example("/v1/feedback", float("inf"), "u", False)  # was a 500: the 422 echoed Infinity back
@example("/v1/feedback", {"session": "s", "score": float("nan"), "reference": None}, "u", False)
def test_no_request_body_makes_the_gateway_fail(gateway, route: str, body, key: str, raw: bool):
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    content = (json.dumps(body) if not raw else str(body)).encode()
    response = gateway.post(route, content=content, headers=headers)
    assert response.status_code < 500 or response.status_code in (502, 503), response.text
    assert gateway.get("/health").status_code == 200
