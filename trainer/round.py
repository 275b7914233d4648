"""One training round: stored groups in, a published LoRA checkpoint out.

1. Rows are built from complete groups on the sampled token ids (`trainer.dataset`).
2. `PolicyGradientTrainer` is TRL's `SFTTrainer` (LoRA wiring, fused per-token log-probs, the
   training loop) with the loss swapped for a policy gradient:
   L = -mean_tokens(A * w * log pi), w = min(exp(log pi - log mu), cap) detached: truncated
   importance sampling against the behaviour logprobs mu, since samples may come from an older
   version or another temperature. Distill rows (sampled under another prompt) have w = 1.
   Off-policy rows (HeRL's revisions, written by the reviewer) take HeRL's shaped weight instead,
   L = -A * rho / (rho + gamma), rho = pi / mu, unclipped, its gradient through rho.
3. A new round continues from its parent's adapter when there is one, otherwise starts LoRA on
   the base model. The adapter is published atomically; a LoRA that binds no module, or whose
   weights did not move, fails the round loudly.
4. Trainer state is saved every `save_steps` under `adapters_root/.rounds/<name>`; a round
   started again under the same name resumes from the last save, on the same rows.
5. Under torchrun (`trainer.distributed`) every process builds the same rows and the trainer
   splits each batch across them; the main process alone publishes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import SFTConfig, SFTTrainer

from memory import folders
from memory.records import Group
from trainer.dataset import (
    IGNORE,
    TrainRow,
    build_rows,
    context_counts,
    length_batches,
    padded_share,
)
from trainer.errors import TrainerError
from trainer.settings import TrainSettings

log = logging.getLogger(__name__)


class RoundResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    adapter_path: str
    rows: int
    train_tokens: int
    loss_first: float | None
    loss_last: float | None
    train_seconds: float
    seconds: float
    resumed_from_step: int = Field(0, description="-1: already published, not trained again")
    contexts: dict[str, int] = {}
    kl_first: float | None = None  # KL to the sampling policy, first tenth of the steps
    kl_last: float | None = None  # and last tenth
    outside_share: float | None = None  # sampled tokens past the trust region, mean per step
    steps: int = 0  # optimizer steps
    padded_share: float | None = None  # share of the computed positions that were padding
    processes: int = 1  # training processes (one per GPU) that shared each batch


class PolicyGradientTrainer(SFTTrainer):
    """SFTTrainer with an advantage-weighted, importance-corrected policy-gradient loss."""

    # The loss is the token mean of the whole batch, micro-batches and all (`batch_tokens`):
    # the trainer must not divide it again by the number of micro-batches.
    loss_is_scaled_for_ga = True  # type: ignore[assignment]  # TRL declares it None

    def __init__(
        self,
        *args: Any,
        is_cap: float = 2.0,
        shaping_gamma: float = 0.1,
        clip: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.is_cap, self.shaping_gamma, self.clip = is_cap, shaping_gamma, clip
        self.drift: list[tuple[float, float]] = []  # per pass: (KL, share outside the region)

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        advantages = inputs.pop("advantages")
        behaviour = inputs.pop("behaviour_logprobs")
        importance = inputs.pop("importance")
        off_policy = inputs.pop("off_policy")
        outputs = model(**inputs, use_cache=False, fused_lm_head=True)
        # The fused head scores next tokens: position t holds log pi(token t+1 | tokens <= t).
        logp = outputs.log_probs
        mask = (inputs["labels"][:, 1:] != IGNORE).float()
        advantages, behaviour = advantages[:, 1:], behaviour[:, 1:]
        ratio = torch.exp(logp.detach() - behaviour)
        sampled = importance[:, None] & (mask > 0)  # tokens the policy sampled, in this prompt
        eps = 0.2 if self.clip is None else self.clip  # 0.2: PPO's region, for the record
        outside = sampled & outside_region(ratio, advantages, eps)
        weight = torch.where(importance[:, None], ratio.clamp(max=self.is_cap), 1.0)
        if self.clip is not None:
            weight = torch.where(outside, 0.0, weight)
        rho = torch.exp(torch.where(off_policy[:, None], logp - behaviour, 0.0))
        shaped = rho / (rho + self.shaping_gamma)
        per_token = torch.where(off_policy[:, None], shaped, weight * logp) * -advantages * mask
        passes = getattr(self, "current_gradient_accumulation_steps", 1)  # set once training
        loss = per_token.sum() / batch_tokens(mask, num_items_in_batch, passes)
        drift = drift_of(ratio, sampled, outside) if getattr(model, "training", False) else None
        if drift is not None:
            self.drift.append(drift)
        return (loss, outputs) if return_outputs else loss


def batch_tokens(mask: torch.Tensor, num_items_in_batch: Any, passes: int) -> torch.Tensor:
    """The trained tokens of the whole batch a micro-batch (`mask`) belongs to: the trainer's
    count over every micro-batch of the step, else (it counts none) this one's times the
    `passes` of a step."""
    if num_items_in_batch is None:
        counted = mask.sum() * passes
    else:
        counted = torch.as_tensor(num_items_in_batch, dtype=mask.dtype)
    return counted.clamp(min=1.0)


def outside_region(ratio: torch.Tensor, advantages: torch.Tensor, eps: float) -> torch.Tensor:
    """Tokens past PPO's trust region: already pushed up (A > 0) beyond 1 + eps, or down
    (A < 0) below 1 - eps, since they were sampled."""
    return ((advantages > 0) & (ratio > 1 + eps)) | ((advantages < 0) & (ratio < 1 - eps))


def drift_of(
    ratio: torch.Tensor, sampled: torch.Tensor, outside: torch.Tensor
) -> tuple[float, float] | None:
    """How far the policy has moved from the one that sampled `sampled` tokens: the mean KL (k3
    estimator, (r - 1) - log r) and the share of those tokens outside the trust region."""
    n = int(sampled.sum())
    if n == 0:
        return None
    r = ratio[sampled]
    return float(((r - 1) - torch.log(r)).mean()), float(outside.sum()) / n


def train_round(
    groups: list[Group],
    *,
    base_model: Path,
    parent_adapter: Path | None,
    adapters_root: Path,
    name: str,
    settings: TrainSettings,
) -> RoundResult:
    """Train on `groups` and publish the adapter as `adapters_root/name`.

    Started again with the same name after a crash, it resumes from the last saved step.
    """
    started = time.monotonic()
    rows = build_rows(groups, settings)
    if not rows:
        raise TrainerError("no trainable rows: every group lacked reward variance")
    ordered = settings.batch_order == "length"  # else the trainer shuffles the rows
    if ordered:
        rows = length_batches(rows, settings.batch_size, settings.seed)
    published = adapters_root / name
    if folders.is_complete(published):
        log.info("round %s was already published; not training again", name)
        return _result(published, rows, [], 0.0, started, resumed_from_step=-1)
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = _load_policy(base_model, parent_adapter, settings)
    work = adapters_root / ".rounds" / name
    resume = _last_save(work)
    trainer = PolicyGradientTrainer(
        model=model,
        args=training_config(settings, str(work)),
        train_dataset=_dataset(rows),
        data_collator=_Collator(pad_id=tokenizer.pad_token_id or 0),
        processing_class=tokenizer,
        peft_config=None if parent_adapter else lora_config(settings),
        is_cap=settings.is_cap,
        shaping_gamma=settings.shaping_gamma,
        clip=settings.clip,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_Progress())
    before = _lora_snapshot(trainer.model)
    if resume is not None:
        log.info("resuming round %s from %s", name, resume.name)
    with disk_errors(work):
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if resume is None:
        _check_moved(before, _lora_snapshot(trainer.model))
    step = int(resume.name.split("-")[-1]) if resume else 0
    shape = {
        "steps": trainer.state.global_step,
        "processes": trainer.args.world_size,
        "padded_share": padded_share(rows, settings.pass_size) if ordered else None,
    }
    if not trainer.is_world_process_zero():  # another process of a distributed round
        return _result(published, rows, [], 0.0, started, step).model_copy(update=shape)
    staging = folders.staging_dir(adapters_root, name)
    trained: Any = trainer.model  # a PeftModel; transformers types it as any module
    try:
        with disk_errors(staging):
            trained.save_pretrained(staging)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # a torn save is never left to look whole
        raise
    path = folders.publish(staging, adapters_root, name)
    shutil.rmtree(work, ignore_errors=True)
    history = trainer.state.log_history
    losses = [entry["loss"] for entry in history if "loss" in entry]
    train_seconds = next((e["train_runtime"] for e in history if "train_runtime" in e), 0.0)
    result = _result(path, rows, losses, train_seconds, started, resumed_from_step=step)
    return result.model_copy(update={**shape, **_drift_figures(trainer.drift)})


@contextmanager
def disk_errors(where: Path) -> Iterator[None]:
    """safetensors reports a failed write (a full disk) as its own error type: an `OSError`
    here, with the errno it names, so every command treats it as the disk it is."""
    try:
        yield
    except SafetensorError as exc:
        found = re.search(r"os error (\d+)", str(exc))
        code = int(found.group(1)) if found else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (saving under {where})") from exc


def _drift_figures(drift: list[tuple[float, float]]) -> dict[str, float | None]:
    """The KL from the sampling policy over the first and last tenth of the passes (a step
    makes one a micro-batch), and the share of sampled tokens outside the trust region over the
    round."""
    if not drift:
        return {}
    tenth = max(1, len(drift) // 10)
    return {
        "kl_first": sum(k for k, _ in drift[:tenth]) / tenth,
        "kl_last": sum(k for k, _ in drift[-tenth:]) / tenth,
        "outside_share": sum(o for _, o in drift) / len(drift),
    }


def _result(
    path: Path,
    rows: list[TrainRow],
    losses: list[float],
    train_seconds: float,
    started: float,
    resumed_from_step: int,
) -> RoundResult:
    return RoundResult(
        adapter_path=str(path),
        rows=len(rows),
        train_tokens=sum(row.trained_tokens for row in rows),
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        train_seconds=train_seconds,
        seconds=time.monotonic() - started,
        resumed_from_step=resumed_from_step,
        contexts=context_counts(rows),
    )


class _Progress(TrainerCallback):
    """One log line about every tenth of the round, instead of a dict per step on stdout."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        every = max(1, state.max_steps // 10)
        if logs and "loss" in logs and (state.global_step % every == 0):
            log.info("train step %d/%d loss %.4f", state.global_step, state.max_steps, logs["loss"])


