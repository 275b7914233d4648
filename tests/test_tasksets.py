"""Task sets from plugins: `module:attribute` and entry points work through the catalog like the
built-in ones, and a bad plugin is one line that names what is wrong."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from verifiers import catalog
from verifiers.errors import VerifierError
from verifiers.task import Task
from verifiers.verdict import Verdict

EXAMPLE = "examples.tasksets.larger:larger"


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on the import path for plugin modules written by a test; the catalog's cache
    and the modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    catalog.get.cache_clear()
    yield tmp_path
    catalog.get.cache_clear()
    for name in [m for m in sys.modules if m.startswith("fw_plugin")]:
        del sys.modules[name]


def write(folder: Path, module: str, source: str) -> str:
    (folder / f"{module}.py").write_text(textwrap.dedent(source))
    return module


def test_the_example_plugin_works_like_a_built_in_task_set() -> None:
    held_out = catalog.eval_tasks(EXAMPLE, 16)
    train = catalog.train_tasks(EXAMPLE, 32, seed=3, held_out=held_out)
    assert {(t.taskset, t.split) for t in held_out} == {(EXAMPLE, "eval")}
    assert {(t.taskset, t.split) for t in train} == {(EXAMPLE, "train")}
    assert len({t.task_id for t in held_out + train}) == 48
    assert not {t.question for t in held_out} & {t.question for t in train}
    assert catalog.eval_tasks(EXAMPLE, 16) == held_out  # fixed by name and count
    task = held_out[0]
    right = catalog.verify(task, f"So <answer>{task.answer}</answer>")
    assert (right.reward, right.correct) == (1.0, True)
    assert catalog.verify(task, f"It is {task.answer}").reward == 0.5  # no tags: half credit
    assert catalog.verify(task, "<answer>0</answer>").correct is False
    question, solution = catalog.worked_example(EXAMPLE)
    assert catalog.verify(task.model_copy(update={"answer": "207"}), solution).correct
    assert anyio.run(catalog.averify, task, solution) == catalog.verify(task, solution)
    assert not catalog.is_episodic(EXAMPLE) and not catalog.runs_code(EXAMPLE)


def test_the_example_agent_s_task_set_scores_a_reference_by_the_agent_s_own_rule() -> None:
    """The gateway verifies `{session, reference}` feedback with `--taskset`; the agent's own
    task set pays its plain final answer in full, and the answer a model writes as a second
    tool call (its last number the right sum) nothing, as the agent's evaluation does."""
    from examples.agent import correct

    agent = "examples.agent:Sums"
    task = Task(task_id="t", taskset=agent, split="train", question="What is 1 + 2?", answer="3")
    for reply, right in [
        ("3", True), ("The sum is 3.", True), ("tool result: 3", True),
        ("<answer>3</answer>", False), ("4", False), ("", False),
        ('{"name": "output", "arguments": {"value": 3}}', False),
    ]:  # fmt: skip
        verdict = catalog.verify(task, reply)
        assert (verdict.correct, verdict.reward) == (right, float(right)), reply
        assert correct(reply, 3) is right  # the same rule as the agent's own evaluation
    assert catalog.verify(task.model_copy(update={"answer": "three"}), "three").reward == 0.0
    held_out = catalog.eval_tasks(agent, 4)
    assert not {t.question for t in held_out} & {
        t.question for t in catalog.train_tasks(agent, 64, seed=1, held_out=held_out)
    }


def test_an_object_with_the_names_is_a_task_set_and_its_scores_become_verdicts(
    plugin_dir: Path,
) -> None:
    write(
        plugin_dir,
        "fw_plugin_scores",
        """
        from verifiers.task import Task
        from verifiers.verdict import Verdict


        class Evens:
            system_prompt = "Answer yes or no."

            @staticmethod
            def train_tasks(count, seed, held_out):
                seen = {t.question for t in held_out}
                pool = [(f"Is {n} even?", "yes" if n % 2 == 0 else "no") for n in range(40)]
                return [(q, a) for q, a in pool if q not in seen][:count]

            @staticmethod
            def eval_tasks(count):
                return [Task(task_id=f"even-{n}", taskset="mine", split="train",
                             question=f"Is {n} even?", answer="yes" if n % 2 == 0 else "no")
                        for n in range(count)]

            @staticmethod
            def verify(task, completion):
                said = completion.strip().lower()
                if said == "maybe":
                    return 0.25
                if said == "verdict":
                    return Verdict(reward=0.0, correct=False, format_ok=False, answer=None,
                                   reason="asked for one", feedback=("say yes or no",))
                return said == task.answer
    """,
    )
    name = "fw_plugin_scores:Evens"
    held_out = catalog.eval_tasks(name, 4)
    assert [(t.task_id, t.taskset, t.split) for t in held_out][0] == ("even-0", name, "eval")
    train = catalog.train_tasks(name, 36, seed=0, held_out=held_out)
    assert len(train) == 36 and not {t.question for t in train} & {t.question for t in held_out}
    assert catalog.system_prompt(name) == "Answer yes or no."
    zero = held_out[0]
    assert catalog.verify(zero, "yes") == Verdict(
        reward=1.0, correct=True, format_ok=True, answer=None, reason="correct"
    )
    assert catalog.verify(zero, "no").reward == 0.0
    assert catalog.verify(zero, "maybe").reward == 0.25
    assert catalog.verify(zero, "verdict").feedback == ("say yes or no",)
    with pytest.raises(VerifierError, match="has no worked example"):
        catalog.worked_example(name)
    with pytest.raises(VerifierError, match="gave 36 train tasks apart from its held-out ones; "
                       "asked for 37"):  # fmt: skip
        catalog.train_tasks(name, 37, seed=0, held_out=held_out)


