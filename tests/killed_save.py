"""A training round that SIGKILLs itself inside a save, for tests/test_killed_saves.py.

`python -m tests.killed_save ROOT MODEL NAME KILL_AT SEED`: trains a small round (a save every
step), and at the KILL_AT-th file the saves write (the trainer's checkpoints, or the adapter it
publishes: safetensors, torch archives, JSON state) starts a timer of a few milliseconds that
kills the process with SIGKILL, so the kill lands inside or right after a real write. KILL_AT 0
never kills. Prints the round's result as JSON when it lives.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from tests.helpers import make_group
from trainer import round as training
from trainer.settings import TrainSettings

SETTINGS = TrainSettings(epochs=1, batch_size=2, learning_rate=1e-3, save_steps=1, mode="grpo")


def main() -> None:
    logging.basicConfig(level=logging.INFO)  # the trainer says where it resumes from
    root, model, name, kill_at, seed = sys.argv[1:6]
    rng = random.Random(int(seed))
    writes = [0]

    def counted(write: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            writes[0] += 1
            if writes[0] == int(kill_at):
                delay = rng.uniform(0.0, 0.004)
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return write(*args, **kwargs)

        return wrapper

    torch.save = counted(torch.save)
    safetensors.torch.save_file = counted(safetensors.torch.save_file)
    json.dump = counted(json.dump)
    groups = [make_group([1.0, 0.0, 0.0, 1.0], task_id=f"t{i}", completion_len=6) for i in range(3)]
    result = training.train_round(
        groups, base_model=Path(model), parent_adapter=None, adapters_root=Path(root),
        name=name, settings=SETTINGS,
    )  # fmt: skip
    print(json.dumps({"resumed_from_step": result.resumed_from_step, "writes": writes[0]}))


if __name__ == "__main__":
    main()
