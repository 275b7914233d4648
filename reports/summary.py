"""The `flywheel run` summary (the JSON contract in the README) and its before/after table."""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

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
                _fmt(r.eval_format_rate, 2),
                "yes" if r.promoted else "no",
            )
        )
    lines = [text_table(header, rows), ""]
    lines.append(f"held-out: {summary.eval_tasks} {summary.taskset} tasks, greedy, no guidance")
    lines.append("bare ok: success rate of the train attempts sampled with no guidance")
    lines.append(_verdict(summary))
    if summary.failed_tasks:
        first = summary.failed_tasks[0]
        lines.append(
            f"left out: {len(summary.failed_tasks)} tasks failed by their own doing "
            f"(the first, {first.task_id}: {first.error})"
        )
    return "\n".join(lines)


def _verdict(summary: RunSummary) -> str:
    """Best version against the base, judged against the noise of the held-out evaluation.

    Both are scored on the same tasks, so the test is paired (McNemar): of the tasks where they
    differ, the version must win more than it loses by over 2 standard errors. Without the
    per-task counts it falls back to the unpaired difference of two proportions.
    """
    scored = [r for r in summary.rounds if r.eval_pass_at_1 is not None]
    if not scored:
        return "no round produced a new version."
    best_round = max(scored, key=lambda r: r.eval_pass_at_1 or 0.0)
    best, base = best_round.eval_pass_at_1 or 0.0, summary.baseline_pass_at_1
    change = f"best held-out pass@1 {best:.3f} vs base {base:.3f}"
    gained, lost = best_round.eval_gained, best_round.eval_lost
    margin: float
    if gained is not None and lost is not None:
        margin, noise = gained - lost, 2 * math.sqrt(gained + lost)
        detail = f"{gained} tasks gained, {lost} lost; 2 standard errors: {noise:.1f} tasks"
    else:
        p = max(min((best + base) / 2, 1 - 1e-9), 1e-9)
        margin, noise = best - base, 2 * math.sqrt(2 * p * (1 - p) / summary.eval_tasks)
        detail = f"2 standard errors: {noise:.3f}"
    if margin > noise:
        return f"improved: {change} ({detail})."
    if -margin > noise:
        return f"worse: {change} ({detail})."
    return f"no clear change: {change}, within noise ({detail})."


def _ratio(hits: int, total: int) -> str:
    return "-" if total == 0 else f"{hits / total:.2f}"


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
