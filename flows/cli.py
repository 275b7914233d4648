"""The `flywheel` command line.

Every command has `--help`, fails with one line (`flywheel: error: ...`) and a non-zero exit on
bad input, and logs progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.errors import FlowError

if TYPE_CHECKING:
    from memory.records import Group, Segment

EXIT_BAD_INPUT = 2
MODELS = ("smollm2", "tiny")
DEFAULT_SERVER_PYTHON = Path(".venv-serving/bin/python")
MODES = ("grpo", "r3l", "rltldr")
# flag -> (settings key, type, help); `train.x` keys are training-round settings.
RUN_FLAGS: dict[str, tuple[str, type, str]] = {
    "--rounds": ("rounds", int, "flywheel rounds"),
    "--tasks": ("tasks", int, "train tasks per round"),
    "--group-size": ("group_size", int, "attempts per task"),
    "--eval-tasks": ("eval_tasks", int, "held-out tasks"),
    "--taskset": ("taskset", str, "task set"),
    "--temperature": ("temperature", float, "sampling temperature of train attempts"),
    "--guided-fraction": ("guided_fraction", float, "share of each group sampled with guidance"),
    "--sge": ("sge", int, "1: a strategy first, then the answer (SGE)"),
    "--reflect-retry": ("reflect_retry", int, "1: reflect on failed attempts and retry (R3L)"),
    "--insights": ("insights", int, "1: sequential attempts with judged insights (RLTLDR)"),
    "--reviewer-url": ("reviewer_url", str, "endpoint for reflections and judgements"),
    "--reviewer-model": ("reviewer_model", str, "the reviewer endpoint's model name"),
    "--library": ("library", int, "1: grow an experience library, show its lessons (EDGE)"),
    "--outcome-bonus": ("outcome.bonus", float, "bonus for rarely seen answers (c_hist)"),
    "--repeat-penalty": ("outcome.repeat_penalty", float, "penalty for repeated answers"),
    "--mode": ("train.mode", str, "advantage mode"),
    "--learning-rate": ("train.learning_rate", float, "LoRA learning rate"),
    "--epochs": ("train.epochs", int, "passes over a round's rows"),
}


def main(argv: list[str] | None = None) -> int:
    # A training process next to the model server must not spin on OpenMP waits; set before torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpx2", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("flywheel: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI boundary turns known failures into one line
        line = _one_line(exc)
        if line is None:
            raise
        print(f"flywheel: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flywheel", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run flywheel rounds: collect, train, swap, evaluate")
    _run_arguments(run)
    run.add_argument(
        "--server-url", default=None, help="use this running vLLM server instead of starting one"
    )
    run.add_argument(
        "--server-python",
        type=Path,
        default=DEFAULT_SERVER_PYTHON,
        help="python of the model server's environment (default .venv-serving)",
    )
    run.add_argument("--port", type=int, default=8011, help="port for the started server")
    run.add_argument("--summary-json", type=Path, default=None, help="write the summary here")
    run.add_argument(
        "--prefect",
        choices=("local", "temporary"),
        default=os.environ.get("FLYWHEEL_PREFECT", "local"),
        help="local: a Prefect server kept running between runs, whose UI shows them "
        "(default); temporary: one for this run only. PREFECT_API_URL wins over both.",
    )
    run.add_argument("--prefect-port", type=int, default=4200, help="local Prefect server port")
    run.set_defaults(handler=_run)

    model_server = commands.add_parser(
        "serve-model", help="run a supervised vLLM server (restarted when it stops generating)"
    )
    model_server.add_argument("--model", default="smollm2")
    model_server.add_argument("--workdir", type=Path, default=Path(".flywheel"))
    model_server.add_argument("--server-python", type=Path, default=DEFAULT_SERVER_PYTHON)
    model_server.add_argument("--port", type=int, default=8011)
    model_server.add_argument(
        "--probe-interval",
        type=float,
        default=10.0,
        help="seconds between generation probes (default 10)",
    )
    model_server.set_defaults(handler=_serve_model)

    looped = commands.add_parser(
        "serve",
        help="the continuous loop: Prefect deployments that collect on an interval and train "
        "once enough groups exist, on a local Prefect server kept running, and the gateway",
    )
    _run_arguments(looped)
    looped.add_argument("--server-url", required=True, help="the running model server")
    looped.add_argument(
        "--every", type=float, default=600.0, help="seconds between collection batches (600)"
    )
    looped.add_argument(
        "--train-every", type=float, default=60.0, help="seconds between training checks (60)"
    )
    looped.add_argument(
        "--min-groups", type=int, default=None, help="complete groups a round waits for (--tasks)"
    )
    looped.add_argument("--prefect-port", type=int, default=4200, help="local Prefect server port")
    looped.add_argument(
        "--gateway-port", type=int, default=None, help="also serve the gateway on this port"
    )
    looped.set_defaults(handler=_serve)

    export = commands.add_parser(
        "export", help="training rows (token ids, labels, advantages, weights) as JSON lines"
    )
    export.add_argument("--round", type=int, default=None, help="one round's groups (default all)")
    export.add_argument(
        "--mode", choices=MODES, default=None, help="advantage mode (default rltldr)"
    )
    export.add_argument("--out", type=Path, required=True, help="the JSON-lines file to write")
    export.add_argument(
        "--segments",
        action="store_true",
        help="instead: every attempt of the complete groups with its token segments "
        "(ids, behaviour logprobs, loss type, weight, advantage)",
    )
    _db_arguments(export)
    export.set_defaults(handler=_export)

    collector = commands.add_parser(
        "worker", help="a collection worker: claim queued tasks from the store and collect them"
    )
    collector.add_argument("--db", default=None, help="database URL (shared with `flywheel run`)")
    collector.add_argument("--workdir", type=Path, default=Path(".flywheel"))
    collector.add_argument("--server-url", required=True, help="the model server to sample from")
    collector.add_argument("--reviewer-url", default=None)
    collector.add_argument("--reviewer-model", default=None)
    collector.add_argument("--lease", type=float, default=120.0, help="lease seconds (120)")
    collector.add_argument("--lot-size", type=int, default=16, help="tasks claimed at a time")
    collector.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    collector.add_argument(
        "--idle-exit", type=float, default=None, help="stop after this many seconds with no work"
    )
    collector.add_argument(
        "--outage",
        type=float,
        default=300.0,
        help="seconds the model server may stay down before the worker stops (300)",
    )
    collector.set_defaults(handler=_worker)

    gateway = commands.add_parser(
        "gateway", help="serve the OpenAI-compatible gateway in front of vLLM servers"
    )
    gateway.add_argument(
        "--upstream", action="append", required=True, help="a vLLM server URL (repeat for several)"
    )
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    _db_arguments(gateway)
    gateway.add_argument("--model", default="smollm2", help="the base model the upstreams serve")
    gateway.add_argument("--alias", default="policy", help="stable model name (default policy)")
    gateway.add_argument(
        "--min-gain",
        type=float,
        default=0.0,
        help="held-out pass@1 gain over the serving version needed to promote",
    )
    gateway.add_argument(
        "--capture", action="store_true", help="record chat traffic as trajectories in the store"
    )
    gateway.set_defaults(handler=_gateway)

    promote = commands.add_parser("promote", help="point the alias at a version (gated)")
    promote.add_argument("version")
    promote.add_argument("--force", action="store_true", help="skip the evaluation gate")
    promote.add_argument("--min-gain", type=float, default=0.0)
    _store_arguments(promote)
    promote.set_defaults(handler=_promote)

    rollback = commands.add_parser("rollback", help="point the alias back at the previous version")
    _store_arguments(rollback)
    rollback.set_defaults(handler=_rollback)

    status = commands.add_parser("status", help="the serving version, versions, recent rounds")
    _db_arguments(status)
    status.set_defaults(handler=_status)

    lineage = commands.add_parser(
        "lineage", help="the rounds, groups and parents that produced a version"
    )
    lineage.add_argument("version")
    lineage.add_argument(
        "--groups", action="store_true", help="also list each round's groups (id: task)"
    )
    _db_arguments(lineage)
    lineage.set_defaults(handler=_lineage)

    lessons = commands.add_parser(
        "library", help="the experience library's lessons, or one lesson's history (--entry)"
    )
    lessons.add_argument("--entry", type=int, default=None, help="where it was used, what it did")
    lessons.add_argument("--top", type=int, default=20, help="lessons to list, by utility")
    _db_arguments(lessons)
    lessons.set_defaults(handler=_library)

    strategies = commands.add_parser(
        "strategies", help="success rate per strategy (SGE) over first attempts"
    )
    strategies.add_argument("--taskset", default=None, help="one task set (default all)")
    strategies.add_argument("--top", type=int, default=20, help="strategies to list, most tried")
    _db_arguments(strategies)
    strategies.set_defaults(handler=_strategies)

    report = commands.add_parser(
        "report", help="an HTML page of plots from the store, and its table on stdout"
    )
    _db_arguments(report)
    report.add_argument(
        "--out", type=Path, default=None, help="HTML file (default WORKDIR/report.html)"
    )
    report.set_defaults(handler=_report_html)

    sandbox = commands.add_parser(
        "sandbox", help="which isolation model-written code gets on this host"
    )
    sandbox.set_defaults(handler=_sandbox)

    prepare = commands.add_parser("prepare-model", help="build the model folder (cached)")
    prepare.add_argument("--model", default="smollm2", choices=MODELS)
    prepare.add_argument("--workdir", type=Path, default=Path(".flywheel"))
    prepare.set_defaults(handler=_prepare_model)
    return parser


def _db_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=None, help="database URL (default SQLite in the workdir)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(".flywheel"),
        help="models, adapters, logs and the default database (default .flywheel)",
    )


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    _db_arguments(parser)
    parser.add_argument(
        "--gateway-url",
        default=None,
        help="go through this running gateway, which serves the version before recording it "
        "(admin key from FLYWHEEL_ADMIN_KEYS; its own gate applies)",
    )


def _db_url(args: argparse.Namespace) -> str:
    return args.db or f"sqlite:///{args.workdir}/flywheel.db"


def _keys(variable: str) -> frozenset[str]:
    return frozenset(k.strip() for k in os.environ.get(variable, "").split(",") if k.strip())


def _serve_model(args: argparse.Namespace) -> int:
    import threading

    from serving.server import ServerSettings, VllmServer

    model_path = _model_folder(args.model, args.workdir)
    settings = ServerSettings(
        python=args.server_python,
        model_path=model_path,
        served_name=model_path.name,
        port=args.port,
        log_path=args.workdir / "logs" / f"vllm-{args.port}.log",
    )
    stop = threading.Event()
    with VllmServer(settings) as server:
        print(f"vLLM serving {model_path.name} on {server.url}; Ctrl-C stops it", file=sys.stderr)
        try:
            server.supervise(stop, interval_s=args.probe_interval)
        except KeyboardInterrupt:
            stop.set()
    return 0


def _export(args: argparse.Namespace) -> int:
    """The rows a training round would use, for any trainer: one JSON object per line with
    `input_ids`, `labels` (-100 where nothing is trained), per-token `advantages`, the
    `behaviour_logprobs` of the sampled tokens, `importance` (whether to weight by the ratio
    against them) and the `context` the row is trained under."""
    from memory import store
    from trainer.dataset import build_rows
    from trainer.settings import TrainSettings

    _writable(args.out, "--out")
    settings = TrainSettings(**({"mode": args.mode} if args.mode else {}))
    with store.transaction(store.open_store(_db_url(args))) as session:
        groups = store.load_groups(session, "train", args.round, complete_only=True)
        if args.segments:
            return _export_segments(groups, store.group_segments(session, _ids(groups)), args.out)
    rows = build_rows(groups, settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for row in rows:
            out.write(json.dumps(row.model_dump()) + "\n")
    tokens = sum(row.trained_tokens for row in rows)
    print(f"{len(rows)} rows ({tokens} trained tokens, {settings.mode}) from {len(groups)} "
          f"complete groups written to {args.out}")  # fmt: skip
    return 0


def _export_segments(
    groups: list[Group], segments: dict[tuple[int, int, str], list[Segment]], out: Path
) -> int:
    """One JSON object per attempt: its group, reward and prompt ids, and its completion as
    segments; a segment's weight is 0 where nothing is trained (pivot and forced tokens)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out.open("w") as stream:
        for group in groups:
            for attempt in group.attempts:
                if attempt.sample is None:
                    continue
                pieces = segments.get((group.id or 0, attempt.sample_index, attempt.kind), [])
                record = {
                    "group_id": group.id,
                    "task_id": group.task_id,
                    "sample_index": attempt.sample_index,
                    "kind": attempt.kind,
                    "context": attempt.context,
                    "reward": attempt.reward,
                    "train_reward": attempt.train_reward,
                    "prompt_token_ids": attempt.sample.prompt_token_ids,
                    "segments": [p.model_dump(exclude={"schema_version"}) for p in pieces],
                }
                stream.write(json.dumps(record) + "\n")
                written += 1
    print(f"{written} attempts from {len(groups)} complete groups written to {out}")
    return 0


