"""Own examples: the policy's verified successes on earlier tasks, shown as worked examples.

A 135M policy answers far better after one worked example than after any written guidance
(a strategy, an insight, a hint): in-context imitation is what it can use. So the guided slots
may show, instead of the task set's one fixed example, the policy's own verified answer to the
most similar task it has already solved: the experience is the policy's, and so is the work.

1. `ExampleBook` is one batch's shared state: the newest verified answer of each solved task
   (at most `capacity` tasks, the oldest dropped first), written by the policy itself (a bare or
   guided first attempt; never a reviewer's revision, a nudged or a retried attempt).
2. Nearest: the solved task of the same task set whose question has the closest shape
   (numbers stand as `#`, then difflib's ratio), ties to the newest. Never the task itself,
   and never an answer the verifier accepts for this task (checked as strategies and hints
   are; an example the check cannot be made on is passed by): an example shows how, not what.
3. With no such example the guided slots show the task set's worked example (`agents.slots`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from difflib import SequenceMatcher

from memory.records import Group
from verifiers.catalog import averify, is_episodic
from verifiers.errors import TaskFault
from verifiers.task import Task

NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Example:
    """A solved task of a task set, and the policy's verified answer to it."""

    taskset: str
    question: str
    answer: str


def shape(question: str) -> str:
    """A question's form: its numbers as `#`, its spacing normalised."""
    return " ".join(NUMBER.sub("#", question).split())


class ExampleBook:
    """The policy's verified answers per solved task, newest last (module docstring, 1)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._solved: OrderedDict[str, Example] = OrderedDict()  # by task id, oldest first

    def __len__(self) -> int:
        return len(self._solved)

    def record(self, group: Group) -> None:
        """Keep the group's newest verified answer that the policy wrote itself."""
        own = [a.sample for a in group.first_attempts if a.correct and a.sample is not None]
        if not own or not own[-1].text.strip():
            return
        self._solved.pop(group.task_id, None)
        self._solved[group.task_id] = Example(group.taskset, group.question, own[-1].text.strip())
        while len(self._solved) > self.capacity:
            self._solved.popitem(last=False)

    async def nearest(self, task: Task) -> tuple[str, str] | None:
        """The most similar other solved task's question and answer, or None (docstring, 2)."""
        if is_episodic(task.taskset):  # an episode's guided slots see lessons, not an example
            return None
        target = shape(task.question)
        newest_first = [
            example
            for key, example in reversed(self._solved.items())
            if key != task.task_id and example.taskset == task.taskset
        ]
        ranked = sorted(  # stable: among equally close examples the newest comes first
            newest_first,
            key=lambda example: SequenceMatcher(None, target, shape(example.question)).ratio(),
            reverse=True,
        )
        for example in ranked:
            if example.question == task.question:
                continue
            try:
                leaks = (await averify(task, example.answer)).correct
            except TaskFault:  # the check could not be made: pass this example by
                continue
            if not leaks:
                return example.question, example.answer
        return None
