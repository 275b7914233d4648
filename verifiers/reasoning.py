"""Reasoning-gym task sets at a difficulty the base model sometimes solves.

1. A task set is a named preset (a reasoning-gym generator, its difficulty config, a worked
   example), or `gym:NAME` for any of reasoning-gym's generators at its default difficulty.
2. Held-out (eval) tasks come from their own seed; train tasks are drawn from per-round seeds and
   never include a question that is in the held-out set, so evaluation measures generalisation.
3. `verify` scores a completion behind `extract_answer`, with reasoning-gym's own scorer or, for
   math presets, by symbolic equivalence with math-verify ("x = 13", "13.0" and "26/2" all match
   13). Extracted answers longer than `MAX_MATH_ANSWER` are not parsed: sympy must not be handed
   a model-sized expression to chew on.
4. A correct answer that contradicts the working right before it (`7 - 9 = 2. <answer>-2`)
   counts for pass@1 but earns no reward: rewarded, such answers taught a round that an
   answer's sign is free of its working, and it lost 29 held-out tasks to flipped signs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import math_verify
import reasoning_gym

from verifiers.answer import extract_answer
from verifiers.errors import VerifierError
from verifiers.task import Split, Task, task_id
from verifiers.verdict import FULL_REWARD, Verdict

UNFORMATTED_CREDIT = 0.5
EVAL_SEED = 1_000_003
EXAMPLE_SEED = 2_000_003
GYM_PREFIX = "gym:"
MAX_MATH_ANSWER = 200

# math-verify warns on every call that its signal-based timeout is off; it must be off, because
# verification runs in worker threads where signals cannot be used.
logging.getLogger("math_verify").setLevel(logging.ERROR)


@dataclass(frozen=True)
class Preset:
    """A reasoning-gym generator, its difficulty, and one worked example (question, solution)
    in the answer format, which guided attempts may show the policy."""

    generator: str
    config: dict[str, Any] = field(default_factory=dict)
    example: tuple[str, str] = ("Calculate 3 + 4.", "3 + 4 = 7. <answer>7</answer>")
    checker: Literal["gym", "math"] = "gym"


PRESETS: dict[str, Preset] = {
    "arithmetic": Preset(
        "basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    ),
    "chain_sum": Preset(
        "chain_sum",
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
        (
            "State the final answer to the following arithmetic problem: 3 + 4 =",
            "3 + 4 = 7. <answer>7</answer>",
        ),
    ),
    "two_digit_sums": Preset(  # the harder second set: greedy pass@1 0.172 on 64 held-out
        "chain_sum",
        {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
        (
            "State the final answer to the following arithmetic problem: 58 - 23 =",
            "58 - 23 = 35. <answer>35</answer>",
        ),
    ),
    "equations": Preset(
        "simple_equations",
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_value": 1,
            "max_value": 9,
            "operators": ("+", "-"),
            "operators_weights": [0.5, 0.5],
        },
        ("Solve for x: x + 4 = 7", "x = 7 - 4 = 3. <answer>3</answer>"),
        checker="math",
    ),
}


@cache
def preset(name: str) -> Preset:
    """A named preset, or `gym:NAME` for any reasoning-gym task at its default difficulty, whose
    worked example is a task drawn from a seed of its own, answered in the answer format."""
    if name in PRESETS:
        return PRESETS[name]
    if not name.startswith(GYM_PREFIX):
        raise VerifierError(f"unknown task set {name!r}; choose one of {', '.join(PRESETS)}")
    generator = name.removeprefix(GYM_PREFIX)
    if generator not in reasoning_gym.factory.DATASETS:
        raise VerifierError(f"reasoning-gym has no task {generator!r} (task set {name!r})")
    first = reasoning_gym.create_dataset(generator, size=1, seed=EXAMPLE_SEED)[0]
    return Preset(generator, {}, (first["question"], f"<answer>{first['answer']}</answer>"))


def worked_example(name: str) -> tuple[str, str]:
    """A solved example of the task set, in the answer format: (question, solution)."""
    return preset(name).example


def eval_tasks(name: str, count: int) -> list[Task]:
    """The held-out tasks of a task set: fixed by name and count, never trained on."""
    return _unique_tasks(name, "eval", count, seed=EVAL_SEED, exclude=set())


def train_tasks(name: str, count: int, seed: int, held_out: Iterable[Task]) -> list[Task]:
    """`count` distinct train tasks from `seed`, none of whose questions is held out."""
    exclude = {task.question for task in held_out}
    return _unique_tasks(name, "train", count, seed=seed, exclude=exclude)


def verify(task: Task, completion: str) -> Verdict:
    extraction = extract_answer(completion)
    if extraction.answer is None:
        return Verdict(
            reward=0.0, correct=False, format_ok=False, answer=None, reason=extraction.reason
        )
    correct = _correct(task, extraction.answer)
    reward = (1.0 if extraction.format_ok else UNFORMATTED_CREDIT) if correct else 0.0
    reason = ("correct" if correct else "wrong") + f", {extraction.reason}"
    if correct and extraction.contradicted:
        reward, reason = 0.0, f"correct, but the working before it ends in = {extraction.stated}"
    return Verdict(
        reward=reward,
        correct=correct,
        format_ok=extraction.format_ok,
        answer=extraction.answer,
        reason=reason,
    )


def _correct(task: Task, answer: str) -> bool:
    if preset(task.taskset).checker == "math":
        return math_equivalent(task.answer, answer)
    dataset = _dataset(task.taskset, size=1, seed=0)
    entry = {"question": task.question, "answer": task.answer, "metadata": {}}
    return bool(dataset.score_answer(answer, entry) >= FULL_REWARD)


def math_equivalent(gold: str, answer: str) -> bool:
    """Symbolic equivalence of two math answers (math-verify), thread-safe. Neither is parsed
    when longer than `MAX_MATH_ANSWER`: sympy can chew on a long expression for minutes."""
    if len(answer) > MAX_MATH_ANSWER or len(gold) > MAX_MATH_ANSWER:
        return False
    parsed = math_verify.parse(answer, parsing_timeout=None)
    return bool(parsed) and math_verify.verify(
        math_verify.parse(gold, parsing_timeout=None), parsed, timeout_seconds=None
    )


def _unique_tasks(name: str, split: Split, count: int, seed: int, exclude: set[str]) -> list[Task]:
    if count < 1:
        raise VerifierError(f"task count must be at least 1, got {count}")
    tasks: dict[str, Task] = {}
    pool = _dataset(name, size=count * 8, seed=seed)
    for entry in pool:
        question = entry["question"]
        if question in exclude or question in tasks:
            continue
        tasks[question] = Task(
            task_id=task_id(name, question),
            taskset=name,
            split=split,
            question=question,
            answer=str(entry["answer"]),
        )
        if len(tasks) == count:
            return list(tasks.values())
    raise VerifierError(f"task set {name!r} has fewer than {count} distinct {split} tasks")


def _dataset(name: str, size: int, seed: int) -> Any:
    chosen = preset(name)
    return reasoning_gym.create_dataset(chosen.generator, size=size, seed=seed, **chosen.config)