def _last_save(work: Path) -> Path | None:
    """The newest whole trainer save. The trainer writes `trainer_state.json` last, so a save
    killed half-way has none, or a torn one, or weights cut short: it is passed over."""
    saves = [p for p in work.glob("checkpoint-*") if _whole_save(p)]
    return max(saves, key=lambda p: int(p.name.split("-")[-1]), default=None)


def _whole_save(path: Path) -> bool:
    """The state parses, every safetensors file holds all the data its header names, and every
    torch archive (optimizer, scheduler) has its central directory: nothing was cut short."""
    try:
        json.loads((path / "trainer_state.json").read_text())
        for weights in path.glob("*.safetensors"):
            with safe_open(weights, framework="pt") as tensors:
                for key in tensors.keys():  # noqa: SIM118
                    tensors.get_slice(key)
        for archive in path.glob("*.pt"):
            zipfile.ZipFile(archive).close()
    except Exception:  # noqa: BLE001 - safetensors and zipfile raise several unrelated types
        return False
    return True


def _load_policy(base_model: Path, parent_adapter: Path | None, settings: TrainSettings) -> Any:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=_dtype(settings))
    if parent_adapter is None:
        return model
    if not folders.is_complete(parent_adapter):
        raise TrainerError(f"parent adapter {parent_adapter} is not a complete checkpoint")
    return PeftModel.from_pretrained(model, parent_adapter, is_trainable=True)


