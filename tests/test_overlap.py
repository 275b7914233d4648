"""Overlapped rounds: a round's training runs beside the next round's collection, the seconds
they ran together are recorded, a failed training still lets the collection finish, and a round
trains only on groups at most `max_staleness` promotions old."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from flows import rounds
from flows.settings import RunSettings
from memory import store
from memory.records import PolicyVersion
from serving import promotion
from tests.helpers import make_group
from trainer.errors import TrainerError
from trainer.round import RoundResult


def context(db_url: str, current: str = "v2", max_staleness: int = 1) -> rounds.RoundContext:
    settings = RunSettings(db_url=db_url, overlap=True, max_staleness=max_staleness)
    version = PolicyVersion(name=current, base_model="base")
    return rounds.RoundContext(
        settings=settings, server_url="http://up", base_name="base", base_model=Path("base"),
        held_out=[], round_index=3, current=version,
    )  # fmt: skip


def promoted(db_url: str, names: list[str]) -> None:
    """Promote `names` in order (each through the gate, forced)."""
    engine = store.open_store(db_url)
    with store.transaction(engine) as session:
        for index, name in enumerate(names):
            store.save_policy_version(session, PolicyVersion(
                name=name, base_model="base", round_index=index))  # fmt: skip
            promotion.promote(session, name, promotion.Gate(), force=True)


def test_a_round_keeps_groups_at_most_max_staleness_promotions_old(db_url: str) -> None:
    promoted(db_url, ["base", "v1", "v2"])
    groups = [make_group([1.0, 0.0], task_id=f"t-{v}").model_copy(update={"policy_version": v})
              for v in ("v2", "v1", "base")]  # fmt: skip
    with store.transaction(store.open_store(db_url)) as session:
        kept, stale, dropped = rounds._fresh(session, context(db_url), groups)
        assert [g.policy_version for g in kept] == ["v2", "v1"] and (stale, dropped) == (1, 1)
        strict = context(db_url, max_staleness=0)
        kept, stale, dropped = rounds._fresh(session, strict, groups)
        assert [g.policy_version for g in kept] == ["v2"] and (stale, dropped) == (0, 2)


def fake_training(seconds: float, fails: bool = False):
    async def train(*_args) -> RoundResult:
        await anyio.sleep(seconds)
        if fails:
            raise TrainerError("no trainable rows")
        return RoundResult(adapter_path="a", rows=1, train_tokens=8, loss_first=None,
                           loss_last=None, train_seconds=seconds, seconds=seconds)  # fmt: skip

    return train


@pytest.mark.parametrize("fails", [False, True])
def test_training_runs_beside_the_next_collection(
    db_url: str, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    monkeypatch.setattr(
        rounds.stages, "within_deadline", lambda stage, _s: fake_training(0.6, fails)
    )
    collected: list[float] = []

    async def collect_next() -> None:
        await anyio.sleep(0.4)
        collected.append(time.monotonic())

    async def main() -> tuple[float, dict[str, float], Exception | None]:
        seconds: dict[str, float] = {}
        began = time.monotonic()
        try:
            await rounds._train(context(db_url), [], "v3", (seconds, rounds.Clock()), collect_next)
        except TrainerError as exc:
            return time.monotonic() - began, seconds, exc
        return time.monotonic() - began, seconds, None

    elapsed, seconds, error = anyio.run(main)
    assert collected, "the next round's collection finished"
    assert elapsed < 0.9  # together, not 0.6 + 0.4 one after the other
    assert seconds["train"] == pytest.approx(0.6, abs=0.15)
    assert seconds["hidden"] == pytest.approx(0.4, abs=0.15)
    assert (error is not None) == fails
