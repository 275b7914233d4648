"""Task sets from outside the project: `module:attribute`, or a name a package registers.

1. `--taskset my_tasks:arithmetic` imports `my_tasks` (the working directory first, as uvicorn
   and Prefect do) and reads its `arithmetic`: a `TaskSet`, or any object (a module, a class)
   with the same names.
2. An installed package can register a short name in the `flywheel.tasksets` entry-point group:
   `[project.entry-points."flywheel.tasksets"] arithmetic = "my_tasks:arithmetic"`.
3. The name is what the stores record as each task's task set, so a worker on another machine
   finds the same plugin by it: install the plugin (or start the worker in its folder) there too.
4. A plugin that cannot be imported, lacks a part, or has one of the wrong kind ends the
   command with one line that names the plugin and what is wrong.
5. `function` finds other callables the same way (a user's own evaluation of their agent).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from verifiers.errors import VerifierError
from verifiers.taskset import TaskSet, from_object

GROUP = "flywheel.tasksets"
MAX_NAME = 100  # the stores' task-set column
CALLABLES = ("train_tasks", "eval_tasks", "verify", "environment")
FIELDS = tuple(TaskSet.__dataclass_fields__)


def registered() -> dict[str, str]:
    """The names installed packages register, each with its `module:attribute`."""
    return {point.name: point.value for point in entry_points(group=GROUP)}


def load(name: str) -> TaskSet:
    """The task set a plugin name stands for, checked."""
    if len(name) > MAX_NAME:
        raise VerifierError(f"task set name {name[:40]!r}... is longer than {MAX_NAME} characters")
    target = registered().get(name, name)
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise VerifierError(f"task set {name!r}: a plugin is named module:attribute")
    found = getattr(_module(f"task set {name!r}", module_name), attribute, None)
    if found is None:
        raise VerifierError(f"task set {name!r}: module {module_name!r} has no {attribute!r}")
    if not isinstance(found, TaskSet) and not any(hasattr(found, f) for f in FIELDS):
        kind = type(found).__name__
        raise VerifierError(f"task set {name!r} is a {kind}, not a TaskSet (docs/tasksets.md)")
    try:
        taskset = from_object(found)
    except Exception as exc:  # noqa: BLE001 - a plugin's own code, reported in one line
        raise VerifierError(f"task set {name!r}: {type(exc).__name__}: {exc}") from exc
    _check(name, taskset)
    return taskset


def function(spec: str, what: str) -> Callable[..., Any]:
    """The callable a `module:attribute` spec names (imported as a task set is), for `what`
    (e.g. "evaluation", in errors)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise VerifierError(f"{what} {spec!r}: name a callable as module:attribute")
    found: object = getattr(_module(f"{what} {spec!r}", module_name), attribute, None)
    if not callable(found):
        raise VerifierError(
            f"{what} {spec!r}: module {module_name!r} has no callable {attribute!r}"
        )
    return found


def _module(label: str, module_name: str) -> Any:
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and f"{module_name}.".startswith(f"{exc.name}."):
            raise VerifierError(
                f"{label}: no module {module_name!r} here "
                "(start the command in the folder that holds it, or install it)"
            ) from exc
        raise VerifierError(f"{label}: importing {module_name} failed: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a plugin's own code, reported in one line
        raise VerifierError(
            f"{label}: importing {module_name} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _check(name: str, taskset: TaskSet) -> None:
    missing = taskset.missing()
    if missing:
        raise VerifierError(
            f"task set {name!r} has no {', '.join(missing)} (a task set needs train_tasks, "
            "eval_tasks and verify, or an environment)"
        )
    for field in CALLABLES:
        value: Callable[..., Any] | None = getattr(taskset, field)
        if value is not None and not callable(value):
            raise VerifierError(f"task set {name!r}: {field} is not callable")
    if not isinstance(taskset.system_prompt, str) or not taskset.system_prompt.strip():
        raise VerifierError(f"task set {name!r}: system_prompt must be a non-empty string")
    example = taskset.worked_example
    pair = isinstance(example, tuple) and len(example) == 2
    if example is not None and not (pair and all(isinstance(x, str) for x in example)):
        raise VerifierError(f"task set {name!r}: worked_example must be (question, solution)")
