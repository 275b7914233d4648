"""Dtype benchmark: may the policy's server sample in bfloat16 while training runs in float32?

The trainer weights each sampled token by its importance ratio exp(logp_train - logp_behaviour)
(capped at 2), where logp_behaviour is what the server reported when it sampled. A server in
bfloat16 reports bfloat16 log-probabilities; training computes float32 ones. For each dtype the
server samples the same prompts (64 at a time, temperature 1.0, so the reported log-probabilities
are the sampling distribution's), the trainer's float32 model scores the same tokens, and we
report the drift of the per-token ratio and the sampling speed:

    .venv/bin/python -m bench.dtype [--requests 64] [--json PATH]

A dtype is fit for the policy when its ratios stay near 1 (median |log ratio| well under the
noise the IS cap tolerates, few tokens past the cap); the speed is what it buys.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from agents.policy import PolicyClient
from bench.common import ROOT, Figure, provenance, server_settings, write_results
from memory.records import Sample, SamplingSettings
from reports.table import text_table
from serving.model import prepare_smollm2
from serving.server import VllmServer, cpu_dtype
from verifiers.reasoning import train_tasks

DTYPES = ("float32", "bfloat16")
IS_CAP = 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    model = prepare_smollm2(ROOT / ".flywheel" / "models")
    work = Path(tempfile.mkdtemp(prefix="dtype-"))
    result: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    result["cpu_dtype"] = cpu_dtype()
    for dtype in DTYPES:
        samples, seconds = sample_all(model, dtype, args, work)
        tokens = sum(len(s.completion_token_ids) for s in samples)
        result[dtype] = drift(model, samples) | {"tokens_per_s": tokens / seconds}
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(result))


def figures(result: dict[str, Any]) -> list[Figure]:
    """Sampling speed in each dtype (one pass each); the importance ratios' spread over the
    sampled tokens; tokens past the cap and off by more than 10% as shares of them."""
    found = [Figure.single(f"{d}: sampling", result[d]["tokens_per_s"], "tokens/s")
             for d in DTYPES]  # fmt: skip
    for dtype in DTYPES:
        r, n = result[dtype], result[dtype]["tokens"]
        found += [
            Figure.single(f"{dtype}: median |log r|", r["median_abs_log_ratio"]),
            Figure.single(f"{dtype}: p99 |log r|", r["p99_abs_log_ratio"]),
            Figure.share(f"{dtype}: tokens off by more than 10%",
                         round(r["share_off_by_10pct"] * n), n),
            Figure.share(f"{dtype}: tokens past the IS cap", round(r["share_past_cap"] * n), n),
        ]  # fmt: skip
    return found


def sample_all(
    model: Path, dtype: str, args: argparse.Namespace, work: Path
) -> tuple[list[Sample], float]:
    settings = server_settings(
        model, work / f"vllm-{dtype}.log", port=args.port, weights="fixed", dtype=dtype
    )
    tasks = train_tasks("arithmetic", args.requests, seed=3, held_out=[])
    sampling = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens)

    async def run() -> tuple[list[Sample], float]:
        client = PolicyClient(settings.url)
        try:
            await client.sample(model.name, [{"role": "user", "content": "Hi"}], sampling)
            started = time.monotonic()
            samples: list[Sample] = []
            async with anyio.create_task_group() as tg:
                for task in tasks:
                    messages = [{"role": "user", "content": task.question}]
                    tg.start_soon(_one, client, model.name, messages, sampling, samples)
            return samples, time.monotonic() - started
        finally:
            await client.aclose()

    with VllmServer(settings):
        return anyio.run(run)


async def _one(
    client: PolicyClient, model: str, messages: list[Any], sampling: Any, out: list[Any]
) -> None:
    out.append(await client.sample(model, messages, sampling))


def drift(model_path: Path, samples: list[Sample]) -> dict[str, float]:
    """Per-token log ratios of the float32 trainer's log-probabilities over the server's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    ratios: list[float] = []
    with torch.no_grad():
        for sample in samples:
            ids = sample.prompt_token_ids + sample.completion_token_ids
            logits = model(torch.tensor([ids])).logits[0, len(sample.prompt_token_ids) - 1 : -1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            chosen = logp.gather(1, torch.tensor(sample.completion_token_ids)[:, None])[:, 0]
            behaviour = torch.tensor(sample.logprobs)
            ratios += (chosen - behaviour).tolist()
    absolute = sorted(abs(r) for r in ratios)
    return {
        "tokens": len(ratios),
        "median_abs_log_ratio": statistics.median(absolute),
        "p99_abs_log_ratio": absolute[int(0.99 * (len(absolute) - 1))],
        "mean_log_ratio": statistics.fmean(ratios),
        "share_past_cap": sum(r > math.log(IS_CAP) for r in ratios) / len(ratios),
        "share_off_by_10pct": sum(abs(r) > math.log(1.1) for r in ratios) / len(ratios),
    }


def print_table(result: dict[str, Any]) -> None:
    rows = []
    for dtype in DTYPES:
        r = result[dtype]
        rows.append([
            dtype,
            f"{r['tokens_per_s']:.1f}",
            f"{r['median_abs_log_ratio']:.4f}",
            f"{r['p99_abs_log_ratio']:.4f}",
            f"{r['mean_log_ratio']:+.4f}",
            f"{r['share_off_by_10pct']:.3f}",
            f"{r['share_past_cap']:.4f}",
        ])  # fmt: skip
    header = ["server dtype", "tokens/s", "median |log r|", "p99 |log r|", "mean log r"]
    header += ["ratio off >10%", "past IS cap"]
    print(text_table(header, rows))
    speed = result["bfloat16"]["tokens_per_s"] / result["float32"]["tokens_per_s"]
    print(f"bfloat16 / float32 sampling speed: {speed:.2f}x (CPU suggests {result['cpu_dtype']})")


if __name__ == "__main__":
    main()
