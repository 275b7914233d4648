"""The reliability plan's faults against real servers (the tiny model), through the scenarios of
`bench/chaos.py`: whatever strikes, every submitted rollout is stored exactly once.

Servers here are killed and stopped, so the module starts a supervised server of its own rather
than sharing the session's.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import chaos
from bench.faults import FaultProxy, Faults
from tests.helpers import SERVER_PYTHON, free_port, random_adapter, require


@pytest.fixture(scope="module")
def own_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if not SERVER_PYTHON.is_file():
        require("FLYWHEEL_REQUIRE_VLLM", "no model server environment (run `make setup`)")
    log = tmp_path_factory.mktemp("chaos") / "vllm.log"
    with chaos.supervised_server(tiny_model_path, log, free_port()) as server:
        yield server


# Rollouts a fault strikes in the middle of: it strikes with the lot's requests held at a
# stopped engine, and every rollout is generated again after it, so shorter than the benchmark's.
STRUCK_TOKENS = 128


def assert_whole(row: chaos.Row) -> None:
    assert (row.lost, row.duplicated) == (0, 0), row
    assert row.stored == row.submitted, row


@pytest.mark.vllm
@pytest.mark.slow
def test_a_server_killed_during_64_rollouts_is_restarted_and_nothing_is_lost(
    own_server, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'k.db'}"
    row = chaos.server_killed(own_server, db, tasks=16, group_size=4, max_tokens=STRUCK_TOKENS)
    assert_whole(row)
    assert row.recover_s is not None  # groups were stored again after the kill
    assert "given back" in row.note and not row.note.startswith("0 ")


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_that_answers_health_but_generates_nothing_is_caught(
    own_server, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 's.db'}"
    row = chaos.server_stalled(own_server, db, tasks=16, group_size=4, max_tokens=STRUCK_TOKENS)
    assert_whole(row)
    assert row.note.startswith("stall caught by"), row.note


@pytest.mark.vllm
def test_bursts_of_503_and_connection_resets_lose_nothing(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    model = tiny_model_path.name
    bursts = chaos.error_bursts(tiny_server, model, f"sqlite:///{tmp_path / 'b.db'}", 12, 4)
    resets = chaos.resets(tiny_server, model, f"sqlite:///{tmp_path / 'r.db'}", 12, 4)
    for row in (bursts, resets):
        assert_whole(row)
    assert not bursts.note.startswith("0 ") and not resets.note.startswith("0 ")


@pytest.mark.vllm
def test_a_load_whose_answer_is_lost_is_reconciled_from_the_models_list(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    adapter = random_adapter(tiny_model_path, tmp_path / "adapters")
    row = chaos.lost_load_answer(tiny_server, tiny_model_path, adapter)
    assert (row.stored, row.duplicated) == (1, 0), row
    assert row.note.startswith("1 answer dropped")


def test_a_trainer_killed_while_saving_resumes_from_a_whole_save(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    row = chaos.trainer_killed_while_saving(tiny_model_path, tmp_path)
    assert (row.lost, row.duplicated) == (0, 0), row
    assert row.note.startswith("resumed from step 2,"), row.note


@pytest.mark.vllm
@pytest.mark.slow
def test_a_soak_of_256_agents_through_faults_stores_what_was_submitted(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """384 rollouts, 256 in flight, through 503s, stalls and resets; afterwards nothing leaks:
    no thread, file descriptor or significant memory is left behind."""
    import resource

    model = tiny_model_path.name
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    proxy = FaultProxy(tiny_server, Faults(error=0.03, stall=0.01, reset=0.03, seed=7))
    with proxy.running() as url:
        scene = chaos.Scene(url, model, f"sqlite:///{tmp_path / 'soak.db'}", 96, 4)
        watchdog = chaos.WatchdogSettings(poll_s=2.0, stall_s=30.0, floor_s=30.0, ceiling_s=60.0)
        settings = chaos.worker_settings(concurrency=256, lot_size=32, watchdog=watchdog)
        chaos.finish(scene.collect(settings))
    row = scene.row("soak", None)
    scene.engine.dispose()
    assert_whole(row)
    assert min(proxy.counts[k] for k in ("error", "stall", "reset")) > 0, proxy.counts
    gc.collect()
    assert threading.active_count() <= threads
    assert len(os.listdir("/proc/self/fd")) <= fds + 2
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert grown_mb < 300, f"peak memory grew by {grown_mb:.0f} MB"


@pytest.mark.vllm
@pytest.mark.parametrize("through", ["direct", "fault proxy"])
def test_a_request_past_its_deadline_is_aborted_on_the_server(
    tiny_server: str, tiny_model_path: Path, through: str
) -> None:
    """The client gives up and closes the connection; vLLM aborts the request, so it does not
    keep generating for nobody (what made timed-out resends pile up before). Through the fault
    proxy too, which would otherwise keep the server busy under every chaos test."""
    if through == "fault proxy":
        with FaultProxy(tiny_server, Faults()).running() as url:
            _abandon_a_request(url, tiny_server, tiny_model_path)
    else:
        _abandon_a_request(tiny_server, tiny_server, tiny_model_path)


def _abandon_a_request(url: str, tiny_server: str, tiny_model_path: Path) -> None:
    import time

    import anyio

    from agents.errors import ServerUnavailable
    from agents.policy import PolicyClient
    from memory.records import SamplingSettings

    async def ask() -> None:
        client = PolicyClient(url, watchdog=chaos.WatchdogSettings(floor_s=1, ceiling_s=1))
        try:
            messages = [{"role": "user", "content": "Count to a thousand."}]
            sampling = SamplingSettings(temperature=1.0, max_tokens=1800)
            await client.sample(tiny_model_path.name, messages, sampling)
        finally:
            await client.aclose()

    with pytest.raises(ServerUnavailable, match="gave no answer in 1 s"):
        anyio.run(ask)
    deadline = time.monotonic() + 2.5  # unaborted, it would run about 5 s more (1800 tokens)
    while chaos.running_requests(tiny_server) > 0:
        assert time.monotonic() < deadline, "the abandoned request kept running on the server"
        time.sleep(0.1)
