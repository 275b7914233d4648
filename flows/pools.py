"""Prefect work pools: the loop's flows as deployments that Prefect workers run on any machine.

`flywheel deploy` registers three deployments, each on a named work pool (process pools by
default, created if missing):

1. `flywheel-collect/collect` on the collection pool, on an interval: a fresh batch of train
   tasks from the promoted version, enqueued in the store's queue and collected. Before it
   collects, it starts `helpers` runs of the drain deployment, so workers on other machines share
   the batch.
2. `flywheel-drain/drain` on the collection pool, unscheduled: a queue worker (what `flywheel
   worker` is without Prefect). It claims queued tasks under leases, collects and stores them,
   and ends once the queue has stayed empty for `idle_s`. A run that dies stops renewing its
   leases, and the others take its tasks again: every task ends with exactly one group.
3. `flywheel-train/train` on the training pool, on an interval: train, publish, swap, evaluate
   and promote once the next round has enough complete groups. Prefect lets one run of it
   execute at a time, whichever worker claims it (a deployment concurrency limit of 1; a run
   that would overlap is cancelled).

A worker's machine needs the project installed, `PREFECT_API_URL`, and, where its view of the
store or the model server differs from the deploying machine's, `FLYWHEEL_DB_URL` and
`FLYWHEEL_SERVER_URL` (`workers.worker.here`). Versions are written under the run's work folder:
it must be one shared path on the training machines and the model server (docs/scaling.md).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import (
    ConcurrencyLimitConfig,
    ConcurrencyLimitStrategy,
    StateType,
)
from prefect.exceptions import ObjectAlreadyExists
from prefect.types.entrypoint import EntrypointType
from prefect.workers.process import ProcessWorker
from pydantic import BaseModel, ConfigDict, Field

from flows.flywheel import DRAIN, Cadence, as_deployment, collect_batch, train_when_ready
from flows.settings import RunSettings
from memory.store import open_store
from workers import worker


class PoolSettings(BaseModel):
    """Where the deployments run, and how collection fans out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    collect: str = Field("flywheel-collect", description="the collection work pool")
    train: str = Field("flywheel-train", description="the training work pool")
    helpers: int = Field(1, ge=0, description="drain runs started beside each collection run")
    idle_s: float = Field(30.0, gt=0, description="how long a drain run waits for work")
    lease_s: float = Field(120.0, gt=0, description="how long a claim holds without renewal")
    lot_size: int = Field(16, ge=1, description="tasks a drain run claims at a time")


@flow(name="flywheel-drain", log_prints=False)
async def drain(
    db_url: str,
    server_url: str,
    idle_s: float = 30.0,
    settings: worker.WorkerSettings | None = None,
    reviewer_url: str | None = None,
    reviewer_model: str | None = None,
) -> int:
    """Collect queued tasks until the queue has been empty for `idle_s`; returns the groups
    this run stored."""
    from agents.policy import Endpoint, PolicyClient

    db_url, server_url = worker.here(db_url, server_url)
    engine = open_store(db_url)
    reviewer = None
    if reviewer_url and reviewer_model:
        reviewer = Endpoint(PolicyClient(reviewer_url), reviewer_model)
    owner = worker.new_owner()
    settings = settings or worker.WorkerSettings()
    try:
        stored = await worker.work(
            engine, server_url, owner, settings,
            worker.Shift(worker.IdleClock(engine, idle_s).expired), reviewer=reviewer,
        )  # fmt: skip
    finally:
        if reviewer is not None:
            await reviewer.client.aclose()
        engine.dispose()
    get_run_logger().info("drain %s: stored %d groups", owner, stored)
    return stored


async def ensure_pool(name: str) -> bool:
    """Create the process work pool `name` unless it exists; True when created."""
    template = ProcessWorker.get_default_base_job_template()
    async with get_client() as client:
        try:
            await client.create_work_pool(
                WorkPoolCreate(name=name, type="process", base_job_template=template)
            )
        except ObjectAlreadyExists:
            return False
    return True


