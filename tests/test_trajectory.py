"""Attempts as the store keeps them: steps, token segments by loss type, verdicts, reflections
and strategies, on SQLite and PostgreSQL; and the conversion of a store written before them."""

from __future__ import annotations

import json

import pytest
from alembic import command
from alembic.config import Config
from pydantic import ValidationError
from sqlalchemy import create_engine, select, text

from memory import database, ingest, store, trajectory
from memory.models import ReflectionRow, VerdictRow
from memory.records import Attempt, Group, GroupPlan, Sample, SamplingSettings
from memory.store import open_store, transaction
from tests.helpers import make_group

SAMPLING = SamplingSettings(temperature=1.0, max_tokens=16)


def episode(kind: str = "base", pivot: int = 0, reward: float = 0.0) -> Attempt:
    """Three turns: ids 10-12 sampled, 20-21 a forced reply, 13-14, 22-23, then 15-16."""
    ids = [10, 11, 12, 20, 21, 13, 14, 22, 23, 15, 16]
    logprobs = [-0.5, -0.25, -1.5, 0.0, 0.0, -2.0, -1e-9, 0.0, 0.0, -0.125, -3.0]
    messages = [
        {"role": "system", "content": "Find the number."},
        {"role": "user", "content": "Guess between 1 and 100."},
        {"role": "assistant", "content": "50"},
        {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "25"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "37"},
        {"role": "user", "content": "solved"},
    ]
    return Attempt(
        sample_index=0,
        kind=kind,  # type: ignore[arg-type]
        policy_version="base",
        messages=messages,
        sampling=SAMPLING,
        sample=Sample(
            text="Turn 0: 50",
            prompt_token_ids=[1, 2],
            completion_token_ids=ids,
            logprobs=logprobs,
            finish_reason="stop",
        ),
        reward=reward,
        correct=reward == 1.0,
        format_ok=True,
        answer="37",
        reason="found it",
        forced_spans=[(3, 5), (7, 9)],
        pivot_tokens=pivot,
        parent_index=0 if kind == "retry" else None,
        turns=3,
        feedback=["guess 50: lower", "guess 25: higher", "guess 37: solved"],
    )


def group_of(*attempts: Attempt, plan: GroupPlan | None = None) -> Group:
    return Group(
        round_index=1,
        purpose="train",
        task_id="guess-1",
        taskset="guess",
        question="Guess",
        policy_version="base",
        size=1,
        attempts=list(attempts),
        plan=plan or GroupPlan(),
    )


def test_segments_cut_an_episode_by_loss_type_and_step() -> None:
    pieces = trajectory.segments(episode(kind="retry", pivot=5))
    assert [(p.start, p.loss, p.step_index) for p in pieces] == [
        (0, "pivot", 0),
        (3, "forced", 0),
        (5, "policy", 1),
        (7, "forced", 1),
        (9, "policy", 2),
    ]
    assert [p.weight for p in pieces] == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert [p.temperature for p in pieces] == [1.0, None, 1.0, None, 1.0]
    steps = trajectory.steps(episode(kind="retry", pivot=5))
    assert [(s.observation, s.action, s.replayed) for s in steps] == [
        ("Guess between 1 and 100.", "50", True),
        ("lower", "25", False),
        ("higher", "37", False),
    ]
    assert [s.reward for s in steps] == [None, None, 0.0]


def test_a_pivot_inside_a_forced_span_does_not_split_it() -> None:
    pieces = trajectory.segments(episode(pivot=4))
    assert [(p.start, p.loss) for p in pieces][:2] == [(0, "pivot"), (3, "forced")]
    assert trajectory.forced_spans(pieces) == [(3, 5), (7, 9)]


def test_packed_ids_and_logprobs_are_exact() -> None:
    ids, logprobs = [0, 1, 151_643, 2**31 - 1], [-1e-300, -0.1, 0.0, -123.456789012345]
    assert trajectory.unpack_ids(trajectory.pack_ids(ids)) == ids
    assert trajectory.unpack_floats(trajectory.pack_floats(logprobs)) == logprobs


