"""The learning benchmark's accounting: which version an arm serves at its end, and the paired
comparison of the arms' final versions on the same held-out tasks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.learn import final_version, paired
from flows.settings import load_run_settings


def test_an_arm_serves_its_last_promoted_round_or_the_base_model() -> None:
    rounds = [
        {"policy_version": "r1", "promoted": True},
        {"policy_version": "r2", "promoted": False},
    ]
    assert final_version({"base_model": "base", "rounds": rounds}) == "r1"
    assert final_version({"base_model": "base", "rounds": rounds[1:]}) == "base"


def test_final_versions_are_paired_on_the_tasks_both_were_evaluated_on() -> None:
    first = {"solved": {"a": True, "b": False, "c": False, "d": True}}
    other = {"solved": {"a": True, "b": True, "c": True, "d": False, "e": True}}
    (result,) = paired({"default": first, "herl": other}).values()
    assert result["vs"] == "default" and result["tasks"] == 4  # "e" is not shared
    assert (result["won"], result["lost"]) == (2, 1)
    assert result["difference"] == pytest.approx(0.25)
    assert result["low"] < result["difference"] < result["high"]


def test_every_arm_is_a_valid_run_config(tmp_path) -> None:
    """Each arm's dotted keys load as `flywheel run` settings (a typo would fail an arm only
    after the minutes before it had run)."""
    from bench.learn import ARMS, _toml
    from flows.settings import load_run_settings

    for arm, spec in ARMS.items():
        config = tmp_path / f"{arm}.toml"
        config.write_text(_toml({k: v for k, v in spec.items() if k != "halve_group"}))
        settings = load_run_settings(config, {})
        if arm.startswith("default"):
            assert settings.collect.revise.blind and settings.train.revision_weight == "distill"
    assert ARMS["default+insights"]["train.mode"] == "rltldr"


def test_several_methods_go_on_top_of_the_default_at_once(tmp_path) -> None:
    """`default+A+B` is the default with each named method's settings added, a valid run config
    served by the reviewer; a name with an unknown method or another base is no arm."""
    from bench.learn import ARMS, _toml, arm_settings, reviewed, whose
    from flows.settings import load_run_settings

    spec = arm_settings("default+examples+r3l+outcome")
    assert spec is not None
    config = tmp_path / "all.toml"
    config.write_text(_toml(spec))
    settings = load_run_settings(config, {})
    assert settings.collect.own_examples and settings.collect.retry.enabled
    assert settings.outcome.bonus == 0.1 and settings.collect.revise.blind
    assert settings.train.revision_weight == "distill"
    assert reviewed("default+examples+r3l+outcome") and not reviewed("alone")
    assert whose({"settings": {"reviewer": "q"}}, "default", "default+examples+outcome") == (
        "policy and reviewer"
    )
    assert arm_settings("default+examples") is ARMS["default+examples"]
    assert arm_settings("default+examples+typo") is None
    assert arm_settings("alone+r3l+outcome") is None


def test_arms_run_several_times_are_compared_with_welch_over_runs() -> None:
    from bench.learn import figures

    def curve(solved: int, rounds: int = 3) -> dict:  # a round a minute
        return {"solved": {f"t{i}": i < solved for i in range(4)}, "pass_at_1": [0.0] * rounds,
                "ended_s": [60.0 * r for r in range(rounds)]}  # fmt: skip

    runs = [{"arms": {"default": curve(1), "default+r3l": curve(2, rounds=2)}},
            {"arms": {"default": curve(2), "default+r3l": curve(4)}}]  # fmt: skip
    result = {"arms": runs[0]["arms"], "runs": runs, "settings": {"reviewer": "None"}}
    found = {f.name: f for f in figures(result)}
    mean = found["default+r3l: final held-out pass@1, mean over runs"]
    assert (mean.value, mean.n, mean.counts) == (0.75, 2, "policy")
    welch = found["default+r3l minus default, final pass@1 (Welch over runs)"]
    assert welch.value == pytest.approx(0.375) and welch.n == 4
    rounds = found["default+r3l: rounds in the time budget, mean over runs"]
    assert (rounds.value, rounds.n) == (1.5, 2)  # a curve holds the base, then each round
    took = found["default+r3l: minutes until its last round ended, mean over runs"]
    assert (took.value, took.n, took.unit) == (1.5, 2, "min")
    assert welch.low is not None and welch.low < 0.375 < (welch.high or 0)
    single = {f.name: f for f in figures({**result, "paired": {}, "runs": runs[:1]})}
    assert single["default: final held-out pass@1"].counts == "policy"  # one run: per task
    reviewed = {**result, "settings": {"reviewer": "qwen2.5-coder-0.5b"}}
    found = {f.name: f for f in figures(reviewed)}  # the default revises: the reviewer's work too
    assert found["default+r3l minus default, final pass@1 (Welch over runs)"].counts == (
        "policy and reviewer"
    )


def test_an_arm_records_what_its_method_did(tmp_path) -> None:
    """Per kind and guidance, the train attempts and their successes; the rewards an outcome
    bonus shaped; the library's lessons: what says why a method added nothing."""
    from bench.learn import what_it_did
    from memory import store
    from tests.helpers import make_group

    url = f"sqlite:///{tmp_path / 'arm.db'}"
    group = make_group([1.0, 0.0, 0.0])
    guided, shaped, bare = group.attempts
    attempts = [
        guided.model_copy(update={"kind": "guided", "context": "worked_example"}),
        shaped.model_copy(update={"shaped_reward": 0.1}),
        bare.model_copy(update={"shaped_reward": 0.0}),
    ]
    later = make_group([1.0], round_index=2, task_id="t2")
    engine = store.open_store(url)
    with store.transaction(engine) as session:
        store.save_groups(session, [group.model_copy(update={"attempts": attempts}), later])
    with store.transaction(engine) as session:
        did = what_it_did(session)
    assert did["attempts"] == {"base:bare": [3, 1], "guided:worked_example": [1, 1]}
    assert did["rounds"]["2"] == {"base:bare": [1, 1]}  # round by round too
    assert did["rounds"]["1"] == {"base:bare": [2, 0], "guided:worked_example": [1, 1]}
    assert (did["shaped"], did["lessons"]) == (1, 0)


