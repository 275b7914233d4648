"""Group-relative advantages (GRPO): A_i = (r_i - mean) / (std + eps) within one group.

A group whose rewards are all equal carries no signal and gets all-zero advantages.
"""

from __future__ import annotations

import statistics

EPS = 1e-6


def grpo_advantages(rewards_G: list[float]) -> list[float]:
    if len(rewards_G) < 2:
        return [0.0] * len(rewards_G)
    mean = statistics.fmean(rewards_G)
    std = statistics.pstdev(rewards_G)
    if std < EPS:
        return [0.0] * len(rewards_G)
    return [(r - mean) / (std + EPS) for r in rewards_G]
