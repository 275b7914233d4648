"""An attempt's completion as the store keeps it: steps, and token segments by loss type.

1. Segments cut the completion ids at every forced span's ends and at the pivot (when the pivot
   does not fall inside a forced span): each piece is `forced` (inside a span), `pivot` (before
   the pivot) or `policy` (sampled, trained). Joining the segments gives the completion back,
   ids, logprobs and spans exactly.
2. Steps: an episode of k turns has k steps; step i ends where the i-th forced reply ends. A
   one-turn attempt is one step. Each step names its observation and action from the messages.
3. Token ids and logprobs are packed as little-endian int32 and float64 bytes: exact, compact,
   and an order of magnitude cheaper to write than JSON lists.
"""

from __future__ import annotations

import json
import sys
from array import array
from bisect import bisect_right
from typing import Any

from memory.records import Attempt, LossType, Sample, Segment, Step

MASKED: dict[LossType, float] = {"policy": 1.0, "pivot": 0.0, "forced": 0.0}


def pack_ids(ids: list[int]) -> bytes:
    return _packed(array("i", ids))


def unpack_ids(data: bytes) -> list[int]:
    return _unpacked("i", data).tolist()


def pack_floats(values: list[float]) -> bytes:
    return _packed(array("d", values))


def unpack_floats(data: bytes) -> list[float]:
    return _unpacked("d", data).tolist()


def segments(attempt: Attempt) -> list[Segment]:
    """The completion of `attempt` cut by loss type; none when it has no sample."""
    sample = attempt.sample
    if sample is None:
        return []
    ids, logprobs = sample.completion_token_ids, sample.logprobs
    spans, pivot = attempt.forced_spans, attempt.pivot_tokens
    cuts = {0, len(ids), *(point for span in spans for point in span)}
    if not any(start < pivot < end for start, end in spans):
        cuts.add(min(pivot, len(ids)))
    ends, forced_starts, first_policy = _step_ends(attempt), {s for s, _ in spans}, True
    pieces: list[Segment] = []
    bounds = sorted(cuts)
    for start, end in zip(bounds, bounds[1:], strict=False):
        # No cut falls inside a span, so a piece starting where a span starts is that span.
        loss: LossType = (
            "forced" if start in forced_starts else "pivot" if end <= pivot else "policy"
        )
        temperature = None if loss == "forced" else attempt.sampling.temperature
        if loss == "policy" and first_policy and attempt.strategy:
            temperature = attempt.sampling.strategy_temperature or temperature
        first_policy = first_policy and loss != "policy"
        pieces.append(
            Segment(
                index=len(pieces),
                step_index=bisect_right(ends, start),
                start=start,
                loss=loss,
                token_ids=ids[start:end],
                logprobs=logprobs[start:end],
                temperature=temperature,
                weight=MASKED[loss],
            )
        )
    return pieces


def joined(prompt_ids: list[int], text: str, finish: str, pieces: list[Segment]) -> Sample:
    """The sample whose completion the segments cut (in index order)."""
    ordered = sorted(pieces, key=lambda piece: piece.index)
    return Sample(
        text=text,
        prompt_token_ids=prompt_ids,
        completion_token_ids=[i for piece in ordered for i in piece.token_ids],
        logprobs=[p for piece in ordered for p in piece.logprobs],
        finish_reason=finish,
    )


def forced_spans(pieces: list[Segment]) -> list[tuple[int, int]]:
    ordered = sorted(pieces, key=lambda piece: piece.index)
    return [(p.start, p.start + len(p.token_ids)) for p in ordered if p.loss == "forced"]


def steps(attempt: Attempt) -> list[Step]:
    """One step per turn, with its observation and action text; none for a failed call."""
    if attempt.sample is None:
        return []
    actions, observations = _turns(attempt)
    ends = [*_step_ends(attempt), len(attempt.sample.completion_token_ids)]
    sampling = attempt.sampling
    return [
        Step(
            index=index,
            observation=observation,
            action=action,
            replayed=0 < ends[index] <= attempt.pivot_tokens and attempt.kind == "retry",
            reward=attempt.reward if index == len(actions) - 1 else None,
            outcome=attempt.reward,
            temperature=sampling.temperature,
            strategy=attempt.strategy if index == 0 else None,
            strategy_temperature=sampling.strategy_temperature if index == 0 else None,
        )
        for index, (action, observation) in enumerate(zip(actions, observations, strict=True))
    ]


def _step_ends(attempt: Attempt) -> list[int]:
    """Completion offsets where each step but the last ends: after each turn's forced reply."""
    return [end for _, end in attempt.forced_spans[: attempt.turns - 1]]


def _turns(attempt: Attempt) -> tuple[list[str], list[str]]:
    """Each turn's action and the observation before it. The last `turns` assistant messages
    are the episode's turns; a one-turn attempt's action is its sampled text."""
    messages = attempt.messages
    positions = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if attempt.turns == 1 or len(positions) < attempt.turns:
        assert attempt.sample is not None
        return [attempt.sample.text], [_last_user(messages)]
    positions = positions[-attempt.turns :]
    actions = [_content(messages[i]) for i in positions]
    observations = [_last_user(messages[: positions[0]])]
    for before, after in zip(positions, positions[1:], strict=False):
        observations.append("\n".join(_content(m) for m in messages[before + 1 : after]))
    return actions, observations


def _last_user(messages: list[dict[str, Any]]) -> str:
    users = [m for m in messages if m.get("role") == "user"]
    return _content(users[-1]) if users else ""


def _content(message: dict[str, Any]) -> str:
    if calls := message.get("tool_calls"):
        return json.dumps(calls, sort_keys=True)
    return str(message.get("content") or "")


def _packed(values: array[Any]) -> bytes:
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def _unpacked(code: str, data: bytes) -> array[Any]:
    values = array(code, data)
    if sys.byteorder == "big":
        values.byteswap()
    return values
