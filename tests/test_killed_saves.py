"""Reliability plan item 14, made real: the trainer process is SIGKILLed at random points inside
its real saves (checkpoints and the published adapter) at least 20 times. Every resume starts from
the newest save that is whole, and nothing torn is ever published."""

from __future__ import annotations

import json
import random
import re
import select
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import safetensors.torch

from memory import folders

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KILLS = 20


def whole(checkpoint: Path) -> bool:
    """Checked apart from the trainer's own test: state parses, weights and archives load."""
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
        for weights in checkpoint.glob("*.safetensors"):
            safetensors.torch.load_file(weights)
        for archive in checkpoint.glob("*.pt"):
            zipfile.ZipFile(archive).testzip()
    except Exception:  # noqa: BLE001 - any failure to read back means torn
        return False
    return True


def newest_whole(work: Path) -> str | None:
    saves = sorted(work.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return next((p.name for p in reversed(saves) if whole(p)), None)


def test_kills_inside_saves_resume_from_the_last_whole_save(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    rng = random.Random(7)
    kills, rounds, resumes = 0, 0, 0
    with trainer(tmp_path, tiny_model_path) as train:
        while kills < KILLS:
            name = f"policy-r{rounds}"
            expected = newest_whole(tmp_path / ".rounds" / name)
            code, log = train(name, rng.randint(1, 24), rng.randint(0, 10**6))
            resumed = re.search(r"resuming round \S+ from (checkpoint-\d+)", log)
            assert (resumed.group(1) if resumed else None) == expected, log[-2000:]
            resumes += resumed is not None
            published = tmp_path / name
            assert not published.exists() or folders.is_complete(published)
            if code == -9:
                kills += 1
                continue
            assert code == 0, log[-2000:]
            assert folders.is_complete(published) and whole_adapter(published)
            rounds += 1  # published: the next kills go into a new round
            shutil.rmtree(tmp_path / ".rounds", ignore_errors=True)
    assert resumes >= 5  # most kills left a whole save to resume from


@contextmanager
def trainer(root: Path, model: Path) -> Iterator[Callable[[str, int, int], tuple[int, str]]]:
    """`tests.killed_save`'s process: each call trains one round in a child of its own, killed
    at the given write; the child's exit code and output."""
    logs = root / "logs"
    logs.mkdir()
    command = [sys.executable, "-m", "tests.killed_save", str(root), str(model)]
    process = subprocess.Popen(
        command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout

    def train(name: str, kill_at: int, seed: int) -> tuple[int, str]:
        log = logs / f"{len(list(logs.iterdir()))}.log"
        stdin.write(f"{name} {kill_at} {seed} {log}\n")
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], 300)
        assert ready, f"no round ended in 300 s: {log.read_text()[-2000:]}"
        return int(stdout.readline()), log.read_text()

    try:
        yield train
    finally:
        stdin.close()
        process.wait(timeout=60)


def whole_adapter(folder: Path) -> bool:
    safetensors.torch.load_file(folder / "adapter_model.safetensors")
    return json.loads((folder / "adapter_config.json").read_text())["r"] > 0
