"""Code tasks against real sandboxed executions: correct code earns reward, and every reward
hack in the list earns nothing."""

from __future__ import annotations

import json

import pytest

from verifiers.coding import eval_tasks, extract_code, train_tasks, verify
from verifiers.errors import VerifierError
from verifiers.problems import PROBLEMS
from verifiers.sandbox import Isolation, best_isolation
from verifiers.task import Task


@pytest.fixture(scope="module")
def task() -> Task:
    if best_isolation() is Isolation.PROCESS:
        pytest.skip("no namespace isolation on this host")
    return next(t for t in train_tasks(18, seed=0) if t.task_id == "code:run_length")


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```"


SOLUTION = """
def run_length(s):
    out = []
    for ch in s:
        if out and out[-1][0] == ch:
            out[-1][1] += 1
        else:
            out.append([ch, 1])
    return "".join(f"{n}{ch}" for ch, n in out)
"""


def test_a_correct_fenced_solution_earns_full_reward(task: Task) -> None:
    verdict = verify(task, fenced(SOLUTION))
    assert (verdict.reward, verdict.correct, verdict.format_ok) == (1.0, True, True)
    assert all(line.startswith("passed") for line in verdict.feedback)


def test_unfenced_code_is_run_for_partial_credit(task: Task) -> None:
    verdict = verify(task, "Sure." + SOLUTION)
    assert (verdict.reward, verdict.correct, verdict.format_ok) == (0.5, True, False)


def test_feedback_names_each_failing_case(task: Task) -> None:
    verdict = verify(task, fenced("def run_length(s):\n    return s"))
    assert verdict.reward == 0.0
    assert "failed: run_length('aaab') returned 'aaab', expected '3a1b'" in verdict.feedback
    assert "run_length('aaab')" in verdict.reason  # the first failure, for reflections


def test_the_same_behaviour_has_the_same_answer_key(task: Task) -> None:
    one = verify(task, fenced("def run_length(s):\n    return ''"))
    two = verify(task, fenced("def run_length(text):\n    result = ''\n    return result"))
    other = verify(task, fenced("def run_length(s):\n    return s"))
    assert one.answer == two.answer != other.answer


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "def run_length(s):\n    raise SystemExit(0)",
        "import builtins\nbuiltins.AssertionError = Exception\ndef run_length(s):\n    return s",
        "class Anything(str):\n    def __eq__(self, other):\n        return True\n"
        "def run_length(s):\n    return Anything()",
        "import json\njson.dumps = lambda *a, **k: '{\"results\": []}'\n"
        "def run_length(s):\n    return s",
        'print(\'{"results": [{"value": "3a1b"}]}\')\nimport os\nos._exit(0)',
        "import glob\ndef run_length(s):\n    return str(glob.glob('/**/*test*', recursive=True))",
        "def run_length(s):\n    while True:\n        pass",
        "run_length = None",
    ],
    ids=["exit", "os-exit", "raise-exit", "patch-assert", "always-equal", "patch-reporter",
         "print-report", "read-tests", "hang", "not-callable"],
)  # fmt: skip
def test_reward_hacks_earn_nothing(task: Task, code: str) -> None:
    verdict = verify(task, fenced(code))
    assert verdict.reward == 0.0 and not verdict.correct, verdict


@pytest.mark.parametrize(
    ("completion", "reason"),
    [
        ("```python\ndef f(): pass\n```\n```python\ndef g(): pass\n```", "multiple code blocks"),
        ("```python\n\n```", "empty code block"),
        ("```python\ndef f(): pass", "unclosed code fence"),
        ("I cannot help with that.", "no code"),
    ],
)
def test_malformed_replies_are_refused_before_running(completion: str, reason: str) -> None:
    assert extract_code(completion) == (None, False, reason)


def test_held_out_problems_never_appear_in_training() -> None:
    held_out = {t.task_id for t in eval_tasks(6)}
    trained = {t.task_id for seed in range(5) for t in train_tasks(18, seed)}
    assert held_out.isdisjoint(trained)
    assert len(held_out) + len(trained) == len(PROBLEMS)


def test_hidden_tests_stay_out_of_the_question() -> None:
    for task in eval_tasks(6):
        expected = [json.dumps(e) for _, e in json.loads(task.answer)["cases"]]
        assert not any(e in task.question for e in expected if len(e) > 3)


def test_asking_for_more_tasks_than_exist_is_a_clear_error() -> None:
    with pytest.raises(VerifierError, match="has 6 eval tasks; asked for 7"):
        eval_tasks(7)
