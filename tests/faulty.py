"""Task sets whose own code fails on some tasks, as a user's plugin might: `verify` raises on
one question and spins forever on another, and an environment raises at the step of some seeds.
The tests name them as plugins (`tests.faulty:sums`, `tests.faulty:counter`)."""

from __future__ import annotations

from typing import Any

from verifiers.episode import EpisodeStatus, Observation
from verifiers.task import Task
from verifiers.verdict import Verdict

RAISES = "What is 13 + 1?"
HANGS = "What is 12 + 1?"
SUMS = [(f"What is {n} + 1?", str(n + 1)) for n in range(10, 18)]
HELD_OUT = [(f"What is {n} + 2?", str(n + 2)) for n in range(10)]


class sums:  # noqa: N801 - a plugin attribute, named as users name theirs
    train_tasks = staticmethod(lambda count, seed: SUMS[:count])
    eval_tasks = staticmethod(lambda count: HELD_OUT[:count])
    worked_example = ("What is 1 + 1?", "1 + 1 = 2. <answer>2</answer>")

    @staticmethod
    def verify(task: Task, completion: str) -> bool:
        if task.question == RAISES:
            raise ValueError("the answer key for this task is corrupt")
        if task.question == HANGS:
            while True:  # a verifier stuck in pure Python (sympy on a huge expression)
                pass
        return task.answer in completion


class Counter:
    """Say a number; the episode ends after one turn. Seeds 3, 10, 17, ... break at the step."""

    max_steps = 1

    def __init__(self, seed: int) -> None:
        self.seed, self.said = seed, ""

    def reset(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "Count."}, {"role": "user", "content": "Say 1."}]

    def step(self, action: dict[str, Any]) -> Observation:
        if self.seed % 7 == 3:
            raise RuntimeError(f"no level for seed {self.seed}")
        self.said = action.get("content") or ""
        return Observation(messages=(), status=EpisodeStatus.FINISHED)

    def verdict(self) -> Verdict:
        ok = "1" in self.said
        return Verdict(reward=float(ok), correct=ok, format_ok=True, answer=self.said, reason="")

    def replay(self, actions: list[dict[str, Any]]) -> Counter:
        return self


class counter:  # noqa: N801
    environment = Counter
