"""Trainer benchmark: our policy-gradient round against plain TRL SFT on the same tokens.

Both variants train the same LoRA (rank, modules, batch, epochs, learning rate, device) on the
same rows (prompt + completion token ids, completion tokens trained); ours adds per-token
advantages and the importance-sampling weights. Each runs in its own process so that peak memory
is its own, and the two alternate over `--passes`. Reports trained tokens/s with its interval
over passes, our overhead, and peak memory (RSS; CUDA peak on a GPU). `--micro-batch N` passes
each batch in micro-batches of N rows (`[train] micro_batch_size`), both variants alike.

    .venv/bin/python -m bench.train [--model smollm2|tiny|qwen2.5-coder-0.5b] [--rows 64]
        [--batch-size 8] [--micro-batch N] [--passes 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Figure, provenance, write_results
from cli.arguments import MODELS, model_folder
from memory.records import Attempt, Group, Sample, SamplingSettings
from trainer.settings import TrainSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--rows", type=int, default=64, help="rows (attempts) to train on")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=None, help="rows a pass takes")
    parser.add_argument("--passes", type=int, default=3, help="of each variant, alternating")
    parser.add_argument("--variant", choices=("ours", "sft"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
        return
    made = provenance()
    passes: dict[str, list[dict[str, Any]]] = {"sft": [], "ours": []}
    for index in range(args.passes):
        for variant in ("sft", "ours"):
            passes[variant].append(run_variant(variant))
            print(f"pass {index + 1}/{args.passes} {variant}: "
                  f"{passes[variant][-1]['tokens_per_s']:.1f} tokens/s", flush=True)  # fmt: skip
    result = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "variant")},
        **{f"{v}_{k}": statistics.median(p[k] for p in passes[v])
           for v in passes for k in ("train_seconds", "tokens_per_s", "peak_rss_mib")},
        **{f"{v}_{k}": passes[v][0][k] for v in passes for k in ("peak_cuda_mib", "device")},
        "passes": passes,
    }  # fmt: skip
    result["overhead"] = result["sft_tokens_per_s"] / result["ours_tokens_per_s"] - 1
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(passes))


def figures(passes: dict[str, list[dict[str, Any]]]) -> list[Figure]:
    """Tokens/s of each variant and our overhead, with intervals over passes; peak memory."""
    ratios = [s["tokens_per_s"] / o["tokens_per_s"] - 1
              for s, o in zip(passes["sft"], passes["ours"], strict=True)]  # fmt: skip
    device = passes["ours"][0]["device"]
    return [
        Figure.mean(f"plain TRL SFT, trained tokens/s ({device})",
                    [p["tokens_per_s"] for p in passes["sft"]], "tokens/s"),
        Figure.mean(f"flywheel round, trained tokens/s ({device})",
                    [p["tokens_per_s"] for p in passes["ours"]], "tokens/s"),
        Figure.mean("overhead of the flywheel round over SFT (goal <= 0.10)", ratios),
        Figure.mean("flywheel round, peak RSS", [p["peak_rss_mib"] for p in passes["ours"]],
                    "MiB"),
    ]  # fmt: skip


def run_variant(variant: str) -> dict[str, Any]:
    command = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
    if "--json" in command:
        index = command.index("--json")
        del command[index : index + 2]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed: {done.stderr.strip().splitlines()[-1:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    model_path = model_folder(args.model, ROOT / ".flywheel" / "models")
    # GRPO keeps every row (RLTLDR would subsample them): this measures the trainer, not a filter.
    settings = TrainSettings(epochs=1, batch_size=args.batch_size,
                             micro_batch_size=args.micro_batch, mode="grpo")  # fmt: skip
    groups = synthetic_groups(args)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as scratch:
        if args.variant == "ours":
            from trainer.round import train_round

            result = train_round(
                groups,
                base_model=model_path,
                parent_adapter=None,
                adapters_root=Path(scratch),
                name="bench",
                settings=settings,
            )
            seconds, tokens = result.train_seconds, result.train_tokens
        else:
            seconds, tokens = plain_sft(groups, model_path, settings, scratch)
    cuda = torch.cuda.is_available()
    return {
        "train_seconds": seconds,
        "trained_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "device": "cuda" if cuda else "cpu",
    }


def plain_sft(
    groups: list[Group], model_path: Path, settings: TrainSettings, scratch: str
) -> tuple[float, int]:
    """TRL's own SFTTrainer, same config and LoRA, on the same input ids and labels."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    from trainer.dataset import build_rows
    from trainer.round import lora_config, training_config

    rows = build_rows(groups, settings)
    dataset = Dataset.from_list([{"input_ids": r.input_ids, "labels": r.labels} for r in rows])
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        args=training_config(settings, scratch),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=lora_config(settings),
    )
    started = time.monotonic()
    trainer.train()
    runtime = next(
        (e["train_runtime"] for e in trainer.state.log_history if "train_runtime" in e),
        time.monotonic() - started,
    )
    return runtime, sum(r.trained_tokens for r in rows)


def synthetic_groups(args: argparse.Namespace) -> list[Group]:
    """Groups of 4 with rewards 1, 0, 0, 1 (every row trains), random in-vocabulary tokens."""
    rng = random.Random(0)
    groups = []
    for g in range(args.rows // 4):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        attempts = []
        for i, reward in enumerate((1.0, 0.0, 0.0, 1.0)):
            completion = [rng.randrange(100, 40000) for _ in range(args.completion_tokens)]
            attempts.append(
                Attempt(
                    sample_index=i,
                    policy_version="base",
                    messages=[],
                    sampling=SamplingSettings(temperature=1.0, max_tokens=args.completion_tokens),
                    sample=Sample(
                        text="",
                        prompt_token_ids=prompt,
                        completion_token_ids=completion,
                        logprobs=[-2.0] * len(completion),
                        finish_reason="length",
                    ),
                    reward=reward,
                    correct=reward > 0,
                    format_ok=True,
                    answer=None,
                    reason="bench",
                )
            )
        groups.append(
            Group(
                round_index=1,
                purpose="train",
                task_id=f"bench-{g}",
                taskset="bench",
                question="",
                policy_version="base",
                size=4,
                attempts=attempts,
            )
        )
    return groups


def print_table(r: dict[str, Any]) -> None:
    s = r["settings"]
    micro = f" in micro-batches of {s['micro_batch']}" if s.get("micro_batch") else ""
    print(
        f"{'variant':<22}{'tokens/s':>10}{'train s':>10}{'peak RSS MiB':>14}{'peak CUDA MiB':>15}"
    )
    for variant, label in (("sft", "plain TRL SFT"), ("ours", "flywheel round")):
        cuda = r[f"{variant}_peak_cuda_mib"]
        print(
            f"{label:<22}{r[f'{variant}_tokens_per_s']:>10.1f}{r[f'{variant}_train_seconds']:>10.1f}"
            f"{r[f'{variant}_peak_rss_mib']:>14.0f}{'-' if cuda is None else f'{cuda:.0f}':>15}"
        )
    print(f"overhead of the flywheel round: {100 * r['overhead']:+.1f}% (goal <= 10%)")
    print(
        f"{s['model']} on {r['ours_device']}, {s['rows']} rows x ({s['prompt_tokens']} prompt + "
        f"{s['completion_tokens']} trained tokens), batch {s['batch_size']}{micro}, 1 epoch, "
        "LoRA r=16"
    )


if __name__ == "__main__":
    main()
