"""Exploration logic against a scripted OpenAI-compatible server: guided half-groups and
reflect-then-retry (conditioning rules, token bookkeeping, JSON validation, failures)."""

import json
from collections.abc import Callable

import anyio
import httpx
import pytest

from agents.errors import ServerUnavailable
from agents.policy import Endpoint
from agents.reflection import Reflection, parse_reflection, review_messages
from agents.settings import CollectSettings, RetrySettings
from memory.records import Attempt, Group, Sample, SamplingSettings
from tests.helpers import TASK, client_for, collect_task, completion, scripted, with_attempts
from trainer.dataset import IGNORE, build_rows
from trainer.settings import TrainSettings
from verifiers.taskset import CODE_PROMPT

REFLECTION = {
    "summary": "I gave the wrong number.",
    "root_cause": "I ignored the sign.",
    "outcome": "failure",
    "principle": "Subtracting a negative number adds it.",
    "retry_from_step": 0,
}


def run(handler: Callable[[dict], httpx.Response], settings: CollectSettings) -> Group:
    return collect_task(lambda request: handler(json.loads(request.content)), settings)


def test_guided_slots_see_the_worked_example_and_keep_the_bare_prompt_ids() -> None:
    def handler(body: dict) -> httpx.Response:
        return scripted(body, f"<answer>{TASK.answer}</answer>", [7] * len(body["messages"]))

    group = run(handler, CollectSettings(group_size=4, guided_fraction=0.5))
    assert group.complete
    guided = [a for a in group.attempts if a.guided]
    assert [a.sample_index for a in guided] == [0, 1]
    assert all(a.kind == "guided" and a.context == "demo" for a in guided)
    assert all(a.messages[2]["role"] == "assistant" for a in guided)
    assert all(a.bare_prompt_token_ids == [7, 7] for a in guided)
    assert [a.context for a in group.bare_attempts] == ["bare", "bare"]
    assert all(TASK.answer not in str(a.messages) for a in group.attempts)


def test_an_all_guided_group_gets_bare_ids_from_tokenize() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            seen.append(json.loads(request.content))
            return httpx.Response(200, json={"tokens": [1, 2], "count": 2})
        return scripted({}, "<answer>0</answer>", [9, 9, 9, 9])

    group = collect_task(handler, CollectSettings(group_size=2, guided_fraction=1.0))
    assert all(a.bare_prompt_token_ids == [1, 2] for a in group.attempts)
    assert len(seen) == 1 and len(seen[0]["messages"]) == 2


def reflecting_server(reflection_text: str, retry_answer: str) -> Callable[[dict], httpx.Response]:
    def handler(body: dict) -> httpx.Response:
        if "response_format" in body:
            return scripted(body, reflection_text, [3])
        system = body["messages"][0]["content"]
        if "Guidance from an earlier try" in system:
            return scripted(body, f"<answer>{retry_answer}</answer>", [4, 4])
        return scripted(body, "<answer>999</answer>", [2, 2])

    return handler


def test_a_failed_attempt_is_reflected_on_and_retried_with_the_principle() -> None:
    handler = reflecting_server(json.dumps(REFLECTION), TASK.answer)
    retry = RetrySettings(enabled=True, reflection="full")
    group = run(handler, CollectSettings(group_size=2, retry=retry))
    assert group.complete and len(group.first_attempts) == 2
    retries = [a for a in group.attempts if a.kind == "retry"]
    reflections = [a for a in group.attempts if a.kind == "reflection"]
    assert len(retries) == len(reflections) == 2
    for retry in retries:
        assert retry.correct and retry.improved and retry.parent_index == retry.sample_index
        assert retry.guidance == REFLECTION["principle"]
        assert REFLECTION["principle"] in retry.messages[0]["content"]
        assert retry.bare_prompt_token_ids == [2, 2] and retry.pivot_tokens == 0
    for reflection in reflections:
        assert reflection.format_ok and reflection.improved
        # The reflector sees the attempt and the verifier's verdict, never the reference.
        assert "999" in reflection.messages[1]["content"]
        assert TASK.answer not in reflection.messages[1]["content"].replace("999", "")


