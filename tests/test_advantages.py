"""Advantage modes and row building on hand-built groups with known answers."""

import random

import pytest

from memory.records import Attempt, Group, Sample, SamplingSettings
from tests.helpers import make_group, with_attempts
from trainer.advantages import grpo_advantages, mean_advantages, r3l_advantages
from trainer.dataset import (
    IGNORE,
    TrainRow,
    build_rows,
    context_counts,
    length_batches,
    padded_share,
    positive_ratio_filter,
)
from trainer.settings import TrainSettings

GRPO = TrainSettings(max_length=64, mode="grpo")
R3L = TrainSettings(max_length=64, mode="r3l")
RLTLDR = TrainSettings(max_length=64, mode="rltldr")


def test_grpo_advantages_are_standardised() -> None:
    advantages = grpo_advantages([1.0, 0.0, 0.0, 1.0])
    assert advantages == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert sum(advantages) == pytest.approx(0.0)


def test_r3l_pins_successes_and_amplifies_partial_credit() -> None:
    # mean 0.375: success -> 1, partial 0.5 -> 3 * 0.125, failures keep r - b.
    assert r3l_advantages([1.0, 0.5, 0.0, 0.0]) == pytest.approx([1.0, 0.375, -0.375, -0.375])
    # A single-item group has baseline 0: a lone success gets 1, a lone 0.5 gets 1.5.
    assert r3l_advantages([1.0]) == [1.0]
    assert r3l_advantages([0.5]) == [1.5]


