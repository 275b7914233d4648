"""Held-out evaluation: one greedy sample per held-out task, nothing in context, and the baseline.

1. An evaluation is collected like any batch (purpose `eval`), so a version evaluated again finds
   its groups stored and samples nothing; a batch with a task the server failed for good
   raises, so a figure is never computed from calls that failed. A task that failed by its own
   doing (its verifier raised or hung) is left out, and the figures say over how many tasks
   they were computed.
2. The baseline is the base model's evaluation, stored the first time and read back after.
   Each evaluation is recorded on its version as a scorecard: pass@1 over n tasks with
   Wilson's 95% interval, and the task set that judged it.
3. `paired` compares two versions on the same held-out tasks: tasks gained and tasks lost.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from prefect import get_run_logger
from pydantic import BaseModel, ConfigDict
from sqlalchemy import Engine

from flows.settings import RunSettings
from flows.stages import collect
from memory import store
from memory.records import Group, PolicyVersion, Scorecard
from reports.intervals import wilson
from verifiers.catalog import eval_tasks
from verifiers.task import Task


class Evaluation(BaseModel):
    """A version's held-out figures: correct answers and well-formed answers, per task, over
    `tasks` tasks (`left_out` more failed by their own doing)."""

    model_config = ConfigDict(frozen=True)

    pass_at_1: float
    format_rate: float
    tasks: int
    left_out: int = 0

    def card(self, taskset: str) -> Scorecard:
        """The pass@1 as the gate records it, with Wilson's 95% interval over the tasks."""
        low, high = wilson(round(self.pass_at_1 * self.tasks), self.tasks)
        return Scorecard(
            evaluation=f"held-out tasks of {taskset}"[:300], figure="pass@1",
            value=self.pass_at_1, n=self.tasks, low=low, high=high,
        )  # fmt: skip


async def evaluate(
    settings: RunSettings, server_url: str, held_out: list[Task], version: PolicyVersion
) -> Evaluation:
    groups = await collect(
        settings,
        server_url,
        held_out,
        version.name,
        version.round_index,
        "eval",
        settings.eval_settings(),
    )
    return _figures(groups, len(held_out))


def _figures(groups: list[Group], expected: int) -> Evaluation:
    attempts = [a for g in groups for a in g.attempts]
    if len(groups) > expected or not attempts:
        raise RuntimeError(f"{len(groups)} evaluation groups for {expected} held-out tasks")
    return Evaluation(
        pass_at_1=statistics.fmean(a.correct for a in attempts),
        format_rate=statistics.fmean(a.format_ok for a in attempts),
        tasks=len(groups),
        left_out=expected - len(groups),
    )


async def baseline(
    settings: RunSettings,
    server_url: str,
    base_name: str,
    base_model: Path,
    seconds: dict[str, float],
) -> tuple[list[Task], Evaluation]:
    """The held-out tasks and the base model's figures. The base model is recorded, with its
    folder (the weights a merged-weights server goes back to), and promoted if nothing is; its
    groups, once stored, are read back, not sampled again."""
    db = store.shared_engine(settings.db_url)
    base = register_base(db, base_name, base_model)
    held_out = eval_tasks(settings.taskset, settings.eval_tasks)
    started = time.monotonic()
    figures = await evaluate(settings, server_url, held_out, base)
    seconds["evaluate"] = seconds.get("evaluate", 0.0) + time.monotonic() - started
    get_run_logger().info(
        "baseline held-out pass@1 %.3f (format %.2f)", figures.pass_at_1, figures.format_rate
    )
    with store.transaction(db) as session:
        store.record_scorecard(session, base_name, figures.card(settings.taskset))
    return held_out, figures


def register_base(db: Engine, base_name: str, base_model: Path) -> PolicyVersion:
    """The base model recorded, with its folder (the weights a merged-weights server goes back
    to), and promoted if nothing is."""
    folder = str(base_model)  # an absolute path: the launcher resolved it
    with store.transaction(db) as session:
        store.save_policy_version(
            session, PolicyVersion(name=base_name, base_model=base_name, weights_path=folder)
        )
        if store.policy_version(session, base_name).weights_path is None:  # an older store
            store.set_weights_path(session, base_name, folder)
        if store.promoted_policy(session) is None:
            store.set_promoted(session, base_name, True)
        return store.policy_version(session, base_name)


def paired(db: Engine, base_name: str, name: str, held_out: list[Task]) -> tuple[int, int]:
    """Held-out tasks the version solves that the base did not, and the reverse."""
    wanted = {t.task_id for t in held_out}
    with store.transaction(db) as session:
        base = _solved(store.load_groups(session, "eval", policy_version=base_name), wanted)
        new = _solved(store.load_groups(session, "eval", policy_version=name), wanted)
    common = base.keys() & new.keys()
    return (
        sum(new[t] and not base[t] for t in common),
        sum(base[t] and not new[t] for t in common),
    )


def _solved(groups: list[Group], wanted: set[str]) -> dict[str, bool]:
    return {g.task_id: g.attempts[0].correct for g in groups if g.task_id in wanted and g.attempts}
