"""Training rows from stored groups, on exactly the token ids the server sampled.

1. A group's members are its first attempts, its retries and its nudged attempts; one
   advantage mode scores them (`trainer.advantages`). Members whose advantage is zero are dropped.
2. Context at train time: a guided member is trained as a *distill copy*, its sampled completion
   under the bare prompt (the ids the server tokenised for the unguided attempts), without the
   importance weight, since it was never sampled under that prompt. Only distill copies with a
   positive advantage are kept unless `distill_negatives` is set: pushing down text the policy
   never sampled, with no importance weight to bound it, is what destabilises a small model.
   With `distill_guided` off a guided member is trained under its own guided prompt,
   importance-weighted like any sample.
3. Pivotal credit: a retry replays its parent's first `pivot_tokens` completion tokens; those
   tokens get no gradient, in the retry and in the parent it is paired with. Forced spans
   (text the agent inserted, such as SGE's cues) get no gradient either.
4. HeRL: a verified revision that beats its parent and is beaten by no first attempt of its
   group (in a group that all failed: beats them all) takes the slot of the
   worst first attempt other than its parent, and the parent earns a bonus towards it,
   r' = r + bonus * (r_rev - r); of several verified draws, the best wins (the shortest among
   equals). The revision is trained under the bare prompt as an off-policy row (`trainer.round`
   weighs it with the shaped weight), or with `revision_weight = "distill"` like a distill
   copy: its advantage alone.
5. NudgeRL: attempts sampled with a reviewer's hint (a group that all failed) are members like
   the rest and, being guided, are distilled: a nudged success is trained under the bare prompt.
6. SLEA-RL (`step_weight` above 0): in a group of episodes each turn's tokens also get the
   turn's step advantage, its discounted return against the turns that met a similar
   observation (`trainer.steps`).
7. R3L adds single-item groups: an improved retry under its guided prompt, and the reflection
   that led to it. `filtered` (the default) filters the rows to a positive ratio, as RLTLDR
   does; `rltldr` also adds insight SFT rows (the insight given only the task, weight lambda).
"""

from __future__ import annotations

import random
from collections import Counter

from pydantic import BaseModel, ConfigDict

from memory.records import FIRST_KINDS, Attempt, Group
from trainer.advantages import advantages
from trainer.settings import TrainSettings
from trainer.steps import step_advantages, token_steps

IGNORE = -100
WINDOW = 8  # batches sorted by length together (see `length_batches`)


class TrainRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    input_ids: list[int]
    labels: list[int]
    advantages: list[float]
    behaviour_logprobs: list[float]
    importance: bool = True
    off_policy: bool = False  # written by another model: HeRL's shaped weight, not the ratio
    reward: float = 0.0
    context: str = "bare"

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE)


def build_rows(groups: list[Group], settings: TrainSettings) -> list[TrainRow]:
    """The rows of one round, in group order (the positive-ratio filter uses `settings.seed`)."""
    rows: list[TrainRow] = []
    extras: list[TrainRow] = []
    for group in groups:
        if group.complete:
            rows += _member_rows(group, settings)
            extras += _extra_rows(group, settings)
    if settings.mode in ("filtered", "rltldr"):
        rows = positive_ratio_filter(rows, settings.positive_ratio, random.Random(settings.seed))
    return rows + extras


def length_batches(rows: list[TrainRow], batch_size: int, seed: int) -> list[TrainRow]:
    """The rows in training order: shuffled, cut into windows of `WINDOW` batches, each window
    sorted by length and cut into batches, and the batches shuffled. A batch pads to its longest
    row, so batches of near lengths pad less; the window keeps each batch a draw from the round
    rather than one end of its length range (long answers are more often wrong)."""
    rng = random.Random(seed)
    order = rows[:]
    rng.shuffle(order)
    batches: list[list[TrainRow]] = []
    span = WINDOW * batch_size
    for start in range(0, len(order), span):
        window = sorted(order[start : start + span], key=lambda row: len(row.input_ids))
        batches += [window[i : i + batch_size] for i in range(0, len(window), batch_size)]
    rng.shuffle(batches)
    return [row for batch in batches for row in batch]