def test_an_episode_round_trips_exactly_with_its_parts(db_url: str) -> None:
    engine = open_store(db_url)
    first, retry = episode(), episode(kind="retry", pivot=5, reward=1.0)
    plan = GroupPlan(sampling={"group_size": 1}, experience_ids=[3])
    with transaction(engine) as session:
        group_id = store.save_group(session, group_of(first, retry, plan=plan))
    with transaction(engine) as session:
        (loaded,) = store.load_groups(session, "train")
        steps = store.attempt_steps(session, group_id, 0, "retry")
        pieces = store.attempt_segments(session, group_id, 0, "retry")
        verdicts = session.scalars(select(VerdictRow).order_by(VerdictRow.id)).all()
    assert loaded.attempts == [first, retry]
    assert loaded.plan == plan
    assert [s.replayed for s in steps] == [True, False, False] and steps[-1].reward == 1.0
    assert [p.loss for p in pieces] == ["pivot", "forced", "policy", "forced", "policy"]
    assert [v.verifier for v in verdicts] == ["guess", "guess"]
    assert verdicts[0].feedback == first.feedback and verdicts[1].score == 1.0


def test_reflections_keep_their_fields_and_whether_they_helped(db_url: str) -> None:
    engine = open_store(db_url)
    fields = {"summary": "s", "principle": "halve the range", "retry_from_step": 1}
    reflection = episode().model_copy(
        update={
            "kind": "reflection",
            "sample": Sample(
                text=json.dumps(fields),
                prompt_token_ids=[1],
                completion_token_ids=[5],
                logprobs=[-0.1],
                finish_reason="stop",
            ),
            "forced_spans": [],
            "turns": 1,
            "parent_index": 0,
            "improved": True,
        }
    )
    with transaction(engine) as session:
        store.save_group(session, group_of(episode(), reflection))
    with transaction(engine) as session:
        (row,) = session.scalars(select(ReflectionRow)).all()
    assert (row.kind, row.valid, row.led_to_success, row.target_index) == (
        "reflection",
        True,
        True,
        0,
    )
    assert row.fields == fields


def test_success_rate_per_strategy(db_url: str) -> None:
    engine = open_store(db_url)
    group = make_group([1.0, 0.0, 1.0, 1.0])
    plans = ["Work backwards.", "Estimate first.", "work BACKWARDS", "Estimate first."]
    attempts = [
        a.model_copy(update={"strategy": s}) for a, s in zip(group.attempts, plans, strict=True)
    ]
    with transaction(engine) as session:
        store.save_group(session, group.model_copy(update={"attempts": attempts}))
        stats = store.strategy_stats(session, "arithmetic")
    rates = {s.text.lower(): (s.attempts, s.success_rate) for s in stats}
    assert rates == {"work backwards.": (2, 1.0), "estimate first.": (2, 0.5)}


def test_sge_strategy_tokens_carry_the_strategy_temperature() -> None:
    sampling = SamplingSettings(temperature=0.7, max_tokens=16, strategy_temperature=1.3)
    attempt = (
        make_group([1.0])
        .attempts[0]
        .model_copy(
            update={
                "sampling": sampling,
                "strategy": "Add.",
                "pivot_tokens": 1,
                "forced_spans": [(3, 4)],
            }
        )
    )
    pieces = trajectory.segments(attempt)
    assert [(p.loss, p.temperature) for p in pieces] == [
        ("pivot", 0.7),
        ("policy", 1.3),
        ("forced", None),
        ("policy", 0.7),
    ]
    assert {p.step_index for p in pieces} == {0}


@pytest.mark.parametrize(
    ("spans", "pivot"), [([(3, 12)], 0), ([(5, 7), (4, 6)], 0), ([(2, 1)], 0), ([], 12)]
)
def test_spans_that_do_not_fit_the_completion_are_refused(spans: list, pivot: int) -> None:
    with pytest.raises(ValidationError, match="forced span|pivot"):
        episode().model_copy(update={}).model_validate(
            episode().model_dump() | {"forced_spans": spans, "pivot_tokens": pivot}
        )


def test_a_store_from_before_segments_is_converted(db_url: str) -> None:
    url = db_url
    config = Config()
    config.set_main_option("script_location", str(database.MIGRATIONS))
    engine = create_engine(url)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0006")
        _write_old_attempt(connection)
    database.migrate(url)
    with transaction(open_store(url)) as session:
        (group,) = store.load_groups(session, "train")
        stats = store.strategy_stats(session)
    (attempt,) = group.attempts
    assert attempt.sample is not None
    assert attempt.sample.completion_token_ids == [7, 8, 9, 10, 11]
    assert attempt.sample.logprobs == [-0.5, -0.5, 0.0, -1.0, -1.0]
    assert attempt.forced_spans == [(2, 3)] and attempt.pivot_tokens == 1
    assert [(s.text, s.attempts) for s in stats] == [("Add the tens.", 1)]


