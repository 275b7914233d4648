"""Trainer on a GPU: trained tokens/s and peak memory of the flywheel's round on CUDA/bfloat16.

A randomly initialised model of about 0.5B parameters in the Qwen2 shape (no weights to
download), LoRA r=16 on all linear layers, rows of 256 prompt + 256 trained tokens: the same
`train_round` a CPU run uses, with `device = "cuda"` and `dtype = "bfloat16"`. Prints a table
and, with `--json PATH`, writes it. Skips with a line when no GPU is present (CI has none).

    .venv/bin/python -m bench.trainer_gpu [--rows 256] [--batch-size 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.common import ROOT, Figure, provenance, write_results
from memory.records import Attempt, Group, Sample, SamplingSettings
from reports.table import text_table
from trainer.round import train_round
from trainer.settings import TrainSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    made = provenance()
    result = measure(args)
    rows = [(k, f"{v:.1f}" if isinstance(v, float) else str(v)) for k, v in result.items()]
    print(text_table(("metric", "value"), rows))
    if args.json:
        device = str(result["device"])
        figures = [
            Figure.single(f"trained tokens/s on {device}", float(result["trained tokens/s"])),
            Figure.single(f"peak memory on {device}", float(result["peak memory (MiB)"]), "MiB"),
        ]
        write_results(args.json, result, made, figures)


def model_folder(root: Path) -> tuple[Path, int]:
    """A random Qwen2-shaped model of about 0.5B parameters, saved as a model folder; its path
    and parameter count."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(root / "model")
    tokenizer_from = ROOT / ".flywheel" / "models" / "SmolLM2-135M-Instruct"
    if tokenizer_from.is_dir():
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(root / "model")
    return root / "model", sum(p.numel() for p in model.parameters())


def groups(rows: int, tokens: int) -> list[Group]:
    made = []
    for g in range(rows // 4):
        attempts = [
            Attempt(
                sample_index=i,
                policy_version="base",
                messages=[{"role": "user", "content": "q"}],
                sampling=SamplingSettings(temperature=1.0, max_tokens=tokens),
                sample=Sample(
                    text="a",
                    prompt_token_ids=list(range(1, tokens + 1)),
                    completion_token_ids=[(7 * g + i + k) % 31000 + 100 for k in range(tokens)],
                    logprobs=[-1.0] * tokens,
                    finish_reason="length",
                ),
                reward=float(i % 2),
                correct=bool(i % 2),
                format_ok=True,
                answer=str(i),
                reason="bench",
            )  # fmt: skip
            for i in range(4)
        ]
        made.append(
            Group(
                round_index=1,
                purpose="train",
                task_id=f"t{g}",
                taskset="bench",
                question="q",
                policy_version="base",
                size=4,
                attempts=attempts,
            )  # fmt: skip
        )
    return made


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    work = Path(tempfile.mkdtemp(prefix="trainer-gpu-"))
    base, parameters = model_folder(work)
    settings = TrainSettings(
        mode="grpo", device="cuda", dtype="bfloat16", batch_size=args.batch_size,
        max_length=2 * args.tokens, save_steps=0,
    )  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    result = train_round(
        groups(args.rows, args.tokens), base_model=base, parent_adapter=None,
        adapters_root=work / "adapters", name="gpu", settings=settings,
    )  # fmt: skip
    return {
        "device": torch.cuda.get_device_name(0),
        "parameters (M)": round(parameters / 1e6),
        "rows": result.rows,
        "trained tokens": result.train_tokens,
        "trained tokens/s": result.train_tokens / result.train_seconds,
        "train seconds": result.train_seconds,
        "round seconds": time.monotonic() - started,
        "peak memory (MiB)": torch.cuda.max_memory_allocated() / 2**20,
    }


if __name__ == "__main__":
    main()
