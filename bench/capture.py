"""Capture benchmark: what recording agent traffic costs, and whether its episodes stitch.

Starts SmolLM2-135M on the CPU vLLM server (with its tool template and the hermes tool-call
parser) and two gateways in front of it, one capturing and one not, then:
(a) completion tokens/s through the capturing gateway over the same load through the other
    (the same requests, interleaved passes, the best of each);
(b) multi-turn conversations, each its own session: plain chat (a question, an answer, a
    follow-up), and `examples/agent.py`'s tool-using sums (tool calls parsed by the server,
    tool results sent back). The share of sessions whose captured turns stitch into one
    sequence, and of those, the share equal to the server's own rendering of the whole
    transcript (its /tokenize of the messages);
(c) with `--loop`, in a small loop: `flywheel serve --source captured` with its gateway on a
    SmolLM2 server with LoRA (gate open, `min_gain = -1`, so that any trained version
    serves), two agent sessions of one task with feedback, and the seconds from the last
    feedback to the alias answering with the new version.

    .venv/bin/python -m bench.capture [--requests 48] [--passes 2] [--sessions 16]
        [--model smollm2|FOLDER] [--loop] [--json PATH]

(a) reports the best pass of each gateway against the other, and the median of the paired
passes (each capturing pass over the plain one just before it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from bench.common import (
    FLYWHEEL,
    ROOT,
    Figure,
    checkout_env,
    free_port,
    provenance,
    server_settings,
    stop_serve,
    write_results,
)
from bench.gateway import seed_store
from examples.agent import ADD, solve
from memory import store
from memory.records import Attempt
from memory.sessions import episodes, session_turns
from reports.table import text_table
from serving.gateway import GatewaySettings, create_app, running
from serving.model import prepare_smollm2
from serving.server import VllmServer

PROMPT = [{"role": "user", "content": "Count from one to twenty in words."}]
CHATS = [
    ("What is the capital of France?", "And of Italy?"),
    ("Name a fruit that is red.", "Name another one."),
    ("What is 3 + 4?", "Now double it."),
    ("Say hello in Spanish.", "And in German?"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48, help="requests per throughput pass")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=16, help="sessions of each kind")
    parser.add_argument(
        "--passes", type=int, default=2, help="throughput passes of each gateway (0: none)"
    )
    parser.add_argument(
        "--tool-choice", default="auto", help="the agent's first tool_choice: auto or required"
    )
    parser.add_argument(
        "--model", default="smollm2", help="smollm2, or a model folder (e.g. a Qwen2.5 one)"
    )
    parser.add_argument("--loop", action="store_true", help="also: feedback to a new version")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    model = prepare_smollm2(ROOT / ".flywheel" / "models")
    served = model if args.model == "smollm2" else Path(args.model).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as scratch:
        results = run(args, served, Path(scratch))
        if args.loop:
            results["loop"] = feedback_to_serving(model, Path(scratch) / "loop")
    print_table(results)
    if args.json:
        write_results(args.json, results, made, figures(results))


def figures(results: dict[str, Any]) -> list[Figure]:
    """Capture's cost (capturing over plain throughput, paired by pass), and per kind of session
    the share stitched into one sequence and the share equal to the server's rendering."""
    found = []
    if results.get("paired_ratios"):
        found.append(Figure.mean("capture on / capture off, paired by pass (goal >= 0.95)",
                                 results["paired_ratios"]))  # fmt: skip
    for kind in ("chat", "agent"):
        row = results[kind]
        if row["multi_turn"]:
            found.append(Figure.share(f"{kind}: multi-turn sessions stitched", row["stitched"],
                                      row["multi_turn"], "system"))  # fmt: skip
        if row["stitched"]:
            found.append(
                Figure.share(
                    f"{kind}: stitched sessions equal to the server's rendering",
                    row["equal_to_rendering"],
                    row["stitched"],
                    "system",
                )
            )
    return found


def run(args: argparse.Namespace, model: Path, scratch: Path) -> dict[str, Any]:
    upstream = server_settings(model, scratch / "vllm.log", weights="fixed")
    engine = store.open_store(f"sqlite:///{scratch / 'capture.db'}")
    seed_store(engine, model.name)

    def gateway(capture: bool) -> Any:
        settings = GatewaySettings(
            upstreams=[upstream.url],
            base_model_path=model,
            adapters_root=scratch / "adapters",
            capture=capture,
        )
        return running(create_app(settings, engine), port=free_port())

    with VllmServer(upstream) as server, gateway(True) as on, gateway(False) as off:
        speeds = passes(on, off, args)
        started = time.monotonic()
        kinds = conversations(on, args.sessions, args.tool_choice)
        conversation_seconds = time.monotonic() - started
        figures = stitching(engine, server.url, model.name, kinds)
    return {
        "settings": {k: str(v) for k, v in vars(args).items()},
        **speeds,
        "conversation_seconds": conversation_seconds,
        **figures,
    }