def _ids(groups: list[Group]) -> list[int]:
    return [group.id for group in groups if group.id is not None]


def _strategies(args: argparse.Namespace) -> int:
    from memory import store

    with store.transaction(store.open_store(_db_url(args))) as session:
        stats = store.strategy_stats(session, args.taskset)[: args.top]
    if not stats:
        print("no strategies recorded (collect with --sge 1)")
        return 0
    print(f"{'attempts':>8} {'success':>8} {'reward':>7}  task set     strategy")
    for s in stats:
        print(
            f"{s.attempts:>8} {s.success_rate:>8.3f} {s.mean_reward:>7.3f}  "
            f"{s.taskset:<12} {s.text[:80]}"
        )
    return 0


def _worker(args: argparse.Namespace) -> int:
    import anyio

    from agents.policy import PolicyClient, Reviewer
    from flows import worker
    from memory.store import open_store

    engine = open_store(_db_url(args))
    settings = worker.WorkerSettings(
        lease_s=args.lease,
        lot_size=args.lot_size,
        concurrency=args.concurrency,
        outage_s=args.outage,
    )
    reviewer = None
    if args.reviewer_url and args.reviewer_model:
        reviewer = Reviewer(PolicyClient(args.reviewer_url), args.reviewer_model)
    owner = worker.new_owner()
    idle = _IdleClock(engine, args.idle_exit)
    print(f"worker {owner}: collecting from {args.server_url}; Ctrl-C stops it", file=sys.stderr)
    stored = anyio.run(
        lambda: worker.work(
            engine, args.server_url, owner=owner, settings=settings, until=idle.expired,
            reviewer=reviewer,
        )
    )  # fmt: skip
    print(f"worker {owner}: stored {stored} groups", file=sys.stderr)
    return 0


