"""The commands that run the flywheel: `run` (rounds with a supervised model server), `serve`
(the continuous loop) and `worker` (a collection worker)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cli import flags
from cli.arguments import db_url, keys, model_folder, writable
from flows.errors import FlowError


def run(args: argparse.Namespace) -> int:
    writable(args.summary_json, "--summary-json")
    settings = run_settings(args)
    if settings.source != "generated":
        raise FlowError(
            f"--source {settings.source} trains on captured agent traffic: use flywheel serve"
        )
    _migrate_own_store(settings.db_url)
    model_path = model_folder(args.model, args.models).resolve()
    reviewer_path = None
    if settings.reviewer is not None:
        reviewer_path = model_folder(settings.reviewer, args.models, "--reviewer").resolve()
    started = time.monotonic()
    policy, reviewer = _server_settings(args, model_path, settings.weights, reviewer_path)
    with contextlib.ExitStack() as servers:
        server_url = args.server_url
        if server_url:
            preflight(settings.db_url, server_url, model_path.name)
        servers.enter_context(_prefect(args))  # stopped after the model servers
        own = [policy] if not server_url else []
        urls = _start(servers, [*own, *([reviewer] if reviewer is not None else [])])
        server_url = server_url or urls[0]
        if reviewer is not None:
            reviewer_url = urls[-1]
            named = {"reviewer_url": reviewer_url, "reviewer_model": reviewer.served_name}
            settings = settings.model_copy(update={"reviewer": None, **named})
        server_seconds = time.monotonic() - started
        summary = _run_flow(settings, server_url, model_path.name, model_path)
    if not args.server_url or reviewer is not None:  # a server of our own started
        summary.wall_seconds["server_start"] = server_seconds
    summary.wall_seconds["total"] = time.monotonic() - started
    _report(summary, args.summary_json)
    return 0


def _migrate_own_store(url: str) -> None:
    """`flywheel run` owns its store: it brings it to this code's schema (under the lock)."""
    from memory.database import migrate

    before, after = migrate(url)
    if before is not None and before != after:
        print(f"store schema {before} -> {after}", file=sys.stderr)


def _server_settings(
    args: argparse.Namespace, model_path: Path, weights: str, reviewer_path: Path | None
) -> tuple[Any, Any]:
    """The policy's server settings, on every core, and the reviewer's beside it (each on
    cores of its own, `serving.server.side_by_side`) when there is one."""
    from serving.access import ensure_key
    from serving.server import ServerSettings, all_cores, side_by_side

    key = ensure_key()  # the servers' own; every process this one starts inherits it

    def settings(folder: Path, port: int, log_name: str) -> ServerSettings:
        return ServerSettings(
            python=args.server_python,
            model_path=folder,
            served_name=folder.name,
            port=port,
            weights=weights,
            log_path=args.workdir / "logs" / log_name,
            api_key=key,
        )

    policy = settings(model_path, args.port, "vllm.log")
    if reviewer_path is None:
        return policy.model_copy(update={"cpus": all_cores()}), None
    return side_by_side(policy, settings(reviewer_path, args.port + 1, "reviewer.log"))


def _start(servers: contextlib.ExitStack, settings: list[Any]) -> list[str]:
    """Start model servers and supervise them until `servers` closes; their URLs. Every server
    is launched before any is waited on, so servers side by side (each on cores of its own)
    start together. A server that stays down ends the run with its log's last lines."""
    from serving.server import VllmServer, close_together

    started = [VllmServer(each) for each in settings]
    servers.callback(close_together, started)
    for server in started:
        server.launch()
    for server in started:
        server.wait_healthy()
    for server in started:
        servers.enter_context(server.supervised())
        servers.enter_context(_naming_log(server))
    return [server.url for server in started]


