"""What the commands share: the database URL, keys from the environment, model folders, and
checks on output paths made before any work starts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flows.errors import FlowError
from serving.model import REVIEWERS

MODELS = ("smollm2", "tiny", *REVIEWERS)


DEFAULT_SERVER_PYTHON = Path(".venv-serving/bin/python")


def db_url(args: argparse.Namespace) -> str:
    return args.db or f"sqlite:///{args.workdir}/flywheel.db"


def keys(variable: str) -> frozenset[str]:
    return frozenset(k.strip() for k in os.environ.get(variable, "").split(",") if k.strip())


def writable(path: Path | None, flag: str) -> None:
    """Fail now, before any work, if `path` cannot be written."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as exc:
        raise FlowError(f"{flag} {path} cannot be written: {exc.strerror or exc}") from exc


def model_folder(model: str, workdir: Path, flag: str = "--model") -> Path:
    from serving.model import prepare_parted, prepare_smollm2, prepare_tiny_llama

    cache_dir = workdir / "models"
    if model == "smollm2":
        return prepare_smollm2(cache_dir)
    if model == "tiny":
        return prepare_tiny_llama(cache_dir, prepare_smollm2(cache_dir))
    if model in REVIEWERS:
        return prepare_parted(REVIEWERS[model], cache_dir)
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise FlowError(f"{flag} {model!r} is none of {', '.join(MODELS)}, nor a model folder")
    return folder


def score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