def test_an_environment_plugin_plays_episodes(plugin_dir: Path) -> None:
    write(
        plugin_dir,
        "fw_plugin_game",
        """
        from verifiers.guessing import GuessingGame
        from verifiers.taskset import TaskSet

        small = TaskSet(environment=lambda seed: GuessingGame(seed=seed, high=8))
    """,
    )
    name = "fw_plugin_game:small"
    assert catalog.is_episodic(name)
    held_out = catalog.eval_tasks(name, 3)
    assert "from 1 to 8" in held_out[0].question
    game = catalog.environment(held_out[0])
    assert game.step({"content": f"<guess>{game.secret}</guess>"}).done  # type: ignore[attr-defined]
    assert catalog.train_tasks(name, 2, seed=1, held_out=held_out)[0].split == "train"


BAD = [
    ("no_such_module_x:tasks", "", "no module 'no_such_module_x' here"),
    ("fw_plugin_bad:nothing", "x = 1", "module 'fw_plugin_bad' has no 'nothing'"),
    ("fw_plugin_bad:x", "x = 1", "is a int, not a TaskSet"),
    ("fw_plugin_bad:", "", "a plugin is named module:attribute"),
    ("fw_plugin_bad:t", "import numpy_not_here", "importing fw_plugin_bad failed: No module"),
    ("fw_plugin_bad:t", "raise RuntimeError('boom')", "failed: RuntimeError: boom"),
    (
        "fw_plugin_bad:t",
        "from verifiers.taskset import TaskSet\nt = TaskSet(train_tasks=print)",
        "has no eval_tasks, verify (a task set needs",
    ),
    (
        "fw_plugin_bad:t",
        "class t:\n    train_tasks = eval_tasks = 3\n    verify = print",
        "train_tasks is not callable",
    ),
    (
        "fw_plugin_bad:t",
        "class t:\n    train_tasks = eval_tasks = verify = print\n    system_prompt = ''",
        "system_prompt must be a non-empty string",
    ),
    (
        "fw_plugin_bad:t",
        "class t:\n    train_tasks = eval_tasks = verify = print\n    worked_example = 'q'",
        "worked_example must be (question, solution)",
    ),
]


@pytest.mark.parametrize(("name", "source", "message"), BAD)
def test_a_bad_plugin_is_one_line_naming_what_is_wrong(
    plugin_dir: Path, name: str, source: str, message: str
) -> None:
    if source:
        write(plugin_dir, name.split(":")[0], source)
    with pytest.raises(VerifierError) as caught:
        catalog.check(name)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_plugin_that_fails_at_work_says_which_part_failed(plugin_dir: Path) -> None:
    write(
        plugin_dir,
        "fw_plugin_work",
        """
        class few:
            train_tasks = staticmethod(lambda count, seed: [("q", "a")])
            eval_tasks = staticmethod(lambda count: [("q1", "a"), ("q2", "b")])
            verify = staticmethod(lambda task, completion: 1 / 0 if completion else 7)
    """,
    )
    name = "fw_plugin_work:few"
    with pytest.raises(VerifierError, match="has 2 held-out tasks; asked for 3"):
        catalog.eval_tasks(name, 3)
    task = catalog.eval_tasks(name, 1)[0]
    with pytest.raises(VerifierError, match="verify raised ZeroDivisionError: division by zero"):
        catalog.verify(task, "x")
    with pytest.raises(VerifierError, match="a reward in \\[0, 1\\], not '7'"):
        catalog.verify(task, "")


def test_an_installed_package_registers_a_name(plugin_dir: Path) -> None:
    write(plugin_dir, "fw_plugin_pkg", "from examples.tasksets.larger import larger as tasks\n")
    info = plugin_dir / "fw_plugin_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fw-plugin-pkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[flywheel.tasksets]\nlarger = fw_plugin_pkg:tasks\n")
    assert "larger" in catalog.names()
    tasks = catalog.eval_tasks("larger", 2)
    assert tasks[0].taskset == "larger" and tasks[0].task_id.startswith("larger:")
    assert catalog.verify(tasks[0], f"<answer>{tasks[0].answer}</answer>").correct


def test_a_task_record_keeps_its_id_and_takes_the_plugin_s_name() -> None:
    task = Task(task_id="t1", taskset="other", split="train", question="q", answer="a")
    assert catalog._task("mine", "eval", task).model_dump() == task.model_dump() | {
        "taskset": "mine", "split": "eval"
    }  # fmt: skip


def test_guided_attempts_need_a_worked_example(plugin_dir: Path, tmp_path: Path, capsys) -> None:
    from cli.launch import run_settings
    from cli.main import main
    from cli.parser import build

    write(
        plugin_dir,
        "fw_plugin_bare",
        """
        class bare:
            train_tasks = staticmethod(lambda count, seed: [(f"q{i}", "a") for i in range(count)])
            eval_tasks = staticmethod(lambda count: [(f"e{i}", "a") for i in range(count)])
            verify = staticmethod(lambda task, completion: completion == task.answer)
    """,
    )
    code = main(["run", "--workdir", str(tmp_path), "--taskset", "fw_plugin_bare:bare"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "has no worked example for guided attempts to show" in err
    assert "--guided-fraction 0" in err
    # rounds on captured traffic alone generate no attempt, so nothing needs the example
    flags = ["--workdir", str(tmp_path), "--source", "captured", "--taskset", "fw_plugin_bare:bare"]
    args = build().parse_args(
        ["serve", "--server-url", "http://127.0.0.1:9", *flags, "--guided-fraction", "0.5"]
    )
    assert run_settings(args).taskset == "fw_plugin_bare:bare"
