"""A multi-turn game with hidden state: find a secret number from higher/lower replies.

1. The secret is drawn from the seed, in [1, `high`]; the agent has `max_steps` turns. Each turn
   must hold exactly one `<guess>N</guess>`; anything else (no guess, several, out of range)
   ends the episode as invalid, and guessing a number twice ends it as repeated.
2. The environment knows what the replies so far imply (the open interval), so its feedback
   names the first guess that ignored them: the pivot a reflection should retry from.
3. Reward is 1 for finding the secret, else 0; `correct` means found.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Self

from verifiers.episode import EpisodeStatus, Observation
from verifiers.verdict import Verdict

GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>", re.IGNORECASE)
GUESS_TAG = re.compile(r"<guess>", re.IGNORECASE)
SYSTEM = (
    "You are playing a guessing game. Each turn, reply with one guess written as "
    "<guess>N</guess>. You will be told whether the secret is higher or lower."
)


@dataclass
class GuessingGame:
    seed: int
    high: int = 100
    max_steps: int = 7
    secret: int = field(init=False)
    guesses: list[int] = field(default_factory=list)
    status: EpisodeStatus = EpisodeStatus.RUNNING
    low_bound: int = field(init=False)
    high_bound: int = field(init=False)
    pivot: int | None = None  # the first step whose guess ignored what was known

    def __post_init__(self) -> None:
        self.secret = random.Random(self.seed).randint(1, self.high)
        self.low_bound, self.high_bound = 1, self.high

    def reset(self) -> list[dict[str, Any]]:
        task = f"I picked a whole number from 1 to {self.high}. You have {self.max_steps} guesses."
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]

    def step(self, action: dict[str, Any]) -> Observation:
        if self.status is not EpisodeStatus.RUNNING:
            return self._end(self.status, "the episode is over")
        text = str(action.get("content") or "")
        found = GUESS.findall(text)
        if len(found) != 1 or len(GUESS_TAG.findall(text)) != 1:
            return self._end(EpisodeStatus.INVALID, "a turn needs exactly one <guess>N</guess>")
        guess = int(found[0])
        if not 1 <= guess <= self.high:
            return self._end(EpisodeStatus.INVALID, f"{guess} is outside 1..{self.high}")
        if guess in self.guesses:
            return self._end(EpisodeStatus.REPEATED, f"{guess} was already guessed")
        return self._apply(guess)

    def verdict(self) -> Verdict:
        solved = self.status is EpisodeStatus.SOLVED
        feedback = [f"step {i}: guessed {g}" for i, g in enumerate(self.guesses)]
        if self.pivot is not None:
            feedback.append(f"step {self.pivot} ignored earlier replies")
        return Verdict(
            reward=1.0 if solved else 0.0,
            correct=solved,
            format_ok=self.status is not EpisodeStatus.INVALID,
            answer=str(self.guesses[-1]) if self.guesses else None,
            reason=f"{self.status.value} after {len(self.guesses)} guesses",
            feedback=tuple(feedback),
        )

    def replay(self, actions: list[dict[str, Any]]) -> Self:
        game = type(self)(seed=self.seed, high=self.high, max_steps=self.max_steps)
        for action in actions:
            game.step(action)
        return game

    def _apply(self, guess: int) -> Observation:
        if not self.low_bound <= guess <= self.high_bound and self.pivot is None:
            self.pivot = len(self.guesses)
        self.guesses.append(guess)
        if guess == self.secret:
            return self._end(EpisodeStatus.SOLVED, f"{guess} is right")
        if guess < self.secret:
            self.low_bound = max(self.low_bound, guess + 1)
            reply = "higher"
        else:
            self.high_bound = min(self.high_bound, guess - 1)
            reply = "lower"
        if len(self.guesses) >= self.max_steps:
            return self._end(EpisodeStatus.STEP_LIMIT, f"no guesses left; it was {reply}")
        left = self.max_steps - len(self.guesses)
        return Observation(messages=({"role": "user", "content": f"{reply} ({left} left)"},))

    def _end(self, status: EpisodeStatus, reason: str) -> Observation:
        self.status = status
        return Observation(
            messages=({"role": "user", "content": reason},), status=status, reason=reason
        )
