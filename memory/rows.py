"""Records to rows and back: the column values of attempts, segments, steps and groups, and the
records rebuilt from their rows (segments joined back into the exact sample)."""

from __future__ import annotations

import json
import statistics
from typing import Any

from sqlalchemy.orm import Session, selectinload

from memory import trajectory
from memory.models import (
    AttemptRow,
    RolloutGroupRow,
    SegmentRow,
    StepRow,
)
from memory.records import Attempt, Group, GroupPlan, Segment, Step

ATTEMPTS = selectinload(RolloutGroupRow.attempts)


ATTEMPT_PARTS = (
    ATTEMPTS.selectinload(AttemptRow.segments),
    ATTEMPTS.selectinload(AttemptRow.verdict),
    ATTEMPTS.selectinload(AttemptRow.strategy),
)


def attempt_columns(attempt: Attempt, strategies: dict[str, int]) -> dict[str, Any]:
    sample = attempt.sample
    return {
        "sample_index": attempt.sample_index,
        "kind": attempt.kind,
        "policy_version": attempt.policy_version,
        "messages": attempt.messages,
        "sampling": attempt.sampling.model_dump(),
        "completion": sample.text if sample else None,
        "prompt_token_ids": sample.prompt_token_ids if sample else None,
        "finish_reason": sample.finish_reason if sample else None,
        "reward": attempt.reward,
        "correct": attempt.correct,
        "format_ok": attempt.format_ok,
        "answer": attempt.answer,
        "reason": attempt.reason,
        "error": attempt.error,
        "context": attempt.context,
        "guidance": attempt.guidance,
        "bare_prompt_token_ids": attempt.bare_prompt_token_ids,
        "parent_index": attempt.parent_index,
        "pivot_tokens": attempt.pivot_tokens,
        "improved": attempt.improved,
        "shaped_reward": attempt.shaped_reward,
        "shaping": attempt.shaping,
        "strategy_id": strategies.get(attempt.strategy or ""),
        "turns": attempt.turns,
        "generated_tokens": attempt.generated_tokens,
    }


def segment_columns(piece: Segment) -> dict[str, Any]:
    return {
        "segment_index": piece.index,
        "step_index": piece.step_index,
        "start": piece.start,
        "loss": piece.loss,
        "token_ids": trajectory.pack_ids(piece.token_ids),
        "logprobs": trajectory.pack_floats(piece.logprobs),
        "temperature": piece.temperature,
        "weight": piece.weight,
        "advantage": piece.advantage,
    }


def segment_record(row: SegmentRow) -> Segment:
    return Segment(
        index=row.segment_index,
        step_index=row.step_index,
        start=row.start,
        loss=row.loss,
        token_ids=trajectory.unpack_ids(row.token_ids),
        logprobs=trajectory.unpack_floats(row.logprobs),
        temperature=row.temperature,
        weight=row.weight,
        advantage=row.advantage,
    )


def step_columns(step: Step) -> dict[str, Any]:
    values = step.model_dump(exclude={"schema_version", "index", "strategy"})
    return {"step_index": step.index, **values}


def step_record(row: StepRow) -> Step:
    return Step(
        index=row.step_index,
        observation=row.observation,
        action=row.action,
        replayed=row.replayed,
        reward=row.reward,
        outcome=row.outcome,
        temperature=row.temperature,
        strategy_temperature=row.strategy_temperature,
    )


def json_fields(text: str) -> dict[str, Any]:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return fields if isinstance(fields, dict) else {}


def row_plan(row: RolloutGroupRow) -> GroupPlan:
    return GroupPlan.model_validate(row.plan or {})


def retag(row: RolloutGroupRow, **changes: object) -> None:
    """Change fields of a stored group's plan (by their names in `GroupPlan`)."""
    row.plan = row_plan(row).model_copy(update=changes).stored()


def group_record(row: RolloutGroupRow) -> Group:
    return Group(
        id=row.id,
        round_index=row.round_index,
        purpose=row.purpose,
        task_id=row.task_id,
        taskset=row.taskset,
        question=row.question,
        policy_version=row.policy_version,
        size=row.size,
        attempts=[attempt_record(a) for a in row.attempts],
        plan=row_plan(row),
    )


def attempt_record(row: AttemptRow) -> Attempt:
    sample, pieces = None, [segment_record(piece) for piece in row.segments]
    if row.prompt_token_ids is not None and row.finish_reason is not None:
        sample = trajectory.joined(
            row.prompt_token_ids, row.completion or "", row.finish_reason, pieces
        )
    return Attempt.model_validate(
        {
            "sample_index": row.sample_index,
            "kind": row.kind,
            "policy_version": row.policy_version,
            "messages": row.messages,
            "sampling": row.sampling,
            "sample": sample,
            "reward": row.reward,
            "correct": row.correct,
            "format_ok": row.format_ok,
            "answer": row.answer,
            "reason": row.reason,
            "error": row.error,
            "context": row.context,
            "guidance": row.guidance,
            "bare_prompt_token_ids": row.bare_prompt_token_ids,
            "parent_index": row.parent_index,
            "pivot_tokens": row.pivot_tokens,
            "improved": row.improved,
            "shaped_reward": row.shaped_reward,
            "shaping": row.shaping,
            "strategy": row.strategy.text if row.strategy else None,
            "forced_spans": trajectory.forced_spans(pieces),
            "generated_tokens": row.generated_tokens,
            "turns": row.turns,
            "feedback": row.verdict.feedback if row.verdict else [],
        }
    )


def group_key(group: Group) -> tuple[Any, ...]:
    return (group.round_index, group.purpose, group.task_id, group.policy_version)


def group_columns(group: Group) -> dict[str, Any]:
    rewards = [a.reward for a in group.first_attempts]
    return {
        "round_index": group.round_index,
        "purpose": group.purpose,
        "task_id": group.task_id,
        "policy_version": group.policy_version,
        "taskset": group.taskset,
        "question": group.question,
        "size": group.size,
        "plan": group.plan.stored(),
        "complete": group.complete,
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if rewards else None,
    }


def refresh_group_stats(session: Session, group_id: int) -> None:
    row = session.get(RolloutGroupRow, group_id)
    assert row is not None
    session.refresh(row, ["attempts"])
    group = group_record(row)
    rewards = [a.reward for a in group.first_attempts]
    row.complete = group.complete
    row.reward_mean = statistics.fmean(rewards) if rewards else None
    row.reward_std = statistics.pstdev(rewards) if rewards else None
    session.flush()
