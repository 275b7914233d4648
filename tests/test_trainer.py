"""Trainer mechanics on the tiny random Llama: a round trains, changes weights, publishes."""

from pathlib import Path

import pytest

from tests.conftest import make_group
from trainer import checkpoint
from trainer.errors import TrainerError
from trainer.round import train_round
from trainer.settings import TrainSettings

FAST = TrainSettings(epochs=1, batch_size=4, learning_rate=1e-3)


def groups() -> list:
    return [make_group([1.0, 0.0, 0.0, 1.0], task_id=f"t{i}", completion_len=6) for i in range(3)]


def test_round_publishes_a_complete_adapter(tiny_model_path: Path, tmp_path: Path) -> None:
    result = train_round(
        groups(),
        base_model=tiny_model_path,
        parent_adapter=None,
        checkpoint_root=tmp_path,
        name="policy-r1",
        settings=FAST,
    )
    adapter = Path(result.adapter_path)
    assert adapter == tmp_path / "policy-r1"
    assert checkpoint.is_complete(adapter)
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
    assert result.rows == 12 and result.train_tokens == 12 * 6
    assert not list(tmp_path.glob(f"{checkpoint.STAGING_PREFIX}*"))

    child = train_round(
        groups(),
        base_model=tiny_model_path,
        parent_adapter=adapter,
        checkpoint_root=tmp_path,
        name="policy-r2",
        settings=FAST,
    )
    assert checkpoint.is_complete(Path(child.adapter_path))


def test_round_without_signal_fails_loudly(tiny_model_path: Path, tmp_path: Path) -> None:
    flat = [make_group([0.0, 0.0, 0.0, 0.0])]
    with pytest.raises(TrainerError, match="no trainable rows"):
        train_round(
            flat,
            base_model=tiny_model_path,
            parent_adapter=None,
            checkpoint_root=tmp_path,
            name="p",
            settings=FAST,
        )


def test_incomplete_parent_checkpoint_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    half_written = tmp_path / "half"
    half_written.mkdir()
    with pytest.raises(TrainerError, match="not a complete checkpoint"):
        train_round(
            groups(),
            base_model=tiny_model_path,
            parent_adapter=half_written,
            checkpoint_root=tmp_path,
            name="p",
            settings=FAST,
        )


def test_publish_never_overwrites(tmp_path: Path) -> None:
    first = checkpoint.staging_dir(tmp_path, "v1")
    checkpoint.publish(first, tmp_path, "v1")
    second = checkpoint.staging_dir(tmp_path, "v1")
    with pytest.raises(TrainerError, match="already exists"):
        checkpoint.publish(second, tmp_path, "v1")