def deploy(
    settings: RunSettings,
    server_url: str,
    base_name: str,
    base_model_path: str,
    pools: PoolSettings,
    cadence: Cadence,
) -> dict[str, str]:
    """Register the three deployments on their pools; returns each one's pool by its name."""
    every_s, train_every_s, min_groups = cadence.every_s, cadence.train_every_s, cadence.min_groups
    parameters: dict[str, Any] = {
        "settings": settings.model_dump(mode="json"),
        "server_url": server_url,
        "base_name": base_name,
        "base_model_path": base_model_path,
    }
    drain_parameters = {
        "db_url": settings.db_url,
        "server_url": server_url,
        "idle_s": pools.idle_s,
        "settings": worker.WorkerSettings(
            lease_s=pools.lease_s, lot_size=pools.lot_size, concurrency=settings.concurrency
        ).model_dump(mode="json"),
        "reviewer_url": settings.reviewer_url,
        "reviewer_model": settings.reviewer_model,
    }
    one_at_a_time = ConcurrencyLimitConfig(
        limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW
    )
    deployments = {
        "flywheel-collect/collect": (pools.collect, collect_batch.to_deployment(
            name="collect", interval=every_s,
            parameters={**parameters, "helpers": pools.helpers},
            entrypoint_type=EntrypointType.MODULE_PATH,
            description="A fresh batch of train tasks from the promoted version, shared with "
            "drain runs on the same pool.",
        )),
        DRAIN: (pools.collect, drain.to_deployment(
            name="drain", parameters=drain_parameters,
            entrypoint_type=EntrypointType.MODULE_PATH,
            description="A queue worker: collects queued tasks until the queue stays empty.",
        )),
        "flywheel-train/train": (pools.train, train_when_ready.to_deployment(
            name="train", interval=train_every_s,
            parameters={**parameters, "min_groups": min_groups},
            concurrency_limit=one_at_a_time,
            entrypoint_type=EntrypointType.MODULE_PATH,
            description="Train, publish, swap, evaluate and promote once enough complete "
            "groups exist; one run at a time.",
        )),
    }  # fmt: skip
    for pool, deployment in deployments.values():
        as_deployment(deployment).apply(work_pool_name=pool)
    return {name: pool for name, (pool, _) in deployments.items()}


class PoolView(BaseModel):
    """What `flywheel status` shows of a work pool."""

    name: str
    type: str
    paused: bool
    workers: list[str]  # "name (status, last seen N s ago)"
    queues: list[str]  # "name (status)"
    runs: dict[str, int]  # scheduled, pending and running flow runs


async def describe() -> list[PoolView]:
    """Every work pool of the Prefect API this process talks to."""
    async with get_client() as client:
        return [await _view(client, pool) for pool in await client.read_work_pools()]


def describe_at(api: str) -> list[PoolView]:
    """Every work pool of the Prefect API at `api` (blocking)."""
    import anyio
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}):
        return anyio.run(describe)


async def _view(client: Any, pool: Any) -> PoolView:
    now = datetime.now(UTC)
    workers = [
        f"{w.name} ({w.status.value.lower()}, last seen "
        f"{(now - w.last_heartbeat_time).total_seconds():.0f} s ago)"
        for w in await client.read_workers_for_work_pool(pool.name)
        if w.last_heartbeat_time is not None
    ]
    queues = [
        f"{q.name} ({q.status.value.lower() if q.status else 'unknown'})"
        for q in await client.read_work_queues(work_pool_name=pool.name)
    ]
    in_pool = WorkPoolFilter(name=WorkPoolFilterName(any_=[pool.name]))
    runs = {
        state.value.lower(): await client.count_flow_runs(
            work_pool_filter=in_pool,
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[state]))
            ),
        )
        for state in (StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING)
    }
    return PoolView(
        name=pool.name, type=pool.type, paused=bool(pool.is_paused), workers=workers,
        queues=queues, runs=runs,
    )  # fmt: skip
