"""Agent logic against a scripted OpenAI-compatible server (httpx.MockTransport)."""

import json

import anyio
import httpx
import pytest

from agents.collector import GroupSpec, Hooks, collect_groups
from agents.errors import PolicyError, ServerBusy, ServerUnavailable
from agents.policy import Endpoint
from agents.settings import CollectSettings
from agents.watchdog import WatchdogSettings
from memory.records import SamplingSettings
from tests.helpers import client_for, completion
from verifiers.reasoning import eval_tasks

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


def test_a_server_that_returns_no_token_ids_is_not_vllm() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=completion("2", None))

    with pytest.raises(ServerUnavailable, match="no token ids: is it a vLLM server"):
        anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)


@pytest.mark.parametrize("status", [500, 503, 404, 401, 429])
def test_statuses_about_the_server_mean_it_is_unavailable(status: int) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": "engine dead"}})

    with pytest.raises(ServerUnavailable, match=f"http://scripted answered {status}"):
        anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)


def test_a_request_the_server_refuses_is_the_attempts_own_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    with pytest.raises(PolicyError, match="BadRequestError"):
        anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)


def test_a_reset_connection_is_tried_twice_more_then_unavailable() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ReadError("connection reset by peer", request=request)

    with pytest.raises(ServerUnavailable, match="connection reset by peer"):
        anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)
    assert len(calls) == 3


def test_a_transient_failure_then_an_answer_is_an_answer() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json=completion("<answer>2</answer>", [5]))

    sample = anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)
    assert sample.completion_token_ids == [5] and len(calls) == 2


def test_a_timeout_is_never_sent_again() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(ServerUnavailable, match="APITimeoutError"):
        anyio.run(client_for(handler).sample, "m", MESSAGES, SAMPLING)
    assert len(calls) == 1  # the server may still be working on it: no resend


def test_a_request_past_its_deadline_ends_and_is_not_sent_again() -> None:
    calls = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        await anyio.sleep(30)
        return httpx.Response(200, json=completion("late", [1]))

    async def main() -> None:
        client = client_for(handler, WatchdogSettings(floor_s=0.5, ceiling_s=0.5))
        await client.sample("m", MESSAGES, SAMPLING)

    with pytest.raises(ServerUnavailable, match="gave no answer in 0 s"):
        anyio.run(main)
    assert len(calls) == 1


def test_a_deadline_grows_with_the_requests_that_join_it() -> None:
    """Alone, a 1.5 s answer is past its 1 s deadline; with 20 requests joining it (the batch it
    shares, at the assumed 100 tokens/s) its deadline grows and the answer is taken."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404)
        await anyio.sleep(1.5)
        return httpx.Response(200, json=completion("ok", [1]))

    async def main(companions: int) -> list[str]:
        watchdog = WatchdogSettings(poll_s=0.2, floor_s=1.0, ceiling_s=10.0, assumed_rate=100)
        client = client_for(handler, watchdog)
        texts: list[str] = []

        async def one() -> None:
            texts.append((await client.sample("m", MESSAGES, SAMPLING)).text)

        if not companions:
            await one()
            return texts
        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            await anyio.sleep(0.05)
            for _ in range(companions):
                tg.start_soon(one)
        return texts

    with pytest.raises(ServerUnavailable, match="gave no answer in 1 s"):
        anyio.run(main, 0)
    assert anyio.run(main, 20) == ["ok"] * 21


def test_a_deadline_passed_under_load_is_busy_and_alone_is_not() -> None:
    """Cut short by the ceiling with others in flight, the queue was at fault (`ServerBusy`,
    which a work queue does not count against the task); alone, or past a deadline its queue
    did not explain (a fast server), the request itself was."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404)
        await anyio.sleep(30)
        return httpx.Response(200, json=completion("late", [1]))

    async def main(requests: int, rate: float = 4.0) -> list[BaseException]:
        watchdog = WatchdogSettings(poll_s=0.1, floor_s=0.3, ceiling_s=0.3, assumed_rate=rate)
        client = client_for(handler, watchdog)
        errors: list[BaseException] = []

        async def one() -> None:
            try:
                await client.sample("m", MESSAGES, SAMPLING)
            except ServerUnavailable as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(requests):
                tg.start_soon(one)
        return errors

    alone = anyio.run(main, 1)
    assert len(alone) == 1 and not isinstance(alone[0], ServerBusy)
    crowded = anyio.run(main, 3)
    assert len(crowded) == 3 and isinstance(crowded[0], ServerBusy), crowded
    assert "3 requests in flight" in str(crowded[0]) and crowded[0].in_flight == 3
    unexplained = anyio.run(main, 3, 1e4)  # a queue of well under 0.1 s at this rate
    assert len(unexplained) == 3 and not any(isinstance(e, ServerBusy) for e in unexplained)


