import pytest
from sqlalchemy import func, select

from memory import store
from memory.errors import StoreError
from memory.models import AttemptRow, RolloutGroupRow
from memory.records import PolicyVersion, TrainingRound
from tests.helpers import make_group


def test_groups_round_trip_with_tokens_and_logprobs(db_url: str) -> None:
    engine = store.open_store(db_url)
    group = make_group([1.0, 0.0, 0.5])
    with store.transaction(engine) as session:
        store.save_group(session, group)
    with store.transaction(engine) as session:
        (loaded,) = store.load_groups(session, "train", round_index=1, complete_only=True)
    assert loaded == group.model_copy(update={"id": loaded.id})
    assert loaded.id is not None
    assert loaded.attempts[0].sample is not None
    assert loaded.attempts[0].sample.completion_token_ids == [100, 101, 102, 103, 104]
    assert loaded.attempts[0].sample.logprobs == [-1.0] * 5


def test_text_a_model_sampled_with_nul_is_stored(db_url: str) -> None:
    """PostgreSQL's text and JSON cannot hold NUL: it is stored as U+FFFD, on both databases."""
    engine = store.open_store(db_url)
    group = make_group([1.0, 0.0])
    first = group.attempts[0]
    assert first.sample is not None
    nul = first.model_copy(
        update={
            "sample": first.sample.model_copy(update={"text": "a\x00b"}),
            "messages": [{"role": "assistant", "content": "x\x00"}],
            "answer": "\x00",
        }
    )
    with store.transaction(engine) as session:
        store.save_group(session, group.model_copy(update={"attempts": [nul, group.attempts[1]]}))
    with store.transaction(engine) as session:
        (loaded,) = store.load_groups(session, "train", round_index=1)
    stored = loaded.attempts[0]
    assert stored.sample is not None and stored.sample.text == "a\ufffdb"
    assert stored.messages == [{"role": "assistant", "content": "x\ufffd"}]
    assert stored.answer == "\ufffd"
    assert stored.sample.completion_token_ids == first.sample.completion_token_ids


def test_saving_twice_writes_once(db_url: str) -> None:
    engine = store.open_store(db_url)
    group = make_group([1.0, 0.0])
    for _ in range(2):
        with store.transaction(engine) as session:
            store.save_group(session, group)
    with store.transaction(engine) as session:
        assert session.scalar(select(func.count()).select_from(RolloutGroupRow)) == 1
        assert session.scalar(select(func.count()).select_from(AttemptRow)) == 2


def test_failed_attempts_make_a_group_incomplete(db_url: str) -> None:
    engine = store.open_store(db_url)
    group = make_group([1.0, 0.0])
    failed = group.attempts[1].model_copy(update={"sample": None, "error": "timeout"})
    with store.transaction(engine) as session:
        store.save_group(
            session, group.model_copy(update={"attempts": [group.attempts[0], failed]})
        )
    with store.transaction(engine) as session:
        assert store.load_groups(session, "train", complete_only=True) == []
        (stored,) = store.load_groups(session, "train")
    assert stored.attempts[1].error == "timeout"


def test_promotion_and_round_bookkeeping(db_url: str) -> None:
    engine = store.open_store(db_url)
    with store.transaction(engine) as session:
        assert store.next_round_index(session) == 1
        store.save_policy_version(session, PolicyVersion(name="base", base_model="m"))
        store.record_evaluation(session, "base", 0.2)
        store.set_promoted(session, "base", True)
        store.save_policy_version(
            session, PolicyVersion(name="p1", base_model="m", parent="base", round_index=1)
        )
        store.record_evaluation(session, "p1", 0.1)
        running = TrainingRound(
            round_index=1, method="grpo", policy_in="base", policy_out=None, status="running"
        )
        store.save_training_round(session, running)
    with store.transaction(engine) as session:
        assert store.promoted_policy(session).name == "base"
        assert store.next_round_index(session) == 1, "an unfinished round is resumed"
        store.save_training_round(session, running.model_copy(update={"status": "done"}))
        assert store.next_round_index(session) == 2


def test_bad_urls_fail_with_one_line(tmp_path) -> None:
    with pytest.raises(StoreError, match="invalid database URL"):
        store.open_store("not a url")
    with pytest.raises(StoreError, match="unsupported database 'mysql'"):
        store.open_store("mysql://x@localhost/db")
    with pytest.raises(StoreError, match="cannot open database"):
        store.open_store("postgresql+psycopg://nobody@127.0.0.1:1/none")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError):
        store.open_store(f"sqlite:///{blocker}/sub/db.sqlite")


def test_a_round_cursor_is_committed_once_and_reused(tmp_path) -> None:
    from flows.rounds import RoundContext, _round_record, given_up
    from flows.settings import RunSettings

    settings = RunSettings(db_url=f"sqlite:///{tmp_path / 'fw.db'}", workdir=tmp_path)
    engine = store.open_store(settings.db_url)
    with store.transaction(engine) as session:
        store.save_group(session, make_group([1.0, 0.0], task_id="a"))
        store.save_group(session, make_group([0.0, 0.0], task_id="b"))
        groups = store.load_groups(session, "train", round_index=1)
    base = PolicyVersion(name="base", base_model="base")
    ctx = RoundContext(
        settings=settings, server_url="http://unused", base_name="base", base_model=tmp_path,
        held_out=[], round_index=1, current=base,
    )  # fmt: skip
    first, trained = _round_record(ctx, groups)
    assert first.status == "running" and first.policy_out and first.method == "filtered"
    assert first.group_ids == [g.id for g in groups] and trained == groups
    # After a crash, the same round trains the same groups under the same name, even if
    # more groups have been stored since.
    with store.transaction(engine) as session:
        store.save_group(session, make_group([1.0, 0.0], task_id="c"))
    again, regrouped = _round_record(ctx, [])
    assert again.policy_out == first.policy_out and regrouped == groups
    # Each resume is counted and kept: a round killed while training (out of memory) is
    # skipped after MAX_STARTS starts instead of being resumed and killed forever.
    assert (first.metrics.starts, again.metrics.starts) == (1, 2)
    with store.transaction(engine) as session:
        assert store.training_round(session, 1).metrics.starts == 2
    for _ in range(2):
        again, _ = _round_record(ctx, [])
    assert again.metrics.starts == 4 and "out of memory?" in (given_up(again) or "")
    assert given_up(first) is None


def test_lineage_walks_the_rounds_back_to_the_base(db_url: str) -> None:
    engine = store.open_store(db_url)
    with store.transaction(engine) as session:
        for name in ("base", "p1", "p2"):
            store.save_policy_version(session, PolicyVersion(name=name, base_model="base"))
        for index, (parent, child) in enumerate([("base", "p1"), ("p1", "p2")], start=1):
            store.save_training_round(
                session,
                TrainingRound(
                    round_index=index,
                    method="grpo",
                    policy_in=parent,
                    policy_out=child,
                    status="done",
                    group_ids=[index * 10, index * 10 + 1],
                ),
            )
    with store.transaction(engine) as session:
        chain = store.lineage(session, "p2")
        assert [(r.policy_in, r.policy_out) for r in chain] == [("p1", "p2"), ("base", "p1")]
        assert chain[0].group_ids == [20, 21]
        assert store.lineage(session, "base") == []
        with pytest.raises(StoreError, match="unknown policy version"):
            store.lineage(session, "nope")
