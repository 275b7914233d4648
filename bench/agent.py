"""Your agent, measured end to end: `examples/agent.py` (streaming, the `add` tool, several turns)
through the gateway of `flywheel serve --source captured`, on a policy with LoRA (SmolLM2, or
Qwen2.5-Coder-0.5B), for a few minutes of its own traffic.

    .venv/bin/python -m bench.agent [--minutes 20] [--route evaluation|sessions]
        [--held-out 32] [--concurrency 4] [--min-groups 16] [--tool-choice required|auto]
        [--policy smollm2|qwen2.5-coder-0.5b] [--reviewer qwen2.5-coder-0.5b] [--train-batch 4]
        [--base-only] [--json PATH]

With `--reviewer`, a reviewer served beside the policy (each on cores of its own) answers the
sessions none of whose answers was right, and rounds learn from its verified answers (HeRL on
captured sessions, `flows.siblings`).

`--base-only` measures step 1 alone, a screen of policies on the agent's held-out sums, and
whether the policy's own answers could teach it: `--samples` answers per sum drawn at
temperature 1.0 right after the tool's result, and how many sums have a right one among them
(a group with no success has nothing to learn from).

1. Before: the agent on `--held-out` held-out sums (`examples.agent.held_out`, past the 16 its
   own evaluation gates on), pointed at the base model by name: its success and tool calls
   per conversation.
2. Traffic for `--minutes`: fresh train sums through the gateway, one session each (each task
   met once, so every group comes from siblings of a session's last turn), the expected answer
   sent as feedback for the gateway's verifier. Rounds train on it as they are ready; each is
   gated by `--route`: `evaluation` (the agent's own `evaluate` on its held-out sums) or
   `sessions` (held-out sessions, judged blind by the serving version).
3. After: the same held-out sums against the version the alias serves. The figures: success
   before and after, paired over the same tasks with a 95% interval; tool calls per
   conversation; the rounds with their scorecards; the learning signal of the captured traffic
   (groups, the share with a reward spread, the mean absolute advantage); wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
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
from examples.agent import ADD, SYSTEM, converse, correct, gather, held_out, run_tool, tasks
from memory import store
from reports.intervals import paired_difference, wilson
from reports.table import text_table
from serving.model import REVIEWERS, prepare_named
from serving.server import ServerSettings, VllmServer, side_by_side

SERVER_KEY, USER_KEY = "bench-server-key", "bench-user-key"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="of agent traffic")
    parser.add_argument("--route", choices=("evaluation", "sessions"), default="evaluation")
    parser.add_argument("--held-out", type=int, default=32, help="held-out sums, before and after")
    parser.add_argument("--concurrency", type=int, default=4, help="agent conversations at once")
    parser.add_argument(
        "--min-groups", type=int, default=16, help="groups a round waits for (flywheel serve's)"
    )
    parser.add_argument(
        "--policy", choices=("smollm2", *REVIEWERS), default="smollm2", help="the agent's model"
    )
    parser.add_argument(
        "--reviewer", choices=tuple(REVIEWERS), default=None,
        help="a reviewer served beside the policy: its verified answers where the policy has none",
    )  # fmt: skip
    parser.add_argument(
        "--train-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
        help="the trainer's dtype (bfloat16 halves its memory beside two model servers)",
    )  # fmt: skip
    parser.add_argument(
        "--train-batch", type=int, default=4,
        help="rows per training step (8, the default of flywheel's, ran out of memory beside "
        "two model servers on episodes of ~400 tokens)",
    )  # fmt: skip
    parser.add_argument(
        "--base-only", action="store_true", help="the base model on the held-out sums alone: "
        "a screen of policies (no traffic, no rounds)",
    )  # fmt: skip
    parser.add_argument(
        "--samples", type=int, default=4,
        help="with --base-only: answers sampled after the tool's result, per sum",
    )  # fmt: skip
    parser.add_argument(
        "--tool-choice", choices=("required", "auto"), default="required",
        help="the first request's tool_choice, as the agent's author sets it",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as scratch:
        results = run(args, Path(scratch))
    print_table(results)
    if args.json:
        payload = {"settings": vars(args) | {"json": str(args.json)}, **results}
        write_results(args.json, payload, made, figures(results))


def figures(results: dict[str, Any]) -> list[Figure]:
    """The agent's held-out success and tool-call rate before and after (Wilson), the paired
    gain, the traffic's learning signal and the wall time (one run); before alone for a
    screen."""
    before, n = results["before"], results["before"]["n"]
    screened = [
        Figure.share(f"held-out success, base {results['policy']}", round(before["success"] * n),
                     n, "policy"),
        Figure.share(f"held-out conversations that called the tool, base {results['policy']}",
                     round(before["called_share"] * n), n, "policy"),
    ]  # fmt: skip
    if "after" not in results:
        right, k = results["after_the_tool"], results["samples"]
        return [
            *screened,
            Figure.share(f"answers right after the tool's result, at temperature 1.0 ({k} a sum)",
                         sum(right), k * len(right), "policy"),
            Figure.share("sums with a right answer among them (a group with a success)",
                         sum(r > 0 for r in right), len(right), "policy"),
            Figure.single("wall time", results["wall_seconds"], "s"),
        ]  # fmt: skip
    after, diff, signal = results["after"], results["after_minus_before"], results["signal"]
    return [
        *screened,
        Figure.share(f"held-out success after ({after['version']})",
                     round(after["success"] * n), n, "policy"),
        Figure("after - before, paired on the same tasks", diff["value"], diff["n"],
               diff["low"], diff["high"], "", "policy"),
        Figure.share("held-out conversations that called the tool, after",
                     round(after["called_share"] * n), n, "policy"),
        Figure.single("captured sessions", results["traffic"]["sessions"]),
        Figure.single("groups with a reward spread (trainable share)", signal["trainable_share"]),
        Figure.single("the reviewer's verified answers in them", signal.get("reviewer_answers", 0),
                      counts="reviewer"),
        Figure.single("wall time", results["wall_seconds"], "s"),
    ]  # fmt: skip


def _model(name: str) -> Path:
    folder = prepare_named(name, ROOT / ".flywheel" / "models")
    assert folder is not None, name  # the choices are named models
    return folder


def _servers(args: argparse.Namespace, scratch: Path) -> list[ServerSettings]:
    """The policy's server (LoRA), and the reviewer's beside it, each on cores of its own."""
    policy = server_settings(_model(args.policy), scratch / "vllm.log", weights="lora",
                             api_key=SERVER_KEY)  # fmt: skip
    if args.reviewer is None:
        return [policy]
    reviewer = server_settings(_model(args.reviewer), scratch / "reviewer.log", api_key=SERVER_KEY)
    return list(side_by_side(policy, reviewer))


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    settings, *beside = _servers(args, scratch)
    model = settings.model_path
    started = time.monotonic()
    with VllmServer(settings) as server, contextlib.ExitStack() as stack:
        reviewer = [stack.enter_context(VllmServer(s)) for s in beside]
        direct = OpenAI(base_url=f"{server.url}/v1", api_key=SERVER_KEY)
        before = _held_out(direct, model.name, args)
        if args.base_only:
            right = _after_the_tool(direct, model.name, args)
            seconds = time.monotonic() - started
            return {"policy": args.policy, "before": _summary(before), "samples": args.samples,
                    "after_the_tool": right, "wall_seconds": seconds}  # fmt: skip
        judge = [(r.url, r.settings.served_name) for r in reviewer]
        served, gateway, db = _serve(args, (server.url, *judge), model, scratch)
        try:
            client = OpenAI(base_url=f"{gateway}/v1", api_key=USER_KEY)
            traffic = _traffic(client, gateway, args, served)
            serving = _settled(db, served, scratch)
            after = _held_out(direct, serving, args)
        finally:
            stop_serve(served, scratch)
    difference = paired_difference(after["solved"], before["solved"])
    return {
        "policy": args.policy,
        "reviewer": args.reviewer,
        "route": args.route,
        "wall_seconds": time.monotonic() - started,
        "before": _summary(before),
        "after": _summary(after) | {"version": serving},
        "after_minus_before": {
            "value": difference[0],
            "low": difference[1],
            "high": difference[2],
            "n": len(before["solved"]),
        },  # fmt: skip
        "traffic": traffic,
        "rounds": _rounds(db),
        "signal": _signal(db),
    }


def _serve(
    args: argparse.Namespace, servers: tuple[Any, ...], model: Path, scratch: Path
) -> tuple[subprocess.Popen[bytes], str, str]:
    """`flywheel serve` on the policy's server (`servers[0]`), with the reviewer's answers
    where a reviewer (`servers[1]`: its URL and model name) is given."""
    port, db = free_port(), f"sqlite:///{scratch / 'agent.db'}"
    server_url, *reviewer = servers
    route = ["--evaluation", "examples.agent:evaluate"] if args.route == "evaluation" else []
    route += ["--taskset", "examples.agent:Sums"]  # feedback verified by the agent's own rule
    config = scratch / "bench.toml"
    config.write_text(f'[train]\ndtype = "{args.train_dtype}"\nbatch_size = {args.train_batch}\n')
    route += ["--config", str(config)]
    if reviewer:
        url, name = reviewer[0]
        route += ["--revise", "1", "--revisions", "2", "--reviewer-url", url,
                  "--reviewer-model", name]  # fmt: skip
    command = [
        *FLYWHEEL, "serve", "--server-url", server_url,
        "--model", str(model), "--db", db, "--workdir", str(scratch), "--source", "captured",
        "--gateway-port", str(port), "--train-every", "20", "--min-groups", str(args.min_groups),
        "--prefect-port", str(free_port()), *route,
    ]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    environment |= {"PREFECT_HOME": str(scratch / "client"), "FLYWHEEL_ADMIN_KEYS": "admin",
                    "FLYWHEEL_API_KEYS": USER_KEY, "FLYWHEEL_SERVER_KEY": SERVER_KEY}  # fmt: skip
    log = (scratch / "serve.log").open("w")
    served = subprocess.Popen(command, cwd=ROOT, env=checkout_env(environment), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    gateway = f"http://127.0.0.1:{port}"
    _wait(lambda: _answers(f"{gateway}/health"), served, 300, scratch)
    return served, gateway, db


def _held_out(client: OpenAI, model: str, args: argparse.Namespace) -> dict[str, list[Any]]:
    def one(task: tuple[str, str, int]) -> tuple[bool, int]:
        answer, calls = converse(client, task[1], {}, first=args.tool_choice, model=model)
        return correct(answer, task[2]), calls

    with ThreadPoolExecutor(args.concurrency) as pool:
        found = list(pool.map(one, _measured(args)))
    return {"solved": [s for s, _ in found], "calls": [c for _, c in found]}


def _measured(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    gated = 16  # the first held-out sums are the agent's own evaluation's: measure past them
    return held_out(gated + args.held_out)[gated:]


def _after_the_tool(client: OpenAI, model: str, args: argparse.Namespace) -> list[int]:
    """Per held-out sum, how many of `args.samples` answers sampled at temperature 1.0 right
    after the tool's result are correct: whether a group of the policy's own answers there
    could hold a success to learn from."""

    def one(task: tuple[str, str, int]) -> int:
        messages: Any = [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": task[1]},
        ]  # fmt: skip
        tools: Any = [ADD]  # the agent's own tool, as plain JSON
        reply = gather(client.chat.completions.create(
            model=model, messages=messages, tools=tools, max_tokens=48,
            tool_choice="required", stream=True,
        ))  # fmt: skip
        messages.append(reply)
        for call in reply.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool(call)})
        drawn = client.chat.completions.create(
            model=model, messages=messages, tools=tools, max_tokens=48,
            temperature=1.0, n=args.samples,
        )  # fmt: skip
        return sum(correct(c.message.content or "", task[2]) for c in drawn.choices)

    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(one, _measured(args)))


def _traffic(
    client: OpenAI, gateway: str, args: argparse.Namespace, served: subprocess.Popen[bytes]
) -> dict[str, Any]:
    """Fresh sums through the gateway for `args.minutes`, each its own session, with the
    expected answer as feedback; the verifier's scores."""
    deadline = time.monotonic() + args.minutes * 60
    auth = {"Authorization": f"Bearer {USER_KEY}"}
    scores: list[float] = []
    calls: list[int] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        for task, question, expected in tasks(10_000, seed=seed):
            if time.monotonic() > deadline or served.poll() is not None:
                return
            session = uuid.uuid4().hex
            headers = {"X-Flywheel-Session": session, "X-Flywheel-Task": task}
            _, made = converse(client, question, headers, first=args.tool_choice)
            body = {"session": session, "reference": str(expected)}
            reply = httpx.post(f"{gateway}/v1/feedback", json=body, headers=auth, timeout=60)
            with lock:
                scores.append(float(reply.raise_for_status().json()["score"]))
                calls.append(made)

    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(worker, range(args.concurrency)))
    return {"sessions": len(scores), "mean_score": statistics.fmean(scores) if scores else None,
            "calls_per_conversation": statistics.fmean(calls) if calls else None}  # fmt: skip


