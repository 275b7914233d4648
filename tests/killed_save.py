"""Training rounds that SIGKILL themselves inside a save, for tests/test_killed_saves.py.

`python -m tests.killed_save ROOT MODEL` imports the trainer once, then for each line
`NAME KILL_AT SEED LOG` on stdin forks a child that trains a small round (a save every step);
at the KILL_AT-th file the saves write (the trainer's checkpoints, or the adapter it publishes:
safetensors, torch archives, JSON state), a timer of a few milliseconds kills the child with
SIGKILL, so the kill lands inside or right after a real write. KILL_AT 0 never kills. The
child's output goes to LOG (the round's result as JSON when it lives); the parent answers each
line with the child's exit code (-9: killed). Forking spares each round the trainer's import,
most of a fresh process's time.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from tests.helpers import make_group
from trainer import round as training
from trainer.settings import TrainSettings

SETTINGS = TrainSettings(epochs=1, batch_size=2, learning_rate=1e-3, save_steps=1, mode="grpo")


def train_until_killed(root: Path, model: Path, name: str, kill_at: int, seed: int) -> None:
    rng = random.Random(seed)
    writes = [0]

    def counted(write: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            writes[0] += 1
            if writes[0] == kill_at:
                delay = rng.uniform(0.0, 0.004)
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return write(*args, **kwargs)

        return wrapper

    torch.save = counted(torch.save)
    safetensors.torch.save_file = counted(safetensors.torch.save_file)
    json.dump = counted(json.dump)
    groups = [make_group([1.0, 0.0, 0.0, 1.0], task_id=f"t{i}", completion_len=6) for i in range(3)]
    result = training.train_round(
        groups, base_model=model, parent_adapter=None, adapters_root=root, name=name,
        settings=SETTINGS,
    )  # fmt: skip
    print(json.dumps({"resumed_from_step": result.resumed_from_step, "writes": writes[0]}))


def forked(log: Path, round_: Callable[[], None]) -> int:
    """Run `round_` in a child whose stdout and stderr go to `log`; its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with log.open("w") as out:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                round_()
            code = 0
        except BaseException:  # noqa: BLE001 - reported in the log, as a fresh process would
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    logging.basicConfig(level=logging.INFO)  # the trainer says where it resumes from
    root, model = Path(sys.argv[1]), Path(sys.argv[2])
    for line in sys.stdin:
        name, kill_at, seed, log = line.split()
        round_ = partial(train_until_killed, root, model, name, int(kill_at), int(seed))
        print(forked(Path(log), round_), flush=True)


if __name__ == "__main__":
    main()
