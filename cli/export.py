"""`flywheel export`: the training rows of complete groups, or their token segments, as JSON
lines for any trainer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from cli.arguments import db_url, writable
from memory.folders import atomic_file

if TYPE_CHECKING:
    from memory.records import Group, Segment


def export(args: argparse.Namespace) -> int:
    """The rows a training round would use, for any trainer: one JSON object per line with
    `input_ids`, `labels` (-100 where nothing is trained), per-token `advantages`, the
    `behaviour_logprobs` of the sampled tokens, `importance` (whether to weight by the ratio
    against them) and the `context` the row is trained under."""
    from memory import store
    from trainer.dataset import build_rows
    from trainer.settings import TrainSettings

    writable(args.out, "--out")
    if args.session is not None:
        return _export_session(args)
    settings = TrainSettings(**({"mode": args.mode} if args.mode else {}))
    with store.transaction(store.open_store(db_url(args))) as session:
        groups = store.load_groups(session, "train", args.round, complete_only=True)
        if args.segments:
            return _export_segments(groups, store.group_segments(session, _ids(groups)), args.out)
    rows = build_rows(groups, settings)
    with atomic_file(args.out) as out:
        for row in rows:
            out.write(json.dumps(row.model_dump()) + "\n")
    tokens = sum(row.trained_tokens for row in rows)
    print(f"{len(rows)} rows ({tokens} trained tokens, {settings.mode}) from {len(groups)} "
          f"complete groups written to {args.out}")  # fmt: skip
    return 0


def _export_segments(
    groups: list[Group], segments: dict[tuple[int, int, str], list[Segment]], out: Path
) -> int:
    """One JSON object per attempt: its group, reward and prompt ids, and its completion as
    segments; a segment's weight is 0 where nothing is trained (pivot and forced tokens)."""
    written = 0
    with atomic_file(out) as stream:
        for group in groups:
            for attempt in group.attempts:
                if attempt.sample is None:
                    continue
                pieces = segments.get((group.id or 0, attempt.sample_index, attempt.kind), [])
                record = {
                    "group_id": group.id,
                    "task_id": group.task_id,
                    "sample_index": attempt.sample_index,
                    "kind": attempt.kind,
                    "context": attempt.context,
                    "reward": attempt.reward,
                    "train_reward": attempt.train_reward,
                    "prompt_token_ids": attempt.sample.prompt_token_ids,
                    "segments": [p.model_dump(exclude={"schema_version"}) for p in pieces],
                }
                stream.write(json.dumps(record) + "\n")
                written += 1
    print(f"{written} attempts from {len(groups)} complete groups written to {out}")
    return 0


def _export_session(args: argparse.Namespace) -> int:
    """One captured session: its episode (stitched ids, forced spans, logprobs, reward) as the
    first line, then each turn as captured."""
    from memory import sessions, store
    from memory.errors import NotFound

    with store.transaction(store.open_store(db_url(args))) as session:
        turns = sessions.session_turns(session).get(args.session)
        if not turns:
            raise NotFound(f"unknown session {args.session!r}")
    recorded = [g for g in turns if g.attempts]
    episode = sessions.stitch_turns(recorded)
    head: dict[str, object] = {"session": args.session, "turns": len(recorded)}
    if isinstance(episode, str):
        head["not_stitched"] = episode
    else:
        head |= {"reward": episode.reward, "forced_spans": episode.forced_spans}
        head |= {"sample": episode.sample.model_dump() if episode.sample else None}
    with atomic_file(args.out) as out:
        out.write(json.dumps(head) + "\n")
        for group in recorded:
            turn = group.attempts[0].model_dump(mode="json", exclude={"schema_version"})
            out.write(json.dumps({"capture_id": group.task_id, **turn}) + "\n")
    print(f"session {args.session}: {len(recorded)} turns written to {args.out}")
    return 0


def forget(args: argparse.Namespace) -> int:
    """Delete a captured session (its turns, and any train group that adopted it)."""
    from memory import sessions, store

    with store.transaction(store.open_store(db_url(args))) as session:
        turns, groups = sessions.forget(session, args.session)
    print(f"session {args.session}: {turns} captured turns and {groups} train groups deleted")
    return 0


def _ids(groups: list[Group]) -> list[int]:
    return [group.id for group in groups if group.id is not None]
