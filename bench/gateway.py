"""Serving benchmark: gateway overhead, hot-swap latency, and failed requests during swaps.

Starts a real vLLM server (SmolLM2-135M on CPU by default) and the gateway in front of it, then:
(a) completion tokens/s through the gateway over the same load sent straight to vLLM, the two
    alternating over `--passes` (the ratio paired by pass);
(b) time from "checkpoint published" (an adapter folder atomically in place) to "the alias
    serves it" (validated, loaded, canaried, promoted through the gate), p50 and p99;
(c) failed requests of a steady load through the alias during those consecutive swaps.

    .venv/bin/python -m bench.gateway [--model smollm2|tiny] [--swaps 10] [--passes 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import Engine

from bench.common import ROOT, Figure, free_port, provenance, server_settings, write_results
from memory import folders, store
from memory.records import PolicyVersion
from serving.gateway import GatewaySettings, create_app, running
from serving.model import prepare_smollm2, prepare_tiny_llama
from serving.server import VllmServer

ADMIN = {"Authorization": "Bearer bench-admin"}
PROMPT = [{"role": "user", "content": "Count from one to twenty in words."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--requests", type=int, default=48, help="requests per throughput pass")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--swaps", type=int, default=10)
    parser.add_argument("--passes", type=int, default=3, help="direct and gateway, alternating")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()

    models = ROOT / ".flywheel" / "models"
    model_path = prepare_smollm2(models)
    if args.model == "tiny":
        model_path = prepare_tiny_llama(models, model_path)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as scratch:
        results = run(args, model_path, Path(scratch))
    print_table(results)
    if args.json:
        write_results(args.json, results, made, figures(results))


def figures(results: dict[str, Any]) -> list[Figure]:
    """Throughput and the gateway's ratio over passes, publish-to-alias time over swaps, failed
    requests as a share of those answered during swaps."""
    ratios = [g / d for g, d in zip(results["gateway_passes"], results["direct_passes"],
                                    strict=True)]  # fmt: skip
    return [
        Figure.mean("straight to vLLM", results["direct_passes"], "tokens/s"),
        Figure.mean("through the gateway", results["gateway_passes"], "tokens/s"),
        Figure.mean("gateway / direct, paired by pass", ratios),
        Figure.mean("checkpoint published to alias serving it", results["swap_seconds"], "s"),
        Figure.share("failed requests during swaps (goal 0)",
                     results["failed_requests_during_swaps"], results["requests_during_swaps"]),
    ]  # fmt: skip


def run(args: argparse.Namespace, model_path: Path, scratch: Path) -> dict[str, Any]:
    upstream = server_settings(model_path, scratch / "vllm.log")
    root = scratch / "adapters"
    template = make_adapter(model_path, scratch / "template")
    engine = store.open_store(f"sqlite:///{scratch / 'bench.db'}")
    seed_store(engine, model_path.name)
    gateway_settings = GatewaySettings(
        upstreams=[upstream.url],
        base_model_path=model_path,
        adapters_root=root,
        admin_keys=frozenset({"bench-admin"}),
        keep_versions=3,
    )
    with (
        VllmServer(upstream) as server,
        running(create_app(gateway_settings, engine), port=free_port()) as gateway,
    ):
        throughput(server.url, args, passes=1)  # warm-up: the first requests are slow on CPU
        direct, through = [], []
        for _ in range(args.passes):
            direct.append(throughput(server.url, args))
            through.append(throughput(gateway, args))
        latencies, load_seconds, failures, requests = swaps(
            gateway, engine, template, root, args.swaps
        )
    return {
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "json"},
            "model": model_path.name,
        },
        "direct_tokens_per_s": max(direct),
        "gateway_tokens_per_s": max(through),
        "gateway_over_direct": max(through) / max(direct),
        "direct_passes": direct,
        "gateway_passes": through,
        "swap_seconds_p50": percentile(latencies, 50),
        "swap_seconds_p99": percentile(latencies, 99),
        "swap_seconds": latencies,
        "load_seconds_p50": percentile(load_seconds, 50),
        "requests_during_swaps": requests,
        "failed_requests_during_swaps": failures,
    }


def throughput(url: str, args: argparse.Namespace, passes: int = 1) -> float:
    def one(client: httpx.Client, model: str) -> int:
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": PROMPT,
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    with httpx.Client(base_url=url, timeout=600) as client:
        model = "policy" if "policy" in _model_ids(client) else _model_ids(client)[0]
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(pool.map(lambda _: one(client, model), range(args.requests * passes)))
        return tokens / (time.monotonic() - started)


def swaps(
    gateway: str, engine: Engine, template: Path, root: Path, count: int
) -> tuple[list[float], list[float], int, int]:
    load = SteadyLoad(gateway)
    latencies: list[float] = []
    load_seconds: list[float] = []
    with load, httpx.Client(base_url=gateway, headers=ADMIN, timeout=600) as admin:
        for i in range(1, count + 1):
            name = f"policy-bench-{i}"
            staging = folders.staging_dir(root, name)
            shutil.copytree(template, staging, dirs_exist_ok=True)
            published = folders.publish(staging, root, name)
            started = time.monotonic()
            with store.transaction(engine) as session:
                store.save_policy_version(
                    session,
                    PolicyVersion(
                        name=name, base_model="bench", adapter_path=str(published), round_index=i
                    ),
                )
                store.record_evaluation(session, name, i / 100)  # each passes the gate
            admin.post("/admin/adapters", json={"name": name, "path": str(published)})
            loaded = time.monotonic()
            response = admin.post("/admin/promote", json={"version": name})
            latencies.append(time.monotonic() - started)
            load_seconds.append(loaded - started)
            assert response.status_code == 200, response.text
            load.wait_until_seen(name)
    return latencies, load_seconds, len(load.errors), load.count


class SteadyLoad:
    """Four clients sending alias requests back to back; records failures and versions seen."""

    def __init__(self, url: str, workers: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.count = 0
        self.seen = threading.Condition()
        self.models: set[str] = set()
        self.threads = [threading.Thread(target=self._run) for _ in range(workers)]

    def _run(self) -> None:
        body = {"model": "policy", "messages": PROMPT, "max_tokens": 4, "temperature": 0.0}
        with httpx.Client(base_url=self.url, timeout=600) as client:
            while not self.stop.is_set():
                response = client.post("/v1/chat/completions", json=body)
                with self.seen:
                    self.count += 1
                    if response.status_code != 200:
                        self.errors.append(f"{response.status_code}: {response.text[:200]}")
                    else:
                        self.models.add(response.json()["model"])
                    self.seen.notify_all()

    def wait_until_seen(self, model: str) -> None:
        with self.seen:
            self.seen.wait_for(lambda: model in self.models, timeout=300)

    def __enter__(self) -> SteadyLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def make_adapter(model_path: Path, out: Path) -> Path:
    """A LoRA with random weights on every linear layer (what it says does not matter here)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    config = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules="all-linear",
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    get_peft_model(model, config).save_pretrained(str(out))
    return out


