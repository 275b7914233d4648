"""Training rows from stored groups, on exactly the token ids the server sampled.

Each attempt of a complete group becomes one row: the prompt ids (masked out with -100 labels),
the completion ids (trained), the group advantage on every completion token, and the behaviour
logprobs for the importance-sampling correction. Groups without reward variance are dropped:
their advantages are all zero.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memory.records import Group
from trainer.advantages import grpo_advantages

IGNORE = -100


class TrainRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    input_ids: list[int]
    labels: list[int]
    advantages: list[float]
    behaviour_logprobs: list[float]

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE)


def build_rows(groups: list[Group], max_length: int) -> list[TrainRow]:
    rows: list[TrainRow] = []
    for group in groups:
        if not group.complete:
            continue
        advantages_G = grpo_advantages([a.reward for a in group.attempts])
        for attempt, advantage in zip(group.attempts, advantages_G, strict=True):
            if advantage == 0.0 or attempt.sample is None:
                continue
            sample = attempt.sample
            prompt, completion = sample.prompt_token_ids, sample.completion_token_ids
            n_prompt = len(prompt)
            input_ids = (prompt + completion)[:max_length]
            n_completion = len(input_ids) - n_prompt
            if n_completion <= 0:
                continue
            rows.append(
                TrainRow(
                    input_ids=input_ids,
                    labels=[IGNORE] * n_prompt + completion[:n_completion],
                    advantages=[0.0] * n_prompt + [advantage] * n_completion,
                    behaviour_logprobs=[0.0] * n_prompt + sample.logprobs[:n_completion],
                )
            )
    return rows
