"""Shared fixtures: databases (SQLite, and PostgreSQL when FLYWHEEL_TEST_PG_URL is set), the model
folders, and one real vLLM server per test session serving the tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import pg_database, require, tiny_vllm

ROOT = Path(__file__).resolve().parent.parent
# Tests run their flows on Prefect's test harness or a temporary server, never on a local
# server that would outlive them (the CLI's default).
os.environ["FLYWHEEL_PREFECT"] = "temporary"
WORKDIR = ROOT / ".flywheel"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    with pg_database("flywheel") as url:
        yield url


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
            require("FLYWHEEL_REQUIRE_ROOT", f"cannot mount a tmpfs: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)