def test_arms_are_also_compared_by_the_version_served_when_the_budget_ran_out() -> None:
    """A round that ends past the budget does not count at the budget; nor does one that was
    not promoted: the arm served its last promoted round by then, else the base model."""
    from bench.learn import figures, served_at

    late = {"pass_at_1": [0.25, 0.5, 0.75], "promoted": [True, True], "ended_s": [0, 200, 600]}
    kept = {"pass_at_1": [0.25, 0.5, 0.0], "promoted": [True, False], "ended_s": [0, 300, 500]}
    assert served_at(late, 540) == 0.5 and served_at(late, 600) == 0.75
    assert served_at(kept, 540) == 0.5 and served_at(kept, 100) == 0.25

    def arm(final: float, curve: dict) -> dict:
        return {**curve, "solved": {f"t{i}": i < final * 4 for i in range(4)}}

    runs = [{"arms": {"default": arm(0.75, late), "default+r3l": arm(0.5, kept)}}] * 2
    result = {"runs": runs, "settings": {"reviewer": "None", "minutes": "9.0"}}
    found = {f.name: f for f in figures(result)}
    assert found["default+r3l minus default, final pass@1 (Welch over runs)"].value == -0.25
    at = found["default+r3l minus default, pass@1 served at 9 min (Welch over runs)"]
    assert at.value == 0.0 and at.n == 4  # both served 0.5 at minute 9
    assert found["default: held-out pass@1 served at 9 min, mean over runs"].value == 0.5
    untimed = {f.name for f in figures({**result, "settings": {"minutes": "None"}})}
    assert not any("served at" in name for name in untimed)


def test_an_earlier_file_is_refigured_from_its_runs_and_says_so(tmp_path, monkeypatch) -> None:
    import json
    import sys

    from bench import learn

    curve = {"pass_at_1": [0.25, 0.5], "promoted": [True], "ended_s": [0, 100],
             "solved": {"t0": True, "t1": False}}  # fmt: skip
    made = {"command": "x", "commit": "abc1234", "date": "2026-12-05T00:00:00Z"}
    path = tmp_path / "learn.json"
    runs = [{"arms": {"default": curve, "alone": curve}}] * 2
    settings = {"reviewer": "None", "minutes": "9.0"}
    path.write_text(json.dumps({"provenance": made, "figures": [], "settings": settings,
                                "runs": runs}))  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["learn.py", "--refigure", str(path)])
    learn.main()
    record = json.loads(path.read_text())
    assert record["provenance"]["commit"] == "abc1234" and "refigured" in record["provenance"]
    names = {f["name"] for f in record["figures"]}
    assert "alone minus default, pass@1 served at 9 min (Welch over runs)" in names
    path.write_text("{}")
    with pytest.raises(SystemExit):
        learn.main()


