"""Sampling benchmark: a new version served as merged weights against LoRA and the base model.

On one CPU vLLM server with merged weights (dev routes, no LoRA, torch.compile on), then on one
with LoRA enabled, at the same concurrency and the same requests:
(a) completion tokens/s from the base model, from a newest version served as merged weights,
    and from the same version served as a LoRA adapter (rank 16 on all linear layers, as the
    trainer makes them), base and version alternating over `--passes` (on the merged server the
    base is a merged version with a zero adapter, loaded the same way); the ratio newest/base,
    paired by pass, is the goal (at least 0.9);
(b) swap time, p50 and p99, over `--swaps` in-place reloads between two merged versions;
(c) failed requests of a steady load during those swaps (goal 0).
The versions are random LoRA adapters of the real model merged by the trainer's own code:
speed depends on how a version is served, not on its values.

    .venv/bin/python -m bench.sampling [--model smollm2|tiny] [--swaps 10] [--passes 3]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, Figure, provenance, server_settings, write_results
from reports.table import text_table
from serving import weights
from serving.adapters import ensure_loaded
from serving.model import prepare_smollm2, prepare_tiny_llama
from serving.server import VllmServer
from tests.helpers import random_adapter  # a LoRA of random weights
from trainer.merge import merge_version

PROMPT = "Count from one to twenty in words."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--swaps", type=int, default=10)
    parser.add_argument("--passes", type=int, default=3, help="base and version, alternating")
    parser.add_argument("--port", type=int, default=8061)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    result = measure(args)
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(result))


def figures(result: dict[str, Any]) -> list[Figure]:
    """Tokens/s and the newest/base ratios over passes, swap time over swaps, failed requests
    as a share of those answered during swaps."""
    passes = result["passes"]
    answered = result["requests_during_swaps"]
    return [
        Figure.mean("base model (merged-mode server)", passes["base"], "tokens/s"),
        Figure.mean("newest version, merged weights", passes["merged"], "tokens/s"),
        Figure.mean("merged / base, paired by pass (goal >= 0.9)", passes["merged_over_base"]),
        Figure.mean("base model (LoRA server)", passes["lora_base"], "tokens/s"),
        Figure.mean("newest version, LoRA adapter", passes["lora"], "tokens/s"),
        Figure.mean("LoRA / base, paired by pass", passes["lora_over_base"]),
        Figure.mean("in-place swap between merged versions", result["swap_seconds"], "s"),
        Figure.share("failed requests during swaps (goal 0)",
                     result["failed_requests_during_swaps"], answered),
    ]  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    models = ROOT / ".flywheel" / "models"
    base = prepare_smollm2(models)
    if args.model == "tiny":
        base = prepare_tiny_llama(models, base)
    work = Path(tempfile.mkdtemp(prefix="sampling-"))
    versions = {}
    for name, std in (("v0", 0.0), ("v1", 0.02), ("v2", 0.02)):
        adapter = random_adapter(base, work / "adapters", name, std=std, modules="all-linear")
        versions[name] = (adapter, merge_version(base, adapter, work / "merged", name))
    result: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    passes: dict[str, list[float]] = {key: [] for key in ("base", "merged", "lora_base", "lora")}
    with server(base, args.port, "merged", work) as url:
        for _ in range(args.passes):
            for key, name in (("base", "v0"), ("merged", "v1")):
                target = weights.Served(version=name, folder=versions[name][1])
                weights.serve(url, base.name, target, base)
                passes[key].append(throughput(url, base.name, args))
        result |= swaps(url, base, versions, args.swaps)
    with server(base, args.port + 1, "lora", work) as url:
        ensure_loaded(url, "v1", versions["v1"][0])
        for _ in range(args.passes):
            passes["lora_base"].append(throughput(url, base.name, args))
            passes["lora"].append(throughput(url, "v1", args))
    passes["merged_over_base"] = _ratios(passes["merged"], passes["base"])
    passes["lora_over_base"] = _ratios(passes["lora"], passes["lora_base"])
    for key in ("base", "merged", "lora_base", "lora", "merged_over_base", "lora_over_base"):
        result[key if "over" in key else f"{key}_tokens_per_s"] = statistics.median(passes[key])
    result["passes"] = passes
    return result


def _ratios(top: list[float], bottom: list[float]) -> list[float]:
    return [a / b for a, b in zip(top, bottom, strict=True)]


@contextmanager
def server(base: Path, port: int, mode: str, work: Path) -> Iterator[str]:
    """A started, warmed-up server of `mode` ("merged" or "lora"); yields its URL."""
    settings = server_settings(base, work / f"vllm-{mode}.log", port=port, weights=mode)
    with VllmServer(settings) as running:
        body = {"model": base.name, "prompt": PROMPT, "max_tokens": 8}
        httpx.post(f"{running.url}/v1/completions", json=body, timeout=300)  # warm-up
        yield running.url


def throughput(url: str, model: str, args: argparse.Namespace) -> float:
    """Completion tokens/s of `--requests` requests, `--concurrency` at a time."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 1.0}
    body |= {"ignore_eos": True}

    def one(_: int) -> int:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    started = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(one, range(args.requests)))
    return tokens / (time.monotonic() - started)


def swaps(
    url: str, base: Path, versions: dict[str, tuple[Path, Path]], count: int
) -> dict[str, Any]:
    """`count` swaps between the two versions under a steady load of 4 clients."""
    errors: list[str] = []
    answered = [0]
    stop = threading.Event()
    body = {"model": base.name, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0}

    def load() -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            while not stop.is_set():
                try:
                    response = client.post("/v1/completions", json=body)
                    if response.status_code != 200:
                        errors.append(str(response.status_code))
                except httpx.HTTPError as exc:
                    errors.append(type(exc).__name__)
                answered[0] += 1

    clients = [threading.Thread(target=load) for _ in range(4)]
    for thread in clients:
        thread.start()
    seconds = []
    try:
        for index in range(count):
            name = ("v2", "v1")[index % 2]
            target = weights.Served(version=name, folder=versions[name][1])
            seconds.append(weights.serve(url, base.name, target, base).seconds)
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    ordered = sorted(seconds)
    return {
        "swap_seconds": seconds,
        "swap_p50_s": statistics.median(ordered),
        "swap_p99_s": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "requests_during_swaps": answered[0],
        "failed_requests_during_swaps": len(errors),
    }


def print_table(result: dict[str, Any]) -> None:
    rows = [
        ("base model tokens/s (merged-mode server)", f"{result['base_tokens_per_s']:.1f}", ""),
        ("newest version, merged, tokens/s", f"{result['merged_tokens_per_s']:.1f}", ""),
        ("newest / base", f"{result['merged_over_base']:.3f}", ">= 0.9"),
        ("base model tokens/s (LoRA server)", f"{result['lora_base_tokens_per_s']:.1f}", ""),
        ("newest version, LoRA, tokens/s", f"{result['lora_tokens_per_s']:.1f}", ""),
        ("LoRA / base", f"{result['lora_over_base']:.3f}", ""),
        ("swap p50 s", f"{result['swap_p50_s']:.2f}", "< 10"),
        ("swap p99 s", f"{result['swap_p99_s']:.2f}", "< 10"),
        ("requests during swaps", str(result["requests_during_swaps"]), ""),
        ("failed requests during swaps", str(result["failed_requests_during_swaps"]), "0"),
    ]
    print(text_table(("metric", "value", "goal"), rows))


if __name__ == "__main__":
    main()
