"""The page's speed on a large store: every view, the last page of sessions included.

Seeds a SQLite store (and PostgreSQL with `--pg-url` or FLYWHEEL_TEST_PG_URL) with `--rounds`
training rounds whose train groups hold `--attempts` attempts in all (bare ones and reviewer's
revisions), a version per round with its held-out evaluation, and `--sessions` captured sessions
of two turns each; then requests each view `--requests` times through the app in process
(queries and rendering, no network) and reports the median and 95th percentile latency. The goal:
every view under 200 ms.

    .venv/bin/python -m bench.ui [--attempts 100000] [--sessions 10000] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Figure, provenance, write_results
from bench.store import scratch_database
from memory import store
from memory.records import (
    UNRATED,
    Attempt,
    Group,
    GroupPlan,
    PolicyVersion,
    Sample,
    SamplingSettings,
    TrainingRound,
)
from reports.table import text_table

ADMIN = "bench-admin"
VIEWS = (
    "/ui",
    "/ui/rounds",
    "/ui/exploration",
    "/ui/sessions",
    "/ui/sessions?offset={last}",
    "/ui/session?name={name}",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempts", type=int, default=100_000, help="train attempts in all")
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--requests", type=int, default=20, help="of each view")
    parser.add_argument("--pg-url", default=os.environ.get("FLYWHEEL_TEST_PG_URL"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        results["sqlite"] = measure(f"sqlite:///{folder}/ui.db", args)
    if args.pg_url:
        with scratch_database(args.pg_url) as url:
            results["postgresql"] = measure(url, args)
    print_table(results)
    if args.json:
        payload = {
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "pg_url")},
            "databases": results,
        }
        write_results(args.json, payload, made, figures(results))


def figures(results: dict[str, dict[str, list[float]]]) -> list[Figure]:
    """Each view's median latency per database, with its order-statistic interval."""
    return [
        Figure.median(f"{db}: {view}", ms, "ms")
        for db, views in results.items()
        for view, ms in views.items()
    ]


def measure(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serving import promotion
    from serving.ui import PAGE, Page, add_ui

    engine = store.open_store(url)
    started = time.monotonic()
    seed(engine, args)
    print(f"{url.split(':')[0]}: seeded in {time.monotonic() - started:.0f} s", file=sys.stderr)
    app = FastAPI()
    add_ui(app, Page(engine, frozenset({ADMIN}), promotion.Gate()))
    client = TestClient(app, headers={"Authorization": f"Bearer {ADMIN}"})
    last = (args.sessions - 1) // PAGE * PAGE
    timings: dict[str, list[float]] = {}
    for view in VIEWS:
        path = view.format(last=last, name="k:session-0")
        assert client.get(path).status_code == 200, path  # warm: the first request compiles
        timings[view] = []
        for _ in range(args.requests):
            began = time.perf_counter()
            response = client.get(path)
            timings[view].append((time.perf_counter() - began) * 1000)
            assert response.status_code == 200
    engine.dispose()
    return timings


def seed(engine: Any, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    per_round = args.attempts // args.rounds // 4
    with store.transaction(engine) as session:
        store.save_policy_version(session, PolicyVersion(name="base", base_model="base"))
        store.set_promoted(session, "base", True)
    for r in range(1, args.rounds + 1):
        name, parent = f"policy-r{r}", f"policy-r{r - 1}" if r > 1 else "base"
        groups = [_group(r, f"t{r}-{g}", parent, rng) for g in range(per_round)]
        groups += [_group(r, f"held-{t}", name, rng, purpose="eval", size=1) for t in range(64)]
        with store.transaction(engine) as session:
            store.save_groups(session, groups)
            store.save_policy_version(
                session, PolicyVersion(name=name, base_model="base", round_index=r)
            )
            store.record_evaluation(session, name, rng.random())
            store.save_training_round(
                session,
                TrainingRound(
                    round_index=r,
                    method="filtered",
                    policy_in=parent,
                    policy_out=name,
                    status="done",
                    metrics={
                        "contexts": {"bare": 120, "distill:demo": 30},
                        "kl_last": 0.1,
                        "seconds": 60.0,
                    },
                ),
            )
    for start in range(0, args.sessions, 500):
        turns = [
            _turn(f"k:session-{s}", turn, rng)
            for s in range(start, min(args.sessions, start + 500))
            for turn in range(2)
        ]
        with store.transaction(engine) as session:
            store.save_groups(session, turns)


def _attempt(index: int, version: str, reward: float, kind: Any = "base") -> Attempt:
    return Attempt(
        sample_index=index,
        kind=kind,
        policy_version=version,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        sampling=SamplingSettings(temperature=1.0, max_tokens=64),
        sample=Sample(
            text="2 + 3 = 5. <answer>5</answer>",
            prompt_token_ids=list(range(24)),
            completion_token_ids=list(range(100, 124)),
            logprobs=[-1.0] * 24,
            finish_reason="stop",
        ),
        reward=reward,
        correct=reward > 0,
        format_ok=True,
        answer="5",
        reason="bench",
        generated_tokens=24,
    )


def _group(
    r: int, task: str, version: str, rng: random.Random, purpose: Any = "train", size: int = 4
) -> Group:
    attempts = [_attempt(i, version, float(rng.random() < 0.3)) for i in range(size)]
    if purpose == "train" and not any(a.correct for a in attempts) and rng.random() < 0.5:
        attempts[-1] = _attempt(size - 1, "reviewer", 1.0, kind="revision")
    return Group(
        round_index=r,
        purpose=purpose,
        task_id=task,
        taskset="arithmetic",
        question="What is 2 + 3?",
        policy_version=version,
        size=size,
        attempts=attempts,
    )


def _turn(name: str, turn: int, rng: random.Random) -> Group:
    attempt = _attempt(0, "policy-r1", 0.0).model_copy(
        update={
            "reason": UNRATED,
            "messages": [{"role": "user", "content": f"turn {i}"} for i in range(turn + 1)],
        }
    )
    return Group(
        round_index=0,
        purpose="capture",
        task_id=f"capture:{name}:{turn}",
        taskset="gateway",
        question="q",
        policy_version="policy-r1",
        size=1,
        attempts=[attempt],
        plan=GroupPlan(session=name, task=f"k:task-{rng.randrange(1000)}"),
    )


def print_table(results: dict[str, dict[str, list[float]]]) -> None:
    rows = []
    for db, views in results.items():
        for view, ms in views.items():
            ordered = sorted(ms)
            p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
            rows.append(
                [
                    db,
                    view,
                    f"{statistics.median(ms):.1f}",
                    f"{p95:.1f}",
                    "yes" if p95 < 200 else "NO",
                ]
            )
    print(text_table(["database", "view", "p50 ms", "p95 ms", "under 200 ms"], rows))


if __name__ == "__main__":
    main()
