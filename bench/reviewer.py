"""Reviewer benchmark: a reviewer model beside the policy on one host, and what it costs.

Two vLLM servers on one CPU host each get cores of their own (`serving.server.split_cores`).
Measured, on the same requests:
(a) the policy's sampling tokens/s alone on the whole host, on its own cores with the reviewer
    idle, and with the reviewer busy: what the split costs the policy;
(b) the reviewer's tokens/s for R3L reflections at concurrency 1 and 16, in float32 and in
    bfloat16, and how many of its replies are valid reflections;
(c) the cost of one reviewer token in policy tokens: the policy tokens/s the host gives up while
    the reviewer is busy (alone on the whole host, less beside a busy reviewer) over the
    reviewer's tokens/s; the weight `bench/explore.py` gives reviewer tokens. Both loads run
    for the whole of the reviewer's pass (the policy's in batches of 16 until it ends), after a
    warm-up pass at each batch size.

    .venv/bin/python -m bench.reviewer [--reviewer qwen2.5-coder-0.5b] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from agents import reflection
from bench.common import ROOT, Figure, provenance, write_results
from bench.smollm2_server import fixed_server
from reports.table import text_table
from serving.model import REVIEWERS, prepare_parted, prepare_smollm2
from serving.server import VllmServer, cpu_dtype, split_cores
from verifiers.reasoning import train_tasks

POLICY_PROMPT = "Count from one to twenty in words."
DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reviewer", choices=sorted(REVIEWERS), default="qwen2.5-coder-0.5b")
    parser.add_argument("--reflections", type=int, default=64)
    parser.add_argument("--port", type=int, default=8071)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    result = measure(args)
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(result, args.reflections))


def figures(result: dict[str, Any], reflections: int) -> list[Figure]:
    """Throughputs (one pass each), the share of valid reflections in each dtype (Wilson over
    the reflections written alone and busy), and the chosen price of a reviewer token."""
    found = [Figure.single("policy alone, whole host", result["policy_alone"], "tokens/s")]
    for dtype in DTYPES:
        r = result[dtype]
        found.append(Figure.single(f"reviewer {dtype}, 16 at once",
                                   r["c16_tokens_per_s"], "tokens/s", "reviewer"))  # fmt: skip
        found.append(
            Figure.share(
                f"reviewer {dtype}: valid reflections",
                round(r["valid"] * 2 * reflections),
                2 * reflections,
                "reviewer",
            )
        )
    found.append(Figure.single(f"price of a reviewer token ({result['chosen_dtype']}), in "
                               "policy tokens", result["reviewer_token_cost"]))  # fmt: skip
    return found


def measure(args: argparse.Namespace) -> dict[str, Any]:
    models = ROOT / ".flywheel" / "models"
    policy = prepare_smollm2(models)
    reviewer = prepare_parted(REVIEWERS[args.reviewer], models)
    work = Path(tempfile.mkdtemp(prefix="reviewer-"))
    policy_cpus, reviewer_cpus = split_cores()
    result: dict[str, Any] = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "cores": {"policy": policy_cpus, "reviewer": reviewer_cpus},
        "cpu_dtype": cpu_dtype(),
    }
    with server(policy, args.port, None, "float32", work) as url:
        result["policy_alone"] = policy_for(url, policy.name, 40.0)
    with server(policy, args.port, policy_cpus, "float32", work) as policy_url:
        result["policy_own_cores"] = policy_for(policy_url, policy.name, 40.0)
        for dtype in DTYPES:
            with server(reviewer, args.port + 1, reviewer_cpus, dtype, work) as url:
                result[dtype] = reviewer_rates(url, reviewer.name, policy_url, policy, args)
    for dtype in DTYPES:
        given_up = result["policy_alone"] - result[dtype]["policy_busy_tokens_per_s"]
        result[dtype]["token_cost"] = max(0.0, given_up) / result[dtype]["busy_tokens_per_s"]
    working = [d for d in DTYPES if result[d]["valid"] >= 0.95] or list(DTYPES)
    best = min(working, key=lambda d: result[d]["token_cost"])
    result["chosen_dtype"] = best
    result["reviewer_token_cost"] = result[best]["token_cost"]
    return result


@contextmanager
def server(model: Path, port: int, cpus: str | None, dtype: str, work: Path) -> Iterator[str]:
    """A started, warmed-up server without LoRA; yields its URL."""
    settings = fixed_server(model, port, f"{model.name}-{dtype}-{cpus}.log", cpus, dtype, work)
    with VllmServer(settings) as running:
        body = {"model": model.name, "prompt": "Hello", "max_tokens": 8}
        httpx.post(f"{running.url}/v1/completions", json=body, timeout=600)  # warm-up
        yield running.url


def policy_for(url: str, model: str, seconds: float) -> float:
    """`policy_while` for `seconds`, after one batch of warm-up."""
    _policy_sample(url, model)
    busy = threading.Event()
    busy.set()
    threading.Timer(seconds, busy.clear).start()
    return policy_while(url, model, busy)


def policy_while(url: str, model: str, busy: threading.Event) -> float:
    """Completion tokens/s of batches of 16 samples, sent while `busy` is set."""
    tokens, started, ended = 0, time.monotonic(), time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        while busy.is_set():
            tokens += sum(pool.map(lambda _: _policy_sample(url, model), range(16)))
            ended = time.monotonic()
    return tokens / max(ended - started, 1e-9)


def _policy_sample(url: str, model: str) -> int:
    body = {"model": model, "prompt": POLICY_PROMPT, "max_tokens": 64, "temperature": 1.0}
    body |= {"ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"])


def reflection_messages(count: int) -> list[list[dict[str, str]]]:
    """R3L's reviewer prompt for wrong answers to arithmetic tasks (off by one)."""
    prompts = []
    for task in train_tasks("arithmetic", count, seed=11, held_out=[]):
        wrong = int(task.answer) + 1
        feedback = f"The verifier gave reward 0: the answer {wrong} is wrong."
        text = f"Task: {task.question}\n\nAttempt: The answer is {wrong}.\n\n{feedback}"
        prompts.append([
            {"role": "system", "content": reflection.REFLECT_SYSTEM},
            {"role": "user", "content": text},
        ])  # fmt: skip
    return prompts


