"""Trainer mechanics on the tiny random Llama: a round trains, changes weights, publishes."""

from pathlib import Path

import pytest

from memory import folders
from memory.errors import StoreError
from tests.helpers import make_group
from trainer.errors import TrainerError
from trainer.round import RoundResult, train_round
from trainer.settings import TrainSettings

FAST = TrainSettings(epochs=1, batch_size=4, learning_rate=1e-3, mode="grpo")


def groups() -> list:
    return [make_group([1.0, 0.0, 0.0, 1.0], task_id=f"t{i}", completion_len=6) for i in range(3)]


def test_round_publishes_a_complete_adapter(tiny_model_path: Path, tmp_path: Path) -> None:
    result = train_round(
        groups(),
        base_model=tiny_model_path,
        parent_adapter=None,
        adapters_root=tmp_path,
        name="policy-r1",
        settings=FAST,
    )
    adapter = Path(result.adapter_path)
    assert adapter == tmp_path / "policy-r1"
    assert folders.is_complete(adapter)
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
    assert result.rows == 12 and result.train_tokens == 12 * 6
    assert not list(tmp_path.glob(f"{folders.STAGING_PREFIX}*"))

    child = train_round(
        groups(),
        base_model=tiny_model_path,
        parent_adapter=adapter,
        adapters_root=tmp_path,
        name="policy-r2",
        settings=FAST,
    )
    assert folders.is_complete(Path(child.adapter_path))


def test_a_round_saved_onto_a_full_disk_fails_and_publishes_nothing(
    tiny_model_path: Path, small_disk
) -> None:
    import errno

    root = small_disk(48)  # room for the trainer's work, not for the adapter as well
    with pytest.raises(OSError) as caught:
        train_round(groups(), base_model=tiny_model_path, parent_adapter=None,
                    adapters_root=root, name="policy-r1", settings=FAST)  # fmt: skip
    assert caught.value.errno == errno.ENOSPC
    assert not folders.is_complete(root / "policy-r1") and not (root / "policy-r1").exists()


def test_round_without_signal_fails_loudly(tiny_model_path: Path, tmp_path: Path) -> None:
    flat = [make_group([0.0, 0.0, 0.0, 0.0])]
    with pytest.raises(TrainerError, match="no trainable rows"):
        train_round(
            flat,
            base_model=tiny_model_path,
            parent_adapter=None,
            adapters_root=tmp_path,
            name="p",
            settings=FAST,
        )


