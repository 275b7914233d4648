"""Advantages, one function per mode (methods.md sections 2 and 3); a round uses exactly one.

- GRPO: A_i = (r_i - mean) / (std + eps).
- R3L: b = mean (0 for a single-item group), s_i = r_i - b; a full success gets A = 1, a
  non-negative s_i is amplified by alpha, a negative one is kept as is.
- filtered and RLTLDR: A_i = r_i - mean, no std (their rows are then filtered, in
  `trainer.dataset`).

A group of two or more whose rewards are all equal carries no signal: all-zero advantages.
"""

from __future__ import annotations

import statistics

from memory.records import FULL_REWARD, AdvantageMode

EPS = 1e-6


def advantages(mode: AdvantageMode, rewards_G: list[float], alpha: float = 3.0) -> list[float]:
    if mode == "grpo":
        return grpo_advantages(rewards_G)
    if mode == "r3l":
        return r3l_advantages(rewards_G, alpha)
    return mean_advantages(rewards_G)


def grpo_advantages(rewards_G: list[float]) -> list[float]:
    if _flat(rewards_G):
        return [0.0] * len(rewards_G)
    mean = statistics.fmean(rewards_G)
    std = statistics.pstdev(rewards_G)
    return [(r - mean) / (std + EPS) for r in rewards_G]


def r3l_advantages(rewards_G: list[float], alpha: float = 3.0) -> list[float]:
    if len(rewards_G) > 1 and _flat(rewards_G):
        return [0.0] * len(rewards_G)
    baseline = statistics.fmean(rewards_G) if len(rewards_G) > 1 else 0.0
    advantages_G = []
    for reward in rewards_G:
        shifted = reward - baseline
        if reward >= FULL_REWARD:
            advantages_G.append(1.0)
        elif shifted >= 0:
            advantages_G.append(alpha * shifted)
        else:
            advantages_G.append(shifted)
    return advantages_G


def mean_advantages(rewards_G: list[float]) -> list[float]:
    if _flat(rewards_G):
        return [0.0] * len(rewards_G)
    mean = statistics.fmean(rewards_G)
    return [r - mean for r in rewards_G]


def _flat(rewards_G: list[float]) -> bool:
    return len(rewards_G) < 2 or max(rewards_G) - min(rewards_G) < EPS
