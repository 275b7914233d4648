"""Start-up benchmark: the policy's and the reviewer's servers one after the other, and side by
side as `flywheel run --reviewer` starts them (both launched before either is waited on, each
pinned to cores of its own, `cli.launch._start`). Seconds from the first launch until both
generate.

    .venv/bin/python -m bench.startup [--reviewer qwen2.5-coder-0.5b] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Figure, provenance, write_results
from bench.smollm2_server import fixed_server
from cli.launch import _start
from reports.table import text_table
from serving.model import REVIEWERS, prepare_parted, prepare_smollm2
from serving.server import ServerSettings, side_by_side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reviewer", choices=sorted(REVIEWERS), default="qwen2.5-coder-0.5b")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--passes", type=int, default=2, help="of each order, alternating")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    made = provenance()
    models = ROOT / ".flywheel" / "models"
    logs = Path(tempfile.mkdtemp(prefix="startup-"))
    policy = fixed_server(prepare_smollm2(models), args.port, "policy.log", None, "float32", logs)
    reviewer = fixed_server(
        prepare_parted(REVIEWERS[args.reviewer], models), args.port + 1, "reviewer.log", None,
        "float32", logs,
    )  # fmt: skip
    pair = side_by_side(policy.model_copy(update={"weights": "merged"}), reviewer)
    passes: dict[str, list[float]] = {"one after the other": [], "side by side": []}
    for _ in range(args.passes):
        passes["one after the other"].append(started(*pair, together=False))
        passes["side by side"].append(started(*pair, together=True))
    rows = [(how, " ".join(f"{s:.0f}" for s in seconds)) for how, seconds in passes.items()]
    print(text_table(("servers started", "seconds until both generate"), rows))
    if args.json:
        payload = {"settings": {"reviewer": args.reviewer, "passes": args.passes},
                   "seconds": passes}  # fmt: skip
        figures = [Figure.mean(f"both generate, started {how}", seconds, "s")
                   for how, seconds in passes.items()]  # fmt: skip
        write_results(args.json, payload, made, figures)


def started(*servers: ServerSettings, together: bool) -> float:
    """Seconds until every server generates, started together or one at a time."""
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        if together:
            _start(stack, list(servers))
        else:
            for server in servers:
                _start(stack, [server])
        return time.monotonic() - began


if __name__ == "__main__":
    main()
