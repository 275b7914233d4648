"""The results page is what the results files give, byte for byte, and no file without its
provenance and figures reaches it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import ROOT, Figure, portable
from bench.results import PAGE, RESULTS, Result, load, render


def test_the_committed_page_is_what_the_committed_files_give() -> None:
    page = render(load(), sorted((RESULTS / "archive").glob("*")))
    assert PAGE.read_text() == page, "bench/README.md is stale: run make results"


def test_every_results_file_records_how_it_was_made() -> None:
    for result in load():
        made = result.provenance
        assert result.command.startswith(".venv/bin/python -m bench."), result.path
        assert made["commit"] and made["date"] and made["machine"]["cores"], result.path
        assert result.figures, result.path


def test_a_recorded_command_names_no_folder_of_the_machine_that_ran_it() -> None:
    assert portable(str(ROOT / "bench/results/agent.json")) == "bench/results/agent.json"
    assert portable("/tmp/scratch-1/agent.json") == "agent.json"
    assert portable("--json=/tmp/scratch-1/agent.json") == "--json=agent.json"
    assert portable("--minutes") == "--minutes" and portable("30") == "30"
    for result in load():
        assert ROOT.as_posix() not in result.command and " /" not in result.command, result.path


def test_a_file_without_provenance_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "typed.json").write_text(json.dumps({"tokens_per_s": 12.0}))
    with pytest.raises(SystemExit, match="typed.json: no provenance or figures"):
        load(tmp_path)


def made_by(command: str) -> dict:
    """A results file's provenance, as `bench.common.provenance` writes it."""
    machine = {"cpu": "AMD EPYC", "cores": 2, "dtype": "float32"}
    return {"command": command, "commit": "abc1234", "date": "2026-12-03T10:00:00Z",
            "dirty": False, "machine": machine}  # fmt: skip


def test_a_row_shows_its_n_interval_and_whose_work_it_counts(tmp_path: Path) -> None:
    figures = [Figure.share("held-out pass@1", 16, 64, "policy").__dict__,
               Figure.mean("tokens", [10.0, 12.0, 14.0], "tokens/s").__dict__,
               Figure.single("wall time", 389.6, "s").__dict__]  # fmt: skip
    made = made_by(".venv/bin/python -m bench.train --passes 3")
    page = render([Result(tmp_path / "train.json", made, figures)], [])
    assert "| held-out pass@1 | 0.250 | 64 | 0.160 to 0.368 | policy |" in page
    assert "| tokens | 12.00 tokens/s | 3 | 7.03 to 16.97 | - |" in page
    assert "| wall time | 389.6 s | 1 | - | - |" in page
    assert "commit `abc1234` · AMD EPYC, 2 cores, native float32" in page
    assert "    .venv/bin/python -m bench.train --passes 3" in page
    again = {**made, "refigured": {"commit": "def5678", "date": "2026-12-05T10:00:00Z"}}
    page = render([Result(tmp_path / "train.json", again, figures)], [])
    assert "native float32 · figures recomputed at `def5678`" in page


def test_a_runs_stage_seconds_are_one_row_per_arm(tmp_path: Path) -> None:
    figures = [Figure.mean(f"{arm}: {stage} stage, all rounds", values, "s").__dict__
               for arm, stage, values in (("reviewer", "collect", [170.0, 180.0]),
                                          ("reviewer", "train", [200.0, 220.0]),
                                          ("alone", "collect", [80.0, 80.0]))]  # fmt: skip
    figures.append(Figure.mean("reviewer: wall time of the command", [500.0, 520.0], "s").__dict__)
    page = render(
        [Result(tmp_path / "run.json", made_by(".venv/bin/python -m bench.run --runs 2"), figures)],
        [],
    )
    assert "| arm | n | collect | train |" in page
    assert "| reviewer | 2 | 175.0 (111.5 to 238.5) | 210.0 (82.9 to 337.1) |" in page
    assert "| alone | 2 | 80.00 (80.00 to 80.00) | - |" in page  # no train stage: "-"
    assert "| reviewer: wall time of the command | 510.0 s |" in page
    assert "stage, all rounds" not in page


def test_a_run_is_read_from_its_summary_and_the_arms_compared_over_runs() -> None:
    from bench.run import figures, figures_of

    def summary(kept: bool, gained: int, lost: int, final: float) -> dict:
        rounds = [{"promoted": kept, "eval_gained": gained, "eval_lost": lost,
                   "eval_pass_at_1": final, "policy_version": "policy-r1",
                   "wall_seconds": {"collect": 100.0}}]  # fmt: skip
        wall = {"collect": 100.0, "total": 900.0}
        return {"rounds": rounds, "eval_tasks": 64, "baseline_pass_at_1": 0.266,
                "base_model": "SmolLM2", "wall_seconds": wall}  # fmt: skip

    refused = figures_of(summary(False, 3, 9, 0.172), 950.0)
    assert refused["final_pass_at_1"] == 0.266 and (refused["gained"], refused["lost"]) == (0, 0)
    runs = {"reviewer": [figures_of(summary(True, 16, 5, 0.438), 960.0),
                         figures_of(summary(True, 14, 4, 0.422), 940.0)],
            "alone": [refused, figures_of(summary(True, 7, 6, 0.281), 530.0)]}  # fmt: skip
    found = {f.name: f for f in figures(runs)}
    assert found["reviewer: final held-out pass@1"].value == pytest.approx(0.43)
    assert found["alone: final minus base, paired per run"].value == pytest.approx(1 / 128)
    welch = found["alone minus reviewer, final pass@1 (Welch over runs)"]
    assert welch.value == pytest.approx((0.266 + 0.281) / 2 - 0.43) and welch.n == 4
    assert found["reviewer: total stage, all rounds"].value == 900.0
    assert welch.counts == "policy"  # the policy's own answers; one arm had no reviewer
    share = "reviewer: share of the run after the server's start with work for the policy's "
    assert found[share + "server (baseline, collection, evaluation)"].value == pytest.approx(1 / 9)


