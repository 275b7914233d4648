"""Store benchmark: attempt ingest and concurrent work claims, on SQLite and PostgreSQL.

1. Ingest: `--groups` groups of `--group-size` attempts, each an episode of `--steps` turns of
   `--tokens` sampled tokens and an 8-token forced reply (so `--steps` step rows, about twice as
   many token segments and a verdict per attempt), saved `--per-tx` groups per transaction
   through the store's own idempotent upserts. Reports trajectories (attempts) per second, and
   the rate at which they are read back as records.
2. Claims: `--items` work items claimed and completed by `--workers` processes at once, `--lot`
   at a time. Reports items per second and how many were claimed twice (must be 0).
3. Retrieval: a library of `--entries` entries admitted through the library's own rules (with
   their sentence embeddings), then `--queries` searches for a task's prompt, top 6 within 800
   characters: p50 and p99 latency with embeddings and with BM25.

    .venv/bin/python -m bench.store [--pg-url postgresql+psycopg://...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
import uuid
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.common import Figure, provenance, write_results
from memory import library, store, workqueue
from memory.embedding import Embedder
from memory.library import LibrarySettings
from memory.records import (
    Attempt,
    Group,
    LessonDraft,
    Sample,
    SamplingSettings,
    WorkItem,
)
from memory.retrieval import Index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default=os.environ.get("FLYWHEEL_TEST_PG_URL"))
    parser.add_argument("--groups", type=int, default=500)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=24, help="sampled tokens per step")
    parser.add_argument("--per-tx", type=int, default=16)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--lot", type=int, default=8)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        rows.append(measure("sqlite", f"sqlite:///{folder}/bench.db", args))
    if args.pg_url:
        with scratch_database(args.pg_url) as url:
            rows.append(measure("postgresql", url, args))
    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "pg_url")}
    }
    result["databases"] = rows
    print_table(result)
    if args.json:
        write_results(args.json, result, made, figures(result))


def figures(result: dict[str, Any]) -> list[Figure]:
    """Per database (one pass each): ingest, read and claim rates; items claimed twice or lost
    as shares of those claimed; retrieval's p99."""
    items = result["settings"]["items"]
    found = []
    for db in result["databases"]:
        name = db["database"]
        found += [
            Figure.single(f"{name}: trajectories stored", db["trajectories_per_s"], "/s"),
            Figure.single(f"{name}: trajectories read back", db["loaded_per_s"], "/s"),
            Figure.single(f"{name}: work items claimed", db["claims_per_s"], "/s"),
            Figure.share(f"{name}: items claimed twice", db["duplicates"], items, "system"),
            Figure.share(f"{name}: items lost", db["lost"], items, "system"),
        ]
        found += [Figure.single(f"{name}: {key.replace('_', ' ')}", db[key], "ms")
                  for key in db if key.endswith("p99_ms")]  # fmt: skip
    return found


