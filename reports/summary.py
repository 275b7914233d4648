"""The `flywheel run` summary (the JSON contract in the README) and its before/after table."""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from reports.intervals import Z, mean_interval, wilson
from reports.table import text_table


class RoundSummary(BaseModel):
    round_index: int
    policy_version: str | None
    parent_version: str
    adapter_path: str | None
    rollouts: int
    successes: int
    bare_rollouts: int = 0
    bare_successes: int = 0
    train_tokens: int
    groups: int = 0  # the groups trained on
    stale_groups: int = 0  # of them, sampled by an earlier version (overlapped rounds)
    dropped_groups: int = 0  # left out: sampled more than `max_staleness` versions before
    # RLTLDR's check, with insights on: success with the batch's insights minus without
    insight_advantage: float | None = None
    eval_pass_at_1: float | None
    eval_format_rate: float | None
    eval_gained: int | None = None
    eval_lost: int | None = None
    promoted: bool
    note: str = ""
    wall_seconds: dict[str, float] = Field(default_factory=dict)
    started_s: float = 0.0  # seconds from the run's flow start (the baseline counts)
    ended_s: float = 0.0


class FailedTask(BaseModel):
    """A task left out of its batch because it failed by its own doing (its verifier,
    environment or sandbox raised or hung), with the last reason."""

    round_index: int
    purpose: str
    task_id: str
    failures: int
    error: str


class RunSummary(BaseModel):
    base_model: str
    taskset: str
    baseline_pass_at_1: float
    baseline_format_rate: float
    eval_tasks: int
    db_url: str
    rounds: list[RoundSummary] = Field(default_factory=list)
    wall_seconds: dict[str, float] = Field(default_factory=dict)
    failed_tasks: list[FailedTask] = Field(default_factory=list)


def format_table(summary: RunSummary) -> str:
    header = (
        "round",
        "version",
        "rollouts",
        "successes",
        "bare ok",
        "train tok",
        "pass@1",
        "95%",
        "format",
        "promoted",
    )
    rows = [
        (
            "base",
            summary.base_model,
            "-",
            "-",
            "-",
            "-",
            f"{summary.baseline_pass_at_1:.3f}",
            _wilson(summary.baseline_pass_at_1, summary.eval_tasks),
            f"{summary.baseline_format_rate:.2f}",
            "-",
        )
    ]
    for r in summary.rounds:
        rows.append(
            (
                str(r.round_index),
                r.policy_version or "(none)",
                str(r.rollouts),
                str(r.successes),
                _ratio(r.bare_successes, r.bare_rollouts),
                str(r.train_tokens),
                _fmt(r.eval_pass_at_1, 3),
                _wilson(r.eval_pass_at_1, summary.eval_tasks),
                _fmt(r.eval_format_rate, 2),
                "yes" if r.promoted else "no",
            )
        )
    lines = [text_table(header, rows), ""]
    lines.append(
        f"held-out: {summary.eval_tasks} {summary.taskset} tasks, greedy, no guidance "
        "(95%: Wilson's interval)"
    )
    lines.append("bare ok: success rate of the train attempts sampled with no guidance")
    if stages := _stages(summary.wall_seconds):
        lines.append(stages)
    lines.append(_verdict(summary))
    if summary.failed_tasks:
        first = summary.failed_tasks[0]
        lines.append(
            f"left out: {len(summary.failed_tasks)} tasks failed by their own doing "
            f"(the first, {first.task_id}: {first.error})"
        )
    return "\n".join(lines)


STAGES = ("server_start", "baseline", "collect", "curate", "train", "merge", "swap", "evaluate")


def _stages(seconds: dict[str, float]) -> str:
    """Seconds per stage over the run, how long training ran beside collection, and the share
    of the run after the server's start in which the policy's server had work."""
    parts = [f"{name.replace('_', ' ')} {seconds[name]:.0f}" for name in STAGES if name in seconds]
    if not parts:
        return ""
    hidden = seconds.get("hidden", 0.0)
    beside = f" ({hidden:.0f} s of training ran beside collection)" if hidden else ""
    total = f"; {seconds['total']:.0f} s in all" if "total" in seconds else ""
    share = serving_share(seconds)
    working = f"; the policy's server had work {share:.0%} of it" if share is not None else ""
    return f"seconds: {', '.join(parts)}{total}{beside}{working}"


SERVING_STAGES = ("baseline", "collect", "evaluate")  # the stages the policy's server works in


def serving_share(seconds: dict[str, float]) -> float | None:
    """The share of the run after the model server's start spent in stages the policy's server
    works in (baseline, collection, evaluation: they run one after another, and collection is
    the part training may run beside), or None without a run's total."""
    after = seconds.get("total", 0.0) - seconds.get("server_start", 0.0)
    if after <= 0:
        return None
    return min(1.0, sum(seconds.get(name, 0.0) for name in SERVING_STAGES) / after)


def _verdict(summary: RunSummary) -> str:
    """Best version against the base, with the 95% interval of the gain.

    Both are scored on the same tasks, so the gain is paired: the mean of per-task differences
    (+1 gained, -1 lost, 0 otherwise) with Student's interval. Without the per-task counts it
    falls back to the difference of two independent shares (normal interval). The verdict is
    "improved" or "worse" only when the interval excludes zero.
    """
    scored = [r for r in summary.rounds if r.eval_pass_at_1 is not None]
    if not scored:
        return "no round produced a new version."
    best_round = max(scored, key=lambda r: r.eval_pass_at_1 or 0.0)
    best, base, n = best_round.eval_pass_at_1 or 0.0, summary.baseline_pass_at_1, summary.eval_tasks
    change = f"best held-out pass@1 {best:.3f} vs base {base:.3f}"
    gained, lost = best_round.eval_gained, best_round.eval_lost
    if gained is not None and lost is not None and n > 1:
        tasks = [1.0] * gained + [-1.0] * lost + [0.0] * max(0, n - gained - lost)
        gain, low, high = mean_interval(tasks)
        detail = f"{gained} tasks gained, {lost} lost of {n}"
    else:
        half = Z * math.sqrt((best * (1 - best) + base * (1 - base)) / max(n, 1))
        gain, low, high = best - base, best - base - half, best - base + half
        detail = f"{n} tasks, unpaired"
    gain_text = f"gain {gain:+.3f} (95% {low:+.3f} to {high:+.3f}; {detail})"
    if low > 0:
        return f"improved: {change}, {gain_text}."
    if high < 0:
        return f"worse: {change}, {gain_text}."
    return f"no clear change: {change}, {gain_text}."


def _wilson(share: float | None, n: int) -> str:
    if share is None or n == 0:
        return "-"
    low, high = wilson(round(share * n), n)
    return f"{low:.2f}-{high:.2f}"


def _ratio(hits: int, total: int) -> str:
    return "-" if total == 0 else f"{hits / total:.2f}"


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
