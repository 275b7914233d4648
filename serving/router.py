"""The gateway's router: which versions are served, where the alias points, which upstream model
servers answer, and what is in flight.

1. A request for the alias is resolved to the version the alias points at when it starts, so
   moving the alias drops nothing.
2. Upstreams are taken in turn among those that answer. A probe per upstream every
   `sync_interval_s` (a real generation, `serving.probe`) takes a failing one out of the rotation
   and puts it back once it generates again, with every served version loaded on it first (a
   restarted server has lost its adapters). A connection refused takes it out at once.
3. Promotion and rollback first make every upstream serve the version, and only then record
   the decision, each in a short transaction of its own: no transaction is held open across an
   adapter load, and the store never names a version the upstreams do not serve.
4. Old versions are unloaded once nothing is in flight on them.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Engine

from memory import store
from serving import adapters, probe, promotion
from serving.errors import ServingError, UpstreamError
from serving.limits import RequestLimits

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0


class GatewaySettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    upstreams: list[str] = Field(min_length=1)
    base_model_path: Path
    adapters_root: Path
    alias: str = promotion.DEFAULT_ALIAS
    user_keys: frozenset[str] = frozenset()
    admin_keys: frozenset[str] = frozenset()
    max_lora_rank: int = 16
    keep_versions: int = 3
    gate: promotion.Gate = promotion.Gate()
    timeout_s: float = 600.0
    sync_interval_s: float = 5.0
    capture: bool = False
    uncaptured_keys: frozenset[str] = frozenset()  # keys whose traffic is never recorded
    taskset: str | None = None  # whose verifier scores feedback that sends a reference
    limits: RequestLimits = RequestLimits()

    @model_validator(mode="after")
    def _closed_to_capture(self) -> GatewaySettings:
        if self.capture and not self.user_keys:
            raise ValueError(
                "capture records training data, so it needs API keys: set FLYWHEEL_API_KEYS"
            )
        return self


class NoUpstream(UpstreamError):
    """No upstream model server is answering."""


class Router:
    """Which versions are served, where the alias points, and what is in flight."""

    def __init__(self, settings: GatewaySettings, engine: Engine, http: httpx.AsyncClient) -> None:
        self.settings = settings
        self.engine = engine
        self.http = http  # the gateway's client to its upstreams
        self.base_modules = adapters.base_model_modules(settings.base_model_path)
        self.target = ""
        self.versions: list[str] = []  # served adapter versions, oldest first
        self.paths: dict[str, Path] = {}
        self.inflight: Counter[str] = Counter()
        self.down: dict[str, str] = {}  # upstream -> why it left the rotation
        self._turn = 0
        self._admin_lock = anyio.Lock()

    @property
    def base_name(self) -> str:
        return self.settings.base_model_path.name

    def next_upstream(self) -> str:
        pool = [u for u in self.settings.upstreams if u not in self.down]
        if not pool:
            raise NoUpstream(f"no model server is answering ({'; '.join(self.down.values())})")
        self._turn += 1
        return pool[self._turn % len(pool)]

    def mark_down(self, upstream: str, reason: str) -> None:
        if upstream not in self.down:
            log.warning("upstream %s leaves the rotation: %s", upstream, reason)
        self.down[upstream] = f"{upstream}: {reason}"

    def resolve(self, model: Any) -> str | None:
        """The version a request names (the alias resolved); None if not served here."""
        if model == self.settings.alias:
            return self.target
        if isinstance(model, str) and (model == self.base_name or model in self.versions):
            return model
        return None

    async def sync_from_store(self) -> None:
        """Point the alias at the store's serving version, loading its adapter if needed."""
        with store.transaction(self.engine) as session:
            head = store.promoted_policy(session)
        if head is None:
            self.target = self.base_name
            return
        if head.adapter_path is not None:
            await self._serve(head.name, Path(head.adapter_path))
        self.target = head.name

    async def sync(self) -> None:
        async with self._admin_lock:
            await self.sync_from_store()

    async def follow_store(self) -> None:
        """Keep the alias on the store's serving version (promotions made elsewhere). A failure
        (a database error, an upstream that cannot load) is logged, and following goes on."""
        while True:
            await anyio.sleep(self.settings.sync_interval_s)
            try:
                await self.sync()
            except Exception as exc:  # noqa: BLE001 - a background loop must outlive any one error
                log.warning("alias sync failed, keeping %s: %s", self.target, exc)

    async def watch_upstreams(self) -> None:
        """Probe every upstream each interval; see the module docstring (2). Whatever an
        upstream answers, the watch goes on: a reply it cannot read takes that upstream out of
        the rotation until a probe succeeds again."""
        while True:
            for upstream in self.settings.upstreams:
                try:
                    await self._check(upstream)
                except Exception as exc:  # noqa: BLE001 - a background loop must outlive any reply
                    self.mark_down(upstream, f"unreadable answer: {type(exc).__name__}: {exc}")
            await anyio.sleep(self.settings.sync_interval_s)

    async def _check(self, upstream: str) -> None:
        found = await probe.agenerate(self.http, upstream, self.base_name, PROBE_TIMEOUT_S)
        if not found.ok:
            self.mark_down(upstream, found.reason)
            return
        if upstream not in self.down:
            return
        try:
            async with self._admin_lock:
                for name in self.versions:
                    await anyio.to_thread.run_sync(
                        adapters.ensure_loaded, upstream, name, self.paths[name]
                    )
        except (ServingError, httpx.HTTPError) as exc:
            log.warning("upstream %s answers but cannot serve the versions yet: %s", upstream, exc)
            self.down[upstream] = f"{upstream}: cannot serve the versions yet: {exc}"
            return
        log.warning("upstream %s is back in the rotation", upstream)
        self.down.pop(upstream, None)

    async def load(self, name: str, path: Path) -> None:
        async with self._admin_lock:
            await self._serve(name, path)
            await self._evict()

    async def promote(self, version: str, force: bool) -> dict[str, Any]:
        """Gate, serve everywhere, then record and move the alias; if serving fails the store is
        left unchanged. An unknown version raises `StoreError`."""
        async with self._admin_lock:
            with store.transaction(self.engine) as session:
                candidate = store.policy_version(session, version)
                refusal = promotion.refusal(session, candidate, self.settings.gate, force)
            if refusal is None and candidate.adapter_path is not None:
                await self._serve(version, Path(candidate.adapter_path))
            with store.transaction(self.engine) as session:
                event = promotion.promote(
                    session, version, self.settings.gate, self.settings.alias, force
                )
            if event.action == "promote":
                self.target = version
            return event.model_dump(mode="json")

    async def rollback(self) -> dict[str, Any]:
        """Serve the previous version everywhere, then record the rollback and move the alias."""
        async with self._admin_lock:
            with store.transaction(self.engine) as session:
                previous = promotion.rollback_target(session)
            if previous.adapter_path is not None:
                await self._serve(previous.name, Path(previous.adapter_path))
            with store.transaction(self.engine) as session:
                event = promotion.rollback(session, self.settings.alias)
            self.target = previous.name
            return event.model_dump(mode="json")

    def state(self) -> dict[str, Any]:
        return {
            "alias": self.settings.alias,
            "target": self.target,
            "base": self.base_name,
            "versions": list(self.versions),
            "inflight": dict(self.inflight),
            "down": sorted(self.down),
        }

    async def _serve(self, name: str, path: Path) -> None:
        """Make every answering upstream serve `name`; a restarted one gets it back later."""
        if name == self.base_name:
            return
        resolved = await anyio.to_thread.run_sync(self._checked_path, name, path)
        for upstream in self.settings.upstreams:
            if upstream in self.down:
                continue
            try:
                await anyio.to_thread.run_sync(adapters.ensure_loaded, upstream, name, resolved)
            except httpx.HTTPError as exc:
                raise UpstreamError(f"{upstream} could not load {name}: {exc}") from exc
        self.paths[name] = resolved
        if name not in self.versions:
            self.versions.append(name)

    def _checked_path(self, name: str, path: Path) -> Path:
        """Validate and confine a version's adapter every time it is registered; a name already
        served keeps its folder (weights the gate never saw never take a promoted name)."""
        resolved = adapters.validate_adapter(
            path,
            root=self.settings.adapters_root,
            max_rank=self.settings.max_lora_rank,
            base_modules=self.base_modules,
        )
        served = self.paths.get(name)
        if served is not None and served != resolved:
            raise ServingError(f"{name!r} already serves {served}; a new folder needs a new name")
        return resolved

    async def _evict(self) -> None:
        keep = {self.target, *self._rollback_targets()}
        while len(self.versions) > self.settings.keep_versions:
            idle = [v for v in self.versions if v not in keep and self.inflight[v] == 0]
            if not idle:
                return
            victim = idle[0]
            for upstream in self.settings.upstreams:
                if upstream not in self.down:
                    await anyio.to_thread.run_sync(adapters.unload_adapter, upstream, victim)
            self.versions.remove(victim)
            self.paths.pop(victim, None)

    def _rollback_targets(self) -> list[str]:
        with store.transaction(self.engine) as session:
            return [v.name for v in store.promoted_history(session)[:2]]
