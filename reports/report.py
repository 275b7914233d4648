"""`flywheel report`: what the store says about the flywheel, as a table and an HTML page.

Drawn from the store alone: held-out pass@1 per version, the success rate of first attempts per
context (bare, worked example, insights, strategies) per round, generated and trained tokens per
round, time per stage (collection as the span of a round's stored attempts, training from the
round's record), and the experience library: its size over time and each lesson's utility
against how often it was shown. Every rate carries its n and Wilson's 95% interval, in the table
and as the plots' error bars. Plots are PNGs inside the one HTML file.
"""

from __future__ import annotations

import base64
import html
import io
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from memory import library, store, workqueue
from memory.folders import atomic_file
from reports.intervals import error_bars, wilson
from reports.table import text_table


class RoundRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    round_index: int
    method: str
    status: str
    policy_out: str | None
    eval_pass_at_1: float | None
    success_by_context: dict[str, float]
    attempts_by_context: dict[str, int]
    generated_tokens: int
    train_tokens: int
    collect_seconds: float
    train_seconds: float


class VersionRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    round_index: int
    pass_at_1: float | None
    n: int  # held-out tasks scored
    promoted: bool


class Report(BaseModel):
    model_config = ConfigDict(frozen=True)

    versions: list[VersionRow]
    rounds: list[RoundRow]
    library_sizes: list[tuple[str, int]] = []  # (ISO time, active lessons)
    lessons: list[tuple[int, float, str]] = []  # (exposures, utility, text)
    failed: list[tuple[int, str, str, str, str]] = []  # (round, purpose, task, whose, error)


def build(session: Session) -> Report:
    scored = store.eval_task_counts(session)
    versions = [
        VersionRow(name=v.name, round_index=v.round_index, pass_at_1=v.eval_pass_at_1,
                   n=scored.get(v.name, 0), promoted=v.promoted)
        for v in store.policy_versions(session)
    ]  # fmt: skip
    rounds = [_round_row(session, r) for r in store.training_rounds(session, last=1000)]
    sizes = [(at.isoformat(), n) for at, n in library.size_history(session)]
    lessons = [(e.exposures, e.utility, e.text) for e in library.lessons(session)]
    failed = [
        (item.round_index, item.purpose, item.task_id, item.fault or "server", item.error or "")
        for item in workqueue.failed(session)
    ]
    return Report(
        versions=versions, rounds=rounds, library_sizes=sizes, lessons=lessons, failed=failed
    )


def _round_row(session: Session, record: Any) -> RoundRow:
    groups = store.load_groups(session, "train", round_index=record.round_index)
    hits: dict[str, list[bool]] = defaultdict(list)
    for group in groups:
        for attempt in group.first_attempts:
            hits[attempt.context].append(attempt.correct)
    span = store.attempt_time_span(session, "train", record.round_index)
    return RoundRow(
        round_index=record.round_index,
        method=record.method,
        status=record.status,
        policy_out=record.policy_out,
        eval_pass_at_1=record.metrics.eval_pass_at_1,
        success_by_context={k: sum(v) / len(v) for k, v in sorted(hits.items())},
        attempts_by_context={k: len(v) for k, v in sorted(hits.items())},
        generated_tokens=sum(a.generated_tokens for g in groups for a in g.attempts),
        train_tokens=record.metrics.train_tokens,
        collect_seconds=span,
        train_seconds=record.metrics.seconds,
    )


def format_table(report: Report) -> str:
    contexts = sorted({c for r in report.rounds for c in r.success_by_context})
    scored = {v.name: v.n for v in report.versions}
    header = ["round", "mode", "version", "pass@1 (95%, n)", *[f"ok:{c}" for c in contexts]]
    header += ["gen tok", "train tok", "collect s", "train s"]
    rows = []
    for r in report.rounds:
        rows.append(
            [
                str(r.round_index),
                r.method,
                r.policy_out or "-",
                _with_interval(r.eval_pass_at_1, scored.get(r.policy_out or "", 0), 3),
                *[_rate(r, c) for c in contexts],
                str(r.generated_tokens),
                str(r.train_tokens),
                f"{r.collect_seconds:.0f}",
                f"{r.train_seconds:.0f}",
            ]
        )
    lines = [text_table(header, rows)]
    if not report.rounds:
        lines.append("(no rounds yet: run `flywheel run`)")
    lines.append(
        "ok:<context> = success rate of first attempts sampled under that context; "
        "(95%, n) = Wilson's interval and the tasks or attempts it counts"
    )
    if report.failed:
        lines += ["", f"failed tasks ({len(report.failed)}):"]
        failed_rows = [(str(r), purpose, task, whose, error[:120])
                       for r, purpose, task, whose, error in report.failed]  # fmt: skip
        lines.append(text_table(["round", "purpose", "task", "whose", "last error"], failed_rows))
    return "\n".join(lines)


