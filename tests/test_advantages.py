import pytest

from tests.conftest import make_group
from trainer.advantages import grpo_advantages
from trainer.dataset import IGNORE, build_rows


def test_grpo_advantages_are_standardised() -> None:
    advantages = grpo_advantages([1.0, 0.0, 0.0, 1.0])
    assert advantages == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert sum(advantages) == pytest.approx(0.0)


def test_groups_without_variance_carry_no_signal() -> None:
    assert grpo_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert build_rows([make_group([0.0, 0.0, 0.0, 0.0])], max_length=64) == []


def test_rows_train_only_completion_tokens_with_group_advantage() -> None:
    group = make_group([1.0, 0.0], prompt=[7, 8, 9], completion_len=4)
    rows = build_rows([group], max_length=64)
    assert len(rows) == 2
    good, bad = rows
    assert good.input_ids == [7, 8, 9, 100, 101, 102, 103]
    assert good.labels == [IGNORE, IGNORE, IGNORE, 100, 101, 102, 103]
    assert good.advantages[:3] == [0.0, 0.0, 0.0]
    assert good.advantages[3:] == pytest.approx([1.0] * 4, abs=1e-5)
    assert bad.advantages[3:] == pytest.approx([-1.0] * 4, abs=1e-5)
    assert good.behaviour_logprobs == [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0]
    assert good.trained_tokens == 4


def test_rows_are_truncated_to_max_length() -> None:
    rows = build_rows([make_group([1.0, 0.0], prompt=[7, 8, 9], completion_len=10)], 5)
    assert all(len(r.input_ids) == len(r.labels) == len(r.advantages) == 5 for r in rows)


def test_incomplete_groups_are_not_trained() -> None:
    group = make_group([1.0, 0.0, 1.0])
    partial = group.model_copy(update={"attempts": group.attempts[:2]})
    assert not partial.complete
    assert build_rows([partial], max_length=64) == []