def test_a_brief_reflection_asks_for_the_principle_alone_and_sees_the_feedback() -> None:
    asked: list[dict] = []
    principle = {"principle": "Subtracting a negative number adds it."}

    def handler(body: dict) -> httpx.Response:
        if "response_format" in body:
            asked.append(body)
        return reflecting_server(json.dumps(principle), TASK.answer)(body)

    settings = CollectSettings(group_size=2, retry=RetrySettings(enabled=True, reflection="brief"))
    group = run(handler, settings)
    retries = [a for a in group.attempts if a.kind == "retry"]
    assert len(retries) == 2 and all(
        r.correct and r.guidance == principle["principle"] for r in retries
    )
    schema = asked[0]["response_format"]["json_schema"]["schema"]
    assert schema["required"] == ["principle"] and list(schema["properties"]) == ["principle"]
    assert asked[0]["max_tokens"] == 64 and "under 20 words" in asked[0]["messages"][0]["content"]
    assert parse_reflection(json.dumps(principle), brief=True).outcome == "failure"
    assert isinstance(parse_reflection(json.dumps(REFLECTION), brief=False), Reflection)
    failed = group.first_attempts[0].model_copy(update={"feedback": ["failed: f(2) returned 3"]})
    prompt = review_messages("system", TASK.question, failed)[1]["content"]
    assert prompt.endswith("Its feedback:\n- failed: f(2) returned 3")


WORKING = "I add the two numbers.\nThat makes 999.\n<answer>999</answer>"