def write_html(report: Report, path: Path) -> None:
    figures = [
        _versions_plot(report),
        _context_plot(report),
        _cost_plot(report),
        _library_plot(report),
    ]
    body = "\n".join(f'<img alt="plot" src="data:image/png;base64,{f}">' for f in figures if f)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Flywheel report</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}img{{max-width:100%}}
pre{{background:#f6f6f6;padding:1em;overflow-x:auto}}</style></head>
<body><h1>Flywheel report</h1>
<pre>{html.escape(format_table(report))}</pre>
{body}
<p>Experience library: {len(report.lessons)} active lessons.</p>
</body></html>
"""
    with atomic_file(path) as out:
        out.write(page)


def _rate(row: RoundRow, context: str) -> str:
    rate = row.success_by_context.get(context)
    return _with_interval(rate, row.attempts_by_context.get(context, 0), 2)


def _with_interval(share: float | None, n: int, digits: int) -> str:
    if share is None:
        return "-"
    if not n:
        return f"{share:.{digits}f}"
    low, high = wilson(round(share * n), n)
    return f"{share:.{digits}f} ({low:.2f}-{high:.2f}, {n})"


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode()


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _versions_plot(report: Report) -> str | None:
    scored = [v for v in report.versions if v.pass_at_1 is not None]
    if not scored:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 3.5))
    values = [v.pass_at_1 or 0.0 for v in scored]
    axis.bar(range(len(scored)), values, yerr=error_bars(values, [v.n for v in scored]),
             capsize=4, color="#4c72b0")  # fmt: skip
    axis.set_xticks(range(len(scored)), [v.name for v in scored], rotation=30, ha="right")
    axis.set_ylabel("held-out pass@1")
    axis.set_title("held-out pass@1 per version (95% Wilson interval)")
    axis.set_ylim(0, 1)
    png = _png(figure)
    plt.close(figure)
    return png


def _context_plot(report: Report) -> str | None:
    contexts = sorted({c for r in report.rounds for c in r.success_by_context})
    if not contexts:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 3.5))
    for context in contexts:
        rows = [r for r in report.rounds if context in r.success_by_context]
        rates = [r.success_by_context[context] for r in rows]
        errors = error_bars(rates, [r.attempts_by_context[context] for r in rows])
        axis.errorbar([r.round_index for r in rows], rates, yerr=errors, marker="o", capsize=3,
                      label=context)  # fmt: skip
    axis.set_xticks([r.round_index for r in report.rounds])
    axis.set_xlabel("round")
    axis.set_ylabel("success rate")
    axis.set_title("first-attempt success rate per context (95% Wilson interval)")
    axis.set_ylim(0, 1)
    axis.legend()
    png = _png(figure)
    plt.close(figure)
    return png


def _cost_plot(report: Report) -> str | None:
    if not report.rounds:
        return None
    plt = _pyplot()
    figure, (tokens, seconds) = plt.subplots(1, 2, figsize=(10, 3.5))
    index = [r.round_index for r in report.rounds]
    tokens.bar(index, [r.generated_tokens for r in report.rounds], label="generated")
    tokens.bar(index, [r.train_tokens for r in report.rounds], label="trained", alpha=0.7)
    tokens.set_xticks(index)
    seconds.set_xticks(index)
    tokens.set_title("tokens per round")
    tokens.legend()
    seconds.bar(index, [r.collect_seconds for r in report.rounds], label="collect")
    seconds.bar(
        index,
        [r.train_seconds for r in report.rounds],
        bottom=[r.collect_seconds for r in report.rounds],
        label="train",
    )
    seconds.set_title("seconds per stage")
    seconds.legend()
    png = _png(figure)
    plt.close(figure)
    return png


def _library_plot(report: Report) -> str | None:
    if not report.library_sizes:
        return None
    plt = _pyplot()
    figure, (sizes, utility) = plt.subplots(1, 2, figsize=(10, 3.5))
    sizes.step(range(len(report.library_sizes)), [n for _, n in report.library_sizes], where="post")
    sizes.set_title("library size, change by change")
    sizes.set_xlabel("library event")
    utility.scatter([e for e, _, _ in report.lessons], [u for _, u, _ in report.lessons], s=12)
    utility.axhline(0.0, color="grey", linewidth=0.8)
    utility.set_title("lesson utility (EDGE gain, decayed)")
    utility.set_xlabel("groups shown to")
    png = _png(figure)
    plt.close(figure)
    return png
