"""Prompt contexts: the bare prompt, and the guided variants an attempt may be sampled under.

Each variant has a name that is stored on the attempt (`Attempt.context`), so training knows
which guidance was in the prompt and evaluation can leave guided attempts out.

- bare: system prompt and task.
- demo: one worked example of the task set as an earlier user/assistant turn.
- hint: guidance appended to the system prompt (a reflection's principle, R3L's pivot 0).
- insights: the task, then each insight as its own user message (RLTLDR).
- experience: lessons retrieved from the experience library in the system prompt (EDGE).
- strategies: the task, then earlier strategies for it with their outcomes (SGE's reflection).
"""

from __future__ import annotations

from typing import Any

from verifiers.task import Task

Messages = list[dict[str, Any]]


def bare_messages(task: Task, system_prompt: str) -> Messages:
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": task.question},
    ]


def demo_messages(task: Task, system_prompt: str, example: tuple[str, str]) -> Messages:
    question, solution = example
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": question},
        {"role": "assistant", "content": solution},
        {"role": "user", "content": task.question},
    ]


def hint_messages(task: Task, system_prompt: str, hint: str) -> Messages:
    return [
        {"role": "system", "content": f"{system_prompt}\n\nGuidance from an earlier try: {hint}"},
        {"role": "user", "content": task.question},
    ]


def experience_messages(task: Task, system_prompt: str, lessons: list[str]) -> Messages:
    listed = "\n".join(f"- {lesson}" for lesson in lessons)
    return [
        {
            "role": "system",
            "content": f"{system_prompt}\n\nLessons from earlier attempts:\n{listed}",
        },
        {"role": "user", "content": task.question},
    ]


def insight_messages(task: Task, system_prompt: str, insights: list[str]) -> Messages:
    notes = [{"role": "user", "content": f"Insight: {insight}"} for insight in insights]
    return bare_messages(task, system_prompt) + notes


def strategies_messages(task: Task, system_prompt: str, note: str) -> Messages:
    return [*bare_messages(task, system_prompt), {"role": "user", "content": note}]


def demo_text(example: tuple[str, str]) -> str:
    """The guidance of the demo variant as one string, for the attempt's record."""
    question, solution = example
    return f"{question} -> {solution}"