def padded_share(rows: list[TrainRow], pass_size: int) -> float:
    """The share of the positions a round computes that are padding, passed `pass_size` rows at
    a time in this order (a micro-batch pads to its own longest row)."""
    computed = real = 0
    for start in range(0, len(rows), pass_size):
        lengths = [len(row.input_ids) for row in rows[start : start + pass_size]]
        computed, real = computed + max(lengths) * len(lengths), real + sum(lengths)
    return 1.0 - real / computed if computed else 0.0


def context_counts(rows: list[TrainRow]) -> dict[str, int]:
    """How many rows were trained under each context, for the round's record."""
    return dict(Counter(row.context for row in rows))


def positive_ratio_filter(rows: list[TrainRow], ratio: float, rng: random.Random) -> list[TrainRow]:
    """Subsample so that `ratio` of the rows have a positive reward (RLTLDR)."""
    positive = [i for i, row in enumerate(rows) if row.reward > 0]
    negative = [i for i, row in enumerate(rows) if row.reward <= 0]
    if not positive or not negative:
        return rows
    if len(positive) / len(rows) < ratio:
        keep = round(len(positive) * (1 - ratio) / ratio)
        negative = rng.sample(negative, max(1, keep))
    else:
        keep = round(len(negative) * ratio / (1 - ratio))
        positive = rng.sample(positive, max(1, min(keep, len(positive))))
    kept = set(positive) | set(negative)
    return [row for i, row in enumerate(rows) if i in kept]


def member_advantages(group: Group, settings: TrainSettings) -> dict[tuple[int, str], float]:
    """The advantage each member (first attempts, retries and a revision, by sample index and
    kind) gets in its group under `settings.mode`; what the store records on the trained
    segments."""
    members = _members(group)
    scores = advantages(settings.mode, _rewards(members, settings), settings.amplification)
    return {(a.sample_index, a.kind): score for a, score in zip(members, scores, strict=True)}


def _members(group: Group) -> list[Attempt]:
    """The attempts a group's advantages are computed over: its first attempts, retries and
    nudged attempts (NudgeRL), and a winning revision in place of its worst first attempt."""
    extras = [a for a in group.attempts if a.kind in ("retry", "nudge") and a.error is None]
    revision = winning_revision(group)
    if revision is None:
        return group.first_attempts + extras
    return _without_worst(group.first_attempts, revision.parent_index) + extras + [revision]


def winning_revision(group: Group) -> Attempt | None:
    """HeRL: the group's best verified revision (the shortest among equals, then the first
    drawn), when it beats its parent (`improved`, as collected) and no first attempt beats it."""
    best = max((a.reward for a in group.first_attempts), default=0.0)
    revisions = [
        a
        for a in group.attempts
        if a.kind == "revision" and a.error is None and a.sample and a.improved
        and a.reward >= best
    ]  # fmt: skip
    return min(revisions, key=_revision_rank, default=None)


def _revision_rank(revision: Attempt) -> tuple[float, int, int]:
    tokens = len(revision.sample.completion_token_ids) if revision.sample else 0
    return -revision.reward, tokens, revision.sample_index


def _without_worst(firsts: list[Attempt], keep: int | None) -> list[Attempt]:
    """`firsts` less the lowest-rewarded attempt other than slot `keep` (the last among equals)."""
    others = [a for a in firsts if a.sample_index != keep]
    if not others:
        return firsts
    worst = min(others, key=lambda a: (a.train_reward, -a.sample_index))
    return [a for a in firsts if a is not worst]


def _rewards(members: list[Attempt], settings: TrainSettings) -> list[float]:
    """Each member's training reward; a revised attempt earns HeRL's bonus towards its revision."""
    revision = next((a for a in members if a.kind == "revision"), None)
    parent = revision and next(
        (a for a in members if a.kind in FIRST_KINDS and a.sample_index == revision.parent_index),
        None,
    )
    rewards = []
    for attempt in members:
        reward = attempt.train_reward
        if revision and attempt is parent:
            reward += settings.revision_bonus * (revision.reward - reward)
        rewards.append(reward)
    return rewards