def passes(on: str, off: str, args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved throughput passes through each gateway: the best of each, and each capturing
    pass over the plain one just before it."""
    if args.passes == 0:
        return {}
    throughput(off, args)  # warm-up
    plain, captured = [], []
    for _ in range(args.passes):
        plain.append(throughput(off, args))
        captured.append(throughput(on, args))
    ratios = sorted(c / p for c, p in zip(captured, plain, strict=True))
    return {
        "plain_tokens_per_s": max(plain),
        "captured_tokens_per_s": max(captured),
        "captured_over_plain": max(captured) / max(plain),
        "paired_ratios": ratios,
        "median_paired_ratio": ratios[len(ratios) // 2],
    }


def feedback_to_serving(model: Path, scratch: Path) -> dict[str, Any]:
    """Seconds from the last feedback of a task's episodes to the alias answering with the
    version trained on them, through `flywheel serve --source captured`."""
    scratch.mkdir(parents=True)
    settings = server_settings(model, scratch / "vllm.log", weights="lora")
    db = f"sqlite:///{scratch / 'loop.db'}"
    config = scratch / "open-gate.toml"
    config.write_text("[gate]\nmin_gain = -1.0\n")
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    command = [
        *FLYWHEEL, "serve", "--server-url", settings.url,
        "--model", str(model), "--db", db, "--workdir", str(scratch), "--config", str(config),
        "--source", "captured", "--train-every", "2", "--min-groups", "1",
        "--eval-tasks", "16", "--prefect-port", str(free_port()), "--gateway-port", str(port),
    ]  # fmt: skip
    environment = {**os.environ, "FLYWHEEL_ADMIN_KEYS": "admin", "FLYWHEEL_API_KEYS": "user"}
    environment = {k: v for k, v in environment.items() if k != "PREFECT_API_URL"}
    auth = {"Authorization": "Bearer user"}
    log = (scratch / "serve.log").open("w")
    with VllmServer(settings):
        served = subprocess.Popen(
            command,
            env=checkout_env(environment),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            engine = store.open_store(db)
            _wait(lambda: _baseline(engine, model.name), served, 900)  # before any traffic
            client = OpenAI(base_url=f"{gateway}/v1", api_key="user")
            for number, score in ((1, 1.0), (2, 0.0)):
                name = f"loop-{number}"
                headers = {"X-Flywheel-Session": name, "X-Flywheel-Task": "sum-2-3"}
                solve(client, "What is 2 + 3?", headers, turns=2)
                body = {"session": name, "score": score}
                httpx.post(f"{gateway}/v1/feedback", json=body, headers=auth).raise_for_status()
            fed = time.monotonic()
            _wait(lambda: _answered_by_new(client, model.name), served, 900)
            seconds = time.monotonic() - fed
        finally:
            stop_serve(served, scratch)
    with store.transaction(engine) as session:
        (record,) = store.training_rounds(session)[-1:]
    print(f"feedback to serving: {seconds:.1f} s", file=sys.stderr)
    return {"seconds": seconds, "round": record.round_index, "version": record.policy_out,
            "train_tokens": record.metrics.train_tokens}  # fmt: skip


def _wait(check: Any, process: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"flywheel serve stopped or took too long (exit {process.poll()})")
        time.sleep(0.25)


def _baseline(engine: Any, base: str) -> bool:
    with store.transaction(engine) as session:
        versions = {v.name: v for v in store.policy_versions(session)}
    return base in versions and versions[base].eval_pass_at_1 is not None


def _answered_by_new(client: OpenAI, base: str) -> bool:
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    return reply.model not in ("policy", base)


def throughput(url: str, args: argparse.Namespace) -> float:
    def one(client: httpx.Client) -> int:
        body = {"model": "policy", "messages": PROMPT, "max_tokens": args.max_tokens}
        response = client.post("/v1/chat/completions", json=body | {"ignore_eos": True})
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    with httpx.Client(base_url=url, timeout=600) as client:
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(pool.map(lambda _: one(client), range(args.requests)))
    return tokens / (time.monotonic() - started)


def conversations(url: str, sessions: int, tool_choice: str) -> dict[str, list[str]]:
    """Plain two-turn chats and tool-using agent runs, each its own session; their ids."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none")

    def chat(index: int) -> str:
        session = f"chat-{uuid.uuid4().hex[:8]}"
        first, second = CHATS[index % len(CHATS)]
        messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
        for follow_up in (None, second):
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
            reply = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=32,  # type: ignore[arg-type]
                extra_headers={"X-Flywheel-Session": session},
            ).choices[0].message  # fmt: skip
            messages.append({"role": "assistant", "content": reply.content or ""})
        return session

    def agent(index: int) -> str:
        session = f"agent-{uuid.uuid4().hex[:8]}"
        question = f"What is {index % 9 + 1} + {index % 7 + 2}?"
        solve(client, question, {"X-Flywheel-Session": session}, first=tool_choice)
        return session

    with ThreadPoolExecutor(8) as pool:
        chats = list(pool.map(chat, range(sessions)))
        agents = list(pool.map(agent, range(sessions)))
    return {"chat": chats, "agent": agents}


