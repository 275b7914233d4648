"""Folders and files published atomically: checkpoints, merged model weights, prepared models,
exports, summaries and reports.

A folder is written under a staging name, flushed to disk, marked complete, and renamed into
place in one step; a reader ignores any folder without the marker, so a writer killed half-way
never leaves something that looks finished. A file is written beside its target under a hidden
name, flushed, and renamed over it (`atomic_file`): a full disk or a crash leaves the old file,
never half a new one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TextIO

from memory.errors import StoreError

MARKER = "COMPLETE"
REFERENCE = "reference.json"  # in a merged-weights folder: the trainer's own greedy outputs
STAGING_PREFIX = ".staging-"


@contextmanager
def atomic_file(path: Path) -> Iterator[TextIO]:
    """A text stream whose content replaces `path` only once all of it is on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, part = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.fchmod(handle, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # not mkstemp's 0600
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(part, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(part)
        raise


def staging_dir(root: Path, name: str) -> Path:
    """A fresh, empty staging folder for `root/name` (a stale one is removed)."""
    path = root / f"{STAGING_PREFIX}{name}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def publish(staging: Path, root: Path, name: str, replace: bool = False) -> Path:
    """Mark `staging` complete and move it to `root/name`, durably. An existing target is an
    error unless `replace` (a rebuilt cache, never a published version)."""
    target = root / name
    if target.exists():
        if not replace:
            raise StoreError(f"{target} already exists; published names must be new")
        shutil.rmtree(target)
    for path in staging.rglob("*"):
        if path.is_file():
            _fsync(path, os.O_RDONLY)
    (staging / MARKER).write_text("ok\n")
    _fsync(staging / MARKER, os.O_RDONLY)
    _fsync(staging, os.O_RDONLY)
    os.rename(staging, target)
    _fsync(root, os.O_RDONLY)
    return target


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
