"""Retrieval of library lessons for one prompt: in scope, ranked, within a character budget.

1. Scoped lessons are the active ones in the prompt's scope: the task's own, its task set's, and
   global ones; only they are scored.
2. They are ranked by cosine similarity of sentence embeddings when an embedder is given and
   every scoped lesson has a vector, else by BM25 over their words (k1 1.5, b 0.75); ties go to
   the higher utility.
3. The best `k` whose texts fit in `char_budget` characters together are returned.

An `Index` is built once from a snapshot of the library (a round's worth of prompts) and is
read-only, so concurrent agents can share it.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from memory.embedding import Embedder, from_bytes
from memory.records import Lesson

K1, B = 1.5, 0.75


@dataclass(frozen=True)
class Hit:
    lesson: Lesson
    score: float


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class Index:
    def __init__(
        self,
        lessons: list[Lesson],
        vectors: dict[int, bytes] | None = None,
        embedder: Embedder | None = None,
    ) -> None:
        self.lessons = lessons
        self.by_scope: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, e in enumerate(lessons):
            self.by_scope[(e.scope, e.scope_key if e.scope != "global" else "")].append(i)
        vectors = vectors or {}
        self.embedder = embedder if lessons and all(e.id in vectors for e in lessons) else None
        self.matrix = (
            np.stack([from_bytes(vectors[e.id]) for e in lessons]) if self.embedder else None
        )
        self._bm25(lessons)

    def search(
        self, query: str, task_id: str, taskset: str, k: int = 6, char_budget: int = 800
    ) -> list[Hit]:
        scoped = [
            *self.by_scope.get(("task", task_id), ()),
            *self.by_scope.get(("task_type", taskset), ()),
            *self.by_scope.get(("global", ""), ()),
        ]
        if not scoped:
            return []
        scores = dict(zip(scoped, self._similarity(query, scoped), strict=True))
        order = sorted(scoped, key=lambda i: (-scores[i], -self.lessons[i].utility))
        hits, used = [], 0
        for i in order:
            text = self.lessons[i].text
            if used + len(text) > char_budget:
                continue
            hits.append(Hit(self.lessons[i], float(scores[i])))
            used += len(text)
            if len(hits) == k:
                break
        return hits

    def _similarity(self, query: str, scoped: list[int]) -> list[float]:
        """Scores of the scoped only: a prompt's scope is a small part of the library."""
        if self.embedder is not None and self.matrix is not None:
            return list(self.matrix[scoped] @ self.embedder.embed([query])[0])
        terms = set(words(query))
        scores = []
        for doc in scoped:
            counts, norm = self.counts[doc], K1 * (1 - B + B * self.lengths[doc] / self.mean_length)
            scores.append(
                sum(
                    self.idf[t] * counts[t] * (K1 + 1) / (counts[t] + norm)
                    for t in terms & counts.keys()
                )
            )
        return scores

    def _bm25(self, lessons: list[Lesson]) -> None:
        self.counts = [Counter(words(lesson.text)) for lesson in lessons]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.mean_length = sum(self.lengths) / len(lessons) if lessons else 1.0
        frequency = Counter(term for c in self.counts for term in c)
        n = len(lessons)
        self.idf = {t: math.log((n - df + 0.5) / (df + 0.5) + 1) for t, df in frequency.items()}
