"""Reliability plan item 14, made real: the trainer process is SIGKILLed at random points inside
its real saves (checkpoints and the published adapter) at least 20 times. Every resume starts from
the newest save that is whole, and nothing torn is ever published."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import zipfile
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
    while kills < KILLS:
        name = f"policy-r{rounds}"
        work = tmp_path / ".rounds" / name
        expected = newest_whole(work)
        kill_at = rng.randint(1, 24)
        done = subprocess.run(
            [sys.executable, "-m", "tests.killed_save", str(tmp_path), str(tiny_model_path),
             name, str(kill_at), str(rng.randint(0, 10**6))],
            capture_output=True, text=True, cwd=ROOT, timeout=300,
        )  # fmt: skip
        resumed = re.search(r"resuming round \S+ from (checkpoint-\d+)", done.stderr)
        assert (resumed.group(1) if resumed else None) == expected, done.stderr[-2000:]
        resumes += resumed is not None
        published = tmp_path / name
        assert not published.exists() or folders.is_complete(published)
        if done.returncode == -9:
            kills += 1
            continue
        assert done.returncode == 0, done.stderr[-2000:]
        assert folders.is_complete(published) and whole_adapter(published)
        rounds += 1  # published: the next kills go into a new round
        shutil.rmtree(tmp_path / ".rounds", ignore_errors=True)
    assert resumes >= 5  # most kills left a whole save to resume from


def whole_adapter(folder: Path) -> bool:
    safetensors.torch.load_file(folder / "adapter_model.safetensors")
    return json.loads((folder / "adapter_config.json").read_text())["r"] > 0
