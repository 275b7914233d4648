"""The `flywheel` command's parser: one subcommand a function, each with its `--help`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, NoReturn, get_args

from cli import admin, arguments, export, flags, inspection, launch
from memory.records import AdvantageMode

MODES = get_args(AdvantageMode)
EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse, its errors in the one-line form of every other error (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"flywheel: error: {self.prog.removeprefix('flywheel ')}: "
                                  f"{message}\n")  # fmt: skip


def build() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flywheel",
        description="A data flywheel for LLM agents: collect, verify, remember, train, serve.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _run_command(commands)
    _serve_model_command(commands)
    _serve_command(commands)
    _export_command(commands)
    _worker_command(commands)
    _gateway_command(commands)
    _promote_command(commands)
    _rollback_command(commands)
    _status_command(commands)
    _lineage_command(commands)
    _library_command(commands)
    _strategies_command(commands)
    _report_command(commands)
    _ui_command(commands)
    _sandbox_command(commands)
    _prepare_model_command(commands)
    _migrate_command(commands)
    return parser


def _run_command(commands: Any) -> None:
    run = commands.add_parser("run", help="run flywheel rounds: collect, train, swap, evaluate")
    flags.add_run_arguments(run)
    _db_arguments(run)
    _model_argument(run)
    run.add_argument(
        "--server-url", default=None, help="use this running vLLM server instead of starting one"
    )
    run.add_argument(
        "--server-python",
        type=Path,
        default=arguments.DEFAULT_SERVER_PYTHON,
        help="python of the model server's environment (default: the installation's .venv-serving)",
    )
    run.add_argument(
        "--port", type=arguments.port, default=8011, help="port for the started server"
    )
    run.add_argument("--summary-json", type=Path, default=None, help="write the summary here")
    run.add_argument(
        "--prefect",
        choices=("local", "temporary"),
        default=os.environ.get("FLYWHEEL_PREFECT", "local"),
        help="local: a Prefect server kept running between runs, whose UI shows them "
        "(default); temporary: one for this run only. PREFECT_API_URL wins over both.",
    )
    run.add_argument(
        "--prefect-port", type=arguments.port, default=4200, help="local Prefect server port"
    )
    run.set_defaults(handler=launch.run)


def _serve_model_command(commands: Any) -> None:
    model_server = commands.add_parser(
        "serve-model", help="run a supervised vLLM server (restarted when it stops generating)"
    )
    model_server.add_argument("--model", default="smollm2")
    _models_argument(model_server)
    model_server.add_argument("--workdir", type=Path, default=Path(".flywheel"))
    model_server.add_argument("--server-python", type=Path, default=arguments.DEFAULT_SERVER_PYTHON)
    model_server.add_argument("--port", type=arguments.port, default=8011)
    model_server.add_argument(
        "--probe-interval",
        type=float,
        default=10.0,
        help="seconds between generation probes (default 10)",
    )
    model_server.add_argument(
        "--weights",
        choices=("lora", "merged"),
        default="lora",
        help="serve new versions as LoRA adapters (default), or merged weights reloaded in "
        "place (vLLM's dev routes, on loopback only)",
    )
    model_server.set_defaults(handler=admin.serve_model)


def _serve_command(commands: Any) -> None:
    looped = commands.add_parser(
        "serve",
        help="the continuous loop: Prefect deployments that collect on an interval and train "
        "once enough groups exist, on a local Prefect server kept running, and the gateway",
    )
    _loop_arguments(looped)
    looped.add_argument(
        "--gateway-port",
        type=arguments.port,
        default=None,
        help="also serve the gateway on this port",
    )
    looped.set_defaults(handler=launch.serve)
    deploying = commands.add_parser(
        "deploy",
        help="the continuous loop as deployments on Prefect work pools, run by `prefect worker "
        "start --pool ...` on any machine",
    )
    _loop_arguments(deploying)
    deploying.add_argument("--collect-pool", default="flywheel-collect", help="collection pool")
    deploying.add_argument("--train-pool", default="flywheel-train", help="training pool")
    deploying.add_argument(
        "--helpers", type=int, default=1, help="drain runs started beside each collection run (1)"
    )
    deploying.add_argument("--lease", type=float, default=120.0, help="lease seconds (120)")
    deploying.set_defaults(handler=launch.deploy)


def _loop_arguments(looped: Any) -> None:
    flags.add_run_arguments(looped)
    _db_arguments(looped)
    _model_argument(looped)
    looped.add_argument("--server-url", required=True, help="the running model server")
    looped.add_argument(
        "--replica",
        action="append",
        default=None,
        metavar="URL",
        help="another model server serving the same versions (repeat for several): new "
        "versions are loaded on each, collection spreads over them",
    )
    looped.add_argument(
        "--every", type=float, default=600.0, help="seconds between collection batches (600)"
    )
    looped.add_argument(
        "--train-every", type=float, default=60.0, help="seconds between training checks (60)"
    )
    looped.add_argument(
        "--min-groups", type=int, default=None, help="complete groups a round waits for (--tasks)"
    )
    looped.add_argument(
        "--prefect-port", type=arguments.port, default=4200, help="local Prefect server port"
    )


def _export_command(commands: Any) -> None:
    exporting = commands.add_parser(
        "export", help="training rows (token ids, labels, advantages, weights) as JSON lines"
    )
    exporting.add_argument(
        "--round", type=int, default=None, help="one round's groups (default all)"
    )
    exporting.add_argument(
        "--mode",
        choices=get_args(AdvantageMode),
        default=None,
        help="advantage mode (default filtered)",
    )
    exporting.add_argument("--out", type=Path, required=True, help="the JSON-lines file to write")
    exporting.add_argument(
        "--segments",
        action="store_true",
        help="instead: every attempt of the complete groups with its token segments "
        "(ids, behaviour logprobs, loss type, weight, advantage)",
    )
    exporting.add_argument(
        "--session", default=None, help="instead: one captured session, its episode and turns"
    )
    _db_arguments(exporting)
    exporting.set_defaults(handler=export.export)
    forgetting = commands.add_parser(
        "forget", help="delete a captured session: its turns and the train groups that adopted it"
    )
    forgetting.add_argument("--session", required=True)
    _db_arguments(forgetting)
    forgetting.set_defaults(handler=export.forget)


def _worker_command(commands: Any) -> None:
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
    collector.set_defaults(handler=launch.worker)


def _gateway_command(commands: Any) -> None:
    gateway = commands.add_parser(
        "gateway", help="serve the OpenAI-compatible gateway in front of vLLM servers"
    )
    gateway.add_argument(
        "--upstream", action="append", required=True, help="a vLLM server URL (repeat for several)"
    )
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=arguments.port, default=8000)
    _db_arguments(gateway)
    gateway.add_argument("--model", default="smollm2", help="the base model the upstreams serve")
    _models_argument(gateway)
    gateway.add_argument("--alias", default="policy", help="stable model name (default policy)")
    gateway.add_argument(
        "--min-gain",
        type=float,
        default=0.0,
        help="gain over the serving version needed to promote (held-out pass@1, or a margin)",
    )
    gateway.add_argument(
        "--capture", action="store_true", help="record chat traffic as trajectories in the store"
    )
    gateway.add_argument(
        "--held-out-share",
        type=float,
        default=0.2,
        help="share of captured sessions kept to judge new versions, never trained on (0.2)",
    )
    gateway.add_argument(
        "--taskset",
        default=None,
        help="a task set whose verifier scores feedback that sends a reference answer",
    )
    gateway.add_argument(
        "--rate", type=float, default=20.0, help="requests a second each key may send (20)"
    )
    gateway.add_argument(
        "--burst", type=int, default=60, help="requests each key may send at once (60)"
    )
    gateway.set_defaults(handler=admin.gateway)


def _promote_command(commands: Any) -> None:
    promote = commands.add_parser("promote", help="point the alias at a version (gated)")
    promote.add_argument("version")
    promote.add_argument("--force", action="store_true", help="skip the evaluation gate")
    promote.add_argument("--min-gain", type=float, default=0.0)
    _store_arguments(promote)
    promote.set_defaults(handler=admin.promote)


def _rollback_command(commands: Any) -> None:
    rollback = commands.add_parser("rollback", help="point the alias back at the previous version")
    _store_arguments(rollback)
    rollback.set_defaults(handler=admin.rollback)


def _status_command(commands: Any) -> None:
    status = commands.add_parser("status", help="the serving version, versions, recent rounds")
    _db_arguments(status)
    status.add_argument(
        "--prefect-port",
        type=arguments.port,
        default=4200,
        help="local Prefect server port, for its pools",
    )
    status.set_defaults(handler=inspection.status)


def _lineage_command(commands: Any) -> None:
    lineage = commands.add_parser(
        "lineage", help="the rounds, groups and parents that produced a version"
    )
    lineage.add_argument("version")
    lineage.add_argument(
        "--groups", action="store_true", help="also list each round's groups (id: task)"
    )
    _db_arguments(lineage)
    lineage.set_defaults(handler=inspection.lineage)


def _library_command(commands: Any) -> None:
    lessons = commands.add_parser(
        "library", help="the experience library's lessons, or one lesson's history (--lesson)"
    )
    lessons.add_argument(
        "--lesson", "--entry", type=int, default=None, help="where one was used, what it did"
    )
    lessons.add_argument("--top", type=int, default=20, help="lessons to list, by utility")
    _db_arguments(lessons)
    lessons.set_defaults(handler=inspection.library)


def _strategies_command(commands: Any) -> None:
    strategies = commands.add_parser(
        "strategies", help="success rate per strategy (SGE) over first attempts"
    )
    strategies.add_argument("--taskset", default=None, help="one task set (default all)")
    strategies.add_argument("--top", type=int, default=20, help="strategies to list, most tried")
    _db_arguments(strategies)
    strategies.set_defaults(handler=inspection.strategies)


def _report_command(commands: Any) -> None:
    report = commands.add_parser(
        "report", help="an HTML page of plots from the store, and its table on stdout"
    )
    _db_arguments(report)
    report.add_argument(
        "--out", type=Path, default=None, help="HTML file (default WORKDIR/report.html)"
    )
    report.set_defaults(handler=inspection.report_html)


def _ui_command(commands: Any) -> None:
    ui = commands.add_parser(
        "ui", help="the page to watch the flywheel and steer it, from a store (no gateway needed)"
    )
    _db_arguments(ui)
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=arguments.port, default=8300)
    ui.set_defaults(handler=inspection.ui)


def _sandbox_command(commands: Any) -> None:
    sandbox = commands.add_parser(
        "sandbox", help="which isolation model-written code gets on this host"
    )
    sandbox.set_defaults(handler=admin.sandbox)


def _prepare_model_command(commands: Any) -> None:
    prepare = commands.add_parser("prepare-model", help="build the model folder (cached)")
    prepare.add_argument("--model", default="smollm2", choices=arguments.MODELS)
    _models_argument(prepare)
    prepare.set_defaults(handler=admin.prepare_model)


def _migrate_command(commands: Any) -> None:
    migrate = commands.add_parser(
        "migrate",
        help="upgrade the store's schema to this flywheel's, under a lock (the one step that "
        "migrates; flywheel run does it for its own store)",
    )
    _db_arguments(migrate)
    migrate.set_defaults(handler=admin.migrate)


def _db_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=None, help="database URL (default SQLite in the workdir)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(".flywheel"),
        help="adapters, logs and the default database (default .flywheel, here)",
    )


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    _db_arguments(parser)
    parser.add_argument(
        "--gateway-url",
        default=None,
        help="go through this running gateway, which serves the version before recording it "
        "(admin key from FLYWHEEL_ADMIN_KEYS; its own gate applies)",
    )


def _model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (default), tiny (random, for tests) or a model folder",
    )
    _models_argument(parser)


def _models_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        type=Path,
        default=arguments.MODELS_DIR,
        help="where named models are built, once (default: the installation's "
        f"{arguments.MODELS_DIR}; FLYWHEEL_HOME moves it)",
    )
