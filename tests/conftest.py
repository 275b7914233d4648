"""Shared fixtures: databases (SQLite, and PostgreSQL when FLYWHEEL_TEST_PG_URL is set), the model
folders, and one real vLLM server per test session serving the tiny model."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from memory.records import Attempt, Group, Sample, SamplingSettings
from verifiers.sandbox import Isolation, Limits, Sandbox

ROOT = Path(__file__).resolve().parent.parent
# Tests run their flows on Prefect's test harness or a temporary server, never on a local
# server that would outlive them (the CLI's default).
os.environ["FLYWHEEL_PREFECT"] = "temporary"
WORKDIR = ROOT / ".flywheel"
SERVER_PYTHON = ROOT / ".venv-serving" / "bin" / "python"


def _require(env: str, reason: str) -> None:
    if os.environ.get(env):
        pytest.fail(f"{reason} ({env} is set, so this may not be skipped)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    with pg_database("flywheel") as url:
        yield url


@contextmanager
def pg_database(prefix: str) -> Iterator[str]:
    """A fresh PostgreSQL database named `prefix_...`, dropped at the end; a skip (a failure
    where CI requires PostgreSQL) without one."""
    admin_url = os.environ.get("FLYWHEEL_TEST_PG_URL")
    if not admin_url:
        _require("FLYWHEEL_REQUIRE_PG", "no PostgreSQL (set FLYWHEEL_TEST_PG_URL)")
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """One temporary Prefect server for the flows of this session, stopped within it."""
    from prefect.testing.utilities import prefect_test_harness

    os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"  # the harness stops before exit
    with prefect_test_harness():
        yield


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from serving.model import prepare_smollm2

    return prepare_smollm2(WORKDIR / "models")


@pytest.fixture(scope="session")
def tiny_model_path(smollm2_path: Path) -> Path:
    from serving.model import prepare_tiny_llama

    return prepare_tiny_llama(WORKDIR / "models", smollm2_path)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real vLLM server for the whole session (start-up dominates: about a minute)."""
    with tiny_vllm(tiny_model_path, tmp_path_factory.mktemp("vllm")) as server:
        yield server.url


@contextmanager
def tiny_vllm(tiny_model_path: Path, log_dir: Path, **options: Any) -> Iterator[Any]:
    """A real vLLM server of the tiny model on a free port (`options`: more `ServerSettings`);
    skipped, or failed where CI requires it, without the server's environment."""
    if not SERVER_PYTHON.is_file():
        _require("FLYWHEEL_REQUIRE_VLLM", "no model server environment (run `make setup`)")
    from serving.server import ServerSettings, VllmServer

    settings = ServerSettings(
        python=SERVER_PYTHON,
        model_path=tiny_model_path,
        served_name=tiny_model_path.name,
        port=free_port(),
        log_path=log_dir / "vllm.log",
        **options,
    )
    with VllmServer(settings) as server:
        yield server


def seed_promoted(engine, name: str, pass_at_1: float | None = None) -> None:
    """Store `name` as the serving (promoted) version, with an evaluation if given."""
    from memory import store
    from memory.records import PolicyVersion

    with store.transaction(engine) as session:
        store.save_policy_version(session, PolicyVersion(name=name, base_model=name))
        if pass_at_1 is not None:
            store.record_evaluation(session, name, pass_at_1)
        store.set_promoted(session, name, True)


def make_group(
    rewards: list[float],
    *,
    task_id: str = "t1",
    round_index: int = 1,
    prompt: list[int] | None = None,
    completion_len: int = 5,
) -> Group:
    """A complete group with hand-set rewards, for store and trainer tests."""
    prompt = prompt or [1, 2, 3]
    attempts = [
        Attempt(
            sample_index=i,
            policy_version="base",
            messages=[{"role": "user", "content": "q"}],
            sampling=SamplingSettings(temperature=1.0, max_tokens=16),
            sample=Sample(
                text=f"answer {i}",
                prompt_token_ids=prompt,
                completion_token_ids=[100 + i + k for k in range(completion_len)],
                logprobs=[-1.0] * completion_len,
                finish_reason="stop",
            ),
            reward=reward,
            correct=reward > 0,
            format_ok=True,
            answer=str(i),
            reason="test",
        )
        for i, reward in enumerate(rewards)
    ]
    return Group(
        round_index=round_index,
        purpose="train",
        task_id=task_id,
        taskset="arithmetic",
        question="q",
        policy_version="base",
        size=len(rewards),
        attempts=attempts,
    )


def isolated(isolation: Isolation, limits: Limits | None = None) -> Sandbox:
    """A sandbox of `isolation`, or a skip (a failure where CI requires bubblewrap) saying why
    this host cannot run it."""
    from verifiers.sandbox import Sandbox, works

    if os.geteuid() != 0:
        pytest.skip("sandbox slots drop to their own uid, which needs root")
    if not works(isolation):
        if isolation is Isolation.BUBBLEWRAP:
            _require("FLYWHEEL_REQUIRE_BWRAP", "bubblewrap is not installed or does not work here")
        pytest.skip(f"{isolation} isolation does not work here")
    return Sandbox(limits=limits, isolation=isolation)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Any]:
    """`mount(kilobytes)`: a folder on a tmpfs of that size, to fill up (unmounted at the end);
    a skip where tmpfs cannot be mounted (not root), a failure where CI requires it."""
    import subprocess

    mounted: list[Path] = []

    def mount(kilobytes: int) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kilobytes}k", "tmpfs", str(folder)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            _require("FLYWHEEL_REQUIRE_ROOT", f"cannot mount a tmpfs: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)