def test_a_group_that_all_failed_learns_from_its_verified_revision(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    failed = make_group([0.0, 0.0, 0.0, 0.0], completion_len=6)
    parent = failed.attempts[1]
    assert parent.sample is not None
    ids = {"completion_token_ids": [200, 201, 202], "logprobs": [0.0] * 3}
    fix = parent.sample.model_copy(update=ids)
    revision = parent.model_copy(
        update={"kind": "revision", "parent_index": 1, "context": "revision", "sample": fix,
                "reward": 1.0, "correct": True, "improved": True}
    )  # fmt: skip
    result = train_round(
        [failed.model_copy(update={"attempts": [*failed.attempts, revision]})],
        base_model=tiny_model_path,
        parent_adapter=None,
        adapters_root=tmp_path,
        name="policy-r1",
        settings=FAST,
    )
    # Slot 3 gave its place to the revision; the other three are pushed down, the parent least.
    assert result.contexts == {"bare": 3, "revision": 1}
    assert folders.is_complete(Path(result.adapter_path))
    assert result.loss_first is not None and result.loss_first == result.loss_first  # not NaN


def test_incomplete_parent_checkpoint_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    half_written = tmp_path / "half"
    half_written.mkdir()
    with pytest.raises(TrainerError, match="not a complete checkpoint"):
        train_round(
            groups(),
            base_model=tiny_model_path,
            parent_adapter=half_written,
            adapters_root=tmp_path,
            name="p",
            settings=FAST,
        )


def test_publish_never_overwrites(tmp_path: Path) -> None:
    first = folders.staging_dir(tmp_path, "v1")
    folders.publish(first, tmp_path, "v1")
    second = folders.staging_dir(tmp_path, "v1")
    with pytest.raises(StoreError, match="already exists"):
        folders.publish(second, tmp_path, "v1")


def test_a_killed_round_resumes_from_its_last_save(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.round import PolicyGradientTrainer

    settings = TrainSettings(epochs=1, batch_size=2, learning_rate=1e-3, save_steps=2, mode="grpo")
    original = PolicyGradientTrainer.training_step
    steps = []

    def crash_after_three(self, *args, **kwargs):
        if len(steps) == 3:
            raise KeyboardInterrupt("killed")
        steps.append(self.state.global_step)
        return original(self, *args, **kwargs)

    def run_round() -> RoundResult:
        return train_round(
            groups(),
            base_model=tiny_model_path,
            parent_adapter=None,
            adapters_root=tmp_path,
            name="policy-r1",
            settings=settings,
        )

    monkeypatch.setattr(PolicyGradientTrainer, "training_step", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_round()
    assert not folders.is_complete(tmp_path / "policy-r1")
    # A later save killed half-way (no trainer state written yet) is passed over.
    (tmp_path / ".rounds" / "policy-r1" / "checkpoint-4").mkdir()
    monkeypatch.setattr(PolicyGradientTrainer, "training_step", original)
    result = run_round()
    # 12 rows in batches of 2: steps 0-2 ran, the save at step 2 is where the second run starts.
    assert result.resumed_from_step == 2
    assert folders.is_complete(Path(result.adapter_path))
    assert not (tmp_path / ".rounds" / "policy-r1").exists()
    again = run_round()
    assert again.resumed_from_step == -1 and again.adapter_path == result.adapter_path


def test_training_raises_the_likelihood_of_rewarded_completions(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """On a fixed batch: the loss of the rewarded rows (their NLL) falls, the other rows' rises
    (no trust region: the scripted behaviour logprobs are not the tiny model's, so every
    failed token would already sit below 1 - clip)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = [make_group([1.0, 0.0, 0.0, 0.0], task_id=f"t{i}", completion_len=6) for i in range(3)]
    settings = TrainSettings(
        epochs=6, batch_size=12, learning_rate=3e-3, save_steps=0, mode="grpo", clip=None
    )
    result = train_round(
        batch,
        base_model=tiny_model_path,
        parent_adapter=None,
        adapters_root=tmp_path,
        name="p",
        settings=settings,
    )

    def nll(model, rewarded: bool) -> float:
        losses = []
        for group in batch:
            for attempt in group.attempts:
                if (attempt.reward > 0) != rewarded:
                    continue
                sample = attempt.sample
                ids = torch.tensor([sample.prompt_token_ids + sample.completion_token_ids])
                labels = ids.clone()
                labels[0, : len(sample.prompt_token_ids)] = -100
                with torch.no_grad():
                    losses.append(model(input_ids=ids, labels=labels).loss.item())
        return sum(losses) / len(losses)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    before = (nll(base, True), nll(base, False))
    trained = PeftModel.from_pretrained(base, result.adapter_path)
    after = (nll(trained, True), nll(trained, False))
    assert after[0] < before[0] - 0.1
    assert after[1] > before[1]
    assert result.kl_first is not None and result.kl_last is not None
    assert result.kl_first >= 0 and result.kl_last >= 0 and 0 <= (result.outside_share or 0) <= 1


def test_the_trust_region_stops_tokens_already_moved_in_their_advantages_direction() -> None:
    """With clip 0.2: a token pushed up past 1.2 (A > 0) or down below 0.8 (A < 0) gets no
    gradient; one inside the region keeps -A * w; without clip all four do, and the step's drift
    (KL and the share outside) is noted either way."""
    from types import SimpleNamespace

    import torch

    from trainer.dataset import IGNORE
    from trainer.round import PolicyGradientTrainer

    ratios = torch.tensor([1.5, 1.1, 0.5, 0.9])  # pi / mu of four sampled tokens
    signs = torch.tensor([1.0, 1.0, -1.0, -1.0])

    def gradient(clip: float | None) -> tuple[torch.Tensor, list]:
        logp = torch.cat([torch.zeros(1), torch.log(ratios * 0.5)])[None, :].requires_grad_()
        trainer = SimpleNamespace(is_cap=2.0, shaping_gamma=0.1, clip=clip, drift=[])

        class Model:
            training = True

            def __call__(self, **_: object) -> SimpleNamespace:
                return SimpleNamespace(log_probs=logp[:, 1:])

        inputs = {
            "input_ids": torch.zeros(1, 5, dtype=torch.long),
            "labels": torch.tensor([[IGNORE, 1, 1, 1, 1]]),
            "advantages": torch.cat([torch.zeros(1), signs])[None, :],
            "behaviour_logprobs": torch.full((1, 5), float(torch.log(torch.tensor(0.5)))),
            "importance": torch.tensor([True]),
            "off_policy": torch.tensor([False]),
        }
        loss = PolicyGradientTrainer.compute_loss(trainer, Model(), inputs)  # type: ignore[arg-type]
        loss.backward()
        return logp.grad[0, 1:], trainer.drift

    clipped, drift = gradient(0.2)
    assert clipped[0] == 0 and clipped[2] == 0
    assert torch.isclose(clipped[1], torch.tensor(-1.1 / 4)) and torch.isclose(
        clipped[3], torch.tensor(0.9 / 4)
    )
    free, _ = gradient(None)
    assert torch.allclose(free, -signs * ratios / 4)
    ((kl, outside),) = drift
    assert outside == 0.5 and kl > 0


def test_micro_batches_take_the_same_steps_as_whole_batches(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """A batch passed a row at a time, gradients summed, trains the same weights as the batch
    at once: the loss stays the batch's token mean, so rows of unequal length (2, 9 and 4
    tokens here) keep their weight. A micro-batch that does not divide the batch is refused."""
    import pydantic
    from safetensors.torch import load_file

    from trainer.round import training_config

    uneven = [make_group([1.0, 0.0, 0.5, 0.0], task_id=f"t{n}", completion_len=n)
              for n in (2, 9, 4)]  # fmt: skip
    trained = {}
    for micro in (None, 1):
        settings = FAST.model_copy(update={"micro_batch_size": micro, "save_steps": 0})
        result = train_round(uneven, base_model=tiny_model_path, parent_adapter=None,
                             adapters_root=tmp_path / f"m{micro}", name="p",
                             settings=settings)  # fmt: skip
        trained[micro] = load_file(Path(result.adapter_path) / "adapter_model.safetensors")
    assert trained[None].keys() == trained[1].keys()
    moved = [(trained[None][k] - trained[1][k]).abs().max().item() for k in trained[None]]
    assert max(moved) < 1e-5, f"micro-batches trained other weights (by up to {max(moved):.2e})"
    config = training_config(FAST.model_copy(update={"micro_batch_size": 2}), str(tmp_path))
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (2, 2)
    with pytest.raises(pydantic.ValidationError, match="does not divide batch_size"):
        TrainSettings(batch_size=8, micro_batch_size=3)