def _member_rows(group: Group, settings: TrainSettings) -> list[TrainRow]:
    members = _members(group)
    pivots = {a.parent_index: a.pivot_tokens for a in members if a.kind == "retry"}
    rewards = _rewards(members, settings)
    scores = advantages(settings.mode, rewards, settings.amplification)
    steps = _steps(members, rewards, settings)
    rows = []
    for attempt, advantage, step in zip(members, scores, steps, strict=True):
        paired = pivots.get(attempt.sample_index, 0) if attempt.kind in FIRST_KINDS else 0
        pivot = attempt.pivot_tokens or paired  # a parent shares its retry's replayed tokens
        credited = advantage != 0.0 or any(step or [])
        row = _row(attempt, advantage, pivot, settings, steps=step) if credited else None
        if row is None or (advantage < 0 and not row.importance and not settings.distill_negatives):
            continue
        rows.append(row)
    return rows


def _steps(
    members: list[Attempt], rewards: list[float], settings: TrainSettings
) -> list[list[float] | None]:
    """SLEA-RL's step terms per member's completion token (`trainer.steps`), for a group of
    episodes when `step_weight` is set; None for the rest."""
    episodic = any(m.forced_spans for m in members)
    if settings.step_weight == 0.0 or not episodic or len(members) < 2:
        return [None] * len(members)
    by_turn = step_advantages(members, rewards, settings.step_gamma)
    return [
        token_steps(m, turns, settings.step_weight) if m.sample is not None else None
        for m, turns in zip(members, by_turn, strict=True)
    ]


def _extra_rows(group: Group, settings: TrainSettings) -> list[TrainRow]:
    rows: list[TrainRow | None] = []
    for attempt in group.attempts:
        if attempt.error is not None or attempt.sample is None:
            continue
        if settings.mode == "r3l" and attempt.improved and attempt.kind in ("retry", "reflection"):
            advantage = advantages("r3l", [max(attempt.reward, 1.0)], settings.amplification)[0]
            rows.append(_row(attempt, advantage, attempt.pivot_tokens, settings, distill=False))
        if settings.mode == "rltldr" and attempt.kind == "insight":
            rows.append(_row(attempt, settings.insight_weight, 0, settings, distill=True))
    return [row for row in rows if row is not None]


def _row(
    attempt: Attempt,
    advantage: float,
    pivot: int,
    settings: TrainSettings,
    distill: bool | None = None,
    steps: list[float] | None = None,
) -> TrainRow | None:
    """One row; None when the attempt has no sample, nothing left to train, or no bare ids.
    `steps` adds a term per completion token to the advantage (SLEA-RL's step credit)."""
    sample = attempt.sample
    if sample is None:
        return None
    revision = attempt.kind == "revision"  # its prompt is already the bare prompt
    off_policy = revision and settings.revision_weight == "shaped"
    if distill is None:
        distill = settings.distill_guided and attempt.distillable and not revision
    prompt = attempt.bare_prompt_token_ids if distill else sample.prompt_token_ids
    if prompt is None:
        return None
    completion = sample.completion_token_ids
    input_ids = (prompt + completion)[: settings.max_length]
    n_prompt, n_completion = len(prompt), len(input_ids) - len(prompt)
    if n_completion <= pivot:
        return None
    trained = [IGNORE] * pivot + completion[pivot:n_completion]
    for start, end in attempt.forced_spans:
        trained[start:end] = [IGNORE] * len(trained[start:end])
    return TrainRow(
        input_ids=input_ids,
        labels=[IGNORE] * n_prompt + trained,
        advantages=[0.0] * n_prompt
        + [advantage + (steps[k] if steps else 0.0) for k in range(n_completion)],
        behaviour_logprobs=[0.0] * n_prompt + sample.logprobs[:n_completion],
        importance=not distill and not revision,
        off_policy=off_policy,
        reward=attempt.reward,
        context=_context_name(attempt, distill),
    )


def _context_name(attempt: Attempt, distill: bool) -> str:
    if attempt.kind in ("reflection", "insight", "revision"):
        return attempt.kind
    if not attempt.guided:
        return "bare"
    return f"distill:{attempt.context}" if distill else f"guided:{attempt.context}"
