"""The task-set catalog: every name works end to end through one surface."""

from __future__ import annotations

import anyio
import pytest

from verifiers.catalog import (
    CODE_SETS,
    averify,
    check,
    eval_tasks,
    is_episodic,
    names,
    system_prompt,
    train_tasks,
    verify,
    worked_example,
)
from verifiers.errors import VerifierError
from verifiers.sandbox import Isolation, best_isolation

NO_NAMESPACES = best_isolation() is Isolation.PROCESS


@pytest.mark.parametrize("name", names())
def test_every_task_set_has_tasks_an_example_and_a_prompt(name: str) -> None:
    if name in CODE_SETS and NO_NAMESPACES:
        pytest.skip("no namespace isolation on this host: code task sets refuse to run")
    held_out = eval_tasks(name, 4)
    train = train_tasks(name, 4, seed=1, held_out=held_out)
    assert {t.taskset for t in held_out + train} == {name}
    assert not {t.task_id for t in held_out} & {t.task_id for t in train}
    if is_episodic(name):
        with pytest.raises(VerifierError, match="played in episodes"):
            worked_example(name)
        return
    question, solution = worked_example(name)
    assert question and solution and system_prompt(name)


def test_the_worked_examples_are_in_the_format_their_verifier_requires() -> None:
    if NO_NAMESPACES:
        pytest.skip("no namespace isolation on this host")
    for name in [n for n in names() if not is_episodic(n)]:
        task = eval_tasks(name, 1)[0]
        _, solution = worked_example(name)
        verdict = verify(task, solution)
        assert verdict.format_ok, (name, verdict)


def test_async_verification_matches_the_blocking_one() -> None:
    if NO_NAMESPACES:
        pytest.skip("no namespace isolation on this host: code task sets refuse to run")
    task = eval_tasks("code", 1)[0]
    reply = "```python\ndef count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n```"
    assert anyio.run(averify, task, reply) == verify(task, reply)
    assert verify(task, reply).correct


def test_unknown_names_are_refused_in_one_line() -> None:
    with pytest.raises(VerifierError, match=r"unknown task set 'cod'; choose one of .*code"):
        check("cod")


def test_any_reasoning_gym_task_is_a_task_set_by_name() -> None:
    check("gym:leg_counting")
    held_out = eval_tasks("gym:leg_counting", 3)
    train = train_tasks("gym:leg_counting", 3, seed=1, held_out=held_out)
    assert not {t.question for t in held_out} & {t.question for t in train}
    question, solution = worked_example("gym:leg_counting")
    assert solution.startswith("<answer>") and question not in {t.question for t in held_out}
    task = held_out[0]
    assert verify(task, f"<answer>{task.answer}</answer>").reward == 1.0
    with pytest.raises(VerifierError, match="reasoning-gym has no task 'nope'"):
        check("gym:nope")


@pytest.mark.parametrize("name", sorted(CODE_SETS))
def test_code_task_sets_refuse_a_host_that_cannot_isolate_them(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("verifiers.sandbox.best_isolation", lambda: Isolation.PROCESS)
    with pytest.raises(VerifierError, match=r"needs bubblewrap .*apt-get install bubblewrap"):
        check(name)
    check("arithmetic")  # task sets that run no code do not care
