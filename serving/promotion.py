"""Promotion and rollback of the stable alias, decided by the held-out evaluation gate.

1. A candidate is promoted only if every evaluation that judged it lets it through:
   - held-out tasks of a task set: its pass@1 is at least the serving version's plus
     `min_gain`;
   - a margin over the serving version (the agent's held-out sessions judged blind, or the
     user's own evaluation, `memory.records.Scorecard`): the lower end of its 95% interval is
     above `min_gain` (0: the candidate is better at 95%; -1 opens the gate), against the
     version serving now (a margin over another version is stale).
   A candidate nothing judged is refused. A refusal is recorded too, with its reason.
2. Rollback un-promotes the serving version; the previous promoted version serves again.
3. Every decision is an `AliasEvent` in the store, written in the caller's transaction.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from memory import store
from memory.records import AliasEvent, PolicyVersion, Scorecard
from serving.errors import ServingError

DEFAULT_ALIAS = "policy"


class Gate(BaseModel):
    """The evaluation gate: how much better than the serving version a candidate must be; on
    how many held-out turns of the agent's own sessions it is compared, and what share of
    captured sessions is held out for that."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_gain: float = 0.0
    turns: int = Field(
        64, ge=1, description="held-out turns of captured sessions a candidate is compared on"
    )
    held_out_share: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="share of captured sessions kept to judge new versions, never trained on",
    )


def refusal(
    session: Session, version: PolicyVersion, gate: Gate, force: bool = False
) -> str | None:
    """Why the gate refuses `version` (None: it passes); reads only."""
    if force:
        return None
    current = store.promoted_history(session)
    return _refusal(version, current[0] if current else None, gate)


def promote(
    session: Session, candidate: str, gate: Gate, alias: str = DEFAULT_ALIAS, force: bool = False
) -> AliasEvent:
    """Promote `candidate` if it passes the gate; returns the recorded event (promote or refuse).
    An unknown candidate raises `StoreError`."""
    version = store.policy_version(session, candidate)
    current = store.promoted_history(session)
    serving = current[0] if current else None
    refusal = None if force else _refusal(version, serving, gate)
    event = AliasEvent(
        alias=alias,
        action="refuse" if refusal else "promote",
        from_version=serving.name if serving else None,
        to_version=candidate,
        reason=refusal or ("forced" if force else "passed the evaluation gate"),
    )
    if refusal is None:
        store.set_promoted(session, candidate, True)
    store.record_alias_event(session, event)
    return event


def rollback_target(session: Session) -> PolicyVersion:
    """The version a rollback would serve again; reads only."""
    history = store.promoted_history(session)
    if len(history) < 2:
        raise ServingError("nothing to roll back to: fewer than two promoted versions")
    return history[1]


def rollback(session: Session, alias: str = DEFAULT_ALIAS) -> AliasEvent:
    previous = rollback_target(session)
    head = store.promoted_history(session)[0]
    store.set_promoted(session, head.name, False)
    event = AliasEvent(
        alias=alias,
        action="rollback",
        from_version=head.name,
        to_version=previous.name,
        reason="rolled back",
    )
    store.record_alias_event(session, event)
    return event


def _refusal(version: PolicyVersion, serving: PolicyVersion | None, gate: Gate) -> str | None:
    if version.eval_pass_at_1 is None and not version.scorecards:
        return f"{version.name} has no held-out evaluation"
    if serving is None or serving.name == version.name:
        return None
    for card in version.scorecards:
        if card.margin and (reason := _margin_refusal(card, serving.name, gate)):
            return reason
    if version.eval_pass_at_1 is None:
        return None
    needed = (serving.eval_pass_at_1 or 0.0) + gate.min_gain
    if version.eval_pass_at_1 < needed:
        return (
            f"held-out pass@1 {version.eval_pass_at_1:.3f} is below "
            f"{needed:.3f} ({serving.name} {serving.eval_pass_at_1 or 0.0:.3f} + {gate.min_gain})"
        )
    return None


def _margin_refusal(card: Scorecard, serving: str, gate: Gate) -> str | None:
    if card.against != serving:
        return f"its {card.figure} is over {card.against}, but {serving} serves now"
    if card.low <= gate.min_gain and gate.min_gain > -1.0:  # -1: open, as no margin is lower
        return f"{card.line()}: its 95% interval is not above {gate.min_gain}"
    return None
