"""EAD: the temperature schedule, an attempt sampled span by span from exact ids (scripted and on
real vLLM), and episodes annealed turn by turn."""

import json

import anyio
import httpx
import pytest

from agents import annealing
from agents.policy import Endpoint, PolicyClient
from agents.settings import AnnealSettings, CollectSettings
from flows.settings import RunSettings
from memory.records import Annealing, SamplingSettings
from tests.helpers import TASK, collect_task, completion

SCHEDULE = Annealing()


def test_the_schedule_falls_from_t_max_to_t_min_then_holds() -> None:
    assert SCHEDULE.spans(96) == [
        (0, 8, 1.2),
        (8, 16, 0.979),
        (16, 24, 0.708),
        (24, 32, 0.378),
        (32, 96, 0.1),
    ]
    assert SCHEDULE.spans(10) == [(0, 8, 1.2), (8, 10, 0.979)]
    assert SCHEDULE.temperature(1000) == SCHEDULE.t_min


def annealing_server(seen: list[dict], stop_after: int):
    """A chat answer of 8 tokens cut at the limit, then completions of 8 tokens each, the
    `stop_after`-th of them stopping by itself."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/v1/chat/completions":
            reply = completion("<answer>", list(range(100, 108)), finish="length")
            reply["prompt_token_ids"] = [1, 2]
            return httpx.Response(200, json=reply)
        span = len([b for b in seen if "prompt" in b])
        ids = list(range(200 + 10 * span, 208 + 10 * span))
        choice = {
            "index": 0,
            "text": f"{TASK.answer}</answer>" if span == stop_after else "",
            "finish_reason": "stop" if span == stop_after else "length",
            "token_ids": ids,
            "prompt_token_ids": body["prompt"],
            "logprobs": {"tokens": ["t"] * 8, "token_logprobs": [-0.5] * 8},
        }
        reply = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        return httpx.Response(200, json={**reply, "choices": [choice]})

    return handler


def test_an_annealed_attempt_continues_each_span_from_the_exact_ids() -> None:
    seen: list[dict] = []
    settings = CollectSettings(group_size=1, max_tokens=96, anneal=on(SCHEDULE))
    (attempt,) = collect_task(annealing_server(seen, stop_after=2), settings).attempts
    chat, first, second = seen
    assert (chat["temperature"], chat["max_tokens"]) == (1.2, 8)
    assert (first["temperature"], first["max_tokens"]) == (0.979, 8)
    assert (second["temperature"], second["max_tokens"]) == (0.708, 8)
    assert first["prompt"] == [1, 2, *range(100, 108)]
    assert second["prompt"] == [1, 2, *range(100, 108), *range(210, 218)]
    sample = attempt.sample
    assert sample is not None and sample.prompt_token_ids == [1, 2]
    assert sample.completion_token_ids == [*range(100, 108), *range(210, 218), *range(220, 228)]
    assert len(sample.logprobs) == 24 and sample.finish_reason == "stop"
    # Verified on the joined text; the schedule is recorded with the attempt.
    assert attempt.correct and attempt.generated_tokens == 24
    assert attempt.sampling.annealing == SCHEDULE


def test_anneal_and_sge_are_refused_together() -> None:
    annealed = {"anneal": {"enabled": True}}
    assert RunSettings.model_validate({"collect": annealed}).collect.annealing == SCHEDULE
    assert RunSettings().collect.annealing is None
    with pytest.raises(ValueError, match="choose one"):
        RunSettings.model_validate({"collect": {**annealed, "strategy": {"enabled": True}}})


def on(schedule: Annealing) -> AnnealSettings:
    return AnnealSettings(enabled=True, schedule=schedule)


def test_an_episode_anneals_turn_by_turn() -> None:
    from agents.episode import _Trace, _turn

    trace = _Trace()
    sampling = SamplingSettings(temperature=0.7, max_tokens=32, annealing=SCHEDULE)
    assert _turn(sampling, trace).temperature == 1.2
    trace.generated = 24
    assert _turn(sampling, trace).temperature == 0.378
    plain = SamplingSettings(temperature=0.7, max_tokens=32)
    assert _turn(plain, trace) is plain


@pytest.mark.vllm
def test_an_annealed_sample_on_a_real_server_spends_its_budget_in_spans(
    tiny_server: str, tiny_model_path
) -> None:
    """The random tiny model almost never stops by itself: every span runs to its limit and the
    joined sample holds exactly the budget, ids and logprobs aligned."""
    model = tiny_model_path.name
    sampling = SamplingSettings(temperature=1.0, max_tokens=40, annealing=SCHEDULE)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]

    async def main():
        client = PolicyClient(tiny_server)
        try:
            return await annealing.sample(Endpoint(client, model), messages, sampling)
        finally:
            await client.aclose()

    sample = anyio.run(main)
    assert len(sample.completion_token_ids) == len(sample.logprobs)
    if sample.finish_reason == "length":  # else its end-of-turn token came first (rare)
        assert len(sample.completion_token_ids) == 40
    assert all(lp <= 0.0 for lp in sample.logprobs)
