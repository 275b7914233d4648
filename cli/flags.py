"""The flags of `flywheel run` and `flywheel serve`, generated from the `RunSettings` fields.

Each setting is defined once, in its settings class (type, default, bounds, description); the
TOML file and these flags both fill it. `FLAGGED` names the settings a flag may set; the flag is
the setting's name with dashes (`collect.group_size` is `--group-size`, `train.mode` is
`--mode`), or its name in `RENAMED` (a method's switch is the method's flag: `--revise`).
"""

from __future__ import annotations

import argparse
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from flows.settings import RunSettings, load_run_settings

FLAGGED = (
    "rounds",
    "minutes",
    "tasks",
    "overlap",
    "max_staleness",
    "collect.group_size",
    "eval_tasks",
    "taskset",
    "source",
    "judge",
    "siblings",
    "evaluation",
    "gate.held_out_share",
    "collect.temperature",
    "collect.guided_fraction",
    "collect.own_examples",
    "collect.strategy.enabled",
    "collect.retry.enabled",
    "collect.retry.reflection",
    "collect.insights",
    "collect.revise.enabled",
    "collect.revise.revisions",
    "collect.nudge",
    "collect.anneal.enabled",
    "reviewer",
    "reviewer_url",
    "reviewer_model",
    "library.enabled",
    "weights",
    "outcome.bonus",
    "outcome.repeat_penalty",
    "train.mode",
    "train.learning_rate",
    "train.epochs",
    "train.batch_order",
    "train.dtype",
    "train.processes",
)
RENAMED = {
    "outcome.bonus": "--outcome-bonus",
    "train.processes": "--train-processes",
    "train.dtype": "--train-dtype",
    "collect.strategy.enabled": "--sge",
    "collect.retry.enabled": "--reflect-retry",
    "collect.revise.enabled": "--revise",
    "collect.anneal.enabled": "--anneal",
    "library.enabled": "--library",
}


def flag(key: str) -> str:
    return RENAMED.get(key) or "--" + key.rsplit(".", 1)[-1].replace("_", "-")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config` and one flag per flagged setting; every flag defaults to unset (None)."""
    parser.add_argument(
        "--config", type=Path, default=None, help="TOML file of run settings (flags win over it)"
    )
    for key in FLAGGED:
        field, default = _field(key)
        kind, choices = _kind(field.annotation)
        # argparse formats help with %: a description's own % is text.
        text = (field.description or key.replace("_", " ")).replace("%", "%%")
        shown = int(default) if isinstance(default, bool) else default
        parser.add_argument(
            flag(key),
            type=kind,
            choices=choices,
            default=None,
            metavar="{0,1}" if kind is _zero_or_one else None,
            help=f"{text} (default {'none' if shown is None else shown})",
        )


def run_settings(args: argparse.Namespace, fixed: dict[str, Any]) -> RunSettings:
    """Defaults, then `--config`, then the flags given; a bad value names its flag."""
    overrides = dict(fixed)
    for key in FLAGGED:
        value = getattr(args, flag(key).lstrip("-").replace("-", "_"))
        if value is not None:
            overrides[key] = value
    return load_run_settings(args.config, overrides, {key: flag(key) for key in FLAGGED})


def _field(key: str) -> tuple[FieldInfo, Any]:
    """A setting's field, and its default in a run (a table's defaults may be the run's own:
    `collect`'s temperature)."""
    model: type[BaseModel] = RunSettings
    default: Any = _run_defaults()
    *tables, leaf = key.split(".")
    for table in tables:
        nested = model.model_fields[table].annotation
        assert isinstance(nested, type) and issubclass(nested, BaseModel)
        model, default = nested, getattr(default, table)
    return model.model_fields[leaf], getattr(default, leaf)


@cache
def _run_defaults() -> RunSettings:
    return RunSettings()


def _kind(annotation: Any) -> tuple[Any, list[str] | None]:
    """The argparse type (and choices) of a setting; booleans are 0 or 1 on the command line."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return str, [str(choice) for choice in typing.get_args(annotation)]
    if annotation is bool:
        return _zero_or_one, None
    return annotation, None


def _zero_or_one(text: str) -> int:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 or 1, not {text!r}")
    return int(text)