def test_every_benchmark_runs_as_a_script_from_the_checkout() -> None:
    """The contract: `.venv/bin/python bench/NAME.py` runs every benchmark (its own folder then
    leads the import path, so no benchmark may shadow a package, and each must find the
    checkout's examples and test helpers)."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    shared = {"__init__", "common", "faults", "smollm2_server"}
    scripts = sorted(p for p in (root / "bench").glob("*.py") if p.stem not in shared)

    def run(script: Path) -> tuple[str, int, str]:
        done = subprocess.run([sys.executable, str(script), "--help"], cwd=root,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        return script.name, done.returncode, done.stderr.strip()[-300:]

    with ThreadPoolExecutor(4) as pool:
        failed = [r for r in pool.map(run, scripts) if r[1] != 0]
    assert failed == []


def test_a_benchmark_stopped_with_sigterm_unwinds_as_ctrl_c_does() -> None:
    """So the model servers it started (in sessions of their own) stop with it: the `finally`
    blocks that stop them run."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        f"sys.modules['__main__'].__file__ = {str(ROOT / 'bench' / 'any.py')!r}\n"
        "import bench.common\n"
        "try:\n    print('started', flush=True)\n    time.sleep(60)\n"
        "finally:\n    print('servers stopped', flush=True)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert process.stdout is not None and process.stdout.readline() == "started\n"
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert out == "servers stopped\n", err
    assert process.returncode != 0 and time.monotonic() - started < 30


def test_an_interrupted_benchmark_lets_its_command_stop_its_servers(tmp_path: Path) -> None:
    """`subprocess.run` would kill the command outright on Ctrl-C, and the model servers it
    started in sessions of their own would outlive both: the command is asked to stop, and
    the benchmark waits for it."""
    import signal
    import subprocess
    import sys
    import time

    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    command = (
        "import pathlib, signal, time\n"
        "def stop(*_): raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "try:\n"
        f"    pathlib.Path({str(ready)!r}).write_text('')\n"
        "    time.sleep(60)\n"
        f"finally:\n    time.sleep(1)\n    pathlib.Path({str(stopped)!r}).write_text('')\n"
    )
    script = (
        "import sys\n"
        f"sys.modules['__main__'].__file__ = {str(ROOT / 'bench' / 'any.py')!r}\n"
        "from bench.common import run_command\n"
        f"run_command([sys.executable, '-c', {command!r}])\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=30)
    assert process.returncode != 0
    assert stopped.exists()  # the command's cleanup ran whole before the benchmark ended


def test_a_command_killed_outright_ends_its_run_though_its_server_lives_on(tmp_path) -> None:
    """A command killed by the kernel leaves the server it started in a session of its own
    (Prefect's temporary one) holding its output open: the benchmark still sees it end, with
    its exit code and what it wrote, and does not wait on the server."""
    import os
    import signal
    import time

    from bench.common import run_command

    server = "setsid sleep 600 & echo $!; echo dying >&2; kill -9 $$"
    started = time.monotonic()
    done = run_command(["sh", "-c", server])
    try:
        assert time.monotonic() - started < 60, "waited on the server's open output"
        assert done.returncode == -signal.SIGKILL and done.stderr == "dying\n"
    finally:
        os.kill(int(done.stdout.split()[0]), signal.SIGKILL)
    log = tmp_path / "run.log"  # its progress, to be followed while it runs
    done = run_command(["sh", "-c", server], log=log)
    try:
        assert done.stderr == "dying\n" == log.read_text()
    finally:
        os.kill(int(done.stdout.split()[0]), signal.SIGKILL)


def test_an_overlapped_arm_reports_how_stale_its_trained_groups_were() -> None:
    from bench.run import figures, figures_of

    def summary(stale: int, dropped: int) -> dict:
        rounds = [{"promoted": True, "eval_gained": 1, "eval_lost": 0, "eval_pass_at_1": 0.3,
                   "rollouts": 32,
                   "policy_version": "policy-r1", "groups": 10, "stale_groups": stale,
                   "dropped_groups": dropped, "wall_seconds": {}}]  # fmt: skip
        return {"rounds": rounds, "eval_tasks": 64, "baseline_pass_at_1": 0.25,
                "base_model": "SmolLM2", "wall_seconds": {"total": 600.0}}  # fmt: skip

    runs = {
        "reviewer": [figures_of(summary(0, 0), 600.0)],
        "overlap": [figures_of(summary(4, 0), 600.0), figures_of(summary(6, 5), 600.0)],
    }
    found = {f.name: f for f in figures(runs)}
    stale = found["overlap: trained groups an earlier version sampled"]
    assert (stale.value, stale.n) == (0.5, 20)
    dropped = found["overlap: groups left out as too old"]
    assert (dropped.value, dropped.n) == (pytest.approx(5 / 25), 25)
    assert not [name for name in found if name.startswith("reviewer") and "version" in name]
    per_minute = found["overlap: rollouts collected per minute of the command"]
    assert (per_minute.value, per_minute.n) == (pytest.approx(3.2), 2)  # 32 in 600 s each
