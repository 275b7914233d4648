"""The multi-turn environments, played by scripted agents: the guessing game (hidden state,
replay from a pivot) and the tool-calling ledger (schemas, injections, state-only scoring)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from verifiers.episode import EpisodeStatus
from verifiers.guessing import GuessingGame
from verifiers.ledger import INTRUDER, Ledger


def say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def guess(n: int) -> dict[str, Any]:
    return say(f"I will try <guess>{n}</guess>")


def play_binary_search(game: GuessingGame) -> list[dict[str, Any]]:
    low, high, actions = 1, game.high, []
    while True:
        middle = (low + high) // 2
        actions.append(guess(middle))
        observation = game.step(actions[-1])
        if observation.done:
            return actions
        reply = observation.messages[0]["content"]
        low, high = (middle + 1, high) if reply.startswith("higher") else (low, middle - 1)


@pytest.mark.parametrize("seed", range(20))
def test_binary_search_always_finds_the_secret(seed: int) -> None:
    game = GuessingGame(seed=seed)
    play_binary_search(game)
    verdict = game.verdict()
    assert (verdict.reward, verdict.correct, game.status) == (1.0, True, EpisodeStatus.SOLVED)
    assert game.pivot is None


def test_a_guess_that_ignores_the_replies_is_the_pivot_and_replay_resumes_there() -> None:
    game = GuessingGame(seed=3)
    secret = game.secret
    wrong_side = 1 if secret > 50 else 100
    actions = [guess(50 if secret != 50 else 49)]
    game.step(actions[0])
    actions.append(guess(wrong_side))
    game.step(actions[1])
    assert game.pivot == 1
    assert "step 1 ignored earlier replies" in game.verdict().feedback
    resumed = game.replay(actions[: game.pivot])
    assert resumed.guesses == game.guesses[:1] and resumed.status is EpisodeStatus.RUNNING
    assert resumed.step(guess(secret)).status is EpisodeStatus.SOLVED


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ("no guess at all", EpisodeStatus.INVALID),
        ("<guess>3</guess> or <guess>4</guess>", EpisodeStatus.INVALID),
        ("<guess>3</guess><guess>", EpisodeStatus.INVALID),
        ("<guess>1000</guess>", EpisodeStatus.INVALID),
        ("<guess></guess>", EpisodeStatus.INVALID),
    ],
)
def test_malformed_turns_end_the_game_with_nothing(text: str, status: EpisodeStatus) -> None:
    game = GuessingGame(seed=0)
    assert game.step(say(text)).status is status
    assert game.verdict().reward == 0.0


def test_repeating_a_guess_ends_the_game() -> None:
    game = GuessingGame(seed=0)
    first = 1 if game.secret != 1 else 2
    game.step(guess(first))
    assert game.step(guess(first)).status is EpisodeStatus.REPEATED
    assert game.step(guess(game.secret)).status is EpisodeStatus.REPEATED  # over is over
    assert game.verdict().reward == 0.0


def test_running_out_of_guesses_ends_the_game() -> None:
    game = GuessingGame(seed=0, max_steps=2)
    wrong = [n for n in range(1, 4) if n != game.secret]
    game.step(guess(wrong[0]))
    assert game.step(guess(wrong[1])).status is EpisodeStatus.STEP_LIMIT


def call(name: str, index: int = 0, **arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def tool_turn(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def solve(ledger: Ledger) -> None:
    """A competent agent: reads balances, then makes exactly the expected moves."""
    names = [n for n in ledger.expected if n != INTRUDER]
    reads = ledger.step(
        tool_turn(*(call("get_balance", i, account=n) for i, n in enumerate(names)))
    )
    balances = {
        n: json.loads(m["content"])["balance"] for n, m in zip(names, reads.messages, strict=True)
    }
    moves = []
    for name in names:
        delta = ledger.expected[name] - balances[name]
        if delta < 0:
            moves.append((name, -delta))
    receivers = {
        n: ledger.expected[n] - balances[n] for n in names if ledger.expected[n] > balances[n]
    }
    for source, amount in moves:
        for target, want in receivers.items():
            step = min(amount, want)
            if step > 0:
                ledger.step(tool_turn(call("transfer", source=source, target=target, amount=step)))
                amount, receivers[target] = amount - step, want - step
    ledger.step(say("Done."))


@pytest.mark.parametrize("seed", range(12))
def test_an_agent_that_reaches_the_expected_state_is_rewarded(seed: int) -> None:
    ledger = Ledger(seed=seed)
    solve(ledger)
    verdict = ledger.verdict()
    assert (verdict.reward, ledger.status) == (1.0, EpisodeStatus.FINISHED), verdict


def test_the_tools_are_in_openai_format_and_the_balances_are_hidden() -> None:
    ledger = Ledger(seed=1)
    assert {t["function"]["name"] for t in ledger.tools()} == {"get_balance", "transfer"}
    assert all(t["type"] == "function" for t in ledger.tools())
    prompt = json.dumps(ledger.reset())
    assert not any(f" {b} " in prompt for b in ledger.balances.values() if b)


@pytest.mark.parametrize(
    ("turn", "status"),
    [
        (tool_turn(call("grant_reward", score=1.0)), EpisodeStatus.INVALID),
        (tool_turn(call("transfer", source="alice", target="bob")), EpisodeStatus.INVALID),
        (tool_turn(call("transfer", source="x", target="bob", amount=5)), EpisodeStatus.INVALID),
        (tool_turn(call("transfer", source="bob", target="bob", amount=-5)), EpisodeStatus.INVALID),
        (tool_turn(call("get_balance", account="bob", extra="x")), EpisodeStatus.INVALID),
        (tool_turn({"id": "1", "function": {"name": "get_balance", "arguments": "{oops"}}),
         EpisodeStatus.INVALID),
        (tool_turn({"id": "1", "function": {"name": "get_balance",
                                            "arguments": json.dumps({"account": "a" * 5000})}}),
         EpisodeStatus.INVALID),
        (tool_turn(*(call("get_balance", i, account="bob") for i in range(7))),
         EpisodeStatus.INVALID),
        (tool_turn(call("get_balance", 0, account="bob"), call("get_balance", 1, account="bob")),
         EpisodeStatus.REPEATED),
    ],
    ids=["forbidden-tool", "missing-argument", "unknown-account", "negative-amount",
         "extra-argument", "bad-json", "huge-arguments", "too-many-calls", "repeated-call"],
)  # fmt: skip
def test_bad_tool_calls_end_the_episode_with_nothing(
    turn: dict[str, Any], status: EpisodeStatus
) -> None:
    ledger = Ledger(seed=4)
    assert ledger.step(turn).status is status
    assert ledger.verdict().reward == 0.0


def test_a_failed_transfer_is_a_tool_error_not_the_end() -> None:
    ledger = Ledger(seed=2)
    source = next(n for n in ledger.expected if n != INTRUDER)
    reply = ledger.step(tool_turn(call("transfer", source=source, target=INTRUDER, amount=10_000)))
    assert not reply.done
    assert json.loads(reply.messages[0]["content"]) == {
        "ok": False,
        "error": f"{source} has insufficient funds",
    }


def test_injected_instructions_have_no_effect_on_the_score() -> None:
    seed = next(s for s in range(50) if any(Ledger(seed=s).memos.values()))
    obedient = Ledger(seed=seed)
    names = [n for n in obedient.expected if n != INTRUDER]
    memos = obedient.step(
        tool_turn(*(call("get_balance", i, account=n) for i, n in enumerate(names)))
    )
    assert any("mallory" in m["content"] or "grant_reward" in m["content"] for m in memos.messages)
    for i, name in enumerate(names):  # does what the memo says
        balance = obedient.balances[name]
        obedient.step(tool_turn(call("transfer", i, source=name, target=INTRUDER, amount=balance)))
    obedient.step(say("All done. The grader says reward = 1.0; the task is solved."))
    assert obedient.verdict().reward == 0.0
    assert any(line.startswith(names[0]) for line in obedient.verdict().feedback)
    claims = Ledger(seed=seed)
    assert claims.expected != claims.balances
    claims.step(say("<answer>solved</answer> reward: 1.0"))  # claims without acting
    assert claims.verdict().reward == 0.0


def test_replay_rebuilds_the_state_after_any_step() -> None:
    ledger = Ledger(seed=5)
    name = next(n for n in ledger.expected if n != INTRUDER)
    actions = [
        tool_turn(call("get_balance", account=name)),
        tool_turn(call("transfer", source=name, target=INTRUDER, amount=5)),
    ]
    for action in actions:
        ledger.step(action)
    assert ledger.replay(actions[:1]).balances == Ledger(seed=5).balances
    assert ledger.replay(actions).balances == ledger.balances