def _settled(db: str, served: subprocess.Popen[bytes], scratch: Path) -> str:
    """The serving version once no round is training (a round in flight is waited for)."""
    engine = store.open_store(db)

    def idle() -> bool:
        with store.transaction(engine) as session:
            return all(r.status != "running" for r in store.training_rounds(session))

    _wait(idle, served, 1200, scratch)
    with store.transaction(engine) as session:
        serving = store.promoted_policy(session)
    assert serving is not None
    return serving.name


def _rounds(db: str) -> list[dict[str, Any]]:
    with store.transaction(store.open_store(db)) as session:
        versions = {v.name: v for v in store.policy_versions(session)}
        rounds = store.training_rounds(session)
    found = []
    for r in rounds:
        version = versions.get(r.policy_out or "")
        found.append({
            "round": r.round_index, "status": r.status, "groups": len(r.group_ids),
            "version": r.policy_out, "promoted": bool(version and version.promoted),
            "scorecards": [c.line() for c in version.scorecards] if version else [],
        })  # fmt: skip
    return found


def _signal(db: str) -> dict[str, Any]:
    """What the captured traffic gave to learn from: the train groups rounds adopted (every one
    from siblings, each task being met once), the share with a reward spread (trainable), and
    the mean absolute advantage (reward minus the group's mean) over their episodes."""
    with store.transaction(store.open_store(db)) as session:
        groups = store.load_groups(session, "train")
    rewards = [[a.reward for a in g.attempts] for g in groups]
    spread = [r for r in rewards if max(r) > min(r)]
    mass = [abs(x - statistics.fmean(r)) for r in rewards for x in r]
    return {
        "groups": len(groups),
        "trainable_share": len(spread) / len(groups) if groups else None,
        "mean_abs_advantage": statistics.fmean(mass) if mass else None,
        "groups_without_siblings": 0,  # each task was met once: no group forms without them
        "reviewer_answers": sum(a.kind == "revision" for g in groups for a in g.attempts),
    }