def lora_config(settings: TrainSettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        target_modules="all-linear",
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )


def training_config(settings: TrainSettings, output_dir: str) -> SFTConfig:
    """The TRL config of a round (also the plain-SFT baseline of `bench/train.py`)."""
    on_gpu = _device(settings) == "cuda"
    return SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=settings.pass_size,
        gradient_accumulation_steps=settings.micro_batches,
        # each process counts its own tokens: its loss is its own batch's token mean, and the
        # processes' gradients are averaged
        average_tokens_across_devices=False,
        num_train_epochs=settings.epochs,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="steps" if settings.save_steps else "no",
        save_steps=settings.save_steps or 500,
        save_total_limit=1,
        report_to="none",
        bf16=_dtype(settings) == torch.bfloat16,
        # `length` rows come in batch order (`length_batches`); else the trainer shuffles them.
        train_sampling_strategy="sequential" if settings.batch_order == "length" else "random",
        gradient_checkpointing=False,
        ddp_find_unused_parameters=False,  # every LoRA weight takes part in each step
        use_cpu=not on_gpu,
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=None,
        seed=settings.seed,
        disable_tqdm=True,
    )


def _device(settings: TrainSettings) -> str:
    if settings.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return settings.device


def _dtype(settings: TrainSettings) -> torch.dtype:
    if settings.dtype == "auto":
        return torch.bfloat16 if _device(settings) == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[settings.dtype]


def _dataset(rows: list[TrainRow]) -> Any:
    from datasets import Dataset

    columns = set(TrainRow.model_fields) - {"reward", "context"}
    return Dataset.from_list([row.model_dump(include=columns) for row in rows])


class _Collator:
    """Right-pads a batch of rows; padding carries no label, advantage or behaviour logprob."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)

        def pad(key: str, value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(
                [f[key] + [value] * (width - len(f[key])) for f in features], dtype=dtype
            )

        lengths = torch.tensor([len(f["input_ids"]) for f in features])
        return {
            "input_ids": pad("input_ids", self.pad_id, torch.long),
            "attention_mask": (torch.arange(width)[None, :] < lengths[:, None]).long(),
            "labels": pad("labels", IGNORE, torch.long),
            "advantages": pad("advantages", 0.0, torch.float32),
            "behaviour_logprobs": pad("behaviour_logprobs", 0.0, torch.float32),
            "importance": torch.tensor([bool(f["importance"]) for f in features]),
            "off_policy": torch.tensor([bool(f["off_policy"]) for f in features]),
        }


def _lora_snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {
        name: param.detach().clone()
        for name, param in model.named_parameters()
        if "lora_" in name and param.requires_grad
    }


def _check_moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    if not before:
        raise TrainerError("the LoRA bound no module: nothing would be trained")
    moved = sum(not torch.equal(before[name], after[name]) for name in before)
    if moved == 0:
        raise TrainerError("no LoRA weight changed during the round")
    log.info("%d of %d LoRA tensors changed", moved, len(before))
