"""A task set: what every command needs to train on one kind of task and to judge it.

The built-in task sets are `TaskSet`s, and so is a user's (see `verifiers/plugin.py` and
`docs/tasksets.md`). A task set is one of two shapes:

1. Single completions: `train_tasks(count, seed)` and `eval_tasks(count)` give the tasks, and
   `verify(task, completion)` scores one reply. `train_tasks` may take a third argument, the
   held-out tasks, to draw around them; either way no held-out question is ever trained on.
   Tasks are `Task` records or `(question, answer)` pairs, and the answer is for `verify` only:
   it never enters a prompt. `verify` returns a `Verdict`, a bool (correct or not) or a reward
   in [0, 1], where 1 is a full, correct answer.
2. Episodes: `environment(seed=...)` builds a multi-turn environment (`verifiers/episode.py`)
   that scores its own episodes; its tasks are seeds.

`worked_example` (a question and its solution in the format `verify` wants) lets guided attempts
show the policy the format; `runs_code` says `verify` executes model-written code, which is then
refused on a host that cannot isolate it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from verifiers.episode import Environment
from verifiers.task import Task
from verifiers.verdict import Verdict

ANSWER_PROMPT = (
    "You are a careful math assistant. Work the problem out in one or two short sentences, "
    "then write the final answer inside answer tags, like <answer>42</answer>."
)
CODE_PROMPT = (
    "You are a careful Python programmer. Reply with the requested function in one "
    "```python code block, with no tests or prints."
)

TaskItem = Task | tuple[str, str]
Score = Verdict | bool | float


@dataclass(frozen=True)
class TaskSet:
    train_tasks: Callable[..., Sequence[TaskItem]] | None = None
    eval_tasks: Callable[[int], Sequence[TaskItem]] | None = None
    verify: Callable[[Task, str], Score] | None = None
    environment: Callable[..., Environment] | None = None
    system_prompt: str = ANSWER_PROMPT
    worked_example: tuple[str, str] | None = None
    runs_code: bool = False

    @property
    def episodic(self) -> bool:
        return self.environment is not None

    def missing(self) -> list[str]:
        """What a single-completion task set lacks (nothing, for an episodic one)."""
        if self.episodic:
            return []
        wanted = {"train_tasks": self.train_tasks, "eval_tasks": self.eval_tasks}
        return [name for name, value in (wanted | {"verify": self.verify}).items() if value is None]


def from_object(value: Any) -> TaskSet:
    """A `TaskSet` as is, or one read from the attributes of any object (a module, a class,
    an instance) that has the same names; a callable worked example is called."""
    if isinstance(value, TaskSet):
        return value
    names = [name for name in TaskSet.__dataclass_fields__ if hasattr(value, name)]
    fields = {name: getattr(value, name) for name in names}
    if callable(fields.get("worked_example")):
        fields["worked_example"] = fields["worked_example"]()
    return TaskSet(**fields)