def measure(name: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = store.open_store(url)
    groups = [make_group(i, args) for i in range(args.groups)]
    started = time.perf_counter()
    for start in range(0, len(groups), args.per_tx):
        with store.transaction(engine) as session:
            store.save_groups(session, groups[start : start + args.per_tx])
    ingest_s = time.perf_counter() - started
    started = time.perf_counter()
    with store.transaction(engine) as session:
        loaded = store.load_groups(session, "train")
    load_s = time.perf_counter() - started
    assert [g.attempts for g in loaded] == [g.attempts for g in groups], "round trip differs"
    claims_per_s, duplicates, lost = claim_race(url, engine, args)
    retrieval = retrieval_latency(engine, args)
    engine.dispose()
    return {
        "database": name,
        "trajectories_per_s": args.groups * args.group_size / ingest_s,
        "loaded_per_s": args.groups * args.group_size / load_s,
        "claims_per_s": claims_per_s,
        "duplicates": duplicates,
        "lost": lost,
        **retrieval,
    }


WORDS = [
    "sign", "carry", "digit", "sum", "product", "negative", "minus", "divide", "remainder",
    "order", "bracket", "tag", "answer", "check", "reread", "estimate", "round", "unit",
    "zero", "one", "borrow", "multiply", "subtract", "add", "parity", "step", "result",
]  # fmt: skip


def retrieval_latency(engine: Any, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(0)
    per_task = 10
    candidates = [
        LessonDraft(
            kind="insight", scope="task", scope_key=f"task:{i // per_task}", zone="do",
            text=" ".join(rng.choices(WORDS, k=rng.randint(6, 14))) + f" ({i})",
        )
        for i in range(args.entries)
    ]  # fmt: skip
    settings = LibrarySettings(rate_limit={"do": args.entries, "avoid": 0})
    embedder = embedder_once()
    started = time.perf_counter()
    vectors = embedder.embed_bytes([c.text for c in candidates])
    by_text = dict(zip([c.text for c in candidates], vectors, strict=True))
    with store.transaction(engine) as session:
        library.admit(
            session, candidates, settings, embed=lambda texts: [by_text[t] for t in texts]
        )
    admit_s = time.perf_counter() - started
    with store.transaction(engine) as session:
        entries = library.lessons(session)
        stored = library.embeddings(session, [e.id for e in entries])
    figures = {"library_entries": len(entries), "library_admit_s": admit_s}
    for name, index in (("embedding", Index(entries, stored, embedder)), ("bm25", Index(entries))):
        timings = []
        for _q in range(args.queries):
            query = " ".join(rng.choices(WORDS, k=12))
            task = f"task:{rng.randrange(args.entries // per_task)}"
            started = time.perf_counter()
            hits = index.search(query, task, "arithmetic", k=6, char_budget=800)
            timings.append((time.perf_counter() - started) * 1000)
            assert hits and all(h.lesson.scope_key == task for h in hits)
        timings.sort()
        figures[f"{name}_p50_ms"] = statistics.median(timings)
        figures[f"{name}_p99_ms"] = timings[int(0.99 * (len(timings) - 1))]
    return figures


@cache
def embedder_once() -> Embedder:
    return Embedder()


def make_group(index: int, args: argparse.Namespace) -> Group:
    return Group(
        round_index=1,
        purpose="train",
        task_id=f"bench:{index}",
        taskset="bench",
        size=args.group_size,
        question=f"task {index}",
        policy_version="bench",
        attempts=[make_episode(index, k, args) for k in range(args.group_size)],
    )


def make_episode(index: int, slot: int, args: argparse.Namespace) -> Attempt:
    """`--steps` turns: sampled tokens, then an 8-token forced reply after each but the last."""
    ids: list[int] = []
    logprobs: list[float] = []
    spans: list[tuple[int, int]] = []
    messages = [{"role": "user", "content": f"task {index}"}]
    for step in range(args.steps):
        ids += [(index + slot + step + t) % 49_152 for t in range(args.tokens)]
        logprobs += [-0.5 - t / args.tokens for t in range(args.tokens)]
        messages.append({"role": "assistant", "content": f"move {step}"})
        if step < args.steps - 1:
            spans.append((len(ids), len(ids) + 8))
            ids += [7] * 8
            logprobs += [0.0] * 8
            messages.append({"role": "user", "content": f"reply {step}"})
    return Attempt(
        sample_index=slot,
        policy_version="bench",
        messages=messages,
        sampling=SamplingSettings(temperature=1.0, max_tokens=args.tokens),
        sample=Sample(
            text=" ".join(m["content"] for m in messages),
            prompt_token_ids=list(range(64)),
            completion_token_ids=ids,
            logprobs=logprobs,
            finish_reason="stop",
        ),
        reward=float(slot % 2),
        correct=bool(slot % 2),
        format_ok=True,
        answer=str(slot),
        reason="bench",
        forced_spans=spans,
        turns=args.steps,
        feedback=["turn ok"] * args.steps,
    )


def claim_race(url: str, engine: Any, args: argparse.Namespace) -> tuple[float, int, int]:
    items = [
        WorkItem(
            round_index=1, purpose="train", policy_version="bench", task_id=f"bench:{i}",
            plan=json.dumps({"task": i}),
        )
        for i in range(args.items)
    ]  # fmt: skip
    with store.transaction(engine) as session:
        workqueue.enqueue(session, items)
    context = multiprocessing.get_context("spawn")
    found, start = context.Queue(), context.Barrier(args.workers + 1)
    workers = [
        context.Process(target=claimer, args=(url, f"w{i}", args.lot, found, start))
        for i in range(args.workers)
    ]
    for process in workers:
        process.start()
    start.wait()
    started = time.perf_counter()
    claimed = [found.get(timeout=600) for _ in workers]
    elapsed = time.perf_counter() - started
    for process in workers:
        process.join()
    counts = Counter(item for mine in claimed for item in mine)
    return args.items / elapsed, sum(n - 1 for n in counts.values()), args.items - len(counts)


def claimer(url: str, owner: str, lot: int, found: Any, start: Any) -> None:
    engine = store.open_store(url)
    mine: list[int] = []
    start.wait()
    while True:
        with workqueue.claiming(engine) as session:
            claimed = workqueue.claim(session, owner, limit=lot, lease_s=600)
        if not claimed:
            break
        with store.transaction(engine) as session:
            for item in claimed:
                assert item.id is not None
                workqueue.complete(session, item.id)
        mine += [item.id for item in claimed if item.id is not None]
    found.put(mine)


class scratch_database:
    """A throwaway PostgreSQL database next to the one `admin_url` names."""

    def __init__(self, admin_url: str) -> None:
        self.admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        self.name = f"flywheel_bench_{uuid.uuid4().hex[:8]}"
        self.url = make_url(admin_url).set(database=self.name)

    def __enter__(self) -> str:
        with self.admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {self.name}"))
        return self.url.render_as_string(hide_password=False)

    def __exit__(self, *exc: object) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)"))
        self.admin.dispose()


def print_table(result: dict[str, Any]) -> None:
    s = result["settings"]
    print(
        f"{'database':<11} {'trajectories/s':>15} {'read/s':>7} {'claims/s':>9} "
        f"{'duplicates':>11} {'lost':>5} "
        f"{'emb p50/p99 ms':>15} {'bm25 p50/p99 ms':>16}"
    )
    for r in result["databases"]:
        print(
            f"{r['database']:<11} {r['trajectories_per_s']:>15.0f} {r['loaded_per_s']:>7.0f} "
            f"{r['claims_per_s']:>9.0f} "
            f"{r['duplicates']:>11} {r['lost']:>5} "
            f"{r['embedding_p50_ms']:>7.1f}/{r['embedding_p99_ms']:<7.1f} "
            f"{r['bm25_p50_ms']:>8.1f}/{r['bm25_p99_ms']:<7.1f}"
        )
    print(
        f"ingest: {s['groups']} groups x {s['group_size']} episodes of {s['steps']} steps "
        f"({s['tokens']} sampled + 8 forced tokens each), "
        f"{s['per_tx']} groups per transaction; claims: {s['items']} items, "
        f"{s['workers']} processes, lots of {s['lot']}; retrieval: "
        f"{result['databases'][0]['library_entries']} entries, top 6 within 800 characters"
    )


if __name__ == "__main__":
    main()
