"""A task set of one's own: which of two numbers is the larger.

From the project's folder (a plugin is found from the working directory, or installed):

    flywheel run --taskset examples.tasksets.larger:larger
    .venv/bin/python bench/tasksets.py --tasksets examples.tasksets.larger:larger

A task set names its train and held-out tasks and a verifier; the rest is optional. Tasks here are
(question, answer) pairs, and the answer is for `verify` only. `verify` may return a bool, a
reward in [0, 1] or a full `Verdict` with feedback lines for reflections. See docs/tasksets.md.
"""

from __future__ import annotations

import random

from verifiers.answer import extract_answer
from verifiers.task import Task
from verifiers.taskset import TaskSet

EVAL_SEED = 1_000_003  # held-out tasks come from a seed of their own
UNFORMATTED = 0.5  # the right number without answer tags


def train_tasks(count: int, seed: int) -> list[tuple[str, str]]:
    return [_pair(rng) for rng in _draws(count, seed)]


def eval_tasks(count: int) -> list[tuple[str, str]]:
    return [_pair(rng) for rng in _draws(count, EVAL_SEED)]


def verify(task: Task, completion: str) -> float:
    extraction = extract_answer(completion)
    if extraction.answer != task.answer:
        return 0.0
    return 1.0 if extraction.format_ok else UNFORMATTED


def _draws(count: int, seed: int) -> list[random.Random]:
    rng = random.Random(seed)
    return [random.Random(rng.getrandbits(64)) for _ in range(count)]


def _pair(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(10, 1000), 2)
    return f"Which is larger, {a} or {b}?", str(max(a, b))


larger = TaskSet(
    train_tasks=train_tasks,
    eval_tasks=eval_tasks,
    verify=verify,
    worked_example=(
        "Which is larger, 58 or 207?",
        "207 has three digits and 58 has two, so 207 is larger. <answer>207</answer>",
    ),
)
