"""A round in several processes, one per GPU: `train(RoundRequest)` is every round's entry.

With `processes = 1` the round trains in this process. Above that, `train` writes the round's
request (its groups, paths and settings) to a folder beside the checkpoints and starts

    python -m torch.distributed.run --standalone --nproc_per_node N -m trainer.distributed REQUEST

(the launcher `accelerate launch --multi_gpu` runs too). In each process TRL's trainer finds the
process group through accelerate: every process builds the same rows, each batch is split across
them and the gradients are averaged (NCCL on GPUs, gloo on CPU). The main process publishes the
adapter and writes the result that `train` returns. A process that fails fails the round with
its own error (the end of the log when it could not say); the round's saves let the same name
resume.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from memory.records import Group
from trainer.errors import TrainerError
from trainer.round import RoundResult, train_round
from trainer.settings import TrainSettings

log = logging.getLogger(__name__)

REQUEST = "request.json"
RESULT = "result.json"


class RoundRequest(BaseModel):
    """Everything a training process needs to run `train_round`."""

    model_config = ConfigDict(frozen=True)

    groups: list[Group]
    base_model: Path
    parent_adapter: Path | None
    adapters_root: Path
    name: str
    settings: TrainSettings


def train(request: RoundRequest) -> RoundResult:
    """`train_round` in this process, or across `settings.processes` processes."""
    processes, root = request.settings.processes, request.adapters_root
    if processes == 1:
        return run(request)
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".launch-{request.name}-", dir=root))
    try:
        (folder / REQUEST).write_text(request.model_dump_json())
        _launch(folder / REQUEST, processes)
        return RoundResult.model_validate_json((folder / RESULT).read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(request: RoundRequest) -> RoundResult:
    return train_round(
        request.groups,
        base_model=request.base_model,
        parent_adapter=request.parent_adapter,
        adapters_root=request.adapters_root,
        name=request.name,
        settings=request.settings,
    )


def command(request: Path, processes: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "trainer.distributed",
        str(request),
    ]


def _launch(request: Path, processes: int) -> None:
    """Run the processes, echoing their log. A failure raises with the first process's error,
    or the log's last lines when no process could say."""
    log.info("training in %d processes", processes)
    tail: deque[str] = deque(maxlen=12)
    with subprocess.Popen(
        command(request, processes), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as launched:
        assert launched.stdout is not None
        for line in launched.stdout:
            sys.stderr.write(line)
            tail.append(line.rstrip())
    if launched.returncode == 0 and (request.parent / RESULT).is_file():
        return
    said = sorted(request.parent.glob("error-*.txt"))
    why = said[0].read_text() if said else " | ".join(line for line in tail if line)[-1500:]
    raise TrainerError(f"the {processes} training processes failed: {why}")


def main(argv: list[str]) -> int:
    """One training process: run the request; the main process writes the result."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path, rank = Path(argv[0]), os.environ.get("RANK", "0")  # torchrun numbers the processes
    try:
        result = run(RoundRequest.model_validate_json(path.read_text()))
    except Exception as exc:
        (path.parent / f"error-{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    if rank == "0":
        (path.parent / RESULT).write_text(result.model_dump_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
