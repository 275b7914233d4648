"""Outcome-based exploration (methods.md section 7): reward shaping on final answers.

- Historical bonus: b_i = c_hist * min(1, 1 / sqrt(N(task, answer_i))), with N counted over all
  training (the store's outcome counts, this group included); the group's mean bonus is
  subtracted, so the bonus only moves credit between attempts.
- Batch penalty: p_i = c_batch * #{j != i : answer_j = answer_i} / n, for repeated answers.
- The shaped reward is r + (b - mean b) - p, capped to [0, 1] (the penalty applies first, and a
  bonus never lifts a failure to a success). Each term is kept on the attempt beside the raw
  reward.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter

from pydantic import BaseModel, ConfigDict, Field

from memory.records import FULL_REWARD, Group


class OutcomeSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    bonus: float = Field(0.0, ge=0.0, description="bonus for rarely seen answers (c_hist)")
    repeat_penalty: float = Field(
        0.0, ge=0.0, description="penalty for answers repeated in a group (c_batch)"
    )

    @property
    def enabled(self) -> bool:
        return self.bonus > 0 or self.repeat_penalty > 0


def shape(group: Group, counts: dict[str, int], settings: OutcomeSettings) -> Group:
    """The group with shaped rewards on its first attempts; `counts` exclude this group."""
    firsts = group.first_attempts
    if not settings.enabled or not firsts:
        return group
    keys = [a.answer_key for a in firsts]
    seen = Counter(keys)
    bonuses = [settings.bonus * min(1.0, 1 / math.sqrt(counts.get(k, 0) + seen[k])) for k in keys]
    mean_bonus = statistics.fmean(bonuses)
    shaped = {}
    for attempt, key, bonus in zip(firsts, keys, bonuses, strict=True):
        penalty = settings.repeat_penalty * (seen[key] - 1) / len(firsts)
        value = min(FULL_REWARD, max(0.0, attempt.reward - penalty + bonus - mean_bonus))
        terms = {"bonus": bonus - mean_bonus, "repeat_penalty": -penalty}
        shaped[attempt.sample_index, attempt.kind] = {"shaped_reward": value, "shaping": terms}
    return group.model_copy(
        update={
            "attempts": [
                a.model_copy(update=shaped.get((a.sample_index, a.kind), {}))
                for a in group.attempts
            ]
        }
    )
