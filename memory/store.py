"""The store: one import for reading and writing records in the caller's transaction.

A thin facade over one module per noun, so callers write `store.load_groups(...)`:

- `memory.database`: open a database by URL (migrated), transactions;
- `memory.ingest`: groups with their attempts, steps, segments, verdicts, written in bulk;
- `memory.groups`: groups read back, their segments, advantages, feedback on captured traffic;
- `memory.versions`: policy versions, evaluations, promotion and the alias log;
- `memory.rounds`: training rounds and lineage;
- `memory.outcomes`: outcome counts for exploration bonuses;
- `memory.stats`: counts for status pages and reports.

Write functions take a session and only flush: the caller owns the transaction. Writes are
idempotent upserts on natural keys, so a re-run after a crash never duplicates.
"""

from memory.database import (
    open_store,
    shared_engine,
    transaction,
)
from memory.groups import (
    attempt_segments,
    attempt_steps,
    captured_exchange,
    group_segments,
    group_tasks,
    groups_by_id,
    load_groups,
    record_feedback,
    record_session_feedback,
    set_advantages,
    solved_groups,
)
from memory.ingest import (
    save_group,
    save_groups,
)
from memory.outcomes import (
    add_outcomes,
    outcome_counts,
)
from memory.rounds import (
    lineage,
    next_round_index,
    save_training_round,
    training_round,
    training_rounds,
)
from memory.stats import (
    attempt_counts,
    attempt_time_span,
    eval_task_counts,
    round_spans,
    sampled_by,
    solved_by_source,
    strategy_stats,
)
from memory.versions import (
    alias_events,
    policy_version,
    policy_versions,
    promoted_history,
    promoted_policy,
    record_alias_event,
    record_evaluation,
    record_scorecard,
    save_policy_version,
    set_promoted,
    set_weights_path,
)

__all__ = [
    "add_outcomes",
    "alias_events",
    "attempt_counts",
    "attempt_segments",
    "attempt_steps",
    "attempt_time_span",
    "captured_exchange",
    "eval_task_counts",
    "round_spans",
    "sampled_by",
    "solved_by_source",
    "group_segments",
    "group_tasks",
    "groups_by_id",
    "lineage",
    "load_groups",
    "solved_groups",
    "next_round_index",
    "open_store",
    "shared_engine",
    "outcome_counts",
    "policy_version",
    "policy_versions",
    "promoted_history",
    "promoted_policy",
    "record_alias_event",
    "record_evaluation",
    "record_scorecard",
    "record_feedback",
    "record_session_feedback",
    "save_group",
    "save_groups",
    "save_policy_version",
    "save_training_round",
    "set_advantages",
    "set_promoted",
    "set_weights_path",
    "strategy_stats",
    "training_round",
    "training_rounds",
    "transaction",
]