class _IdleClock:
    """True once the queue has been empty for `limit` seconds (never, without a limit)."""

    def __init__(self, engine: Any, limit: float | None) -> None:
        self.engine, self.limit, self.since = engine, limit, None

    def expired(self) -> bool:
        from memory import store, workqueue

        if self.limit is None:
            return False
        with store.transaction(self.engine) as session:
            empty = workqueue.queue_depth(session) == 0
        if not empty:
            self.since = None
            return False
        self.since = self.since or time.monotonic()
        return time.monotonic() - self.since >= self.limit


def _gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from memory.store import open_store
    from serving.gateway import GatewaySettings, create_app
    from serving.promotion import Gate

    admin_keys = _keys("FLYWHEEL_ADMIN_KEYS")
    if not admin_keys:
        raise FlowError("set FLYWHEEL_ADMIN_KEYS (comma-separated) to protect the admin routes")
    settings = GatewaySettings(
        upstreams=[u.rstrip("/") for u in args.upstream],
        base_model_path=_model_folder(args.model, args.workdir),
        checkpoint_root=args.workdir / "adapters",
        alias=args.alias,
        user_keys=_keys("FLYWHEEL_API_KEYS"),
        admin_keys=admin_keys,
        gate=Gate(min_gain=args.min_gain),
        capture=args.capture,
    )
    from serving.server import ensure_port_free

    ensure_port_free(args.host, args.port)
    app = create_app(settings, open_store(_db_url(args)))
    print(f"gateway on http://{args.host}:{args.port}/v1, alias {args.alias!r}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _promote(args: argparse.Namespace) -> int:
    """Through the gateway when one is named (it serves the version everywhere, then records
    the decision; its own gate applies), else straight in the store."""
    if args.gateway_url:
        body = {"version": args.version, "force": args.force}
        event = _ask_gateway(args.gateway_url, "/admin/promote", body)
    else:
        from memory import store
        from serving import promotion

        with store.transaction(store.open_store(_db_url(args))) as session:
            gate = promotion.Gate(min_gain=args.min_gain)
            recorded = promotion.promote(session, args.version, gate, force=args.force)
        event = recorded.model_dump()
    if event["action"] != "promote":
        raise FlowError(f"not promoted: {event['reason']}")
    print(f"{event['to_version']} now serves (was {event['from_version']}): {event['reason']}")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    if args.gateway_url:
        event = _ask_gateway(args.gateway_url, "/admin/rollback", None)
    else:
        from memory import store
        from serving import promotion

        with store.transaction(store.open_store(_db_url(args))) as session:
            event = promotion.rollback(session).model_dump()
    print(f"{event['to_version']} now serves (was {event['from_version']})")
    return 0


def _ask_gateway(url: str, route: str, body: Any) -> dict[str, Any]:
    """An admin request to a running gateway; any failure is one line, and the gateway changes
    nothing it could not finish."""
    import httpx

    key = next(iter(_keys("FLYWHEEL_ADMIN_KEYS")), "")
    try:
        response = httpx.post(
            url.rstrip("/") + route,
            json=body,
            timeout=300,
            headers={"Authorization": f"Bearer {key}"},
        )
    except httpx.HTTPError as exc:
        raise FlowError(f"the gateway at {url} cannot be reached ({exc}); nothing changed") from exc
    if response.status_code in (200, 409):
        return dict(response.json())
    try:
        reason = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        reason = response.text.strip()[:200]
    raise FlowError(f"the gateway answered {response.status_code}: {reason}; nothing changed")


def _status(args: argparse.Namespace) -> int:
    from memory import library, store, workqueue

    with store.transaction(store.open_store(_db_url(args))) as session:
        serving = store.promoted_policy(session)
        versions = store.policy_versions(session)
        rounds = store.training_rounds(session)
        counts = store.attempt_counts(session)
        depth = workqueue.queue_depth(session)
        holders = workqueue.claim_holders(session)
        lessons = library.size(session)
    if serving is None:
        print("no policy version yet: run `flywheel run`")
        return 0
    print(f"serving: {serving.name} (held-out pass@1 {_score(serving.eval_pass_at_1)})")
    print(f"attempts stored: {', '.join(f'{k} {v}' for k, v in sorted(counts.items())) or 'none'}")
    print(f"queue: {depth} tasks waiting or claimed, by {len(holders)} workers")
    print(f"experience library: {lessons} active lessons")
    print("versions:")
    for v in versions:
        mark = "*" if v.name == serving.name else " "
        print(
            f" {mark} {v.name:<28} round {v.round_index:<3} pass@1 {_score(v.eval_pass_at_1)}"
            f"  {'promoted' if v.promoted else ''}"
        )
    print("recent rounds:")
    for r in rounds:
        tokens = r.metrics.get("train_tokens", "-")
        print(
            f"   {r.round_index:<3} {r.status:<8} {r.method:<7} {r.policy_in} -> "
            f"{r.policy_out or '-'}  train tokens {tokens}"
        )
    return 0


def _lineage(args: argparse.Namespace) -> int:
    from memory import library, store

    with store.transaction(store.open_store(_db_url(args))) as session:
        chain = store.lineage(session, args.version)
        versions = {v.name: v for v in store.policy_versions(session)}
        shown = {r.round_index: library.used_in(session, r.group_ids) for r in chain}
        tasks = {r.round_index: store.group_tasks(session, r.group_ids) for r in chain}
    if not chain:
        print(f"{args.version}: not produced by a training round (a base model)")
        return 0
    for r in chain:
        contexts = ", ".join(f"{k} {v}" for k, v in sorted(r.metrics.get("contexts", {}).items()))
        version = versions.get(r.policy_out or "")
        print(
            f"{r.policy_out}  <- round {r.round_index} ({r.method}, {r.status}) on "
            f"{len(r.group_ids)} groups sampled from {r.policy_in}; "
            f"held-out pass@1 {_score(version.eval_pass_at_1 if version else None)}; "
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


def _library(args: argparse.Namespace) -> int:
    from memory import library, store

    with store.transaction(store.open_store(_db_url(args))) as session:
        if args.entry is None:
            entries = sorted(library.entries(session), key=lambda e: -e.utility)[: args.top]
            total = library.size(session)
        else:
            chosen = library.entry(session, args.entry)
            history = library.events(session, args.entry)
            uses = library.uses(session, args.entry)
            tasks = store.group_tasks(session, [group_id for group_id, _ in uses])
    if args.entry is None:
        print(f"{total} active lessons; the top {len(entries)} by utility:")
        for e in entries:
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
        shown = "not credited yet" if gain is None else f"gain {gain:+.3f}"
        print(f"  used in group {group_id} ({tasks.get(group_id, '?')}): {shown}")
    for event in history:
        changed = {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in event.after.items()
            if event.before.get(k) != v
        }
        print(f"  {event.action:<7} {', '.join(f'{k}={v}' for k, v in changed.items())[:100]}")
    return 0


def _report_html(args: argparse.Namespace) -> int:
    from flows import report
    from memory import store

    out = args.out or args.workdir / "report.html"
    _writable(out, "--out")
    with store.transaction(store.open_store(_db_url(args))) as session:
        data = report.build(session)
    report.write_html(data, out)
    print(report.format_table(data))
    print(f"report written to {out}")
    return 0


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _run_defaults() -> dict[str, Any]:
    from flows.settings import RunSettings

    defaults = RunSettings().model_dump()
    flat = {key: value for key, value in defaults.items() if not isinstance(value, dict)}
    for table in ("train", "outcome", "strategy"):
        flat |= {f"{table}.{key}": value for key, value in defaults[table].items()}
    return flat


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, default=None, help="TOML file of run settings (flags win over it)"
    )
    defaults = _run_defaults()
    for flag, (key, kind, text) in RUN_FLAGS.items():
        choices = MODES if key == "train.mode" else None
        parser.add_argument(
            flag,
            type=kind,
            default=None,
            choices=choices,
            help=f"{text} (default {defaults[key]})",
        )
    _db_arguments(parser)
    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (default), tiny (random, for tests) or a model folder",
    )