def test_rltldr_subtracts_the_mean_without_std() -> None:
    assert mean_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_groups_without_variance_carry_no_signal() -> None:
    for mode in (grpo_advantages, r3l_advantages, mean_advantages):
        assert mode([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    for settings in (GRPO, R3L, RLTLDR):
        assert build_rows([make_group([0.0, 0.0, 0.0, 0.0])], settings) == []


def test_rows_train_only_completion_tokens_with_group_advantage() -> None:
    group = make_group([1.0, 0.0], prompt=[7, 8, 9], completion_len=4)
    rows = build_rows([group], GRPO)
    assert len(rows) == 2
    good, bad = rows
    assert good.input_ids == [7, 8, 9, 100, 101, 102, 103]
    assert good.labels == [IGNORE, IGNORE, IGNORE, 100, 101, 102, 103]
    assert good.advantages[:3] == [0.0, 0.0, 0.0]
    assert good.advantages[3:] == pytest.approx([1.0] * 4, abs=1e-5)
    assert bad.advantages[3:] == pytest.approx([-1.0] * 4, abs=1e-5)
    assert good.behaviour_logprobs == [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0]
    assert good.trained_tokens == 4 and good.importance and good.context == "bare"


def test_rows_are_truncated_to_max_length() -> None:
    group = make_group([1.0, 0.0], prompt=[7, 8, 9], completion_len=10)
    rows = build_rows([group], TrainSettings(max_length=5, mode="grpo"))
    assert all(len(r.input_ids) == len(r.labels) == len(r.advantages) == 5 for r in rows)


def test_incomplete_groups_are_not_trained() -> None:
    group = make_group([1.0, 0.0, 1.0])
    partial = group.model_copy(update={"attempts": group.attempts[:2]})
    assert not partial.complete
    assert build_rows([partial], GRPO) == []


def guided(attempt: Attempt, bare_ids: list[int] | None) -> Attempt:
    assert attempt.sample is not None
    sample = attempt.sample.model_copy(update={"prompt_token_ids": [50, 51, 52, 53, 54]})
    return attempt.model_copy(
        update={
            "kind": "guided",
            "context": "demo",
            "guidance": "an example",
            "sample": sample,
            "bare_prompt_token_ids": bare_ids,
        }
    )


def test_guided_attempts_are_distilled_under_the_bare_prompt() -> None:
    group = make_group([0.0, 0.0, 1.0, 1.0], prompt=[7, 8, 9], completion_len=3)
    first, second, *rest = group.attempts
    group = with_attempts(group, [first, second] + [guided(a, [7, 8, 9]) for a in rest])
    rows = build_rows([group], GRPO)
    distilled = [r for r in rows if r.context == "distill:demo"]
    assert len(distilled) == 2
    assert all(r.input_ids[:3] == [7, 8, 9] and not r.importance for r in distilled)
    assert context_counts(rows) == {"bare": 2, "distill:demo": 2}

    own_prompt = build_rows(
        [group], TrainSettings(max_length=64, mode="grpo", distill_guided=False)
    )
    guided_rows = [r for r in own_prompt if r.context == "guided:demo"]
    assert all(r.input_ids[:5] == [50, 51, 52, 53, 54] and r.importance for r in guided_rows)


def test_guided_attempt_without_bare_ids_is_not_trained_under_a_guessed_prompt() -> None:
    group = make_group([0.0, 1.0], prompt=[7, 8, 9])
    group = with_attempts(group, [group.attempts[0], guided(group.attempts[1], None)])
    assert [r.context for r in build_rows([group], GRPO)] == ["bare"]


def retry_of(parent: Attempt, reward: float, pivot: int, improved: bool) -> Attempt:
    assert parent.sample is not None
    completion = parent.sample.completion_token_ids[:pivot] + [900, 901]
    sample = parent.sample.model_copy(
        update={
            "prompt_token_ids": [60, 61, 62, 63],
            "completion_token_ids": completion,
            "logprobs": [-0.5] * len(completion),
        }
    )
    return parent.model_copy(
        update={
            "kind": "retry",
            "context": "reflection",
            "sample": sample,
            "reward": reward,
            "correct": reward >= 1,
            "parent_index": parent.sample_index,
            "pivot_tokens": pivot,
            "bare_prompt_token_ids": parent.sample.prompt_token_ids,
            "improved": improved,
        }
    )


def test_pivot_masks_the_replayed_prefix_in_the_retry_and_its_parent() -> None:
    group = make_group([0.0, 1.0, 0.0, 0.0], prompt=[7, 8, 9], completion_len=4)
    retry = retry_of(group.attempts[0], reward=1.0, pivot=2, improved=True)
    group = with_attempts(group, [*group.attempts, retry])
    rows = build_rows([group], R3L)
    parent = next(r for r in rows if r.input_ids[3:] == [100, 101, 102, 103])
    assert parent.labels[3:] == [IGNORE, IGNORE, 102, 103]
    distill = next(r for r in rows if r.context == "distill:reflection")
    assert distill.input_ids == [7, 8, 9, 100, 101, 900, 901]
    assert distill.labels == [IGNORE] * 5 + [900, 901]
    # R3L: the improved retry also trains under its guided prompt as a single-item group.
    single = next(r for r in rows if r.context == "guided:reflection")
    assert single.input_ids[:4] == [60, 61, 62, 63] and single.advantages[-1] == 1.0
    # The untouched slots have no pivot: every completion token is trained.
    other = next(r for r in rows if r.input_ids[3:] == [101, 102, 103, 104])
    assert other.trained_tokens == 4


def test_r3l_adds_no_single_item_rows_for_a_retry_that_did_not_improve() -> None:
    group = make_group([0.0, 1.0], prompt=[7, 8, 9], completion_len=4)
    retry = retry_of(group.attempts[0], reward=0.0, pivot=0, improved=False)
    rows = build_rows([with_attempts(group, [*group.attempts, retry])], R3L)
    assert "guided:reflection" not in context_counts(rows)


def insight_for(group: Group) -> Attempt:
    sample = Sample(
        text="Subtracting a negative adds.",
        prompt_token_ids=[70, 71],
        completion_token_ids=[300, 301, 302],
        logprobs=[-0.1] * 3,
        finish_reason="stop",
    )
    return group.attempts[0].model_copy(
        update={
            "kind": "insight",
            "context": "judge",
            "sample": sample,
            "bare_prompt_token_ids": [7, 8, 9],
        }
    )


def test_rltldr_adds_insight_sft_rows_given_only_the_task() -> None:
    group = make_group([1.0, 0.0, 0.0, 0.0], prompt=[7, 8, 9], completion_len=2)
    group = with_attempts(group, [*group.attempts, insight_for(group)])
    rows = build_rows([group], RLTLDR)
    (insight,) = [r for r in rows if r.context == "insight"]
    assert insight.input_ids == [7, 8, 9, 300, 301, 302]
    assert insight.advantages[-1] == 0.5 and not insight.importance
    assert "insight" not in context_counts(build_rows([group], GRPO))
    filtered = build_rows([group], RLTLDR.model_copy(update={"mode": "filtered"}))
    assert "insight" not in context_counts(filtered)  # the default: RLTLDR's filter alone
    assert len(filtered) == len(rows) - 1


def test_rltldr_needs_the_insights_it_trains() -> None:
    from flows.settings import RunSettings

    with pytest.raises(ValueError, match="set collect.insights = true"):
        RunSettings.model_validate({"train": {"mode": "rltldr"}})
    insights = {"collect": {"insights": True}, "train": {"mode": "rltldr"}}
    assert RunSettings.model_validate(insights).train.mode == "rltldr"
    assert RunSettings().train.mode == "filtered"


def rows_with_rewards(rewards: list[float]) -> list[TrainRow]:
    return [
        TrainRow(input_ids=[1], labels=[1], advantages=[1.0], behaviour_logprobs=[0.0], reward=r)
        for r in rewards
    ]


def test_positive_ratio_filter_reaches_the_target_ratio() -> None:
    rows = rows_with_rewards([1.0] * 3 + [0.0] * 9)
    kept = positive_ratio_filter(rows, 0.75, random.Random(0))
    assert sum(r.reward > 0 for r in kept) == 3 and len(kept) == 4
    many_positive = rows_with_rewards([1.0] * 9 + [0.0])
    kept = positive_ratio_filter(many_positive, 0.75, random.Random(0))
    assert sum(r.reward > 0 for r in kept) == 3 and len(kept) == 4


def test_failed_guided_samples_are_not_pushed_down_under_the_bare_prompt() -> None:
    group = make_group([1.0, 0.0, 1.0, 0.0], prompt=[7, 8, 9])
    first, second, *rest = group.attempts
    group = with_attempts(group, [first, second] + [guided(a, [7, 8, 9]) for a in rest])
    rows = build_rows([group], GRPO)
    assert context_counts(rows) == {"bare": 2, "distill:demo": 1}
    assert all(r.advantages[-1] > 0 for r in rows if r.context == "distill:demo")
    with_negatives = build_rows(
        [group], TrainSettings(max_length=64, mode="grpo", distill_negatives=True)
    )
    assert context_counts(with_negatives) == {"bare": 2, "distill:demo": 2}


def test_length_batches_keep_every_row_and_pad_less_than_a_shuffle() -> None:
    rng = random.Random(1)
    rows = [
        TrainRow(input_ids=[1] * n, labels=[1] * n, advantages=[0.5] * n,
                 behaviour_logprobs=[0.0] * n, reward=float(i % 2))
        for i, n in enumerate(rng.choice([20, 40, 200]) + rng.randrange(8) for _ in range(96))
    ]  # fmt: skip
    ordered = length_batches(rows, batch_size=8, seed=0)
    assert sorted(map(id, ordered)) == sorted(map(id, rows))  # each row once
    assert ordered == length_batches(rows, batch_size=8, seed=0)  # a resumed round replays it
    assert ordered != length_batches(rows, batch_size=8, seed=1)
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    assert padded_share(ordered, 8) < 0.5 * padded_share(shuffled, 8)
    # A batch is drawn from a window of the round, not one end of it: short and long rows
    # alternate among the batches rather than coming all at once.
    longest = [max(len(r.input_ids) for r in ordered[i : i + 8]) for i in range(0, 96, 8)]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def episode(index: int, reward: float, replies: list[str]) -> Attempt:
    """An episode of len(replies) + 1 turns of two tokens each, the replies forced between."""
    messages: list[dict] = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    ids, spans = [10, 11], []
    for reply in replies:
        messages += [{"role": "assistant", "content": "act"}, {"role": "tool", "content": reply}]
        spans.append((len(ids), len(ids) + 2))
        ids += [20, 21, 10, 11]
    messages.append({"role": "assistant", "content": "done"})
    sample = Sample(text="t", prompt_token_ids=[1, 2], completion_token_ids=ids,
                    logprobs=[-1.0] * len(ids), finish_reason="stop")  # fmt: skip
    return Attempt(sample_index=index, policy_version="base", messages=messages,
                   sampling=SamplingSettings(temperature=1.0, max_tokens=64), sample=sample,
                   forced_spans=spans, reward=reward, correct=reward > 0, format_ok=True,
                   answer="a", reason="test", turns=len(replies) + 1)  # fmt: skip


def test_slea_credits_the_turns_of_the_episode_that_reached_the_reward_sooner() -> None:
    """Both episodes succeed, so the episode advantage is zero; SLEA's step term still tells
    them apart: at the observations both met, the two-turn episode's returns are higher."""
    short = episode(0, 1.0, ["the sum so far is 12"])
    long = episode(1, 1.0, ["the sum so far is 12", "error: unknown tool name xyz"])
    group = make_group([1.0, 1.0]).model_copy(update={"attempts": [short, long], "size": 2})
    assert build_rows([group], GRPO) == []  # no reward spread, no episode credit
    rows = build_rows([group], GRPO.model_copy(update={"step_weight": 1.0}))
    by_length = {len(r.input_ids): r.advantages[2:] for r in rows}
    short_turns, long_turns = by_length[8], by_length[12]
    # turn 0 ("task"): returns 0.95 and 0.9025; turn 1 ("... is 12"): 1.0 and 0.95
    assert short_turns[:2] == pytest.approx([0.02375] * 2)
    assert short_turns[4:] == pytest.approx([0.025] * 2)
    assert long_turns[:2] == pytest.approx([-0.02375] * 2)
    assert long_turns[4:6] == pytest.approx([-0.025] * 2)
    assert long_turns[8:] == pytest.approx([0.0] * 2)  # its last observation is its own cluster


def test_a_turn_is_compared_with_turns_that_met_a_similar_observation() -> None:
    from trainer.steps import cluster, observations

    assert cluster(["the sum so far is 12", "the sum so far is 13", "error: no such tool"]) == [
        0,
        0,
        1,
    ]
    assert observations(episode(0, 1.0, ["r1", "r2"])) == ["task", "r1", "r2"]


def test_padding_is_counted_per_pass_of_a_micro_batch() -> None:
    """A micro-batch pads to its own longest row, not to the step's."""
    rows = [
        TrainRow(input_ids=[1] * n, labels=[1] * n, advantages=[0.5] * n,
                 behaviour_logprobs=[0.0] * n, reward=1.0)
        for n in (2, 9, 4, 4)
    ]  # fmt: skip
    assert padded_share(rows, 4) == pytest.approx(1 - 19 / 36)  # one pass, all to 9
    assert padded_share(rows, 2) == pytest.approx(1 - 19 / 26)  # (2, 9) to 9, (4, 4) to 4
    micro = TrainSettings(batch_size=4, micro_batch_size=2)
    assert (micro.pass_size, micro.micro_batches) == (2, 2)
    assert TrainSettings(batch_size=4).pass_size == 4  # no micro-batches: the whole batch