XEON = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "dtype": "bfloat16"}


def curve(solved: int) -> dict:
    """A one-round arm's curve that solved the first `solved` of 4 held-out tasks."""
    return {"pass_at_1": [0.25, 0.5], "promoted": [True], "ended_s": [0, 100],
            "solved": {f"t{i}": i < solved for i in range(4)}}  # fmt: skip


def results_file(folder: Path, name: str, runs: list[dict], commit: str, rounds: str = "2",
                 machine: dict = XEON, **more: str) -> Path:  # fmt: skip
    """A learning benchmark's results file of `runs`, measured on `machine`."""
    import json

    from bench import learn

    settings = {"arms": ",".join(runs[0]["arms"]), "rounds": rounds, "minutes": "30.0",
                "reviewer": "qwen2.5-coder-0.5b", "keep": name, **more}  # fmt: skip
    made = {"command": f".venv/bin/python -m bench.learn --json {name}", "commit": commit,
            "date": "2026-12-06T04:49:14Z", "machine": machine}  # fmt: skip
    for run in runs:
        run["paired"] = learn.paired(run["arms"])
    path = folder / name
    path.write_text(json.dumps({"provenance": made, "figures": [], "settings": settings,
                                "arms": runs[0]["arms"], "runs": runs}))  # fmt: skip
    return path


def test_runs_of_files_measured_alike_are_merged_into_one(tmp_path, monkeypatch) -> None:
    import functools
    import json
    import sys

    from bench import learn
    from bench.results import Result, _table

    results = functools.partial(results_file, tmp_path)
    first = results("a.json", [{"arms": {"default": curve(1), "default+examples": curve(2)}}],
                    "abc1234")  # fmt: skip
    more = [{"arms": {"default": curve(2), "default+examples": curve(3)}} for _ in range(2)]
    second = results("b.json", more, "def5678")
    out = tmp_path / "merged.json"
    monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(first), str(second),
                                      "--json", str(out)])  # fmt: skip
    learn.main()
    record = json.loads(out.read_text())
    assert len(record["runs"]) == 3 and record["settings"]["runs"] == "3"
    assert record["provenance"]["commit"] == "abc1234"
    assert [p["commit"] for p in record["provenance"]["merged"]] == ["def5678"]
    welch = {f["name"]: f for f in record["figures"]}[
        "default+examples minus default, final pass@1 (Welch over runs)"
    ]
    assert welch["value"] == pytest.approx(0.25) and welch["n"] == 6
    page = _table(Result(out, record["provenance"], record["figures"]))
    assert "runs added 2026-12-06 at `def5678`" in page and "bench.learn --json b.json" in page
    assert "--merge" in page  # how the file was put together
    third = results("d.json", more, "0123abc")
    again = tmp_path / "again.json"
    monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(out), str(third),
                                      "--json", str(again)])  # fmt: skip
    learn.main()
    record = json.loads(again.read_text())  # a merged file merged again keeps every part
    assert len(record["runs"]) == 5
    assert [p["commit"] for p in record["provenance"]["merged"]] == ["def5678", "0123abc"]
    other = results("c.json", more, "def5678", rounds="3")
    monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(first), str(other),
                                      "--json", str(out)])  # fmt: skip
    with pytest.raises(SystemExit):
        learn.main()
    assert len(json.loads(out.read_text())["runs"]) == 3  # the file written before stays
    wider = [{"arms": {"default": curve(1), "default+r3l": curve(4),
                       "default+examples": curve(3)}}]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(results("e.json", wider, "9")),
                                      str(first), "--json", str(out)])  # fmt: skip
    learn.main()  # the arms both files ran
    record = json.loads(out.read_text())
    assert record["settings"]["arms"] == "default,default+examples"
    assert [list(run["arms"]) for run in record["runs"]] == [["default", "default+examples"]] * 2
    assert list(record["runs"][0]["paired"]) == ["default+examples"]
    swapped = [{"arms": {"default+examples": curve(3), "default": curve(1)}}]
    monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(first),
                                      str(results("f.json", swapped, "9")), "--json",
                                      str(tmp_path / "no.json")])  # fmt: skip
    with pytest.raises(SystemExit):  # another arm first: compared against another
        learn.main()
    for policy, merges in (({"model": "smollm2", "taskset": "arithmetic"}, True),
                           ({"taskset": "two_digit_sums"}, False),
                           ({"model": "qwen2.5-coder-0.5b"}, False)):  # fmt: skip
        named = results("g.json", more, "9", **policy)  # against a file from before they were
        monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(first), str(named),
                                          "--json", str(tmp_path / "g-merged.json")])  # fmt: skip
        if merges:
            learn.main()
        else:
            with pytest.raises(SystemExit):
                learn.main()


