"""What a round leaves in the Prefect UI: the table of every round so far, and a link to the
report page with its plots, rewritten after each round (`reports.report`).

Artifacts are for people: a failure to write them is logged and never fails the round.
"""

from __future__ import annotations

from pathlib import Path

import anyio
from prefect import get_run_logger
from prefect.artifacts import acreate_link_artifact, acreate_table_artifact

from flows.settings import RunSettings
from memory import store
from reports import report


async def publish_round(settings: RunSettings, round_index: int) -> Path | None:
    """The rounds table and the report link, as artifacts of the current flow run; returns
    the report page's path, or None when it could not be written."""
    path = settings.workdir / "report.html"
    try:
        data = await anyio.to_thread.run_sync(_write_report, settings, path)
        await acreate_table_artifact(
            key="flywheel-rounds",
            table=[_row(r) for r in data.rounds],
            description=f"Every round so far, after round {round_index}.",
        )
        await acreate_link_artifact(
            key="flywheel-report",
            link=path.resolve().as_uri(),
            link_text="report with plots",
            description=f"The report after round {round_index}: `flywheel report` rewrites it.",
        )
    except Exception as exc:  # noqa: BLE001 - an artifact never fails a round
        get_run_logger().warning("round %d: artifacts not written: %s", round_index, exc)
        return None
    return path


def _write_report(settings: RunSettings, path: Path) -> report.Report:
    with store.transaction(store.shared_engine(settings.db_url)) as session:
        data = report.build(session)
    report.write_html(data, path)
    return data


def _row(row: report.RoundRow) -> dict[str, object]:
    return {
        "round": row.round_index,
        "method": row.method,
        "status": row.status,
        "version": row.policy_out or "-",
        "held-out pass@1": "-" if row.eval_pass_at_1 is None else round(row.eval_pass_at_1, 3),
        "generated tokens": row.generated_tokens,
        "train tokens": row.train_tokens,
        "collect s": round(row.collect_seconds, 1),
        "train s": round(row.train_seconds, 1),
    }
