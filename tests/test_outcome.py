"""Outcome-based exploration: shaping terms on hand-built groups, counts in the store."""

import math

import pytest

from agents.outcome import OutcomeSettings, shape
from memory import store
from tests.helpers import make_group


def group_with_answers(rewards: list[float], answers: list[str]):
    group = make_group(rewards)
    attempts = [
        a.model_copy(update={"answer": answer})
        for a, answer in zip(group.attempts, answers, strict=True)
    ]
    return group.model_copy(update={"attempts": attempts})


def test_shaping_is_off_by_default_and_keeps_the_raw_reward() -> None:
    group = group_with_answers([1.0, 0.0], ["7", "3"])
    assert shape(group, {}, OutcomeSettings()) == group
    assert all(a.train_reward == a.reward for a in group.attempts)


def test_rare_answers_earn_a_centred_bonus() -> None:
    group = group_with_answers([0.0, 0.0, 0.0], ["5", "5", "9"])
    shaped = shape(group, {"5": 14}, OutcomeSettings(bonus=0.3))
    bonus_5, bonus_9 = 0.3 / math.sqrt(16), 0.3 * 1.0
    mean = (2 * bonus_5 + bonus_9) / 3
    terms = [a.shaping["bonus"] for a in shaped.attempts]
    assert terms == pytest.approx([bonus_5 - mean, bonus_5 - mean, bonus_9 - mean])
    # Rewards are capped to [0, 1]: a below-average bonus never makes a failure negative.
    assert [a.shaped_reward for a in shaped.attempts] == pytest.approx([0.0, 0.0, bonus_9 - mean])
    assert [a.reward for a in shaped.attempts] == [0.0, 0.0, 0.0], "raw reward kept apart"


def test_repeated_answers_are_penalised_within_the_group() -> None:
    group = group_with_answers([1.0, 1.0, 1.0, 0.0], ["4", "4", "4", "2"])
    shaped = shape(group, {}, OutcomeSettings(repeat_penalty=0.2))
    penalties = [a.shaping["repeat_penalty"] for a in shaped.attempts]
    assert penalties == pytest.approx([-0.1, -0.1, -0.1, 0.0])
    assert [a.train_reward for a in shaped.attempts] == pytest.approx([0.9, 0.9, 0.9, 0.0])


def test_outcome_counts_increment_atomically(db_url: str) -> None:
    engine = store.open_store(db_url)
    with store.transaction(engine) as session:
        store.add_outcomes(session, "t1", ["7", "7", "3"])
    with store.transaction(engine) as session:
        store.add_outcomes(session, "t1", ["7"])
        store.add_outcomes(session, "t2", ["7"])
    with store.transaction(engine) as session:
        assert store.outcome_counts(session, "t1") == {"7": 3, "3": 1}
        assert store.outcome_counts(session, "t2") == {"7": 1}


def test_shaped_rewards_round_trip_and_a_group_is_new_once(db_url: str) -> None:
    engine = store.open_store(db_url)
    shaped = shape(group_with_answers([1.0, 0.0], ["4", "4"]), {}, OutcomeSettings(bonus=0.1))
    with store.transaction(engine) as session:
        [(_, new)] = store.save_groups(session, [shaped])
        [(_, again)] = store.save_groups(session, [shaped])
        (loaded,) = store.load_groups(session, "train")
    assert new and not again
    assert [a.shaping for a in loaded.attempts] == [a.shaping for a in shaped.attempts]
    assert [a.shaped_reward for a in loaded.attempts] == [a.shaped_reward for a in shaped.attempts]
