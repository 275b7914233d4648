"""What the flywheel's page shows, read from the store: typed views, one per page.

- `versions`: the alias and its history; every version with its held-out pass@1, n and Wilson's
  95% interval, the evaluations that judged it (scorecards), and its parent, so its lineage
  reaches the base; the held-out curve by round.
- `rounds`: per training round, the rows it trained by source (bare, guided, distilled, revision,
  captured), the share of its groups sampled by a version other than the one it trained from
  (staleness), the drift from the sampling policy, and its stage times.
- `sessions` / `session`: captured traffic a page at a time, and one session turn by turn.
- `exploration`: per round, the tasks the policy solved itself and those only the reviewer's
  revision solved.

Every list is one aggregate query or a page of rows, so a view answers quickly on a large store
(`bench/ui.py`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from memory import actions, sessions, store
from memory.groups import captured_turns
from memory.records import Action, AliasEvent, CapturedSession
from memory.rows import group_record
from reports.intervals import wilson


class View(BaseModel):
    model_config = ConfigDict(frozen=True)


class Share(View):
    """A rate with its n and Wilson's 95% interval."""

    value: float
    n: int
    low: float
    high: float

    @classmethod
    def of(cls, value: float, n: int) -> Share:
        low, high = wilson(round(value * n), n) if n else (value, value)
        return cls(value=value, n=n, low=low, high=high)


class VersionView(View):
    name: str
    round_index: int
    parent: str | None
    pass_at_1: Share | None
    promoted: bool
    serving: bool
    judged_by: list[str]  # each scorecard's line: which evaluation, its figure, n and interval


class VersionsView(View):
    alias: str
    serving: str | None
    versions: list[VersionView]  # newest first
    history: list[AliasEvent]  # newest first
    actions: list[Action]  # newest first


class RoundView(View):
    round_index: int
    method: str
    status: str
    policy_in: str
    policy_out: str | None
    rows_by_source: dict[str, int]
    groups: int
    stale_share: float | None  # groups sampled by a version other than policy_in
    kl_last: float | None
    collect_s: float
    train_s: float
    note: str


class ExplorationView(View):
    round_index: int
    tasks: int
    policy_solved: Share
    reviewer_only: Share


class SessionsView(View):
    sessions: list[CapturedSession]
    total: int
    offset: int
    limit: int


class TurnView(View):
    index: int
    version: str  # the version that answered
    new_messages: list[dict[str, Any]]  # what the agent added since the last turn: the user's
    # message, or the answer's tool calls and their results
    answer: str
    reward: float
    reason: str  # where the reward came from: a verifier, feedback, the judge, or none yet


class SessionView(View):
    name: str
    task: str | None
    held_out: bool
    round_index: int | None
    siblings: int
    turns: list[TurnView]


def versions(session: Session, alias: str = "policy") -> VersionsView:
    scored = store.eval_task_counts(session)
    parents = {r.policy_out: r.policy_in for r in store.training_rounds(session, last=10_000)}
    serving = store.promoted_policy(session)
    found = [
        VersionView(
            name=v.name,
            round_index=v.round_index,
            parent=parents.get(v.name),
            pass_at_1=None
            if v.eval_pass_at_1 is None
            else Share.of(v.eval_pass_at_1, scored.get(v.name, 0)),
            promoted=v.promoted,
            serving=serving is not None and serving.name == v.name,
            judged_by=[card.line() for card in v.scorecards],
        )  # fmt: skip
        for v in store.policy_versions(session)
    ]
    found.sort(key=lambda v: (v.round_index, v.name), reverse=True)
    history = list(reversed(store.alias_events(session, alias)))[:50]
    return VersionsView(
        alias=alias, serving=serving.name if serving else None, versions=found, history=history,
        actions=actions.actions(session, limit=20),
    )  # fmt: skip


def rounds(session: Session) -> list[RoundView]:
    spans, sampled = store.round_spans(session), store.sampled_by(session)
    found = []
    for record in reversed(store.training_rounds(session, last=10_000)):
        by_version = sampled.get(record.round_index, {})
        groups = sum(by_version.values())
        stale = groups - by_version.get(record.policy_in, 0)
        metrics = record.metrics
        found.append(RoundView(
            round_index=record.round_index, method=record.method, status=record.status,
            policy_in=record.policy_in, policy_out=record.policy_out,
            rows_by_source=dict(metrics.contexts), groups=groups,
            stale_share=stale / groups if groups else None, kl_last=metrics.kl_last,
            collect_s=spans.get(record.round_index, 0.0), train_s=metrics.seconds,
            note=metrics.reason,
        ))  # fmt: skip
    return found


def exploration(session: Session) -> list[ExplorationView]:
    return [
        ExplorationView(
            round_index=r,
            tasks=n,
            policy_solved=Share.of(own / n, n),
            reviewer_only=Share.of(revised / n, n),
        )  # fmt: skip
        for r, (n, own, revised) in sorted(store.solved_by_source(session).items(), reverse=True)
        if n
    ]


def session_list(session: Session, offset: int = 0, limit: int = 50) -> SessionsView:
    page, total = sessions.session_page(session, limit=limit, offset=offset)
    return SessionsView(sessions=page, total=total, offset=offset, limit=limit)


def one_session(session: Session, name: str) -> SessionView | None:
    groups = [group_record(row) for row in session.scalars(captured_turns(name))]
    if not groups:
        return None
    siblings = sum(1 for _ in session.scalars(sessions.siblings_of(name)))
    turns, seen = [], 0
    for index, group in enumerate((g for g in groups if g.attempts), 1):
        attempt = group.attempts[0]
        turns.append(TurnView(
            index=index, version=attempt.policy_version,
            new_messages=list(attempt.messages[seen:]),
            answer=attempt.sample.text if attempt.sample else "",
            reward=attempt.reward, reason=attempt.reason,
        ))  # fmt: skip
        seen = len(attempt.messages)
    plan, trained = groups[0].plan, [g.plan.trained_in for g in groups]
    return SessionView(
        name=name, task=plan.task, held_out=plan.held_out,
        round_index=next((r for r in trained if r is not None), None),
        siblings=siblings, turns=turns,
    )  # fmt: skip