def _write_old_attempt(connection) -> None:
    connection.execute(
        text(
            "INSERT INTO rollout_group (id, round_index, purpose, task_id, taskset, question,"
            " policy_version, size, complete, created_at) VALUES"
            " (1, 1, 'train', 't', 'arithmetic', 'q', 'base', 1, true, '2026-01-01')"
        )
    )
    connection.execute(
        text(
            "INSERT INTO attempt (group_id, sample_index, kind, policy_version, messages, sampling,"
            " completion, prompt_token_ids, completion_token_ids, logprobs, finish_reason,"
            " reward, correct, format_ok, answer, reason, context, pivot_tokens, strategy,"
            " forced_spans, generated_tokens, created_at) VALUES (1, 0, 'base', 'base',"
            ' \'[{"role": "user", "content": "q"}]\','
            " '{\"temperature\": 1.0, \"max_tokens\": 8}', 'x', '[1, 2]', '[7, 8, 9, 10, 11]',"
            " '[-0.5, -0.5, 0.0, -1.0, -1.0]', 'stop', 1.0, true, true, '5', 'ok', 'bare', 1,"
            " 'Add the tens.', '[[2, 3]]', 4, '2026-01-01')"
        )
    )


def test_a_round_records_the_advantage_of_each_trained_segment(db_url: str) -> None:
    from trainer.dataset import member_advantages
    from trainer.settings import TrainSettings

    engine = open_store(db_url)
    group = make_group([1.0, 0.0])
    with transaction(engine) as session:
        group_id = store.save_group(session, group)
        (group,) = store.load_groups(session, "train")
        store.set_advantages(
            session, group_id, member_advantages(group, TrainSettings(mode="grpo"))
        )
        won = store.attempt_segments(session, group_id, 0, "base")
        lost = store.attempt_segments(session, group_id, 1, "base")
    assert [p.advantage for p in won] == [pytest.approx(1.0, abs=1e-4)]
    assert [p.advantage for p in lost] == [pytest.approx(-1.0, abs=1e-4)]


def test_a_record_the_columns_cannot_hold_is_refused_up_front() -> None:
    with pytest.raises(ValidationError, match="task_id"):
        make_group([1.0]).model_copy(update={}).model_validate(
            make_group([1.0]).model_dump() | {"task_id": "t" * 201}
        )


def test_a_batch_that_fails_midway_writes_nothing(db_url: str, monkeypatch) -> None:
    engine = open_store(db_url)

    def broken(*_args: object) -> None:
        raise RuntimeError("disk gone")

    monkeypatch.setattr(ingest, "_bulk_insert", broken)
    with pytest.raises(RuntimeError), transaction(engine) as session:
        store.save_groups(session, [make_group([1.0], task_id="a"), make_group([0.0], task_id="b")])
    monkeypatch.undo()
    with transaction(engine) as session:
        assert store.load_groups(session, "train") == []
        assert store.attempt_counts(session) == {}


def test_saving_nothing_or_empty_groups_is_harmless(db_url: str) -> None:
    engine = open_store(db_url)
    empty = make_group([1.0]).model_copy(update={"attempts": []})
    with transaction(engine) as session:
        assert store.save_groups(session, []) == []
        ((group_id, new),) = store.save_groups(session, [empty])
        (loaded,) = store.load_groups(session, "train")
    assert new and loaded.id == group_id and loaded.attempts == [] and not loaded.complete


def test_a_group_plan_is_stored_under_the_keys_the_store_queries() -> None:
    """Only the fields set are stored, the round that trained a session under `round` (the key
    `session_page` and the page query), and a plan with nothing set as no plan at all."""
    plan = GroupPlan(session="k:s", task="k:t", owner="k", trained_in=2, held_out=False)
    assert plan.stored() == {"session": "k:s", "task": "k:t", "owner": "k", "round": 2}
    assert GroupPlan.model_validate(plan.stored()) == plan
    assert GroupPlan().stored() is None
    assert GroupPlan.model_validate({"session": "k:s", "retired": 1}).session == "k:s"