def _settings(args: argparse.Namespace, **fixed: Any) -> Any:
    """Run settings from defaults, --config and flags; checked, with the store opened once."""
    from flows.settings import load_run_settings
    from memory.store import open_store
    from verifiers.catalog import check

    overrides: dict[str, Any] = {"db_url": _db_url(args), "workdir": args.workdir, **fixed}
    for flag, (key, _, _) in RUN_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides[key] = value
    labels = {key: flag for flag, (key, _, _) in RUN_FLAGS.items()}
    settings = load_run_settings(args.config, overrides, labels)
    check(settings.taskset)
    open_store(settings.db_url).dispose()
    return settings


def _use_local_prefect(workdir: Path, port: int) -> None:
    """Point this process at `PREFECT_API_URL`, else at the local server (started once)."""
    from flows import orchestrator

    url = orchestrator.api_url(workdir.resolve() / "prefect", port)
    os.environ["PREFECT_API_URL"] = url
    print(f"Prefect API {url} (UI: {url.removesuffix('/api')})", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    import subprocess

    if args.gateway_port is not None and not _keys("FLYWHEEL_ADMIN_KEYS"):
        raise FlowError("set FLYWHEEL_ADMIN_KEYS (comma-separated) to serve the gateway")
    args.workdir = args.workdir.resolve()
    if args.db is None:
        args.db = f"sqlite:///{args.workdir}/flywheel.db"
    settings = _settings(args)
    model_path = _model_folder(args.model, args.workdir).resolve()
    _preflight(settings.db_url, args.server_url, model_path.name)
    _use_local_prefect(args.workdir, args.prefect_port)
    gateway = None
    if args.gateway_port is not None:
        command = [
            sys.executable, "-m", "flows.cli", "gateway", "--upstream", args.server_url,
            "--db", settings.db_url, "--workdir", str(args.workdir), "--model", str(model_path),
            "--port", str(args.gateway_port),
        ]  # fmt: skip
        gateway = subprocess.Popen(command)
    from flows.flywheel import serve_rounds

    try:
        serve_rounds(
            settings, args.server_url, model_path.name, str(model_path),
            args.every, args.train_every, args.min_groups or settings.tasks,
        )  # fmt: skip
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=30)
    return 0


