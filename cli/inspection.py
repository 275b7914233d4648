"""Inspection commands: what the store says (status, lineage, library, strategies, report), and
the work pools Prefect runs the loop on (status)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cli.arguments import db_url, keys, writable
from reports.table import score, text_table

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from memory.records import WorkItem


def status(args: argparse.Namespace) -> int:
    from memory import store

    with store.transaction(store.open_store(db_url(args))) as session:
        lines = _store_lines(session)
    print("\n".join(lines))
    _pools(args.prefect_port)
    return 0


def _store_lines(session: Session) -> list[str]:
    """The serving version, the queue, the library, every version and the recent rounds."""
    from memory import library, store, workqueue

    serving = store.promoted_policy(session)
    if serving is None:
        return ["no policy version yet: run `flywheel run`"]
    counts = store.attempt_counts(session)
    lines = [
        f"serving: {serving.name} (held-out pass@1 {score(serving.eval_pass_at_1)})",
        f"attempts stored: {', '.join(f'{k} {v}' for k, v in sorted(counts.items())) or 'none'}",
        f"queue: {workqueue.queue_depth(session)} tasks waiting or claimed, by "
        f"{len(workqueue.claim_holders(session))} workers",
        f"experience library: {library.size(session)} active lessons",
        *_failed_lines(workqueue.failed(session)),
        "versions:",
    ]
    for v in store.policy_versions(session):
        mark = "*" if v.name == serving.name else " "
        lines.append(
            f" {mark} {v.name:<28} round {v.round_index:<3} pass@1 {score(v.eval_pass_at_1)}"
            f"  {'promoted' if v.promoted else ''}"
        )
        lines += [f"      {card.line()}" for card in v.scorecards]
    lines.append("recent rounds:")
    for r in store.training_rounds(session):
        tokens = r.metrics.train_tokens if r.status == "done" else "-"
        lines.append(
            f"   {r.round_index:<3} {r.status:<8} {r.method:<7} {r.policy_in} -> "
            f"{r.policy_out or '-'}  train tokens {tokens}"
        )
    return lines


def _failed_lines(failed: list[WorkItem]) -> list[str]:
    """Tasks that failed for good: how many by their own doing, and the last few reasons."""
    if not failed:
        return []
    own = sum(item.fault == "task" for item in failed)
    lines = [f"failed tasks: {len(failed)} ({own} by their own doing, {len(failed) - own} for "
             "want of a server)"]  # fmt: skip
    for item in failed[-3:]:
        lines.append(f"   round {item.round_index} {item.purpose} {item.task_id}: {item.error}")
    return lines


def _pools(port: int) -> None:
    """The work pools of the Prefect API in use (PREFECT_API_URL, else a local server)."""
    from flows import orchestrator

    api = orchestrator.running(port)
    if api is None:
        print("work pools: no Prefect API (set PREFECT_API_URL, or run `flywheel serve`)")
        return
    from flows import pools

    views = pools.describe_at(api)
    print(f"work pools at {api}: {len(views) or 'none'}")
    for view in views:
        runs = ", ".join(f"{n} {state}" for state, n in view.runs.items())
        print(f"   {view.name} ({view.type}{', paused' if view.paused else ''}): {runs}")
        print(f"      queues: {', '.join(view.queues) or 'none'}")
        print(f"      workers: {', '.join(view.workers) or 'none'}")


def lineage(args: argparse.Namespace) -> int:
    from memory import library, store

    with store.transaction(store.open_store(db_url(args))) as session:
        chain = store.lineage(session, args.version)
        versions = {v.name: v for v in store.policy_versions(session)}
        shown = {r.round_index: library.used_in(session, r.group_ids) for r in chain}
        tasks = {r.round_index: store.group_tasks(session, r.group_ids) for r in chain}
    if not chain:
        print(f"{args.version}: not produced by a training round (a base model)")
        return 0
    for r in chain:
        contexts = ", ".join(f"{k} {v}" for k, v in sorted(r.metrics.contexts.items()))
        version = versions.get(r.policy_out or "")
        print(
            f"{r.policy_out}  <- round {r.round_index} ({r.method}, {r.status}) on "
            f"{len(r.group_ids)} groups sampled from {r.policy_in}; "
            f"held-out pass@1 {score(version.eval_pass_at_1 if version else None)}; "
            f"rows by context: {contexts or '-'}"
        )
        if shown[r.round_index]:
            lessons = ", ".join(f"#{i} x{n}" for i, n in sorted(shown[r.round_index].items()))
            print(f"    library lessons shown to its groups: {lessons}")
        if args.groups:
            listed = ", ".join(f"{gid}: {task}" for gid, task in tasks[r.round_index].items())
            print(f"    groups: {listed or '-'}")
    print(f"{chain[-1].policy_in}  (base)")
    return 0


def library(args: argparse.Namespace) -> int:
    from memory import library, store

    with store.transaction(store.open_store(db_url(args))) as session:
        if args.lesson is None:
            shown = sorted(library.lessons(session), key=lambda e: -e.utility)[: args.top]
            total = library.size(session)
        else:
            chosen = library.lesson(session, args.lesson)
            history = library.events(session, args.lesson)
            uses = library.uses(session, args.lesson)
            tasks = store.group_tasks(session, [group_id for group_id, _ in uses])
    if args.lesson is None:
        print(f"{total} active lessons; the top {len(shown)} by utility:")
        for e in shown:
            print(
                f"  #{e.id:<5} {e.utility:+.3f}  shown {e.exposures:<4} evidence {e.evidence:<3} "
                f"{e.kind:<9} {e.scope}:{e.scope_key or '-'} {e.zone}  {e.text[:70]}"
            )
        return 0
    print(f"#{chosen.id} {chosen.kind} ({chosen.scope}:{chosen.scope_key or '-'}, {chosen.zone}, "
          f"{chosen.status}): {chosen.text}")  # fmt: skip
    print(f"utility {chosen.utility:+.3f}, shown to {chosen.exposures} groups, "
          f"evidence {chosen.evidence}; from {chosen.source or '-'}")  # fmt: skip
    gains = [g for _, g in uses if g is not None]
    if gains:
        print(f"gain where used: mean {sum(gains) / len(gains):+.3f} over {len(gains)} groups")
    for group_id, gain in uses[-10:]:  # the latest ten
        credit = "not credited yet" if gain is None else f"gain {gain:+.3f}"
        print(f"  used in group {group_id} ({tasks.get(group_id, '?')}): {credit}")
    for event in history:
        changed = {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in event.after.items()
            if event.before.get(k) != v
        }
        print(f"  {event.action:<7} {', '.join(f'{k}={v}' for k, v in changed.items())[:100]}")
    return 0


def strategies(args: argparse.Namespace) -> int:
    from memory import store

    with store.transaction(store.open_store(db_url(args))) as session:
        stats = store.strategy_stats(session, args.taskset)[: args.top]
    if not stats:
        print("no strategies recorded (collect with --sge 1)")
        return 0
    rows = [
        (str(s.attempts), f"{s.success_rate:.3f}", f"{s.mean_reward:.3f}", s.taskset, s.text[:80])
        for s in stats
    ]
    print(text_table(("attempts", "success", "reward", "task set", "strategy"), rows))
    return 0


def ui(args: argparse.Namespace) -> int:
    """The page alone, on a store: behind FLYWHEEL_ADMIN_KEYS, or a key made for this run and
    printed in the link that signs in."""
    import secrets

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import RedirectResponse

    from memory import store
    from serving.promotion import Gate
    from serving.server import ensure_port_free
    from serving.ui import Page, add_ui

    engine = store.open_store(db_url(args))
    configured = keys("FLYWHEEL_ADMIN_KEYS")
    admin_keys = configured or frozenset({secrets.token_urlsafe(24)})
    ensure_port_free(args.host, args.port)
    app = FastAPI(title="flywheel", docs_url=None, redoc_url=None, openapi_url=None)
    app.get("/", include_in_schema=False)(lambda: RedirectResponse("/ui"))
    add_ui(app, Page(engine, admin_keys, Gate()))
    url = f"http://{args.host}:{args.port}/ui"
    if configured:
        print(f"the flywheel's page: {url} (sign in with a key of FLYWHEEL_ADMIN_KEYS)", flush=True)
    else:  # a key of this run's own, in the link, as Jupyter does
        print(f"the flywheel's page: {url}/login?token={next(iter(admin_keys))}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def report_html(args: argparse.Namespace) -> int:
    from memory import store
    from reports import report

    out = args.out or args.workdir / "report.html"
    writable(out, "--out")
    with store.transaction(store.open_store(db_url(args))) as session:
        data = report.build(session)
    report.write_html(data, out)
    print(report.format_table(data))
    print(f"report written to {out}")
    return 0
