"""Library lessons at an episode's steps: SLEA-RL's step-level retrieval.

1. The round's planner retrieves the task's lessons from the library (`memory.retrieval`, by
   the task's question); an episode's guided slots carry them as candidates.
2. At each step the candidates are ranked by the words they share with what the policy observes
   there: the opening's messages, then each environment reply (Jaccard overlap of word sets; a
   tie keeps the library's order). The opening is shown the best `STEP_K` that fit
   `STEP_BUDGET` characters; a later step the best `STEP_K` not yet shown that share a word
   with its observation. The task's lessons stand in for SLEA's observation cluster: the
   library is searched once per task, and re-ranked per step within it.
3. The opening's lessons go into the system prompt; a later step's follow the environment's
   reply as a message of their own, inside that reply's forced span (never trained). A step
   with nothing new to show adds nothing. Such an episode is recorded with the context
   `STEP_LESSONS` and every lesson it was shown, and trains as sampled: its guidance sits
   inside the sequence, where no bare prompt can replace it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from memory.retrieval import words

STEP_K, STEP_BUDGET = 2, 800


def at_opening(observation: str, candidates: Sequence[str]) -> list[str]:
    """The lessons for the opening: the best `STEP_K` that fit, shared words or not (the task's
    retrieval already ranked them for its question)."""
    return _best(_ranked(observation, candidates, relevant_only=False), ())


def at_step(observation: str, candidates: Sequence[str], shown: Collection[str]) -> list[str]:
    """The lessons for a later step: the best `STEP_K` not shown yet that share a word with
    what it observes."""
    return _best(_ranked(observation, candidates, relevant_only=True), shown)


def _ranked(observation: str, candidates: Sequence[str], relevant_only: bool) -> list[str]:
    seen = set(words(observation))
    overlap = {text: _jaccard(set(words(text)), seen) for text in candidates}
    ranked = sorted(candidates, key=overlap.__getitem__, reverse=True)  # stable: ties keep order
    return [text for text in ranked if overlap[text] > 0] if relevant_only else ranked


def _jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 0.0


def _best(ranked: list[str], shown: Collection[str]) -> list[str]:
    chosen: list[str] = []
    used = 0
    for text in ranked:
        if text in shown or text in chosen or used + len(text) > STEP_BUDGET:
            continue
        chosen.append(text)
        used += len(text)
        if len(chosen) == STEP_K:
            break
    return chosen


def observed(messages: Sequence[dict[str, Any]]) -> str:
    """What a step observes: the text of the messages that came before it."""
    return "\n".join(str(m.get("content") or "") for m in messages if m["role"] != "system")


def in_system(messages: list[dict[str, Any]], lessons: Sequence[str]) -> list[dict[str, Any]]:
    """The opening with `lessons` added to its system prompt."""
    system = f"{messages[0]['content']}\n\n{_listed(lessons)}"
    return [{"role": "system", "content": system}, *messages[1:]]


def step_message(lessons: Sequence[str]) -> dict[str, Any]:
    """The message that shows a later step's lessons, after the environment's reply."""
    return {"role": "user", "content": _listed(lessons)}


def _listed(lessons: Sequence[str]) -> str:
    return "Lessons from earlier tasks that may help at this step:\n" + "\n".join(
        f"- {lesson}" for lesson in lessons
    )