def _run(args: argparse.Namespace) -> int:
    _writable(args.summary_json, "--summary-json")
    settings = _settings(args)
    if args.prefect == "local":
        _use_local_prefect(args.workdir, args.prefect_port)
    model_path = _model_folder(args.model, args.workdir)
    served_name = model_path.name
    started = time.monotonic()
    if args.server_url:
        _preflight(settings.db_url, args.server_url, served_name)
        summary = _run_flow(settings, args.server_url, served_name, model_path)
    else:
        from agents.errors import ServerUnavailable
        from serving.errors import ServingError
        from serving.server import ServerSettings, VllmServer

        server_settings = ServerSettings(
            python=args.server_python,
            model_path=model_path,
            served_name=served_name,
            port=args.port,
            log_path=args.workdir / "logs" / "vllm.log",
        )
        with VllmServer(server_settings) as server, server.supervised():
            server_seconds = time.monotonic() - started
            try:
                summary = _run_flow(settings, server.url, served_name, model_path)
            except ServerUnavailable as exc:
                log = server_settings.log_path
                raise ServingError(f"{exc}; {log} ends: {server.log_tail()}") from exc
        summary.wall_seconds["server_start"] = server_seconds
    summary.wall_seconds["total"] = time.monotonic() - started
    _report(summary, args.summary_json)
    return 0


