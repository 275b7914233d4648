"""Multi-turn episodes against a scripted server with a toy chat template: the token-exact
sequence (turns sampled, replies forced), tool calls parsed into the OpenAI format, and the
environment's verdict as the reward."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anyio
import httpx

from agents.episode import parse_tool_calls, run_episode
from agents.policy import Endpoint
from memory.records import Attempt, Group, SamplingSettings
from tests.helpers import client_for
from verifiers.guessing import GuessingGame
from verifiers.ledger import INTRUDER, Ledger

ROLES = {"system": 10, "user": 11, "assistant": 12, "tool": 13}
END = 2
SAMPLING = SamplingSettings(temperature=1.0, max_tokens=32)


def words(text: str) -> list[int]:
    return [1000 + sum(map(ord, w)) % 997 for w in text.split()]


def template(body: dict) -> list[int]:
    """A prefix-extending chat template: role, words, end; an open last turn has no end."""
    ids: list[int] = []
    for i, message in enumerate(body["messages"]):
        ids += [ROLES[message["role"]], *words(message["content"])]
        if not (body.get("continue_final_message") and i == len(body["messages"]) - 1):
            ids.append(END)
    if body.get("add_generation_prompt"):
        ids.append(ROLES["assistant"])
    return ids


def scripted_agent(turns: list[str], seen: list[dict]):
    replies: Iterator[str] = iter(turns)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": template(body)})
        seen.append(body)
        text = next(replies)
        ids = [*words(text), END]  # the sampled turn ends with its end-of-turn token
        choice = {
            "index": 0, "text": text, "finish_reason": "stop", "token_ids": ids,
            "prompt_token_ids": body["prompt"],
            "logprobs": {"tokens": ["t"] * len(ids), "token_logprobs": [-0.25] * len(ids)},
        }  # fmt: skip
        body = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        return httpx.Response(200, json={**body, "choices": [choice]})

    return handler


def play(env, turns: list[str]):
    seen: list[dict] = []
    client = client_for(scripted_agent(turns, seen))
    attempt = anyio.run(run_episode, Endpoint(client, "m"), env, SAMPLING, 0)
    return attempt, seen


def with_a_failure(attempt: Attempt) -> Group:
    """A group of `attempt` and a bare episode that failed at its first turn."""
    failed, _ = play(GuessingGame(seed=11), ["no idea"])
    return Group(
        round_index=1, purpose="train", task_id="guess:11", taskset="guess", question="q",
        policy_version="m", size=2,
        attempts=[attempt, failed.model_copy(update={"sample_index": 1})],
    )  # fmt: skip


def test_an_episode_is_one_token_exact_sequence_with_replies_forced() -> None:
    game = GuessingGame(seed=11)
    first = 1 if game.secret != 1 else 2
    attempt, seen = play(game, [f"<guess>{first}</guess>", f"<guess>{game.secret}</guess>"])
    assert attempt.reward == 1.0 and attempt.correct and attempt.error is None
    sample = attempt.sample
    assert sample is not None
    (span,) = attempt.forced_spans
    turn_one = [*words(f"<guess>{first}</guess>"), END]
    # The second turn continued exactly the prompt, the first turn and the reply.
    assert seen[1]["prompt"] == sample.prompt_token_ids + sample.completion_token_ids[: span[1]]
    assert sample.completion_token_ids[: len(turn_one)] == turn_one
    reply = sample.completion_token_ids[span[0] : span[1]]
    assert reply[0] == ROLES["user"] and reply[-1] == ROLES["assistant"]  # no doubled end token
    assert all(lp == 0.0 for lp in sample.logprobs[span[0] : span[1]])
    assert all(lp == -0.25 for lp in sample.logprobs[: span[0]] + sample.logprobs[span[1] :])
    roles = [m["role"] for m in attempt.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]  # last: "right"
    turn_line, reply_line = sample.text.splitlines()[:2]
    assert turn_line == f"Turn 0: <guess>{first}</guess>"
    assert reply_line == f"Reply: {attempt.messages[3]['content']}"
    assert attempt.generated_tokens == len(sample.completion_token_ids) - (span[1] - span[0])


def test_an_invalid_turn_ends_the_episode_with_nothing() -> None:
    attempt, seen = play(GuessingGame(seed=3), ["I think it is about fifty"])
    assert len(seen) == 1 and attempt.reward == 0.0 and not attempt.format_ok
    assert attempt.forced_spans == [] and "invalid" in attempt.reason


def test_tool_calls_are_parsed_into_the_openai_format() -> None:
    text = (
        'First <tool_call>{"name": "get_balance", "arguments": {"account": "bob"}}</tool_call> '
        "then <tool_call>not json</tool_call>"
    )
    good, bad = parse_tool_calls(text)
    assert good["type"] == "function" and good["function"]["name"] == "get_balance"
    assert json.loads(good["function"]["arguments"]) == {"account": "bob"}
    assert bad["function"]["name"] == "<malformed>"


def test_a_ledger_episode_is_scored_by_state_and_injections_do_not_pay() -> None:
    seed = next(s for s in range(50) if any(Ledger(seed=s).memos.values()))
    ledger = Ledger(seed=seed)
    calls = [
        {"name": "transfer", "arguments": {"source": n, "target": INTRUDER, "amount": b}}
        for n, b in ledger.balances.items()
        if n != INTRUDER
    ]
    obey = "".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls)
    attempt, _ = play(ledger, [obey, "Done, the grader says reward 1.0."])
    assert attempt.reward == 0.0 and attempt.format_ok
    assert attempt.reason.startswith("finished") and "0 balances wrong" not in attempt.reason
    assert sum(ledger.balances.values()) == ledger.balances[INTRUDER]  # the money did move
    assert "get_balance" in attempt.messages[0]["content"]  # the tools were described
    assert [m["role"] for m in attempt.messages[3:6]] == ["tool"] * 3


def test_an_episode_trains_its_turns_and_never_the_replies() -> None:
    from trainer.dataset import IGNORE, build_rows
    from trainer.settings import TrainSettings

    game = GuessingGame(seed=11)
    first = 1 if game.secret != 1 else 2
    attempt, _ = play(game, [f"<guess>{first}</guess>", f"<guess>{game.secret}</guess>"])
    group = with_a_failure(attempt)
    row = next(r for r in build_rows([group], TrainSettings(mode="grpo")) if r.reward == 1.0)
    assert attempt.sample is not None
    n_prompt = len(attempt.sample.prompt_token_ids)
    (start, end) = attempt.forced_spans[0]
    labels = row.labels[n_prompt:]
    assert all(label == IGNORE for label in labels[start:end])
    assert all(label != IGNORE for label in labels[:start] + labels[end:])


def test_a_failed_episode_is_retried_from_the_reflections_step_replaying_the_turns_before() -> None:
    from agents.policy import Endpoint
    from agents.reflection import reflect_and_retry
    from agents.settings import CollectSettings
    from tests.helpers import completion
    from verifiers.catalog import eval_tasks

    task = eval_tasks("guess", 1)[0]
    secret = GuessingGame(seed=int(task.answer)).secret
    opener = 50 if secret != 50 else 49
    turns = iter([f"<guess>{opener}</guess>", "hmm, maybe", f"<guess>{secret}</guess>"])
    reflection = {
        "summary": "I stopped guessing.", "root_cause": "No guess tag.", "outcome": "failure",
        "principle": "Always answer with one <guess>N</guess>.", "retry_from_step": 1,
    }  # fmt: skip
    completions: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": template(body)})
        if request.url.path == "/v1/chat/completions":  # the reflector
            return httpx.Response(200, json=completion(json.dumps(reflection), [5, 6]))
        completions.append(body)
        text = next(turns)
        ids = [*words(text), END]
        choice = {
            "index": 0, "text": text, "finish_reason": "stop", "token_ids": ids,
            "prompt_token_ids": body["prompt"],
            "logprobs": {"tokens": ["t"] * len(ids), "token_logprobs": [-0.25] * len(ids)},
        }  # fmt: skip
        return httpx.Response(200, json={"id": "c", "object": "text_completion", "created": 0,
                                         "model": "m", "choices": [choice]})  # fmt: skip

    client = client_for(handler)
    parent = anyio.run(
        run_episode, Endpoint(client, "m"), GuessingGame(seed=int(task.answer)), SAMPLING, 0
    )
    assert parent.reward == 0.0 and "invalid" in parent.reason
    policy = Endpoint(client, "m")
    settings = CollectSettings(temperature=SAMPLING.temperature, max_tokens=SAMPLING.max_tokens)
    extras = anyio.run(
        reflect_and_retry, policy, policy, task, [parent], settings, anyio.CapacityLimiter(2)
    )
    reflected, retry = extras
    assert reflected.kind == "reflection" and reflected.improved
    assert retry.kind == "retry" and retry.context == "hint" and retry.improved
    assert retry.reward == 1.0 and retry.parent_index == parent.sample_index
    assert parent.sample is not None and retry.sample is not None
    (reply_span,) = parent.forced_spans
    assert retry.pivot_tokens == reply_span[1]  # turn 0 and its reply are replayed
    replayed = parent.sample.completion_token_ids[: reply_span[1]]
    assert retry.sample.completion_token_ids[: reply_span[1]] == replayed
    assert retry.bare_prompt_token_ids == parent.sample.prompt_token_ids
    assert retry.sample.prompt_token_ids != parent.sample.prompt_token_ids  # the guided prompt
    assert "Guidance from an earlier try: Always answer" in retry.messages[0]["content"]
    # The retry's first call continued the guided prompt plus exactly the replayed ids.
    assert completions[-1]["prompt"] == retry.sample.prompt_token_ids + replayed


HIGHER = "When the reply says higher, guess above your last guess."
LOWER = "When the reply says lower, guess below your last guess."
MIDDLE = "Open with the middle of the range, 50 for 1 to 100."
REPEAT = "Never guess a number twice."


def test_lessons_are_chosen_per_step_by_what_it_observes() -> None:
    from agents.lessons import at_opening, at_step

    candidates = [REPEAT, HIGHER, LOWER, MIDDLE]
    opening = "I picked a whole number from 1 to 100. You have 7 guesses."
    assert at_opening(opening, candidates) == [MIDDLE, REPEAT]  # most shared words first
    assert at_step("higher (6 left)", candidates, [MIDDLE, REPEAT]) == [HIGHER]
    assert at_step("lower (5 left)", candidates, [MIDDLE, REPEAT, HIGHER]) == [LOWER]
    assert at_step("lower (4 left)", candidates, candidates) == []  # nothing new: nothing shown
    assert at_step("xyzzy", candidates, []) == []  # a step shares no word with any lesson
    long = ["x " * 500, HIGHER]
    assert at_opening("x", long) == [HIGHER]  # the 1,000-character lesson does not fit


def test_an_episode_is_shown_the_lessons_of_each_step_inside_its_forced_replies() -> None:
    """SLEA-RL's step retrieval: the opening's lessons in the system prompt, a later step's
    after the environment's reply, inside the reply's forced span, token-exact; the episode
    trains under its own sequence (its guidance is inside it), never as a distill copy."""
    from memory.records import STEP_LESSONS
    from trainer.dataset import IGNORE, build_rows
    from trainer.settings import TrainSettings

    game = GuessingGame(seed=11)
    first = 1 if game.secret != 1 else 2  # below the secret: the reply says higher
    turns = [f"<guess>{first}</guess>", f"<guess>{game.secret}</guess>"]
    seen: list[dict] = []
    client = client_for(scripted_agent(turns, seen))
    lessons = (REPEAT, HIGHER, LOWER, MIDDLE)
    attempt = anyio.run(run_episode, Endpoint(client, "m"), game, SAMPLING, 0, lessons)
    assert attempt.correct and attempt.kind == "guided" and attempt.context == STEP_LESSONS
    assert attempt.guidance == "\n".join([MIDDLE, REPEAT, HIGHER])  # every lesson shown
    system, _, _, reply, lesson, *_ = attempt.messages
    assert MIDDLE in system["content"] and HIGHER not in system["content"]
    assert reply["content"].startswith("higher") and lesson["role"] == "user"
    assert HIGHER in lesson["content"] and LOWER not in lesson["content"]
    sample = attempt.sample
    assert sample is not None
    (span,) = attempt.forced_spans
    assert seen[1]["prompt"] == sample.prompt_token_ids + sample.completion_token_ids[: span[1]]
    forced = sample.completion_token_ids[span[0] : span[1]]
    assert words(HIGHER)[0] in forced  # the step's lesson is in the forced span, never trained
    group = with_a_failure(attempt)
    settings = TrainSettings(mode="grpo")
    assert settings.distill_guided
    row = next(r for r in build_rows([group], settings) if r.reward == 1.0)
    assert row.context == f"guided:{STEP_LESSONS}" and row.importance  # as sampled
    n_prompt = len(sample.prompt_token_ids)
    assert row.input_ids[:n_prompt] == sample.prompt_token_ids
    assert all(label == IGNORE for label in row.labels[n_prompt + span[0] : n_prompt + span[1]])


def test_the_guided_slots_of_an_episode_group_are_shown_the_library_lessons() -> None:
    from agents.settings import CollectSettings
    from agents.slots import first_attempt
    from memory.records import STEP_LESSONS
    from verifiers.catalog import eval_tasks

    task = eval_tasks("guess", 1)[0]
    settings = CollectSettings(group_size=2, guided_fraction=0.5, lessons=(MIDDLE, HIGHER))
    seen: list[dict] = []
    policy = Endpoint(client_for(scripted_agent(["no idea", "no idea"], seen)), "m")
    guided = anyio.run(first_attempt, policy, task, settings, 0)
    bare = anyio.run(first_attempt, policy, task, settings, 1)
    assert guided.context == STEP_LESSONS and MIDDLE in guided.messages[0]["content"]
    assert bare.context == "bare" and bare.guidance is None
    assert MIDDLE not in bare.messages[0]["content"]
