"""The model servers a benchmark runs against: the policy at `--server-url`, or SmolLM2 started
here; and optionally a reviewer model beside it, each server on cores of its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import server_settings
from serving.model import REVIEWERS, prepare_parted, prepare_smollm2
from serving.server import ServerSettings, VllmServer, side_by_side

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".flywheel" / "models"
LOGS = ROOT / ".flywheel" / "logs"


@contextmanager
def smollm2_server(
    server_url: str | None,
    port: int,
    log_name: str,
    cpus: str | None = None,
    weights: str = "lora",
) -> Iterator[tuple[str, Path]]:
    """Yield (server URL, model folder); a server started here is stopped on exit. `weights`:
    "lora" serves trained adapters too, "fixed" only the base model, on its fast path."""
    model = prepare_smollm2(MODELS)
    if server_url:
        yield server_url, model
        return
    settings = fixed_server(model, port, log_name, cpus, "float32")
    with VllmServer(settings.model_copy(update={"weights": weights})) as server:
        yield server.url, model


@contextmanager
def policy_and_reviewer(
    server_url: str | None, port: int, log_name: str, reviewer: str | None
) -> Iterator[tuple[str, Path, str | None, str | None]]:
    """Yield (policy URL, policy folder, reviewer URL, reviewer model name); with `reviewer`
    (a name in `REVIEWERS` or a model folder) a reviewer server starts beside the policy, each
    pinned to half the cores, the reviewer in bfloat16 where the CPU computes it."""
    if reviewer is None:
        with smollm2_server(server_url, port, log_name, weights="fixed") as (url, model):
            yield url, model, None, None
        return
    folder = Path(reviewer)
    if reviewer in REVIEWERS:
        folder = prepare_parted(REVIEWERS[reviewer], MODELS)
    policy = fixed_server(prepare_smollm2(MODELS), port, log_name, None, "float32")
    reviewer_server = fixed_server(folder, port + 1, f"reviewer-{log_name}", None, "float32")
    policy, reviewer_server = side_by_side(policy, reviewer_server)
    with (
        smollm2_server(server_url, port, log_name, policy.cpus, "fixed") as (url, model),
        VllmServer(reviewer_server) as server,
    ):
        yield url, model, server.url, folder.name


def fixed_server(
    model: Path, port: int, log_name: str, cpus: str | None, dtype: str, logs: Path = LOGS
) -> ServerSettings:
    """A server of `model` without LoRA, pinned to `cpus`, logging to `logs/log_name`."""
    return server_settings(model, logs / log_name, port=port, weights="fixed", dtype=dtype,
                           cpus=cpus, startup_timeout_s=600.0)  # fmt: skip