def _preflight(db_url: str, server_url: str, model: str, wait_s: float = 10.0) -> None:
    """A server named on the command line must generate now: a wrong URL fails at once."""
    import anyio

    from flows.readiness import Readiness
    from memory.store import open_store

    readiness = Readiness(open_store(db_url), server_url, outage_s=wait_s)
    anyio.run(readiness.ensure, model)


def _run_flow(settings: Any, server_url: str, served_name: str, model_path: Path) -> Any:
    import anyio

    from flows.flywheel import flywheel_run

    return anyio.run(flywheel_run, settings, server_url, served_name, str(model_path))


def _report(summary: Any, path: Path | None) -> None:
    from flows.summary import format_table

    print(format_table(summary))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary.model_dump(mode="json"), indent=2) + "\n")
        print(f"summary written to {path}")


def _sandbox(args: argparse.Namespace) -> int:
    from verifiers.sandbox import Isolation, best_isolation

    isolation = best_isolation()
    blocks = {
        Isolation.BUBBLEWRAP: "no network, a read-only system, a private /tmp",
        Isolation.UNSHARE: "no network, own pid namespace, an unprivileged uid",
        Isolation.PROCESS: "rlimits and a dropped uid only; the network stays reachable",
    }[isolation]
    print(f"sandbox isolation: {isolation} ({blocks})")
    if isolation is Isolation.PROCESS:
        print("code task sets refuse to run here: install bubblewrap (apt-get install bubblewrap)")
    return 0


