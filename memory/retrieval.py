"""Retrieval of library entries for one prompt: in scope, ranked, within a character budget.

1. Candidates are the active entries in the prompt's scope: the task's own, its task set's, and
   global ones.
2. They are ranked by cosine similarity of sentence embeddings when an embedder is given and
   every candidate has a vector, else by BM25 over their words (k1 1.5, b 0.75); ties go to
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
from memory.records import ExperienceEntry

K1, B = 1.5, 0.75


@dataclass(frozen=True)
class Hit:
    entry: ExperienceEntry
    score: float


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class Index:
    def __init__(
        self,
        entries: list[ExperienceEntry],
        vectors: dict[int, bytes] | None = None,
        embedder: Embedder | None = None,
    ) -> None:
        self.entries = entries
        self.scopes = np.array([e.scope for e in entries], dtype=object)
        self.keys = np.array([e.scope_key for e in entries], dtype=object)
        self.utility = np.array([e.utility for e in entries], dtype=np.float64)
        vectors = vectors or {}
        self.embedder = embedder if entries and all(e.id in vectors for e in entries) else None
        self.matrix = (
            np.stack([from_bytes(vectors[e.id]) for e in entries]) if self.embedder else None
        )
        self._bm25(entries)

    def search(
        self, query: str, task_id: str, taskset: str, k: int = 6, char_budget: int = 800
    ) -> list[Hit]:
        if not self.entries:
            return []
        in_scope = (self.scopes == "global") | (
            ((self.scopes == "task") & (self.keys == task_id))
            | ((self.scopes == "task_type") & (self.keys == taskset))
        )
        scores = self._similarity(query)
        candidates = np.flatnonzero(in_scope)
        order = sorted(candidates, key=lambda i: (-scores[i], -self.utility[i]))
        hits, used = [], 0
        for i in order:
            text = self.entries[i].text
            if used + len(text) > char_budget:
                continue
            hits.append(Hit(self.entries[i], float(scores[i])))
            used += len(text)
            if len(hits) == k:
                break
        return hits

    def _similarity(self, query: str) -> np.ndarray:
        if self.embedder is not None and self.matrix is not None:
            return self.matrix @ self.embedder.embed([query])[0]
        scores = np.zeros(len(self.entries))
        for term in set(words(query)):
            for doc, tf in self.postings.get(term, ()):
                norm = tf + K1 * (1 - B + B * self.lengths[doc] / self.mean_length)
                scores[doc] += self.idf[term] * tf * (K1 + 1) / norm
        return scores

    def _bm25(self, entries: list[ExperienceEntry]) -> None:
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.lengths = np.zeros(len(entries))
        for doc, entry in enumerate(entries):
            counts = Counter(words(entry.text))
            self.lengths[doc] = sum(counts.values())
            for term, tf in counts.items():
                self.postings[term].append((doc, tf))
        self.mean_length = float(self.lengths.mean()) if entries else 1.0
        n = len(entries)
        self.idf = {
            term: math.log((n - len(docs) + 0.5) / (len(docs) + 0.5) + 1)
            for term, docs in self.postings.items()
        }
