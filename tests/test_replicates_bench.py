"""Arms over several runs each: the tasks every confirmation shares, and Welch's interval over
runs beside the narrower one over tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.confirm import labelled
from bench.replicates import by_arm, compare, load_runs, shared_tasks
from reports.intervals import welch_difference


def test_welch_interval_widens_with_the_spread_between_runs() -> None:
    steady = welch_difference([0.42, 0.43, 0.41], [0.35, 0.36, 0.34])
    unsteady = welch_difference([0.42, 0.50, 0.34], [0.35, 0.43, 0.27])
    assert steady[0] == pytest.approx(0.07) and unsteady[0] == pytest.approx(0.07)
    assert steady[1] > 0  # three steady runs an arm tell 0.07 from nothing
    assert unsteady[1] < 0 < unsteady[2]  # spread like the default's does not
    # two runs an arm: 1 degree of freedom at least, t = 12.7 at most, never the normal's 1.96
    assert welch_difference([0.4, 0.5], [0.3, 0.4])[2] - 0.1 > 1.96 * 0.1
    with pytest.raises(ValueError, match="two runs"):
        welch_difference([0.4], [0.3, 0.35])


def _confirmation(path: Path, runs: dict[str, dict[str, bool]], arm: str | None = None) -> Path:
    body = {n: {"solved": s} | ({"arm": arm} if arm else {}) for n, s in runs.items()}
    path.write_text(json.dumps({"runs": body}))
    return path


def test_runs_of_one_arm_from_several_confirmations_are_compared_on_shared_tasks(
    tmp_path: Path,
) -> None:
    first = _confirmation(tmp_path / "one.json", {
        "default": {"a": True, "b": False, "c": False, "x": True},
        "herl": {"a": True, "b": True, "c": False, "x": True},
    })  # fmt: skip
    second = _confirmation(tmp_path / "two.json", {
        "k2/default": {"a": False, "b": False, "c": True},
        "k3/default": {"a": True, "b": False, "c": False},
    }, arm="default")  # fmt: skip
    runs = load_runs(first) + load_runs(second)
    arms = by_arm(runs)
    assert {a: len(r) for a, r in arms.items()} == {"default": 3, "herl": 1}
    assert shared_tasks(runs) == ["a", "b", "c"]  # "x" was scored in one confirmation only
    result = compare(arms["herl"], arms["default"], ["a", "b", "c"])
    assert result.difference == pytest.approx(2 / 3 - 1 / 3)
    assert result.runs_low is None  # one run of herl: no interval over runs
    assert result.tasks_low < result.difference < result.tasks_high


def test_two_runs_of_one_arm_confirmed_together_keep_apart() -> None:
    folders = [Path("k4/rltldr"), Path("k6/rltldr"), Path("k5/rltldr+herl4pb")]
    assert list(labelled(folders)) == ["k4/rltldr", "k6/rltldr", "rltldr+herl4pb"]


def test_a_learning_result_gives_its_arms_scored_on_the_gate_tasks(tmp_path: Path) -> None:
    path = tmp_path / "learn.json"
    path.write_text(json.dumps({"arms": {"rltldr": {"solved": {"a": True, "b": False}}}}))
    (run,) = load_runs(path)
    assert (run.arm, run.label, run.solved) == ("rltldr", "learn:rltldr", {"a": True, "b": False})


def test_runs_that_cannot_be_told_apart_are_refused() -> None:
    with pytest.raises(SystemExit, match="hide"):
        labelled([Path("a/k4/rltldr"), Path("b/k4/rltldr")])
