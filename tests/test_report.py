"""`flywheel report`: a table and an HTML page with plots, from the store alone."""

from pathlib import Path

from cli.main import main
from memory import library, store
from memory.library import LibrarySettings
from memory.records import LessonDraft, PolicyVersion, TrainingRound
from reports.report import build, format_table, write_html
from tests.helpers import make_group


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
        group_id = store.save_group(
            session, group.model_copy(update={"attempts": group.attempts[:2] + guided})
        )
        for index, reward in enumerate([1.0, 0.0, 1.0, 1.0]):  # policy-r1 on 4 held-out tasks
            held_out = make_group([reward], task_id=f"held-{index}")
            store.save_group(session, held_out.model_copy(
                update={"purpose": "eval", "policy_version": "policy-r1"}))  # fmt: skip
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
        lessons = [
            LessonDraft(kind="insight", scope="global", text=text)
            for text in ("Check the sign.", "Reread the question.")
        ]
        first, second = library.admit(session, lessons, LibrarySettings()).added
        library.record_use(session, group_id, [first], [0.8])
        library.credit(session, group_id, 0.5, LibrarySettings())


def test_report_table_and_page(db_url: str, tmp_path: Path) -> None:
    seed(db_url)
    with store.transaction(store.open_store(db_url)) as session:
        report = build(session)
    (row,) = report.rounds
    assert row.success_by_context == {"bare": 0.5, "demo": 0.5}
    assert row.attempts_by_context == {"bare": 2, "demo": 2}
    assert row.train_tokens == 40 and row.train_seconds == 12.0
    assert [(v.name, v.n) for v in report.versions] == [("base", 0), ("policy-r1", 4)]
    table = format_table(report)
    assert "ok:bare" in table and "ok:demo" in table and "policy-r1" in table
    assert "0.500 (0.15-0.85, 4)" in table  # pass@1 with Wilson's interval over its 4 tasks
    assert "0.50 (0.09-0.91, 2)" in table  # first attempts under the worked example
    page = tmp_path / "report.html"
    write_html(report, page)
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 4 and "policy-r1" in text
    assert [n for _, n in report.library_sizes] == [1, 2]
    assert sorted((e, round(u, 6), t) for e, u, t in report.lessons) == [
        (0, 0.0, "Reread the question."),
        (1, 0.05, "Check the sign."),
    ]
    assert "2 active lessons" in text


def test_report_cli_on_an_empty_store(tmp_path: Path, capsys) -> None:
    assert main(["report", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no rounds yet" in out and (tmp_path / "report.html").is_file()


def test_library_status_and_lineage_commands(tmp_path: Path, capsys) -> None:
    db = f"sqlite:///{tmp_path / 'fw.db'}"
    seed(db)
    with store.transaction(store.open_store(db)) as session:
        store.set_promoted(session, "policy-r1", True)
    assert main(["library", "--db", db]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith("2 active lessons")
    assert listing.index("Check the sign.") < listing.index("Reread the question.")
    assert main(["library", "--db", db, "--lesson", "1"]) == 0
    history = capsys.readouterr().out
    assert (
        "shown to 1 groups" in history and "gain where used: mean +0.500 over 1 groups" in history
    )
    assert "credit" in history and "utility=0.05" in history
    assert "  used in group 1 (" in history and "): gain +0.500" in history
    assert main(["library", "--db", db, "--entry", "99"]) == 2
    assert capsys.readouterr().err == "flywheel: error: no lesson 99\n"
    assert main(["status", "--db", db]) == 0
    status = capsys.readouterr().out
    assert "queue: 0 tasks waiting or claimed, by 0 workers" in status
    assert "experience library: 2 active lessons" in status