def test_arms_go_on_from_a_copy_of_rounds_run_once(tmp_path, monkeypatch) -> None:
    """--shared-rounds K: K rounds run once with the first arm's settings, every arm goes on from
    a copy of their store, and its curve and wall time hold the shared rounds."""
    import argparse

    from bench import learn

    def round_(version: str, score: float, ended: float, promoted: bool) -> dict:
        return {"policy_version": version, "promoted": promoted, "eval_pass_at_1": score,
                "eval_format_rate": 1.0, "ended_s": ended, "started_s": ended - 50,
                "rollouts": 8, "bare_successes": 1, "bare_rollouts": 4,
                "train_tokens": 10}  # fmt: skip

    calls = []

    def flywheel(arm, workdir, budget, *rest):
        rounds, minutes = budget
        calls.append((arm, rounds, minutes, (workdir / "flywheel.db").read_text()
                      if (workdir / "flywheel.db").exists() else None))  # fmt: skip
        if not calls[:-1]:  # the shared round
            (workdir / "flywheel.db").write_text("round 1")
            return {"base_model": "base", "baseline_pass_at_1": 0.2, "baseline_format_rate": 0.5,
                    "rounds": [round_("r1", 0.4, 100.0, True)],
                    "wall_seconds": {"collect": 60.0, "total": 100.0}}, 120.0  # fmt: skip
        promoted = arm == "default+examples"
        return {"base_model": "base", "baseline_pass_at_1": 0.2, "baseline_format_rate": 0.5,
                "rounds": [round_(f"{arm}-r2", 0.45, 40.0, promoted)],
                "wall_seconds": {"total": 50.0}, "db_url": str(workdir)}, 60.0  # fmt: skip

    monkeypatch.setattr(learn, "_flywheel", flywheel)
    monkeypatch.setattr(learn, "_read_store", lambda summary: ({"t": True}, {"attempts": {}}))
    args = argparse.Namespace(shared_rounds=1, rounds=2, minutes=5.0)
    serving = learn.Serving(Path("m"), None, None)
    curves = learn.run_arms(["default", "default+examples"], args, serving, tmp_path / "run-1")
    assert [c[:3] for c in calls] == [("default", 1, 5.0), ("default", 1, 3.0),
                                      ("default+examples", 1, 3.0)]  # fmt: skip
    assert [c[3] for c in calls] == [None, "round 1", "round 1"]  # each from the copied store
    kept = tmp_path / "run-1"
    assert (kept / "default+examples" / "flywheel.db").read_text() == "round 1"  # run by run
    assert (kept / "shared" / "flywheel.db").exists()
    default, examples = curves["default"], curves["default+examples"]
    assert default["pass_at_1"] == [0.2, 0.4, 0.45] and default["promoted"] == [True, False]
    assert default["ended_s"] == [0.0, 100.0, 140.0] and default["seconds"] == 180.0
    assert default["run_seconds"] == 150.0 and default["rollouts"] == 16
    assert default["final_version"] == "r1"  # its own round kept out: the shared one serves
    assert examples["final_version"] == "default+examples-r2"