def stitching(engine: Any, server: str, model: str, kinds: dict[str, list[str]]) -> dict[str, Any]:
    """Per kind: sessions with more than one turn, the share stitched, and the share of those
    whose ids equal the server's rendering of the whole transcript."""
    with store.transaction(engine) as session:
        stitched = episodes(session)
        turns = session_turns(session)
    figures: dict[str, Any] = {}
    for kind, ids in kinds.items():
        multi = [s for s in ids if len(turns.get(s, [])) > 1]
        joined = {s: a for s in multi if isinstance(a := stitched[s], Attempt)}
        exact = [s for s, attempt in joined.items() if _rendered_alike(server, model, attempt)]
        reasons = sorted({str(stitched[s]) for s in multi if s not in joined})
        figures[kind] = {
            "sessions": len(ids),
            "multi_turn": len(multi),
            "stitched": len(joined),
            "stitched_share": len(joined) / len(multi) if multi else None,
            "equal_to_rendering": len(exact),
            "exact_share": len(exact) / len(joined) if joined else None,
            "turns": sum(len(turns.get(s, [])) for s in ids),
            "not_stitched_reasons": reasons,
        }
    return figures


def _rendered_alike(server: str, model: str, episode: Attempt) -> bool:
    """The stitched ids are a prefix of the server's rendering of the transcript (the rendering
    closes the last turn with the template's newline after it)."""
    sample = episode.sample
    assert sample is not None
    body: dict[str, Any] = {"model": model, "messages": episode.messages}
    body["add_generation_prompt"] = False
    if any(m.get("tool_calls") or m.get("role") == "tool" for m in episode.messages):
        body["tools"] = [ADD]
    rendered = httpx.post(f"{server}/tokenize", json=body, timeout=60).json()["tokens"]
    ids = sample.prompt_token_ids + sample.completion_token_ids
    return bool(rendered[: len(ids)] == ids)


def print_table(results: dict[str, Any]) -> None:
    if "paired_ratios" in results:
        print(
            f"gateway tokens/s: capture off {results['plain_tokens_per_s']:.1f}, capture on "
            f"{results['captured_tokens_per_s']:.1f}: {results['captured_over_plain']:.3f} "
            f"(goal >= 0.95); paired passes, median {results['median_paired_ratio']:.3f} of "
            + ", ".join(f"{r:.3f}" for r in results["paired_ratios"])
        )
    header = ["sessions", "n", "multi-turn", "stitched", "equal to rendering", "turns"]
    rows = []
    for kind in ("chat", "agent"):
        f = results[kind]
        share = "-" if f["stitched_share"] is None else f"{f['stitched_share']:.2f}"
        exact = "-" if f["exact_share"] is None else f"{f['exact_share']:.2f}"
        rows.append(
            [kind, str(f["sessions"]), str(f["multi_turn"]), f"{f['stitched']} ({share})",
             f"{f['equal_to_rendering']} ({exact})", str(f["turns"])]
        )  # fmt: skip
    print(text_table(header, rows))
    for kind in ("chat", "agent"):
        for reason in results[kind]["not_stitched_reasons"]:
            print(f"{kind}: not stitched: {reason}")
    if "loop" in results:
        loop = results["loop"]
        print(
            f"last feedback to the alias answering with {loop['version']}: "
            f"{loop['seconds']:.1f} s (round {loop['round']}, {loop['train_tokens']} tokens)"
        )


if __name__ == "__main__":
    main()