def pivot_server(seen: list[dict], boundary: list[int], ran: list[int] | None = None):
    """A failed working of three lines, sampled as ids [11, 12, 13]; its first line tokenizes
    to `boundary`; the reflection names step 1; the guided prompt is [1, 2, 7], and the
    continuation call reports running `ran` (default: what it was sent)."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append({"path": request.url.path, **body})
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": boundary if "prompt" in body else [1, 2, 7]})
        if request.url.path == "/v1/completions":
            choice = {
                "index": 0, "text": f"That makes {TASK.answer}.\n<answer>{TASK.answer}</answer>",
                "finish_reason": "stop", "token_ids": [60, 61],
                "prompt_token_ids": body["prompt"] if ran is None else ran,
                "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.25, -0.25]},
            }  # fmt: skip
            reply = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
            return httpx.Response(200, json={**reply, "choices": [choice]})
        if "response_format" in body:
            step = {"principle": "Check the sum.", "retry_from_step": 1}
            return scripted(body, json.dumps(step), [3])
        if "Guidance from an earlier try" in body["messages"][0]["content"]:
            return scripted(body, f"<answer>{TASK.answer}</answer>", [4, 4])
        reply = completion(WORKING, [11, 12, 13])
        reply["prompt_token_ids"] = [2, 2]
        return httpx.Response(200, json=reply)

    return handler


def retried(handler, pivot: bool = True) -> tuple[Group, Attempt]:
    retry = RetrySettings(enabled=True, reflection="brief", pivot=pivot)
    group = collect_task(handler, CollectSettings(group_size=1, retry=retry))
    return group, next(a for a in group.attempts if a.kind == "retry")


def test_a_one_step_retry_keeps_the_working_before_the_first_wrong_step() -> None:
    """R3L's pivot in a one-step answer: the reviewer sees the lines numbered and names the
    first wrong one; the retry continues the guided prompt's ids plus the parent's own ids for
    the lines before it, which training masks in the retry and in its parent."""
    seen: list[dict] = []
    group, retry = retried(pivot_server(seen, [11]))
    asked = next(b for b in seen if "response_format" in b)
    assert (
        "Step 0: I add the two numbers.\nStep 1: That makes 999." in asked["messages"][1]["content"]
    )
    assert "retry_from_step" in asked["response_format"]["json_schema"]["schema"]["required"]
    assert next(b for b in seen if b["path"] == "/tokenize" and "prompt" in b)["prompt"] == (
        "I add the two numbers.\n"
    )
    assert next(b for b in seen if b["path"] == "/v1/completions")["prompt"] == [1, 2, 7, 11]
    assert retry.pivot_tokens == 1 and retry.correct and retry.improved
    assert retry.sample.prompt_token_ids == [1, 2, 7]
    assert retry.sample.completion_token_ids == [11, 60, 61]
    assert retry.sample.logprobs == [-0.5, -0.25, -0.25] and retry.generated_tokens == 2
    assert retry.sample.text.startswith("I add the two numbers.\nThat makes")
    assert retry.bare_prompt_token_ids == [2, 2] and "retried from step 1" in retry.reason
    rows = build_rows([group], TrainSettings(max_length=64, mode="grpo"))
    # The parent and the retry's distill copy (bare prompt): the kept working is context.
    assert [(r.input_ids, r.labels) for r in rows] == [
        ([2, 2, 11, 12, 13], [IGNORE, IGNORE, IGNORE, 12, 13]),
        ([2, 2, 11, 60, 61], [IGNORE, IGNORE, IGNORE, 60, 61]),
    ]


def test_a_step_boundary_that_is_not_token_exact_retries_from_scratch() -> None:
    """The first line tokenizes otherwise than it was sampled: nothing is kept (no
    re-tokenised prefix), and the retry starts afresh with the principle."""
    seen: list[dict] = []
    _, retry = retried(pivot_server(seen, [11, 99]))
    assert retry.pivot_tokens == 0 and retry.correct
    assert retry.sample.prompt_token_ids == [4, 4]  # the guided chat call's
    assert not any(b["path"] == "/v1/completions" for b in seen)


def test_a_kept_working_the_server_did_not_run_fails_the_retry() -> None:
    _, retry = retried(pivot_server([], [11], ran=[1, 2, 7, 12]))
    assert retry.error and "not token-exact" in retry.error and not retry.correct


def test_pivot_off_retries_a_working_from_scratch() -> None:
    seen: list[dict] = []
    _, retry = retried(pivot_server(seen, [11]), pivot=False)
    asked = next(b for b in seen if "response_format" in b)
    assert "Step 0" not in asked["messages"][1]["content"] and retry.pivot_tokens == 0


def test_invalid_or_success_reflections_lead_to_no_retry() -> None:
    for text, reason in [
        ("{not json", "not JSON"),
        (json.dumps({**REFLECTION, "outcome": "maybe"}), "invalid reflection: outcome"),
        (json.dumps({**REFLECTION, "outcome": "success"}), "valid reflection"),
    ]:
        group = run(
            reflecting_server(text, TASK.answer),
            CollectSettings(group_size=1, retry=RetrySettings(enabled=True, reflection="full")),
        )
        assert [a.kind for a in group.attempts] == ["base", "reflection"]
        assert group.attempts[1].reason.startswith(reason)


def test_a_reflection_that_states_the_answer_leads_to_no_retry() -> None:
    leaked = {"principle": f"The answer is {TASK.answer}."}
    group = run(
        reflecting_server(json.dumps(leaked), TASK.answer),
        CollectSettings(group_size=1, retry=RetrySettings(enabled=True, reflection="brief")),
    )
    assert [a.kind for a in group.attempts] == ["base", "reflection"]
    reflection = group.attempts[1]
    assert reflection.reason == "the reflection states the answer" and not reflection.format_ok


def test_a_reflector_that_cannot_answer_abandons_the_group() -> None:
    """A reviewer that is down says nothing about the attempts: the group is not kept with its
    reflections missing, it fails whole (a worker gives it back to the queue)."""

    def handler(body: dict) -> httpx.Response:
        if "response_format" in body:
            return httpx.Response(500, json={"error": {"message": "down"}})
        return scripted(body, "<answer>999</answer>", [2])

    with pytest.raises(BaseExceptionGroup) as caught:
        run(handler, CollectSettings(group_size=2, retry=RetrySettings(enabled=True)))
    assert caught.group_contains(ServerUnavailable)


def test_a_reflection_the_reviewer_refuses_is_recorded_and_the_group_stays_whole() -> None:
    def handler(body: dict) -> httpx.Response:
        if "response_format" in body:
            return httpx.Response(400, json={"error": {"message": "schema not supported"}})
        return scripted(body, "<answer>999</answer>", [2])

    group = run(handler, CollectSettings(group_size=2, retry=RetrySettings(enabled=True)))
    assert group.complete
    failed = [a for a in group.attempts if a.kind == "reflection"]
    assert len(failed) == 2 and all(a.error for a in failed)


def test_parse_reflection_reports_the_first_problem() -> None:
    assert parse_reflection(json.dumps(REFLECTION)).principle == REFLECTION["principle"]
    assert parse_reflection("[]").startswith("invalid reflection")
    assert parse_reflection(json.dumps({**REFLECTION, "retry_from_step": -1})).startswith(
        "invalid reflection: retry_from_step"
    )


JUDGEMENT = {
    "summary": "Wrong sum.",
    "feedback": "The verifier marked it wrong.",
    "wrong_step": "the sign",
    "correction": "keep the sign",
    "insight": "Minus a negative is plus.",
}


def judging_server(judge_text: str, seen: list[dict]) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [41, 42, 43], "count": 3})
        if "response_format" in body:
            return scripted(body, judge_text, [3])
        return scripted(body, "<answer>999</answer>", [8] * len(body["messages"]))

    return handler


def run_insights(handler, group_size: int) -> Group:
    return collect_task(handler, CollectSettings(group_size=group_size, insights=True))


def test_insights_condition_later_attempts_while_the_batch_struggles() -> None:
    seen: list[dict] = []
    group = run_insights(judging_server(json.dumps(JUDGEMENT), seen), group_size=3)
    assert group.complete
    first, second, third = group.first_attempts
    assert first.context == "bare" and first.kind == "base"
    # The first failure's insight is shown to the next attempts, after the task.
    assert second.context == "insights" and second.kind == "guided"
    assert second.messages[-1] == {"role": "user", "content": f"Insight: {JUDGEMENT['insight']}"}
    assert second.bare_prompt_token_ids == first.sample.prompt_token_ids
    insights = [a for a in group.attempts if a.kind == "insight"]
    assert len(insights) == 3
    row = insights[0]
    # Stored for insight SFT: the insight's server token ids after the bare prompt.
    assert row.sample.text == JUDGEMENT["insight"] and row.sample.completion_token_ids == [
        41,
        42,
        43,
    ]
    assert row.sample.prompt_token_ids == first.sample.prompt_token_ids
    # The judge never sees the reference answer.
    judge_prompts = [b for b in seen if "response_format" in b]
    assert all(TASK.answer not in json.dumps(b["messages"]) for b in judge_prompts)


def test_no_insights_are_shown_once_the_batch_succeeds() -> None:
    from agents.insight import InsightBoard

    board = InsightBoard()
    assert board.conditioning() == []
    board.add("a")
    board.add("a")
    assert board.conditioning() == ["a"]
    for correct in (True, True, False):
        board.record(make_attempt(correct))
    assert board.conditioning() == []
    small = InsightBoard(capacity=2)
    for text in ("old", "mid", "new"):
        small.add(text)
    assert small.conditioning() == ["mid", "new"], "the newest insights are kept"


def make_attempt(correct: bool):
    from tests.helpers import make_group

    attempt = make_group([1.0 if correct else 0.0]).attempts[0]
    return attempt.model_copy(update={"correct": correct})


def test_rltldr_s_check_compares_attempts_that_saw_insights_with_bare_ones() -> None:
    """Insight advantage = success with the batch's insights - success with nothing in context;
    the worked example's half counts on neither side, and a round without both has none."""
    from agents.insight import insight_advantage
    from tests.helpers import make_group

    group = make_group([1.0, 0.0, 0.0, 1.0, 0.0])
    contexts = ["bare", "bare", "insights", "demo", "insights"]
    pairs = zip(group.attempts, contexts, strict=True)
    attempts = [a.model_copy(update={"context": c}) for a, c in pairs]
    check = insight_advantage([with_attempts(group, attempts)])
    assert check is not None
    assert (check.with_insights, check.seen, check.without, check.bare) == (0.0, 2, 0.5, 2)
    assert check.advantage == -0.5
    assert insight_advantage([group]) is None  # every attempt bare: nothing to compare


