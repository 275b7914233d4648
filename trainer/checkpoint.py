"""Atomic checkpoint publishing: write to a staging folder, mark it complete, rename into place.

A reader that sees a folder under the checkpoint root without the marker ignores it, so a round
killed while saving never poisons a later promotion.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainer.errors import TrainerError

MARKER = "COMPLETE"
STAGING_PREFIX = ".staging-"


def staging_dir(root: Path, name: str) -> Path:
    path = root / f"{STAGING_PREFIX}{name}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def publish(staging: Path, root: Path, name: str) -> Path:
    target = root / name
    if target.exists():
        raise TrainerError(f"checkpoint {target} already exists; version names must be new")
    (staging / MARKER).write_text("ok\n")
    _fsync_dir(staging)
    os.rename(staging, target)
    _fsync_dir(root)
    return target


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