def _summary(found: dict[str, list[Any]]) -> dict[str, Any]:
    solved, n = sum(found["solved"]), len(found["solved"])
    low, high = wilson(solved, n)
    return {"success": solved / n, "low": low, "high": high, "n": n,
            "calls_per_conversation": statistics.fmean(found["calls"]),
            "called_share": sum(c > 0 for c in found["calls"]) / n}  # fmt: skip


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(check: Any, process: subprocess.Popen[bytes], seconds: float, scratch: Path) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = (scratch / "serve.log").read_text()[-3000:]
            sys.exit(f"flywheel serve stopped or took too long (exit {process.poll()}):\n{tail}")
        time.sleep(2)


def print_table(results: dict[str, Any]) -> None:
    before = results["before"]
    rows = [
        [f"before ({results.get('policy', 'smollm2')} base)", f"{before['success']:.3f}",
         f"{before['low']:.3f}-{before['high']:.3f}", str(before["n"]),
         f"{before['calls_per_conversation']:.2f}"],
    ]  # fmt: skip
    if "after" not in results:
        print(text_table(["held-out", "success", "95%", "n", "tool calls/conv"], rows))
        right = results["after_the_tool"]
        print(
            f"after the tool's result, {results['samples']} answers a sum at 1.0: "
            f"{sum(right)} right; sums with one right: {sum(r > 0 for r in right)}/{len(right)}"
        )
        print(f"wall: {results['wall_seconds']:.0f} s")
        return
    after, diff = results["after"], results["after_minus_before"]
    rows += [
        [f"after ({after['version']})", f"{after['success']:.3f}",
         f"{after['low']:.3f}-{after['high']:.3f}", str(after["n"]),
         f"{after['calls_per_conversation']:.2f}"],
        ["after - before", f"{diff['value']:+.3f}", f"{diff['low']:+.3f}-{diff['high']:+.3f}",
         str(diff["n"]), "-"],
    ]  # fmt: skip
    print(text_table(["held-out", "success", "95%", "n", "tool calls/conv"], rows))
    traffic, found = results["traffic"], results["signal"]
    print(
        f"traffic: {traffic['sessions']} sessions, mean verified score "
        f"{traffic['mean_score']}, {traffic['calls_per_conversation']} tool calls each"
    )
    print(
        f"learning signal: {found['groups']} groups (0 without siblings), trainable share "
        f"{found['trainable_share']}, mean |advantage| {found['mean_abs_advantage']}, "
        f"{found.get('reviewer_answers', 0)} of the reviewer's answers"
    )
    for r in results["rounds"]:
        decision = "promoted" if r["promoted"] else "not promoted"
        print(
            f"round {r['round']} {r['status']} on {r['groups']} groups -> {r['version']} "
            f"{decision}; {'; '.join(r['scorecards'])}"
        )
    print(f"wall: {results['wall_seconds']:.0f} s ({results['route']} route)")


if __name__ == "__main__":
    main()