def test_a_run_cut_short_leaves_the_runs_it_finished_and_says_how_many(
    tmp_path, monkeypatch
) -> None:
    import json
    import sys

    from bench import learn

    finished = {"pass_at_1": [0.25, 0.5], "format_rate": [1.0, 1.0], "rollouts": 8,
                "seconds": 60.0, "promoted": [True], "ended_s": [0, 50],
                "solved": {"t0": True, "t1": False}}  # fmt: skip
    runs = iter([{"default": finished, "alone": finished}])
    kept = []

    def run_arms(arms, args, serving, keep):
        kept.append(keep)
        try:
            return next(runs)
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(learn, "run_arms", run_arms)
    model = tmp_path / "model"
    monkeypatch.setattr(learn, "model_folder", lambda name, _: model)
    path = tmp_path / "learn.json"
    keep = tmp_path / "k"
    monkeypatch.setattr(sys, "argv", ["learn.py", "--arms", "default,alone", "--runs", "3",
                                      "--json", str(path), "--keep", str(keep)])  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        learn.main()
    record = json.loads(path.read_text())
    assert record["settings"]["runs"] == "1" and len(record["runs"]) == 1
    assert "--runs 3" in record["provenance"]["command"]  # what was asked stays on record
    assert kept == [keep / "run-1", keep / "run-2"]  # each run in a folder of its own


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--taskset", "nope"], "unknown task set 'nope'"),
        (["--model", "nowhere"], "--model 'nowhere' is none of smollm2"),
        (["--reviewer", "nobody"], "--reviewer 'nobody' is none of smollm2"),
        (["--model", "qwen2.5-coder-0.5b", "--server-url", "http://h"], "--server-url serves"),
        (["--set", "train.micro_batch_size"], "--set train.micro_batch_size: expected KEY=VALUE"),
        (["--set", "train.mode=r3l"], "--set train.mode: arm default sets it itself"),
        (["--set", "train.batch_size=two"], "--set train.batch_size: Input should be a valid"),
        (["--set", "train.micro_batch=2"], "--set train.micro_batch: Extra inputs"),
    ],
)
def test_a_policy_or_task_set_that_cannot_run_is_refused_in_one_line(
    argv, says, monkeypatch, capsys
) -> None:
    import sys

    from bench import learn

    monkeypatch.setattr(learn, "run_arms", lambda *a: pytest.fail("an arm ran"))
    monkeypatch.setattr(sys, "argv", ["learn.py", "--arms", "default", *argv])
    with pytest.raises(SystemExit):
        learn.main()
    assert says in capsys.readouterr().err


def test_arms_run_the_chosen_policy_on_the_chosen_task_set(tmp_path, monkeypatch) -> None:
    """--model and --taskset reach every arm's `flywheel run`: its --model and --taskset; --set
    settings its config, beside the arm's own."""
    import argparse

    from bench import learn

    commands = []

    def run_command(command, **_):
        commands.append(command)
        return subprocess.CompletedProcess(command, 1, "", "stop here")

    monkeypatch.setattr(learn, "run_command", run_command)
    args = argparse.Namespace(tasks=8, group_size=4, eval_tasks=16, taskset="two_digit_sums",
                              port=8021, set=["train.micro_batch_size = 2"])  # fmt: skip
    serving = learn.Serving(tmp_path / "qwen", None, None)
    with pytest.raises(SystemExit, match="arm default failed"):
        learn._flywheel("default", tmp_path, learn.Budget(1, None), args, serving)
    command = commands[0]
    assert command[command.index("--model") + 1] == str(tmp_path / "qwen")
    config = load_run_settings(Path(command[command.index("--config") + 1]), {})
    assert config.train.micro_batch_size == 2 and config.collect.revise.enabled
    with pytest.raises(ValueError, match="unknown arm"):  # never run as the policy alone
        learn._flywheel("default+typo+r3l", tmp_path, learn.Budget(1, None), args, serving)
    assert command[command.index("--taskset") + 1] == "two_digit_sums"


def test_arms_from_shared_rounds_are_compared_run_by_run() -> None:
    """From a shared start the runs pair the arms: the mean of the runs' differences, whose
    interval is narrower than Welch's when the runs' levels differ."""
    from bench.learn import figures

    def curve(solved: int) -> dict:
        return {"solved": {f"t{i}": i < solved for i in range(8)}, "pass_at_1": [0.0, 0.0],
                "ended_s": [0.0, 60.0]}  # fmt: skip

    runs = [{"arms": {"default": curve(d), "default+r3l": curve(d + 1)}} for d in (2, 4, 6)]
    result = {"runs": runs, "settings": {"reviewer": "None", "shared_rounds": "1"}}
    found = {f.name: f for f in figures(result)}
    pair = found["default+r3l minus default, final pass@1 (paired over runs, from shared rounds)"]
    welch = found["default+r3l minus default, final pass@1 (Welch over runs)"]
    assert pair.value == pytest.approx(0.125) == welch.value and pair.n == 3
    assert pair.low == pytest.approx(0.125)  # the same gain in every run: no spread
    assert welch.low < 0
    result["settings"]["shared_rounds"] = "0"
    assert not any("paired over runs" in name for name in {f.name for f in figures(result)})


