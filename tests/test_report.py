"""`flywheel report`: a table and an HTML page with plots, from the store alone."""

from pathlib import Path

from flows.cli import main
from flows.report import build, format_table, write_html
from memory import store
from memory.records import PolicyVersion, TrainingRound
from tests.conftest import make_group


def seed(db_url: str) -> None:
    engine = store.open_store(db_url)
    with store.transaction(engine) as session:
        store.save_policy_version(session, PolicyVersion(name="base", base_model="base"))
        store.record_evaluation(session, "base", 0.25)
        store.save_policy_version(
            session, PolicyVersion(name="policy-r1", base_model="base", round_index=1)
        )
        store.record_evaluation(session, "policy-r1", 0.5)
        group = make_group([1.0, 0.0, 0.0, 1.0])
        guided = [
            a.model_copy(update={"kind": "guided", "context": "demo"}) for a in group.attempts[2:]
        ]
        store.save_group(
            session, group.model_copy(update={"attempts": group.attempts[:2] + guided})
        )
        store.save_training_round(
            session,
            TrainingRound(
                round_index=1,
                method="rltldr",
                policy_in="base",
                policy_out="policy-r1",
                status="done",
                metrics={"train_tokens": 40, "seconds": 12.0, "eval_pass_at_1": 0.5},
            ),
        )


def test_report_table_and_page(db_url: str, tmp_path: Path) -> None:
    seed(db_url)
    with store.transaction(store.open_store(db_url)) as session:
        report = build(session)
    (row,) = report.rounds
    assert row.success_by_context == {"bare": 0.5, "demo": 0.5}
    assert row.attempts_by_context == {"bare": 2, "demo": 2}
    assert row.train_tokens == 40 and row.train_seconds == 12.0
    table = format_table(report)
    assert "ok:bare" in table and "ok:demo" in table and "policy-r1" in table
    page = tmp_path / "report.html"
    write_html(report, page)
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 3 and "policy-r1" in text


def test_report_cli_on_an_empty_store(tmp_path: Path, capsys) -> None:
    assert main(["report", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no rounds yet" in out and (tmp_path / "report.html").is_file()