@contextlib.contextmanager
def _naming_log(server: Any) -> Iterator[None]:
    """A `ServerUnavailable` for this server becomes a `ServingError` with its log's tail."""
    from agents.errors import ServerUnavailable
    from serving.errors import ServingError

    try:
        yield
    except ServerUnavailable as exc:
        if server.url not in str(exc):
            raise
        log = server.settings.log_path
        raise ServingError(f"{exc}; {log} ends: {server.log_tail()}") from exc


def serve(args: argparse.Namespace) -> int:
    import subprocess

    if args.gateway_port is not None and not keys("FLYWHEEL_ADMIN_KEYS"):
        raise FlowError("set FLYWHEEL_ADMIN_KEYS (comma-separated) to serve the gateway")
    settings, model_path = _loop_settings(args, "serve")
    gateway = None
    if args.gateway_port is not None:
        command = [
            sys.executable, "-m", "cli", "gateway", "--upstream", args.server_url,
            "--db", settings.db_url, "--workdir", str(args.workdir), "--model", str(model_path),
            "--port", str(args.gateway_port), "--taskset", settings.taskset,
            "--min-gain", str(settings.gate.min_gain),
            "--held-out-share", str(settings.gate.held_out_share),
            *(f"--upstream={url}" for url in settings.replicas),
        ]  # fmt: skip
        if settings.source != "generated":  # rounds train on its traffic: record it
            command.append("--capture")
        gateway = subprocess.Popen(command)
    from flows.flywheel import Cadence, serve_rounds

    cadence = Cadence(args.every, args.train_every, args.min_groups or settings.tasks)
    try:
        serve_rounds(settings, args.server_url, model_path.name, str(model_path), cadence)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=30)
    return 0


def deploy(args: argparse.Namespace) -> int:
    import anyio

    from flows import pools as prefect_pools

    settings, model_path = _loop_settings(args, "deploy")
    pools = prefect_pools.PoolSettings(
        collect=args.collect_pool, train=args.train_pool, helpers=args.helpers, lease_s=args.lease
    )
    for pool in dict.fromkeys((pools.collect, pools.train)):
        created = anyio.run(prefect_pools.ensure_pool, pool)
        print(f"work pool {pool}: {'created (process)' if created else 'exists'}")
    from flows.flywheel import Cadence

    cadence = Cadence(args.every, args.train_every, args.min_groups or settings.tasks)
    deployed = prefect_pools.deploy(
        settings, args.server_url, model_path.name, str(model_path), pools, cadence
    )
    for name, pool in deployed.items():
        print(f"deployment {name} on pool {pool}")
    print(
        f"start workers where they should run, with PREFECT_API_URL={os.environ['PREFECT_API_URL']}"
        f":\n  prefect worker start --pool {pools.collect}\n  prefect worker start --pool "
        f"{pools.train}"
    )
    return 0


def _loop_settings(args: argparse.Namespace, command: str) -> tuple[Any, Path]:
    """The continuous loop's settings and model folder (serve, deploy), with the server
    checked and this process pointed at the Prefect API."""
    args.workdir = args.workdir.resolve()
    if args.db is None:
        args.db = f"sqlite:///{args.workdir}/flywheel.db"
    if args.weights == "merged":
        raise FlowError(
            f"flywheel {command} serves LoRA versions: with merged weights, its one server would "
            "answer live traffic with a candidate while evaluating it"
        )
    settings = run_settings(args, weights="lora", replicas=args.replica or [])
    if settings.reviewer is not None:
        raise FlowError(
            f"flywheel {command} uses a reviewer already running: --reviewer-url, --reviewer-model"
        )
    if settings.source != "generated" and not keys("FLYWHEEL_API_KEYS"):
        raise FlowError(
            f"--source {settings.source} captures agent traffic, which needs API keys: set "
            "FLYWHEEL_API_KEYS (comma-separated), and give each agent one"
        )
    model_path = model_folder(args.model, args.models).resolve()
    for url in (args.server_url, *settings.replicas):
        preflight(settings.db_url, url, model_path.name)
    _use_local_prefect(args.workdir, args.prefect_port)
    return settings, model_path


