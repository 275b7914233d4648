"""95% intervals: Wilson's for one share, a paired one for the difference of two shares measured
on the same tasks, Student's for a mean (the evaluation gate's win margins), and Welch's for the
difference of two arms' means over a few runs each."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

Z = 1.959964
# Student's t, two-sided 95%, for 1-30 degrees of freedom (beyond, the normal's Z).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def wilson(successes: int, n: int) -> tuple[float, float]:
    """Wilson's 95% score interval for a share of `successes` out of `n`."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def error_bars(shares: Sequence[float], counts: Sequence[int]) -> list[list[float]]:
    """Matplotlib's asymmetric error bars for Wilson's interval of each share of its count
    (none where the count is not known)."""
    intervals = [wilson(round(p * n), n) if n else (p, p)
                 for p, n in zip(shares, counts, strict=True)]  # fmt: skip
    return [[p - low for p, (low, _) in zip(shares, intervals, strict=True)],
            [high - p for p, (_, high) in zip(shares, intervals, strict=True)]]  # fmt: skip


def paired_difference(a: Sequence[bool], b: Sequence[bool]) -> tuple[float, float, float]:
    """Mean of a - b over the same tasks, with a 95% normal interval of the paired
    differences: (difference, low, high)."""
    if len(a) != len(b) or not a:
        raise ValueError("paired shares need the same, non-empty list of tasks")
    return mean_interval([float(x) - float(y) for x, y in zip(a, b, strict=True)])


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """The mean of the values with its 95% interval, Student's t below 31 values and the
    normal's beyond: (mean, low, high). One value has no spread to go by: (mean, -inf, inf)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return (mean, -math.inf, math.inf)
    half = _t(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return (mean, mean - half, mean + half)


def _t(df: int) -> float:
    return T_975[df - 1] if df <= len(T_975) else Z


def welch_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Mean of a minus mean of b, each a few runs' scores, with Welch's 95% interval (its
    degrees of freedom rounded down): (difference, low, high)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's interval needs at least two runs of each arm")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    if va + vb == 0:
        return (diff, diff, diff)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = _t(int(df)) * math.sqrt(va + vb)
    return (diff, diff - half, diff + half)