def _prepare_model(args: argparse.Namespace) -> int:
    print(_model_folder(args.model, args.workdir))
    return 0


def _model_folder(model: str, workdir: Path) -> Path:
    from serving.model import prepare_smollm2, prepare_tiny_llama

    cache_dir = workdir / "models"
    if model == "smollm2":
        return prepare_smollm2(cache_dir)
    if model == "tiny":
        return prepare_tiny_llama(cache_dir, prepare_smollm2(cache_dir))
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise FlowError(f"--model {model!r} is neither {' nor '.join(MODELS)} nor a model folder")
    return folder


def _one_line(exc: Exception) -> str | None:
    """The line a user sees for a failure the command knows; None for a programming error,
    which keeps its traceback."""
    from pydantic import ValidationError

    from agents.errors import AgentError
    from memory.errors import StoreError
    from memory.records import describe
    from serving.errors import ServingError
    from trainer.errors import TrainerError
    from verifiers.errors import VerifierError

    if isinstance(exc, ValidationError):
        return describe(exc)
    known = (AgentError, StoreError, ServingError, TrainerError, VerifierError, FlowError)
    return str(exc).strip().splitlines()[0] if isinstance(exc, known) and str(exc) else None


def _writable(path: Path | None, flag: str) -> None:
    """Fail now, before any work, if `path` cannot be written."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as exc:
        raise FlowError(f"{flag} {path} cannot be written: {exc.strerror or exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