def worker(args: argparse.Namespace) -> int:
    import anyio

    from agents.policy import Endpoint, PolicyClient
    from memory.store import open_store
    from workers import worker

    engine = open_store(db_url(args))
    settings = worker.WorkerSettings(
        lease_s=args.lease,
        lot_size=args.lot_size,
        concurrency=args.concurrency,
        outage_s=args.outage,
    )
    reviewer = None
    if args.reviewer_url and args.reviewer_model:
        reviewer = Endpoint(PolicyClient(args.reviewer_url), args.reviewer_model)
    owner = worker.new_owner()
    idle = worker.IdleClock(engine, args.idle_exit)
    print(f"worker {owner}: collecting from {args.server_url}; Ctrl-C stops it", file=sys.stderr)
    stored = anyio.run(
        lambda: worker.work(
            engine, args.server_url, owner, settings, worker.Shift(idle.expired),
            reviewer=reviewer,
        )
    )  # fmt: skip
    print(f"worker {owner}: stored {stored} groups", file=sys.stderr)
    return 0


def preflight(db_url: str, server_url: str, model: str, wait_s: float = 10.0) -> None:
    """A server named on the command line must generate now: a wrong URL fails at once. A
    merged-weights server may hold any version's weights: the first stage swaps them."""
    from functools import partial

    import anyio

    from memory.store import open_store
    from workers.readiness import Readiness

    readiness = Readiness(open_store(db_url), server_url, outage_s=wait_s)
    anyio.run(partial(readiness.ensure, model, any_weights=True))


def _run_flow(settings: Any, server_url: str, served_name: str, model_path: Path) -> Any:
    import anyio

    from flows.flywheel import flywheel_run

    return anyio.run(flywheel_run, settings, server_url, served_name, str(model_path))


def _report(summary: Any, path: Path | None) -> None:
    from reports.summary import format_table

    print(format_table(summary))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        from memory.folders import atomic_file

        with atomic_file(path) as out:
            out.write(json.dumps(summary.model_dump(mode="json"), indent=2) + "\n")
        print(f"summary written to {path}")
    page = f".venv/bin/flywheel ui --db {summary.db_url}"
    print(f"watch and steer it: {page} (it prints the link to the page)")


def _use_local_prefect(workdir: Path, port: int) -> None:
    """Point this process at `PREFECT_API_URL`, else at the local server (started once)."""
    from flows import orchestrator

    url = orchestrator.api_url(workdir.resolve() / "prefect", port)
    os.environ["PREFECT_API_URL"] = url
    print(f"Prefect API {url} (UI: {url.removesuffix('/api')})", file=sys.stderr)


@contextlib.contextmanager
def _prefect(args: argparse.Namespace) -> Iterator[None]:
    """Point this process at `PREFECT_API_URL`, else at the local server (`--prefect local`,
    started once and left running), else at a server of its own (`--prefect temporary`),
    stopped when the block ends, and with this process were it killed."""
    from flows import orchestrator

    if args.prefect == "local":
        _use_local_prefect(args.workdir, args.prefect_port)
    if orchestrator.configured():
        yield
        return
    with orchestrator.temporary() as url, orchestrator.using(url):
        yield


def run_settings(args: argparse.Namespace, **fixed: Any) -> Any:
    """Run settings from defaults, --config and flags; checked, with the store opened once."""
    from memory.store import open_store
    from verifiers.catalog import check, has_worked_example
    from verifiers.errors import VerifierError

    fixed = {"db_url": db_url(args), "workdir": args.workdir, **fixed}
    settings = flags.run_settings(args, fixed)
    check(settings.taskset)
    generates = settings.source != "captured"  # captured traffic alone guides no attempt
    if (
        generates
        and settings.collect.guided_fraction > 0
        and not has_worked_example(settings.taskset)
    ):
        raise VerifierError(
            f"task set {settings.taskset!r} has no worked example for guided attempts to show: "
            "give it one, or run with --guided-fraction 0"
        )
    open_store(settings.db_url).dispose()
    return settings
