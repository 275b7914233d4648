"""The `flywheel` command: its error boundary. Every command has `--help`, fails with one line
(`flywheel: error: ...`) and exit code 2 on bad input or an infrastructure failure, and logs
progress on stderr. The parser is `cli.parser`; the commands live by kind: `cli.launch` (run,
serve, deploy, worker), `cli.inspection` (status, lineage, library, strategies, report),
`cli.admin` (the model server, the gateway, promotion, the sandbox, migrations, models) and
`cli.export`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from cli.parser import EXIT_BAD_INPUT, build
from flows.errors import FlowError

EXIT_TERMINATED = 128 + signal.SIGTERM


class _Terminated(KeyboardInterrupt):
    """SIGTERM, unwound as Ctrl-C is: the model servers and the gateway a command started stop
    on the way out, not some seconds after it."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    _disarm()
    raise _Terminated


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _disarm()
    raise KeyboardInterrupt


def _disarm() -> None:
    """Once a command unwinds, a further SIGTERM (a supervisor's again, or a benchmark's after
    the Ctrl-C it shared) must not cut short the cleanup that stops its model servers."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    # A training process next to the model server must not spin on OpenMP waits; set before torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        args = build().parse_args(argv)
    except SystemExit as done:  # --help, or a bad argument already reported in one line
        return done.code if isinstance(done.code, int) else EXIT_BAD_INPUT
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpx2", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with _terminated_as_interrupt():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.handler(args) or 0)
    except _Terminated:
        print("flywheel: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("flywheel: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI boundary turns known failures into one line
        line = _one_line(exc)
        if line is None:
            raise
        print(f"flywheel: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM raises `_Terminated` while a command runs (in the main thread, where signals
    land), and the first SIGTERM or Ctrl-C disarms SIGTERM for the unwinding; the handlers
    before are put back after. A Ctrl-C that was ignored (a background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _terminate)
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


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
    if isinstance(exc, OSError):  # a full disk, an unwritable path: the operator's to fix
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    known = (AgentError, StoreError, ServingError, TrainerError, VerifierError, FlowError)
    return str(exc).strip().splitlines()[0] if isinstance(exc, known) and str(exc) else None


if __name__ == "__main__":
    sys.exit(main())
