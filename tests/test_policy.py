"""Agent logic against a scripted OpenAI-compatible server (httpx.MockTransport)."""

import json

import anyio
import httpx
import pytest

from agents.collector import CollectSettings, collect_groups
from agents.errors import PolicyError
from agents.policy import PolicyClient
from memory.records import SamplingSettings
from verifiers.reasoning import eval_tasks


def completion(text: str, token_ids: list[int] | None, finish: str = "stop") -> dict:
    ids = token_ids or []
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "logprobs": {
            "content": [
                {"token": str(t), "logprob": -0.5, "bytes": [], "top_logprobs": []} for t in ids
            ]
        },
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    if token_ids is not None:
        body["prompt_token_ids"] = [1, 2, 3]
    return body


def client_for(handler) -> PolicyClient:
    transport = httpx.MockTransport(handler)
    return PolicyClient(
        "http://scripted", max_retries=0, http_client=httpx.AsyncClient(transport=transport)
    )


SAMPLING = SamplingSettings(temperature=0.7, max_tokens=8)
MESSAGES = [{"role": "user", "content": "Calculate 1 + 1."}]


def test_sample_keeps_exact_token_ids_and_logprobs() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=completion("<answer>2</answer>", [5, 6, 7]))

    sample = anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)
    assert sample.prompt_token_ids == [1, 2, 3]
    assert sample.completion_token_ids == [5, 6, 7]
    assert sample.logprobs == [-0.5, -0.5, -0.5]
    assert seen[0]["return_token_ids"] is True and seen[0]["logprobs"] is True
    assert seen[0]["temperature"] == 0.7


def test_missing_token_ids_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=completion("2", None))

    with pytest.raises(PolicyError, match="no token ids"):
        anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)


def test_server_errors_become_policy_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "engine dead"}})

    with pytest.raises(PolicyError, match="InternalServerError"):
        anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)


def test_a_failed_call_is_recorded_and_does_not_sink_the_batch() -> None:
    tasks = eval_tasks("arithmetic", 3)
    answers = {t.question: t.answer for t in tasks}
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        question = json.loads(request.content)["messages"][-1]["content"]
        if question == tasks[0].question and calls["n"] % 2:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        text = f"<answer>{answers[question]}</answer>"
        return httpx.Response(200, json=completion(text, [9, 9], finish="length"))

    stored = []

    async def main():
        return await collect_groups(
            client_for(handler),
            tasks,
            model="m",
            round_index=1,
            purpose="train",
            settings=CollectSettings(group_size=2),
            limiter=anyio.CapacityLimiter(1),
            on_group=stored.append,
        )

    groups = anyio.run(main)
    assert len(groups) == len(stored) == 3
    by_task = {g.task_id: g for g in groups}
    failed = by_task[tasks[0].task_id]
    assert not failed.complete
    assert any(a.error and "503" not in a.reason for a in failed.attempts)
    for task in tasks[1:]:
        group = by_task[task.task_id]
        assert group.complete
        assert all(a.correct and a.reward == 1.0 for a in group.attempts)
        assert all("truncated" in a.reason for a in group.attempts)


def test_stored_tasks_are_skipped() -> None:
    tasks = eval_tasks("arithmetic", 2)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=completion("1", [1]))

    async def main():
        return await collect_groups(
            client_for(handler),
            tasks,
            model="m",
            round_index=1,
            purpose="eval",
            settings=CollectSettings(group_size=1),
            limiter=anyio.CapacityLimiter(4),
            on_group=lambda g: None,
            skip={tasks[0].task_id},
        )

    groups = anyio.run(main)
    assert [g.task_id for g in groups] == [tasks[1].task_id]


def test_each_distinct_tokenize_request_goes_out_once() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"tokens": [len(seen)]})

    async def main():
        client = client_for(handler)
        first = await client.tokenize_text("m", "Answer:")
        again = await client.tokenize_text("m", "Answer:")
        other = await client.tokenize_text("m", "Strategy:")
        return first, again, other

    assert anyio.run(main) == ([1], [1], [2])
    assert len(seen) == 2