def seed_store(engine: Engine, base: str) -> None:
    with store.transaction(engine) as session:
        store.save_policy_version(session, PolicyVersion(name=base, base_model=base))
        store.record_evaluation(session, base, 0.0)
        store.set_promoted(session, base, True)


def _model_ids(client: httpx.Client) -> list[str]:
    return [m["id"] for m in client.get("/v1/models").json()["data"]]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("direct vLLM tokens/s", f"{r['direct_tokens_per_s']:.1f}", ""),
        ("gateway tokens/s", f"{r['gateway_tokens_per_s']:.1f}", ""),
        ("gateway / direct", f"{r['gateway_over_direct']:.3f}", ">= 0.95"),
        ("publish -> alias serves, p50 s", f"{r['swap_seconds_p50']:.3f}", "< 1"),
        ("publish -> alias serves, p99 s", f"{r['swap_seconds_p99']:.3f}", "< 1"),
        ("  of which validate + load + canary, p50 s", f"{r['load_seconds_p50']:.3f}", ""),
        ("requests during swaps", str(r["requests_during_swaps"]), ""),
        ("failed requests during swaps", str(r["failed_requests_during_swaps"]), "0"),
    ]
    width = max(len(name) for name, _, _ in rows)
    print(f"{'metric'.ljust(width)}  {'value':>10}  goal")
    for name, value, goal in rows:
        print(f"{name.ljust(width)}  {value:>10}  {goal}")
    print(
        f"model {r['settings']['model']}, {r['settings']['requests']} requests x "
        f"{r['settings']['max_tokens']} tokens at concurrency {r['settings']['concurrency']}"
    )


if __name__ == "__main__":
    main()
