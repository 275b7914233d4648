"""A round in two processes (torchrun, gloo on CPU): the batch is split, one adapter published."""

import math
from pathlib import Path

import pytest

from memory import folders
from tests.helpers import make_group
from trainer import distributed
from trainer.errors import TrainerError
from trainer.settings import TrainSettings

SETTINGS = TrainSettings(epochs=1, batch_size=2, learning_rate=1e-3, mode="grpo")


def groups() -> list:
    return [make_group([1.0, 0.0, 0.0, 1.0], task_id=f"t{i}", completion_len=6) for i in range(4)]


def train(model: Path, root: Path, name: str, processes: int, parent: Path | None = None):
    settings = SETTINGS.model_copy(update={"processes": processes})
    return distributed.train(
        distributed.RoundRequest(
            groups=groups(), base_model=model, parent_adapter=parent, adapters_root=root,
            name=name, settings=settings,
        )
    )  # fmt: skip


def test_two_processes_split_each_batch_and_publish_once(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    alone = train(tiny_model_path, tmp_path / "one", "policy-r1", processes=1)
    shared = train(tiny_model_path, tmp_path / "two", "policy-r1", processes=2)

    assert (alone.processes, shared.processes) == (1, 2)
    assert alone.rows == shared.rows == 16
    assert alone.steps == math.ceil(16 / 2) and shared.steps == math.ceil(16 / (2 * 2))
    adapter = Path(shared.adapter_path)
    assert adapter == tmp_path / "two" / "policy-r1" and folders.is_complete(adapter)
    assert shared.loss_first is not None and shared.train_seconds > 0
    assert not list((tmp_path / "two").glob(".launch-*"))  # the request folder is gone

    child = train(tiny_model_path, tmp_path / "two", "policy-r2", processes=2, parent=adapter)
    assert folders.is_complete(Path(child.adapter_path)) and child.steps == 4


def test_a_failed_process_fails_the_round_with_its_log(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(
        TrainerError,
        match="2 training processes failed: TrainerError: parent adapter .* not a complete",
    ):
        train(tiny_model_path, tmp_path, "policy-r2", processes=2, parent=missing)
    assert not (tmp_path / "policy-r2").exists()