def test_runs_measured_on_another_machine_are_merged_only_when_asked(tmp_path, monkeypatch) -> None:
    """--any-machine merges files from other processors: each run keeps its machine, the page
    says where the added runs ran, and what a time budget held (rounds, pass@1 at the budget) is
    left out, as it is no one measurement."""
    import json
    import sys

    from bench import learn
    from bench.results import Result, _table

    epyc = {"cpu": "AMD EPYC", "cores": 2, "dtype": "bfloat16"}
    runs = [{"arms": {"default": curve(1), "default+r3l": curve(3)}}]
    first = results_file(tmp_path, "a.json", runs, "abc1234")
    slower = {"default": curve(1) | {"ended_s": [0, 120]},
              "default+r3l": curve(3) | {"ended_s": [0, 180]}}  # fmt: skip
    second = results_file(tmp_path, "b.json", [{"arms": dict(slower)} for _ in range(2)],
                          "def5678", machine=epyc)  # fmt: skip
    out = tmp_path / "merged.json"
    merge = ["learn.py", "--merge", str(first), str(second), "--json", str(out)]
    monkeypatch.setattr(sys, "argv", merge)
    with pytest.raises(SystemExit):
        learn.main()
    assert not out.exists()
    monkeypatch.setattr(sys, "argv", [*merge, "--any-machine"])
    learn.main()
    record = json.loads(out.read_text())
    assert [run["machine"]["cpu"] for run in record["runs"]] == [
        XEON["cpu"],
        "AMD EPYC",
        "AMD EPYC",
    ]
    names = {f["name"] for f in record["figures"]}
    assert "default+r3l minus default, final pass@1 (Welch over runs)" in names
    assert not [name for name in names if "budget" in name or "served at" in name]
    minutes = {f["name"]: f["value"] for f in record["figures"] if "minutes" in f["name"]}
    ended = "minutes until its last round ended, mean over runs on"
    xeon = f"{XEON['cpu']} (bfloat16)"
    assert minutes == {  # each kind of machine's time apart
        f"default: {ended} {xeon}": pytest.approx(100 / 60),
        f"default+r3l: {ended} {xeon}": pytest.approx(100 / 60),
        f"default: {ended} AMD EPYC (bfloat16)": pytest.approx(2.0),
        f"default+r3l: {ended} AMD EPYC (bfloat16)": pytest.approx(3.0),
    }
    page = _table(Result(out, record["provenance"], record["figures"]))
    assert "runs added 2026-12-06 at `def5678` on AMD EPYC, 2 cores" in page
    alike = results_file(tmp_path, "c.json", runs, "0123abc")
    monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(first), str(alike), "--json",
                                      str(tmp_path / "alike.json")])  # fmt: skip
    learn.main()  # one kind of machine: the budget's figures stay
    names = {f["name"] for f in json.loads((tmp_path / "alike.json").read_text())["figures"]}
    assert "default+r3l minus default, pass@1 served at 30 min (Welch over runs)" in names
    assert "default+r3l: minutes until its last round ended, mean over runs" in names
    # the same processor serving in float32, at about half the speed: another kind of machine
    slow = results_file(tmp_path, "d.json", runs, "4567def", machine=epyc | {"dtype": "float32"})
    merge = ["learn.py", "--merge", str(second), str(slow), "--json", str(tmp_path / "d2.json")]
    monkeypatch.setattr(sys, "argv", merge)
    with pytest.raises(SystemExit):
        learn.main()
    monkeypatch.setattr(sys, "argv", [*merge, "--any-machine"])
    learn.main()
    record = json.loads((tmp_path / "d2.json").read_text())
    assert {run["machine"]["dtype"] for run in record["runs"]} == {"bfloat16", "float32"}


def test_files_merge_when_their_common_settings_are_the_same_however_written(
    tmp_path, monkeypatch
) -> None:
    """`--set` pairs are compared as the settings they make: spaces around `=` do not keep two
    files apart; another value does."""
    import json
    import sys

    from bench import learn

    runs = [{"arms": {"default": curve(1), "default+r3l": curve(3)}}]
    first = results_file(tmp_path, "a.json", runs, "abc1234", set="['train.micro_batch_size=2']")
    spaced = results_file(tmp_path, "b.json", runs, "def5678", set="['train.micro_batch_size = 2']")
    other = results_file(tmp_path, "c.json", runs, "0123abc", set="['train.micro_batch_size=4']")
    out = tmp_path / "merged.json"
    monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(first), str(spaced),
                                      "--json", str(out)])  # fmt: skip
    learn.main()
    assert len(json.loads(out.read_text())["runs"]) == 2
    monkeypatch.setattr(sys, "argv", ["learn.py", "--merge", str(first), str(other),
                                      "--json", str(tmp_path / "no.json")])  # fmt: skip
    with pytest.raises(SystemExit):
        learn.main()
    assert not (tmp_path / "no.json").exists()
