"""The CLI contract: --help everywhere, one-line errors with a non-zero exit on bad input."""

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["run"],
        ["prepare-model"],
        ["serve-model"],
        ["gateway"],
        ["promote"],
        ["rollback"],
        ["report"],
        ["lineage"],
        ["status"],
        ["library"],
        ["worker"],
        ["serve"],
        ["export"],
        ["strategies"],
        ["sandbox"],
    ],
)
def test_help(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cli", *command, "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0
    assert "usage: flywheel" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--taskset", "nope"], "unknown task set 'nope'"),
        (["--taskset", "no_such_module:tasks"], "no module 'no_such_module' here"),
        (["--taskset", "examples.tasksets.larger:verify"], "is a function, not a TaskSet"),
        (["--taskset", "verifiers.taskset:TaskSet"], "has no train_tasks, eval_tasks, verify"),
        (["--rounds", "0"], "--rounds: Input should be greater than or equal to 1"),
        (["--group-size", "1"], "--group-size: Input should be greater than or equal to 2"),
        (["--guided-fraction", "2"], "--guided-fraction: Input should be less than or equal to 1"),
        (["--config", "/no/such.toml"], "cannot read config /no/such.toml"),
        (["--db", "mysql://x@h/db"], "unsupported database 'mysql'"),
        (["--db", "postgresql+psycopg://u@127.0.0.1:1/x"], "cannot open database"),
        (["--model", "/no/such/folder"], "none of smollm2, tiny, qwen2.5-coder-0.5b"),
        (["--summary-json", "/proc/no/s.json"], "--summary-json /proc/no/s.json cannot be written"),
        (["--source", "captured"], "--source captured trains on captured agent traffic"),
        (["--minutes", "0"], "--minutes: Input should be greater than 0"),
        (["--port", "70000"], "run: argument --port: 70000 is not a port (1-65535)"),
        (["--prefect-port", "http"], "argument --prefect-port: 'http' is not a port number"),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path: Path, capsys) -> None:
    code = main(["run", "--workdir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("flywheel: error: ") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        (b"rounds = 2\n# caf\xe9\n", [], "not UTF-8 text"),
        (b"train = 1\n", ["--mode", "grpo"], "setting train: expected a table of settings, not 1"),
        (b"[collect.anneal.schedule]\nt_maxx = 2.0\n", [], "schedule.t_maxx: Extra inputs are not"),
        (b"[collect.guard]\ndeadline = 2\n", [], "guard.deadline: Extra inputs are not permitted"),
        (b"[guard]\ndeadline_s = 2\n", [], "setting guard: moved to collect.guard"),
        (b"rounds = \n", [], "cannot read config"),
    ],
)
def test_a_bad_config_is_one_line(config, flags, message, tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(config)
    code = main(["run", "--workdir", str(tmp_path), "--config", str(path), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("flywheel: error: ") and message in err
    assert err.count("\n") == 1


def test_a_command_run_from_another_folder_finds_the_installation_s_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_path: Path, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["prepare-model", "--model", "tiny"]) == 0
    assert Path(capsys.readouterr().out.strip()) == tiny_model_path
    assert not (tmp_path / ".flywheel").exists()  # nothing built a second copy here


def test_port_taken_is_one_line(tiny_model_path: Path, tmp_path: Path, capsys) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code = main(
            [
                "run",
                "--workdir",
                str(tmp_path),
                "--model",
                str(tiny_model_path),
                "--server-python",
                sys.executable,
                "--port",
                str(port),
            ]
        )
    err = capsys.readouterr().err
    assert code == 2
    assert f"port {port} on 127.0.0.1 is already in use" in err


def test_promote_and_rollback_by_hand(tmp_path: Path, capsys) -> None:
    from memory import store
    from memory.records import PolicyVersion

    db = f"sqlite:///{tmp_path / 'cli.db'}"
    with store.transaction(store.open_store(db)) as session:
        for name, score in (("base", 0.3), ("v1", 0.2), ("v2", 0.4)):
            store.save_policy_version(session, PolicyVersion(name=name, base_model="m"))
            store.record_evaluation(session, name, score)
        store.set_promoted(session, "base", True)
    assert main(["promote", "v1", "--db", db]) == 2
    assert "not promoted: held-out pass@1 0.200 is below 0.300" in capsys.readouterr().err
    assert main(["promote", "v2", "--db", db]) == 0
    assert main(["promote", "v1", "--db", db, "--force"]) == 0
    assert main(["rollback", "--db", db]) == 0
    assert "v2 now serves (was v1)" in capsys.readouterr().out
    with store.transaction(store.open_store(db)) as session:
        assert store.promoted_policy(session).name == "v2"
        actions = [e.action for e in store.alias_events(session, "policy")]
    assert actions == ["refuse", "promote", "promote", "rollback"]


def seeded(tmp_path: Path) -> str:
    from memory import store
    from memory.records import PolicyVersion

    db = f"sqlite:///{tmp_path / 'cli.db'}"
    with store.transaction(store.open_store(db)) as session:
        for name, score in (("base", 0.3), ("v2", 0.4)):
            store.save_policy_version(session, PolicyVersion(name=name, base_model="m"))
            store.record_evaluation(session, name, score)
        store.set_promoted(session, "base", True)
    return db


def serving(db: str) -> str:
    from memory import store

    with store.transaction(store.open_store(db)) as session:
        return store.promoted_policy(session).name


def test_a_gateway_that_cannot_be_reached_changes_nothing(tmp_path: Path, capsys) -> None:
    from tests.helpers import free_port

    db = seeded(tmp_path)
    gateway = f"http://127.0.0.1:{free_port()}"
    for command in (["promote", "v2"], ["rollback"]):
        assert main([*command, "--db", db, "--gateway-url", gateway]) == 2
        err = capsys.readouterr().err
        assert f"the gateway at {gateway} cannot be reached" in err and "nothing changed" in err
        assert err.count("\n") == 1
    assert serving(db) == "base"


def test_a_locked_database_is_one_line_and_changes_nothing(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    from memory import database

    db = seeded(tmp_path)
    monkeypatch.setattr(database, "SQLITE_BUSY_MS", 200)
    holder = sqlite3.connect(tmp_path / "cli.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        assert main(["promote", "v2", "--db", db]) == 2
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    err = capsys.readouterr().err
    assert err == "flywheel: error: database error: database is locked\n"
    assert serving(db) == "base"


def test_an_unwritable_export_fails_before_reading_anything(tmp_path: Path, capsys) -> None:
    db = seeded(tmp_path)
    for command in (["export"], ["report"]):
        assert main([*command, "--db", db, "--out", "/proc/no/x"]) == 2
        assert "--out /proc/no/x cannot be written" in capsys.readouterr().err


def test_status_shows_serving_version_rounds_and_counts(tmp_path: Path, capsys) -> None:
    from memory import store
    from memory.records import PolicyVersion, Scorecard, TrainingRound
    from tests.helpers import make_group

    db = f"sqlite:///{tmp_path / 'status.db'}"
    assert main(["status", "--db", db]) == 0
    assert "no policy version yet" in capsys.readouterr().out
    with store.transaction(store.open_store(db)) as session:
        store.save_policy_version(session, PolicyVersion(name="base", base_model="m"))
        store.record_evaluation(session, "base", 0.25)
        store.set_promoted(session, "base", True)
        store.save_policy_version(session, PolicyVersion(name="p1", base_model="m", parent="base"))
        margin = Scorecard(
            evaluation="7 held-out turns of 5 captured sessions, judged blind by q",
            figure="win margin", value=0.4, n=5, low=-0.1, high=0.9, against="base",
        )  # fmt: skip
        store.record_scorecard(session, "p1", margin)
        store.save_group(session, make_group([1.0, 0.0, 0.0]))
        store.save_training_round(
            session,
            TrainingRound(
                round_index=1,
                method="grpo",
                policy_in="base",
                policy_out="p1",
                status="done",
                metrics={"train_tokens": 42},
            ),
        )
    assert main(["status", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "serving: base (held-out pass@1 0.250)" in out
    assert (
        "      7 held-out turns of 5 captured sessions, judged blind by q: win margin over base "
        "+0.400 (95% -0.100 to +0.900, n 5)"
    ) in out  # which evaluation judged the version, with its n and interval
    assert "attempts stored: train 3" in out
    assert "1   done     grpo    base -> p1  train tokens 42" in out


def test_capture_needs_api_keys(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("FLYWHEEL_ADMIN_KEYS", "admin-key")
    monkeypatch.delenv("FLYWHEEL_API_KEYS", raising=False)
    code = main(["serve", "--server-url", "http://127.0.0.1:9", "--workdir", str(tmp_path),
                 "--gateway-port", "8123", "--source", "captured"])  # fmt: skip
    assert code == 2 and "captures agent traffic, which needs API keys" in capsys.readouterr().err
    code = main(["gateway", "--upstream", "http://127.0.0.1:9", "--workdir", str(tmp_path),
                 "--model", "tiny", "--capture"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "needs API keys" in err


def test_serve_needs_admin_keys_for_the_gateway(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("FLYWHEEL_ADMIN_KEYS", raising=False)
    code = main(["serve", "--server-url", "http://127.0.0.1:9", "--workdir", str(tmp_path),
                 "--gateway-port", "8123"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err == (
        "flywheel: error: set FLYWHEEL_ADMIN_KEYS (comma-separated) to serve the gateway\n"
    )


def test_export_writes_the_rows_a_round_would_train_on(tmp_path: Path, capsys) -> None:
    import json

    from memory import store
    from tests.helpers import make_group

    db = f"sqlite:///{tmp_path / 'fw.db'}"
    with store.transaction(store.open_store(db)) as session:
        store.save_group(session, make_group([1.0, 0.0, 0.0, 1.0], prompt=[7, 8], completion_len=3))
        store.save_group(session, make_group([0.0, 0.0], task_id="flat"))  # no signal: no rows
    out = tmp_path / "rows.jsonl"
    assert main(["export", "--db", db, "--mode", "grpo", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert all(r["input_ids"][:2] == [7, 8] and r["labels"][:2] == [-100, -100] for r in rows)
    assert [round(a) for a in sorted(r["advantages"][-1] for r in rows)] == [-1, -1, 1, 1]
    assert "4 rows (12 trained tokens, grpo) from 2 complete groups" in capsys.readouterr().out


def test_an_export_onto_a_full_disk_is_one_line_and_keeps_the_last_good_file(
    tmp_path: Path, small_disk, capsys
) -> None:
    from memory import store
    from tests.helpers import make_group

    db = f"sqlite:///{tmp_path / 'fw.db'}"
    with store.transaction(store.open_store(db)) as session:
        for n in range(40):
            store.save_group(session, make_group([1.0, 0.0], task_id=f"t{n}", completion_len=60))
    disk = small_disk(64)
    out = disk / "rows.jsonl"
    out.write_text("the last good export\n")
    assert main(["export", "--db", db, "--mode", "grpo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flywheel: error: No space left on device") and err.count("\n") == 1
    assert out.read_text() == "the last good export\n"
    assert sorted(p.name for p in disk.iterdir()) == ["rows.jsonl"]  # no part file left


def test_export_segments_gives_each_attempt_its_masked_spans(tmp_path: Path, capsys) -> None:
    import json

    from memory import store
    from tests.helpers import make_group

    db = f"sqlite:///{tmp_path / 'fw.db'}"
    group = make_group([1.0, 0.0], completion_len=4)
    masked = group.attempts[0].model_copy(update={"pivot_tokens": 1, "forced_spans": [(2, 3)]})
    with store.transaction(store.open_store(db)) as session:
        store.save_group(
            session, group.model_copy(update={"attempts": [masked, group.attempts[1]]})
        )
    out = tmp_path / "segments.jsonl"
    assert main(["export", "--db", db, "--segments", "--out", str(out)]) == 0
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert [(p["loss"], p["weight"], p["token_ids"]) for p in first["segments"]] == [
        ("pivot", 0.0, [100]),
        ("policy", 1.0, [101]),
        ("forced", 0.0, [102]),
        ("policy", 1.0, [103]),
    ]
    assert second["reward"] == 0.0 and [p["loss"] for p in second["segments"]] == ["policy"]
    assert "2 attempts from 1 complete groups" in capsys.readouterr().out


def test_strategies_lists_success_rates(tmp_path: Path, capsys) -> None:
    from memory import store
    from tests.helpers import make_group

    db = f"sqlite:///{tmp_path / 'fw.db'}"
    group = make_group([1.0, 0.0, 1.0])
    texts = ["Count up.", "Count up.", "Guess."]
    tried = [
        a.model_copy(update={"strategy": t}) for a, t in zip(group.attempts, texts, strict=True)
    ]
    with store.transaction(store.open_store(db)) as session:
        store.save_group(session, group.model_copy(update={"attempts": tried}))
    assert main(["strategies", "--db", db]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["attempts", "success", "reward"]
    assert lines[2].split()[:3] == ["2", "0.500", "0.500"] and lines[2].endswith("Count up.")
    assert lines[3].split()[:2] == ["1", "1.000"]


def test_lineage_names_the_rounds_groups_and_lessons_behind_a_version(
    tmp_path: Path, capsys
) -> None:
    from memory import library, store
    from memory.library import LibrarySettings
    from memory.records import LessonDraft, PolicyVersion, TrainingRound
    from tests.helpers import make_group

    db = f"sqlite:///{tmp_path / 'fw.db'}"
    with store.transaction(store.open_store(db)) as session:
        ids = [store.save_group(session, make_group([1.0, 0.0], task_id=t)) for t in "ab"]
        lesson = LessonDraft(kind="insight", scope="global", text="Carry the one.", source="x")
        (entry,) = library.admit(session, [lesson], LibrarySettings()).added
        library.record_use(session, ids[1], [entry], [0.7])
        for name in ("base", "p1"):
            store.save_policy_version(session, PolicyVersion(name=name, base_model="base"))
        round_1 = TrainingRound(
            round_index=1, method="rltldr", policy_in="base", policy_out="p1", status="done",
            group_ids=ids,
        )  # fmt: skip
        store.save_training_round(session, round_1)
    assert main(["lineage", "p1", "--groups", "--db", db]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("p1  <- round 1 (rltldr, done) on 2 groups sampled from base")
    assert out[1] == f"    library lessons shown to its groups: #{entry} x1"
    assert out[2] == f"    groups: {ids[0]}: a, {ids[1]}: b"
    assert out[3] == "base  (base)"


def test_sandbox_names_the_isolation_in_use(capsys) -> None:
    from verifiers.sandbox import best_isolation

    assert main(["sandbox"]) == 0
    assert capsys.readouterr().out.startswith(f"sandbox isolation: {best_isolation()} (")


def test_a_dead_model_server_ends_run_and_worker_with_one_line(tmp_path: Path, capsys) -> None:
    from memory import store, workqueue
    from memory.records import Batch, WorkItem
    from tests.helpers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    db = f"sqlite:///{tmp_path / 'dead.db'}"
    assert main(["run", "--db", db, "--workdir", str(tmp_path), "--model", "tiny",
                 "--server-url", dead, "--prefect", "temporary"]) == 2  # fmt: skip
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"flywheel: error: the model server at {dead} does not generate")
    with store.transaction(store.open_store(db)) as session:
        assert store.attempt_counts(session) == {}  # nothing recorded from a dead server
        item = WorkItem(round_index=1, purpose="train", policy_version="m", task_id="t", plan="{}")
        workqueue.enqueue(session, [item])
    assert main(["worker", "--db", db, "--server-url", dead, "--outage", "1"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"flywheel: error: the model server at {dead} does not generate with m")
    with store.transaction(store.open_store(db)) as session:
        batch = Batch(round_index=1, purpose="train", policy_version="m")
        assert workqueue.progress(session, batch)["queued"] == 1  # given back


def test_serve_refuses_merged_weights(tmp_path: Path, capsys) -> None:
    args = ["serve", "--server-url", "http://127.0.0.1:9", "--workdir", str(tmp_path)]
    assert main([*args, "--weights", "merged"]) == 2
    assert "flywheel serve serves LoRA versions" in capsys.readouterr().err
    assert main([*args, "--reviewer", "qwen2.5-coder-0.5b"]) == 2
    assert "a reviewer already running" in capsys.readouterr().err


def test_a_reviewer_to_serve_and_a_running_one_exclude_each_other(tmp_path: Path, capsys) -> None:
    args = ["run", "--workdir", str(tmp_path), "--reviewer", "qwen2.5-coder-0.5b"]
    args += ["--reviewer-url", "http://127.0.0.1:9", "--reviewer-model", "m"]
    assert main(args) == 2
    assert "reviewer" in capsys.readouterr().err.strip().splitlines()[-1]


def test_servers_side_by_side_are_all_launched_before_any_is_waited_on(monkeypatch) -> None:
    """The policy's and the reviewer's servers start together: a run with a reviewer waits for
    the slower start, not for both in a row; both are closed together with the run."""
    import contextlib

    from cli import launch
    from serving import server

    calls: list[str] = []

    class Recording:
        def __init__(self, settings: str) -> None:
            self.name, self.url = settings, f"http://{settings}"

        def launch(self) -> None:
            calls.append(f"launch {self.name}")

        def wait_healthy(self) -> None:
            calls.append(f"wait {self.name}")

        @contextlib.contextmanager
        def supervised(self):
            yield

    def close_together(started: list[Recording]) -> None:
        calls.append("close " + " and ".join(each.name for each in started))

    monkeypatch.setattr(server, "VllmServer", Recording)
    monkeypatch.setattr(server, "close_together", close_together)
    with contextlib.ExitStack() as servers:
        urls = launch._start(servers, ["policy", "reviewer"])
    assert urls == ["http://policy", "http://reviewer"]
    assert calls == [
        "launch policy", "launch reviewer", "wait policy", "wait reviewer",
        "close policy and reviewer",
    ]  # fmt: skip


def _slow_command(cleaned: Path) -> subprocess.Popen[str]:
    """A command that prints "started", sleeps, and on its way out prints "cleaning", takes 2 s
    to clean up, and writes "stopped" to `cleaned`."""
    script = f"""
import pathlib, signal, sys, time
import cli.main as m

signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, not a background job
def slow(args):
    try:
        print("started", flush=True)
        time.sleep(60)
    finally:
        print("cleaning", flush=True)
        time.sleep(2)
        pathlib.Path({str(cleaned)!r}).write_text("stopped")

class Parsed:
    handler = staticmethod(slow)

m.build = lambda: type("Parser", (), {{"parse_args": lambda self, argv: Parsed()}})()
sys.exit(m.main([]))
"""
    command = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert command.stdout is not None and command.stdout.readline() == "started\n"
    return command


def test_sigterm_unwinds_a_command_so_what_it_started_stops_first(tmp_path: Path) -> None:
    """`kill` of a command runs its cleanup (the servers it started stop on the way out) and
    ends it with 143, as Ctrl-C does with 130."""
    command = _slow_command(tmp_path / "cleaned")
    command.terminate()
    assert command.wait(timeout=30) == 143
    assert (tmp_path / "cleaned").read_text() == "stopped"
    assert "flywheel: terminated" in (command.stderr.read() if command.stderr else "")


def test_a_second_sigterm_does_not_cut_short_the_cleanup_of_the_first(tmp_path: Path) -> None:
    """A supervisor that signals twice, or a benchmark that passes on the Ctrl-C its command
    also got: the servers still stop whole."""
    command = _slow_command(tmp_path / "cleaned")
    command.send_signal(signal.SIGINT)
    assert command.stdout is not None and command.stdout.readline() == "cleaning\n"
    command.terminate()
    assert command.wait(timeout=30) == 130
    assert (tmp_path / "cleaned").read_text() == "stopped"
