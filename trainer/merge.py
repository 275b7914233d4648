"""Merged versions: a round's LoRA folded into the base weights, as a full model folder.

1. The adapter is merged into the base model in float32 (PEFT's `merge_and_unload`) and saved
   with the base's tokenizer and chat template, so a server loads it like any model folder.
2. Beside the weights, `reference.json` holds the trainer's own greedy continuation of a few
   fixed prompts and its log-probabilities: after a server reloads the folder, its
   log-probabilities of the same tokens must match (`serving.weights.swap`).
3. The folder is published atomically (`memory.folders`) and never overwritten; the adapter
   stays as the version's compact record.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memory import folders
from trainer.errors import TrainerError
from trainer.round import disk_errors

log = logging.getLogger(__name__)

PROMPTS = (
    "What is 7 + 5? Put the answer in <answer></answer> tags.",
    "Write a Python function that reverses a string.",
    "Name three colours.",
)
REFERENCE_TOKENS = 12


def merge_version(base_model: Path, adapter: Path, root: Path, name: str) -> Path:
    """Publish `root/name`: the base model with `adapter` merged in; returns its path. A folder
    already published is returned as it is (a resumed round)."""
    from peft import PeftModel

    target = root / name
    if folders.is_complete(target):
        return target
    if not folders.is_complete(adapter):
        raise TrainerError(f"adapter {adapter} is not a complete checkpoint")
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    merged: Any = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.eval()
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    staging = folders.staging_dir(root, name)
    try:
        with disk_errors(staging):
            merged.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            reference = json.dumps(references(merged, tokenizer)) + "\n"
            (staging / folders.REFERENCE).write_text(reference)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # a torn save is never left to look whole
        raise
    path = folders.publish(staging, root, name)
    log.info("merged version %s published at %s", name, path)
    return path


def references(model: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """The model's greedy continuation of each fixed prompt, with the log-probability of each
    continuation token."""
    found = []
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompt_ids = [int(t) for t in encoded["input_ids"]]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=REFERENCE_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        completion = [int(t) for t in out.sequences[0, len(prompt_ids) :]]
        logprobs = [
            float(torch.log_softmax(score[0].float(), dim=-1)[token])
            for score, token in zip(out.logits, completion, strict=False)
        ]
        found.append({"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": logprobs})
    return found
