"""95% intervals for the benchmarks' shares: Wilson's for one share, and a paired one for the
difference of two shares measured on the same tasks."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

Z = 1.959964


def wilson(successes: int, n: int) -> tuple[float, float]:
    """Wilson's 95% score interval for a share of `successes` out of `n`."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(a: Sequence[bool], b: Sequence[bool]) -> tuple[float, float, float]:
    """Mean of a - b over the same tasks, with a 95% normal interval of the paired
    differences: (difference, low, high)."""
    if len(a) != len(b) or not a:
        raise ValueError("paired shares need the same, non-empty list of tasks")
    diffs = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(diffs)
    half = Z * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 1.0
    return (mean, mean - half, mean + half)
