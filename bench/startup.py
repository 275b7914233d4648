"""Start-up benchmark: the policy's and the reviewer's servers one after the other, and side by
side as `flywheel run --reviewer` starts them (both launched before either is waited on, each
pinned to cores of its own, `cli.launch._start`). Seconds from the first launch until both
generate.

    .venv/bin/python bench/startup.py [--reviewer qwen2.5-coder-0.5b] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from smollm2_server import fixed_server  # noqa: E402

from cli.launch import _start  # noqa: E402
from reports.table import text_table  # noqa: E402
from serving.model import REVIEWERS, prepare_parted, prepare_smollm2  # noqa: E402
from serving.server import ServerSettings, side_by_side  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reviewer", choices=sorted(REVIEWERS), default="qwen2.5-coder-0.5b")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    models = ROOT / ".flywheel" / "models"
    logs = Path(tempfile.mkdtemp(prefix="startup-"))
    policy = fixed_server(prepare_smollm2(models), args.port, "policy.log", None, "float32", logs)
    reviewer = fixed_server(
        prepare_parted(REVIEWERS[args.reviewer], models), args.port + 1, "reviewer.log", None,
        "float32", logs,
    )  # fmt: skip
    pair = side_by_side(policy.model_copy(update={"weights": "merged"}), reviewer)
    seconds = {
        "one after the other": started(*pair, together=False),
        "side by side": started(*pair, together=True),
    }
    rows = [(how, f"{s:.0f}") for how, s in seconds.items()]
    print(text_table(("servers started", "seconds until both generate"), rows))
    print(f"saved: {seconds['one after the other'] - seconds['side by side']:.0f} s")
    if args.json:
        figures: dict[str, Any] = {"reviewer": args.reviewer, "seconds": seconds}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


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