def reflect_all(url: str, model: str, prompts: list[Any], concurrency: int) -> dict[str, float]:
    """Reflections `concurrency` at a time: tokens/s and the share of valid replies."""
    schema = reflection.Reflection.model_json_schema()
    schema["properties"]["outcome"]["enum"] = ["success_but_inefficient", "failure"]
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}

    def one(messages: list[Any]) -> tuple[int, bool]:
        body = {"model": model, "messages": messages, "max_tokens": reflection.REFLECT_MAX_TOKENS}
        body |= {"temperature": 0.3, "response_format": response_format}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
        response.raise_for_status()
        reply = response.json()
        text = reply["choices"][0]["message"]["content"] or ""
        valid = isinstance(reflection.parse_reflection(text), reflection.Reflection)
        return int(reply["usage"]["completion_tokens"]), valid

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, prompts))
    seconds = time.monotonic() - started
    return {
        "tokens_per_s": sum(tokens for tokens, _ in done) / seconds,
        "valid": sum(ok for _, ok in done) / len(done),
        "mean_tokens": sum(tokens for tokens, _ in done) / len(done),
    }


def reviewer_rates(
    url: str, model: str, policy_url: str, policy: Path, args: argparse.Namespace
) -> dict[str, float]:
    prompts = reflection_messages(args.reflections)
    reflect_all(url, model, prompts[:16], 16)  # warm-up: the engine compiles per batch size
    alone_1 = reflect_all(url, model, prompts[:4], 1)
    alone_16 = reflect_all(url, model, prompts, 16)
    busy_flag = threading.Event()
    busy_flag.set()
    with ThreadPoolExecutor(1) as side:  # both busy for the whole of the reviewer's pass
        policy_busy = side.submit(policy_while, policy_url, policy.name, busy_flag)
        busy = reflect_all(url, model, prompts, 16)
        busy_flag.clear()
        policy_tokens = policy_busy.result()
    return {
        "c1_tokens_per_s": alone_1["tokens_per_s"],
        "c16_tokens_per_s": alone_16["tokens_per_s"],
        "busy_tokens_per_s": busy["tokens_per_s"],
        "policy_busy_tokens_per_s": policy_tokens,
        "valid": (alone_16["valid"] + busy["valid"]) / 2,
        "mean_tokens": alone_16["mean_tokens"],
    }


def print_table(result: dict[str, Any]) -> None:
    rows = [
        ["policy alone, whole host", f"{result['policy_alone']:.1f}", "-", "-"],
        [
            f"policy on cores {result['cores']['policy']}, reviewer idle",
            f"{result['policy_own_cores']:.1f}",
            "-",
            "-",
        ],
    ]
    for dtype in DTYPES:
        r = result[dtype]
        rows.append([
            f"reviewer {dtype} on cores {result['cores']['reviewer']}, c1 / c16",
            "-",
            f"{r['c1_tokens_per_s']:.1f} / {r['c16_tokens_per_s']:.1f}",
            f"{r['valid']:.2f}",
        ])  # fmt: skip
        rows.append([
            f"both busy ({dtype} reviewer)",
            f"{r['policy_busy_tokens_per_s']:.1f}",
            f"{r['busy_tokens_per_s']:.1f}",
            "-",
            f"{r['token_cost']:.2f}",
        ])  # fmt: skip
    rows = [row if len(row) == 5 else [*row, "-"] for row in rows]
    header = ["setting", "policy tok/s", "reviewer tok/s", "valid", "token cost"]
    print(text_table(header, rows))
    print(
        f"chosen reviewer dtype: {result['chosen_dtype']} (CPU suggests {result['cpu_dtype']}); "
        f"one reviewer token costs {result['reviewer_token_cost']:.2f} policy tokens"
    )


if __name__ == "__main__":
    main()
