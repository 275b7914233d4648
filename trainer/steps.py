"""SLEA-RL's step-level advantages for episodes: credit for each turn, not only for the episode.

1. A turn's observation is what the policy saw just before it: the task for the first turn, the
   environment's replies since the previous turn for the others.
2. Observations are clustered across the group's episodes: one joins the first cluster whose
   prototype it matches at a similarity of at least 0.85 (difflib's ratio on the text, in place
   of the paper's sentence embeddings), else it starts a cluster (at most 500 a group).
3. With only the episode's final reward R, turn t of T has the discounted return
   R_t = gamma^(T - 1 - t) * R (gamma 0.95). Its step advantage is R_t minus the mean return of
   the group's turns in its cluster: a turn does better than the others that met the same
   situation when its episode reached the reward sooner, or at all.
4. The token advantage of turn t is A_ep + w * A_step(t) (w = `step_weight`); replies and pivot
   tokens are not trained, so they take no credit either way.
"""

from __future__ import annotations

import difflib
import statistics

from memory.records import Attempt

SIMILAR = 0.85
MAX_CLUSTERS = 500
COMPARED = 2000


def turn_spans(attempt: Attempt) -> list[tuple[int, int]]:
    """The completion positions of each sampled turn: between the forced replies."""
    assert attempt.sample is not None
    spans, start = [], 0
    for reply_start, reply_end in attempt.forced_spans:
        spans.append((start, reply_start))
        start = reply_end
    spans.append((start, len(attempt.sample.completion_token_ids)))
    return spans


def observations(attempt: Attempt) -> list[str]:
    """What the policy saw before each of its turns (see the module docstring)."""
    seen: list[str] = []
    since: list[str] = []
    for message in attempt.messages:
        if message["role"] == "assistant":
            seen.append(" | ".join(since))
            since = []
        elif message["role"] != "system":
            since.append(str(message.get("content") or ""))
    turns = len(turn_spans(attempt))
    if len(seen) < turns:  # the last turn is in the sample, not yet in the messages
        seen.append(" | ".join(since))
    return seen[:turns]


def cluster(texts: list[str]) -> list[int]:
    """Each text's cluster: the first prototype it matches at `SIMILAR`, else a new one."""
    prototypes: list[str] = []
    found = []
    for text in texts:
        match = next(
            (i for i, p in enumerate(prototypes) if _similar(text, p)),
            None,
        )
        if match is None and len(prototypes) < MAX_CLUSTERS:
            prototypes.append(text)
            match = len(prototypes) - 1
        found.append(match if match is not None else len(prototypes) - 1)
    return found


def step_advantages(
    members: list[Attempt], rewards: list[float], gamma: float
) -> list[list[float]]:
    """Per member, each turn's step advantage (one turn, as a one-step answer has: its return
    against its cluster's, which is the episode's own advantage again when all share it)."""
    turns = [observations(m) if m.sample is not None else [] for m in members]
    returns = [
        [gamma ** (len(seen) - 1 - t) * reward for t in range(len(seen))]
        for seen, reward in zip(turns, rewards, strict=True)
    ]
    flat = [(i, t) for i, seen in enumerate(turns) for t in range(len(seen))]
    ids = cluster([turns[i][t] for i, t in flat])
    by_cluster: dict[int, list[float]] = {}
    for (i, t), c in zip(flat, ids, strict=True):
        by_cluster.setdefault(c, []).append(returns[i][t])
    means = {c: statistics.fmean(values) for c, values in by_cluster.items()}
    found = [[0.0] * len(seen) for seen in turns]
    for (i, t), c in zip(flat, ids, strict=True):
        found[i][t] = returns[i][t] - means[c]
    return found


def token_steps(attempt: Attempt, steps: list[float], weight: float) -> list[float]:
    """`weight` times each turn's step advantage, on that turn's completion tokens."""
    assert attempt.sample is not None
    added = [0.0] * len(attempt.sample.completion_token_ids)
    for (start, end), step in zip(turn_spans(attempt), steps, strict=False):
        added[start:end] = [weight * step] * (end - start)
    return added


def _similar(a: str, b: str) -> bool:
    """At `SIMILAR` or above on the first `COMPARED` characters (a long tool result's head
    says which situation it is)."""
    a, b = a[:COMPARED], b[:COMPARED]
    return a == b or difflib.SequenceMatcher(None, a, b, autojunk=False).ratio() >= SIMILAR