def test_an_invalid_judgement_adds_no_insight() -> None:
    seen: list[dict] = []
    group = run_insights(judging_server('{"summary": "x"}', seen), group_size=2)
    assert all(a.context == "bare" for a in group.first_attempts)
    insights = [a for a in group.attempts if a.kind == "insight"]
    assert all(a.sample is None and a.reason.startswith("invalid judgement") for a in insights)


def sge_server(
    seen: list[dict],
    strategy_ids: list[int],
    strategy: str = " Add them.\n",
    ran: list | None = None,
):
    """Prompt ids: bare = [1, 2] (+ [5] per extra message); "Strategy:" = [30]; "Answer:" = [70].
    The answer call reports the prompt it was sent, or `ran` (a server that changed it)."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/tokenize":
            if "prompt" in body:
                return httpx.Response(200, json={"tokens": [70]})
            return httpx.Response(200, json={"tokens": [1, 2] + [5] * (len(body["messages"]) - 2)})
        if request.url.path == "/v1/completions":
            ids = [60, 61]
            choice = {
                "index": 0,
                "text": f"<answer>{TASK.answer}</answer>",
                "finish_reason": "stop",
                "token_ids": ids,
                "prompt_token_ids": body["prompt"] if ran is None else ran,
                "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.25, -0.25]},
            }
            reply = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
            return httpx.Response(200, json={**reply, "choices": [choice]})
        bare = [1, 2] + [5] * (len(body["messages"]) - 3)
        reply = completion(strategy, strategy_ids)
        reply["prompt_token_ids"] = [*bare, 30]
        return httpx.Response(200, json=reply)

    return handler


def run_sge(handler, group_size: int = 1, reflect: bool = False) -> Group:
    from agents.strategy import StrategySettings

    sge = StrategySettings(enabled=True, reflect=reflect)
    settings = CollectSettings(group_size=group_size, strategy=sge, max_tokens=8)
    return collect_task(handler, settings)


def test_sge_trains_strategy_and_answer_tokens_but_not_the_forced_ones() -> None:
    seen: list[dict] = []
    group = run_sge(sge_server(seen, [40, 41, 42]))
    (attempt,) = group.attempts
    sample = attempt.sample
    assert sample.prompt_token_ids == [1, 2]
    # "Strategy:" [30], the strategy, the cue "Answer:" [70], the answer: exactly as sampled.
    assert sample.completion_token_ids == [30, 40, 41, 42, 70, 60, 61]
    assert sample.logprobs == [0.0, -0.5, -0.5, -0.5, 0.0, -0.25, -0.25]
    assert attempt.pivot_tokens == 1 and attempt.forced_spans == [(4, 5)]
    assert attempt.strategy == "Add them." and attempt.correct
    assert attempt.sampling.strategy_temperature == 0.7 and attempt.sampling.temperature == 0.6
    strategy_call = next(b for b in seen if b.get("continue_final_message"))
    assert strategy_call["stop"] == ["\n"] and strategy_call["include_stop_str_in_output"]
    assert strategy_call["temperature"] == 0.7
    answer_call = next(b for b in seen if "prompt" in b and "max_tokens" in b)
    assert answer_call["prompt"] == [1, 2, 30, 40, 41, 42, 70]
    assert answer_call["temperature"] == 0.6
    rows = build_rows(
        [
            with_attempts(
                group, [attempt, attempt.model_copy(update={"sample_index": 1, "reward": 0.0})]
            ).model_copy(update={"size": 2})
        ],
        TrainSettings(max_length=64, mode="grpo"),
    )
    trained = rows[0].labels[2:]
    assert trained == [IGNORE, 40, 41, 42, IGNORE, 60, 61]


def test_a_strategy_that_states_the_answer_is_not_a_strategy() -> None:
    group = run_sge(sge_server([], [40], f" It is {TASK.answer}.\n"), group_size=4, reflect=True)
    first, second = group.first_attempts[:2], group.first_attempts[2:]
    for attempt in first:  # its tokens and reward stay; as a strategy it does not count
        assert attempt.strategy is None and attempt.correct
        assert "the strategy states the answer" in attempt.reason
    for attempt in second:
        assert "Earlier strategies" not in attempt.messages[-1]["content"]


def test_an_empty_strategy_line_is_no_strategy() -> None:
    """A policy that ends the strategy line at once wrote no strategy: none is recorded, in
    memory as in the store, and none is shown to the second wave."""
    group = run_sge(sge_server([], [40], "\n"), group_size=4, reflect=True)
    for attempt in group.first_attempts[:2]:
        assert attempt.strategy is None and attempt.sample is not None
    for attempt in group.first_attempts[2:]:
        assert "Earlier strategies" not in attempt.messages[-1]["content"]


def test_a_server_that_ran_another_prompt_fails_the_token_exactness_check() -> None:
    """The answer call is sent the strategy's ids; a server that ran other ids (a token added,
    say) makes the strategy masked context and only the answer trained, and says so."""
    seen: list[dict] = []
    group = run_sge(sge_server(seen, [40, 41, 42], ran=[1, 2, 30, 40, 99, 42, 70]))
    (attempt,) = group.attempts
    assert "strategy not token-exact: answer trained only" in attempt.reason
    assert attempt.pivot_tokens == 5 and attempt.forced_spans == []
    assert attempt.sample.completion_token_ids == [30, 40, 99, 42, 70, 60, 61]


def test_join_masks_a_strategy_that_is_not_token_exact() -> None:
    from agents.strategy import join

    strategy = Sample(
        text=" x\n",
        prompt_token_ids=[1, 2, 30],
        completion_token_ids=[40],
        logprobs=[-0.5],
        finish_reason="stop",
    )
    action = Sample(
        text="y",
        prompt_token_ids=[1, 2, 30, 41, 70],
        completion_token_ids=[60],
        logprobs=[-0.1],
        finish_reason="stop",
    )
    sample, pivot, exact = join([1, 2], strategy, action, cue=1)
    assert not exact and pivot == 3 and sample.completion_token_ids == [30, 41, 70, 60]


def test_sge_second_wave_sees_the_first_waves_strategies() -> None:
    group = run_sge(sge_server([], [40]), group_size=4, reflect=True)
    first, second = group.first_attempts[:2], group.first_attempts[2:]
    assert all(a.context == "bare" for a in first)
    assert [a.sampling.strategy_temperature for a in group.first_attempts] == [0.7, 0.9, 1.1, 1.3]
    for attempt in second:
        assert attempt.context == "strategies" and attempt.kind == "guided"
        assert "worked: Add them." in attempt.messages[-1]["content"]
        assert attempt.bare_prompt_token_ids == [1, 2]


def test_a_configured_reviewer_writes_reflections_and_judgements() -> None:
    reviewer_calls: list[dict] = []
    policy_paths: list[str] = []

    def reviewer_handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        reviewer_calls.append(body)
        text = json.dumps(JUDGEMENT if "judge" in body["messages"][0]["content"] else REFLECTION)
        return scripted(body, text, [3])

    def policy_handler(request: httpx.Request) -> httpx.Response:
        policy_paths.append(request.url.path)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [41]})
        body = json.loads(request.content)
        assert "response_format" not in body, "no reflection goes to the policy"
        return scripted(body, "<answer>999</answer>", [2])

    group = collect_task(
        policy_handler,
        CollectSettings(group_size=2, retry=RetrySettings(enabled=True), insights=True),
        Endpoint(client_for(reviewer_handler), "judge-model"),
    )
    kinds = sorted(a.kind for a in group.attempts)
    # The second attempt saw the first one's insight (guided): only the first is reflected on.
    assert kinds.count("reflection") == 1 and kinds.count("insight") == 2
    assert all(b["model"] == "judge-model" for b in reviewer_calls)
    assert "/tokenize" in policy_paths, "insight ids come from the policy's tokenizer"


def test_code_tasks_are_prompted_for_code_and_verified_in_the_sandbox() -> None:
    from verifiers.coding import train_tasks

    task = next(t for t in train_tasks(18, seed=0) if t.task_id == "code:add")
    replies = iter(
        [
            "```python\ndef add(a, b):\n    return a + b\n```",
            "```python\ndef add(a, b):\n    return a - b\n```",
        ]
    )
    systems = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        systems.append(body["messages"][0]["content"])
        return scripted(body, next(replies), [7])

    group = collect_task(handler, CollectSettings(group_size=2), task=task)
    assert systems == [CODE_PROMPT, CODE_PROMPT]
    by_reward = sorted(group.attempts, key=lambda a: a.reward)
    assert [a.reward for a in by_reward] == [0.0, 1.0]
    assert "failed: add(1, 2) returned -1, expected 3" in by_reward[0].reason


def test_library_lessons_replace_the_demo_in_the_guided_slots() -> None:
    def handler(body: dict) -> httpx.Response:
        return scripted(body, f"<answer>{TASK.answer}</answer>", [7] * len(body["messages"]))

    settings = CollectSettings(group_size=4, guided_fraction=0.5, lessons=("Mind the sign.",))
    group = run(handler, settings)
    guided = [a for a in group.attempts if a.guided]
    assert [a.context for a in guided] == ["experience", "experience"]
    assert all(
        a.messages[0]["content"].endswith("Lessons from earlier attempts:\n- Mind the sign.")
        for a in guided
    )
    assert all(len(a.messages) == 2 for a in guided)  # no worked example
    assert all(a.bare_prompt_token_ids == [7, 7] for a in guided)


def test_the_experience_gain_compares_lesson_slots_with_bare_ones() -> None:
    from tests.helpers import make_group
    from workers.worker import experience_gain

    group = make_group([1.0, 1.0, 0.0, 1.0])
    contexts = ["experience", "experience", "bare", "bare"]
    attempts = [
        a.model_copy(update={"context": c}) for a, c in zip(group.attempts, contexts, strict=True)
    ]
    assert experience_gain(group.model_copy(update={"attempts": attempts})) == 0.5
    assert experience_gain(group) == 0.0  # nothing guided: no gain to credit
    episodes = [a.model_copy(update={"context": "step_lessons"}) for a in attempts[:2]]
    stepped = group.model_copy(update={"attempts": [*episodes, *attempts[2:]]})
    assert experience_gain(stepped) == 0.5  # lessons shown at an episode's steps count too


@pytest.mark.vllm
def test_a_kept_working_is_token_exact_on_a_real_server(tiny_server: str, tiny_model_path) -> None:
    """On vLLM: the retry's ids start with the parent's own ids for the kept lines, and continue
    exactly the guided prompt the server reports running."""
    from agents.context import hint_messages
    from agents.pivot import step_retry
    from agents.policy import PolicyClient

    model, working = tiny_model_path.name, "I add the two numbers.\nThat makes 999.\n"
    guided = hint_messages(TASK, "Answer in <answer></answer> tags.", "Check the sum.")

    async def main() -> tuple[list[int], list[int], Attempt]:
        client = PolicyClient(tiny_server)
        try:
            ids = await client.tokenize_text(model, working)
            sample = Sample(text=working, prompt_token_ids=[1], completion_token_ids=ids,
                            logprobs=[-1.0] * len(ids), finish_reason="length")  # fmt: skip
            sampling = SamplingSettings(temperature=1.0, max_tokens=24)
            parent = Attempt(sample_index=0, kind="base", policy_version=model, messages=[],
                             sampling=sampling, sample=sample, reward=0.0, correct=False,
                             format_ok=True, answer="999", reason="wrong")  # fmt: skip
            retry = await step_retry(
                Endpoint(client, model), TASK, guided, parent, "Check the sum.", 1, sampling
            )
            return ids, await client.tokenize(model, guided), retry
        finally:
            await client.aclose()

    ids, prompt, retry = anyio.run(main)
    assert retry.error is None and 0 < retry.pivot_tokens < len(ids)
    kept = retry.sample.completion_token_ids[: retry.pivot_tokens]
    assert kept == ids[: retry.pivot_tokens] and retry.sample.prompt_token_ids == prompt
    assert retry.sample.text.startswith("I add the two numbers.")
    assert retry.sample.logprobs[: retry.pivot_tokens] == [-1.0] * retry.pivot_tokens
