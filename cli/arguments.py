"""What the commands share: the database URL, keys from the environment, model folders, and
checks on output paths made before any work starts."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from flows.errors import FlowError
from serving.model import REVIEWERS

MODELS = ("smollm2", "tiny", *REVIEWERS)


# The installation: the project folder an editable install runs from, or FLYWHEEL_HOME. The
# model server's environment and the built models live there, whatever folder a command runs in.
HOME = Path(os.environ.get("FLYWHEEL_HOME") or Path(__file__).resolve().parent.parent)
DEFAULT_SERVER_PYTHON = HOME / ".venv-serving" / "bin" / "python"
MODELS_DIR = HOME / ".flywheel" / "models"


def port(text: str) -> int:
    """A TCP port, for argparse: 1-65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1-65535)")
    return value


def db_url(args: argparse.Namespace) -> str:
    return args.db or f"sqlite:///{args.workdir}/flywheel.db"


def keys(variable: str) -> frozenset[str]:
    return frozenset(k.strip() for k in os.environ.get(variable, "").split(",") if k.strip())


def writable(path: Path | None, flag: str) -> None:
    """Fail now, before any work, if `path` cannot be written (its folder takes a new file, and
    an existing `path` is a writable file); nothing is left behind."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
            raise (
                IsADirectoryError(21, "a folder")
                if path.is_dir()
                else PermissionError(13, "read-only")
            )
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise FlowError(f"{flag} {path} cannot be written: {exc.strerror or exc}") from exc


def model_folder(model: str, cache_dir: Path, flag: str = "--model") -> Path:
    """The folder `model` names: a named model, built in `cache_dir` the first time, or a model
    folder given by path."""
    from serving.model import prepare_named

    named = prepare_named(model, cache_dir)
    if named is not None:
        return named
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise FlowError(f"{flag} {model!r} is none of {', '.join(MODELS)}, nor a model folder")
    return folder