def test_a_group_the_server_cannot_finish_is_given_up_not_stored() -> None:
    tasks = eval_tasks("arithmetic", 3)
    answers = {t.question: t.answer for t in tasks}
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        question = json.loads(request.content)["messages"][-1]["content"]
        if question == tasks[0].question:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        text = f"<answer>{answers[question]}</answer>"
        return httpx.Response(200, json=completion(text, [9, 9], finish="length"))

    stored, failed = [], []

    async def main():
        return await collect_groups(
            Endpoint(client_for(handler), "m"),
            tasks,
            GroupSpec(1, "train", CollectSettings(group_size=2)),
            anyio.CapacityLimiter(1),
            Hooks(stored.append, lambda task, exc: failed.append((task.task_id, str(exc)))),
        )

    groups = anyio.run(main)
    assert len(groups) == len(stored) == 2
    assert [task_id for task_id, _ in failed] == [tasks[0].task_id]
    assert "answered 503" in failed[0][1]
    for group in groups:
        assert group.complete
        assert all(a.correct and a.reward == 1.0 for a in group.attempts)
        assert all("truncated" in a.reason for a in group.attempts)


def test_without_a_failure_handler_an_unavailable_server_stops_the_batch() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, json={"error": {"message": "bad gateway"}})

    async def main():
        await collect_groups(
            Endpoint(client_for(handler), "m"),
            eval_tasks("arithmetic", 2),
            GroupSpec(1, "train", CollectSettings(group_size=2)),
            anyio.CapacityLimiter(4),
            Hooks(lambda group: pytest.fail("nothing may be stored")),
        )

    with pytest.raises(BaseExceptionGroup) as caught:
        anyio.run(main)
    assert caught.group_contains(ServerUnavailable)


def test_stored_tasks_are_skipped() -> None:
    tasks = eval_tasks("arithmetic", 2)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=completion("1", [1]))

    async def main():
        return await collect_groups(
            Endpoint(client_for(handler), "m"),
            tasks,
            GroupSpec(1, "eval", CollectSettings(group_size=1)),
            anyio.CapacityLimiter(4),
            Hooks(lambda g: None),
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


def test_a_long_prompt_gets_the_time_its_tokens_take() -> None:
    """At the assumed 100 tokens/s a request of 8 new tokens is given the 1 s floor, too short
    for an answer that takes 1.5 s; a 300-token prompt before those 8 tokens is given 3 s."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404)
        await anyio.sleep(1.5)
        body = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        choice = {"index": 0, "text": "7", "finish_reason": "stop", "token_ids": [7],
                  "prompt_token_ids": json.loads(request.content)["prompt"]}  # fmt: skip
        choice["logprobs"] = {"tokens": ["7"], "token_logprobs": [-0.1]}
        return httpx.Response(200, json={**body, "choices": [choice]})

    async def main(prompt_length: int) -> str:
        watchdog = WatchdogSettings(poll_s=0.2, floor_s=1.0, slack=1.0, assumed_rate=100)
        client = client_for(handler, watchdog)
        return (await client.complete_ids("m", [1] * prompt_length, SAMPLING)).text

    with pytest.raises(ServerUnavailable, match="gave no answer in 1 s"):
        anyio.run(main, 1)
    assert anyio.run(main, 300) == "7"


def test_the_measured_rate_counts_prompt_tokens() -> None:
    """A server busy with prompts (its prompt counter moving, generation still) is working: its
    rate is measured from both counters, and it is not stalled."""
    from agents.watchdog import Watchdog

    reads = iter(range(1, 100))

    def handler(request: httpx.Request) -> httpx.Response:
        n = next(reads)
        text = f"vllm:prompt_tokens_total {400.0 * n}\nvllm:generation_tokens_total 10.0\n"
        return httpx.Response(200, text=text)

    async def main() -> float | None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        watchdog = Watchdog(http, "http://scripted", WatchdogSettings(poll_s=0.1, stall_s=0.3))

        async def answer() -> str:
            await anyio.sleep(0.8)
            return "done"

        assert await watchdog.guard(answer, max_tokens=8, prompt_tokens=200) == "done"
        return watchdog.rate

    rate = anyio.run(main)
    assert rate is not None and rate > 1000  # 400 prompt tokens a read, every ~0.1 s
