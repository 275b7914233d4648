"""The OpenAI-compatible gateway in front of one or more vLLM servers.

1. Inference routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), streaming or not,
   are proxied to the upstream servers in turn. A request for the stable alias (`policy`) is
   rewritten to the version the alias points at *when the request starts*, so switching the
   alias drops nothing and in-flight requests finish on the version they started on.
2. Admin routes load adapters (validated and confined to the checkpoint root, then canaried on
   every upstream), promote through the evaluation gate, and roll back; every decision is
   recorded in the store. Old versions are unloaded once nothing is in flight on them.
3. Keys: user keys for inference (none configured: inference is open), admin keys for admin
   routes. Missing or unknown key: 401; a user key on an admin route: 403. Other routes: 404.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Engine

from memory import store
from memory.errors import StoreError
from serving import adapters, capture, promotion
from serving.errors import ServingError

log = logging.getLogger(__name__)

INFERENCE_ROUTES = ("/v1/chat/completions", "/v1/completions")


class GatewaySettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    upstreams: list[str] = Field(min_length=1)
    base_model_path: Path
    checkpoint_root: Path
    alias: str = promotion.DEFAULT_ALIAS
    user_keys: frozenset[str] = frozenset()
    admin_keys: frozenset[str] = frozenset()
    max_lora_rank: int = 16
    keep_versions: int = 3
    gate: promotion.Gate = promotion.Gate()
    timeout_s: float = 600.0
    sync_interval_s: float = 5.0
    capture: bool = False


class LoadRequest(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,120}$")
    path: str


class FeedbackRequest(BaseModel):
    id: str
    score: float = Field(ge=0.0, le=1.0)
    reason: str = "user feedback"


class PromoteRequest(BaseModel):
    version: str
    force: bool = False


class Router:
    """Which versions are served, where the alias points, and what is in flight."""

    def __init__(self, settings: GatewaySettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.base_modules = adapters.base_model_modules(settings.base_model_path)
        self.target = ""
        self.versions: list[str] = []  # served adapter versions, oldest first
        self.inflight: Counter[str] = Counter()
        self._upstreams = itertools.cycle(settings.upstreams)
        self._admin_lock = asyncio.Lock()

    def next_upstream(self) -> str:
        return next(self._upstreams)

    def resolve(self, model: Any) -> str:
        if model == self.settings.alias:
            return self.target
        if isinstance(model, str) and (model == self.base_name or model in self.versions):
            return model
        raise HTTPException(404, f"model {model!r} is not served here")

    @property
    def base_name(self) -> str:
        return self.settings.base_model_path.name

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

    async def follow_store(self, interval_s: float) -> None:
        """Keep the alias on the store's serving version (promotions made elsewhere)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sync()
            except (ServingError, httpx.HTTPError, OSError) as exc:
                log.warning("alias sync failed, keeping %s: %s", self.target, exc)

    async def load(self, name: str, path: Path) -> None:
        async with self._admin_lock:
            await self._serve(name, path)
            await self._evict()

    async def promote(self, version: str, force: bool) -> dict[str, Any]:
        """Gate, serve, then move the alias; if serving fails the store is left unchanged."""
        async with self._admin_lock:
            with store.transaction(self.engine) as session:
                event = promotion.promote(
                    session, version, self.settings.gate, self.settings.alias, force
                )
                adapter = store.policy_version(session, version).adapter_path
                if event.action == "promote" and adapter is not None:
                    await self._serve(version, Path(adapter))
            if event.action == "promote":
                self.target = version
            return event.model_dump(mode="json")

    async def rollback(self) -> dict[str, Any]:
        async with self._admin_lock:
            with store.transaction(self.engine) as session:
                event = promotion.rollback(session, self.settings.alias)
            await self.sync_from_store()
            return event.model_dump(mode="json")

    def state(self) -> dict[str, Any]:
        return {
            "alias": self.settings.alias,
            "target": self.target,
            "base": self.base_name,
            "versions": list(self.versions),
            "inflight": dict(self.inflight),
        }

    async def _serve(self, name: str, path: Path) -> None:
        """Make every upstream serve `name`; a restarted upstream gets it back here."""
        if name == self.base_name:
            return
        resolved = await asyncio.to_thread(self._checked_path, name, path)
        for upstream in self.settings.upstreams:
            await asyncio.to_thread(adapters.ensure_loaded, upstream, name, resolved)
        if name not in self.versions:
            self.versions.append(name)

    def _checked_path(self, name: str, path: Path) -> Path:
        """Validate a version's adapter the first time this gateway serves it."""
        if name in self.versions:
            return path.resolve()
        return adapters.validate_adapter(
            path,
            root=self.settings.checkpoint_root,
            max_rank=self.settings.max_lora_rank,
            base_modules=self.base_modules,
        )

    async def _evict(self) -> None:
        keep = {self.target, *self._rollback_targets()}
        while len(self.versions) > self.settings.keep_versions:
            idle = [v for v in self.versions if v not in keep and self.inflight[v] == 0]
            if not idle:
                return
            victim = idle[0]
            for upstream in self.settings.upstreams:
                await asyncio.to_thread(adapters.unload_adapter, upstream, victim)
            self.versions.remove(victim)

    def _rollback_targets(self) -> list[str]:
        with store.transaction(self.engine) as session:
            return [v.name for v in store.promoted_history(session)[:2]]


def create_app(
    settings: GatewaySettings,
    engine: Engine,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The gateway app; `transport` replaces the network to the upstreams (tests)."""
    router = Router(settings, engine)
    client = httpx.AsyncClient(
        timeout=settings.timeout_s,
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        transport=transport,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await router.sync_from_store()
        follower = asyncio.create_task(router.follow_store(settings.sync_interval_s))
        yield
        follower.cancel()
        await client.aclose()

    app = FastAPI(
        title="flywheel gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.router = router
    user = Depends(_key_check(settings, admin=False))
    admin = Depends(_key_check(settings, admin=True))

    @app.exception_handler(ServingError)
    async def _serving_error(_request: Request, exc: ServingError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "alias": settings.alias, "target": router.target}

    @app.get("/v1/models", dependencies=[user])
    async def models() -> dict[str, Any]:
        names = [settings.alias, router.base_name, *router.versions]
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "owned_by": "flywheel"} for n in names],
        }

    async def proxy(request: Request, route: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise HTTPException(400, "request body is not JSON") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "request body must be a JSON object")
        version = router.resolve(body.get("model"))
        body["model"] = version
        capturing = settings.capture and route == "/v1/chat/completions" and not body.get("stream")
        asked = capture.prepare_request(body) if capturing else None
        router.inflight[version] += 1
        try:
            upstream_request = client.build_request(
                "POST", router.next_upstream() + route, json=body
            )
            upstream = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            router.inflight[version] -= 1
            raise HTTPException(502, f"upstream error: {type(exc).__name__}") from exc
        if not body.get("stream"):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                router.inflight[version] -= 1
            if asked is not None and upstream.status_code == 200:
                return await record(body, content, asked)
            return Response(
                content,
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type"),
            )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()
                router.inflight[version] -= 1

        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    async def record(body: dict[str, Any], content: bytes, asked: dict[str, bool]) -> Response:
        payload = json.loads(content)
        group = capture.captured_group(body, payload)
        headers = {}
        if group is not None:
            await asyncio.to_thread(_save_group, engine, group)
            headers[capture.CAPTURE_HEADER] = group.task_id
        return JSONResponse(capture.strip_unasked(payload, asked), headers=headers)

    @app.post("/v1/feedback", dependencies=[user])
    async def feedback(body: FeedbackRequest) -> dict[str, str]:
        try:
            await asyncio.to_thread(_save_feedback, engine, body)
        except StoreError as exc:
            raise HTTPException(404, str(exc)) from None
        return {"status": "recorded", "id": body.id}

    @app.post("/v1/chat/completions", dependencies=[user])
    async def chat(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.post("/v1/completions", dependencies=[user])
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/admin/adapters", dependencies=[admin])
    async def load(body: LoadRequest) -> dict[str, Any]:
        await router.load(body.name, Path(body.path))
        return router.state()

    @app.post("/admin/promote", dependencies=[admin])
    async def promote(body: PromoteRequest) -> JSONResponse:
        event = await router.promote(body.version, body.force)
        return JSONResponse(event, status_code=200 if event["action"] == "promote" else 409)

    @app.post("/admin/rollback", dependencies=[admin])
    async def rollback() -> dict[str, Any]:
        return await router.rollback()

    @app.post("/admin/sync", dependencies=[admin])
    async def sync() -> dict[str, Any]:
        await router.sync()
        return router.state()

    @app.get("/admin/state", dependencies=[admin])
    async def state() -> dict[str, Any]:
        return router.state()

    return app


@contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread; yields its URL, stops on exit."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ServingError(f"gateway did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _save_group(engine: Engine, group: Any) -> None:
    with store.transaction(engine) as session:
        store.save_group(session, group)


def _save_feedback(engine: Engine, body: FeedbackRequest) -> None:
    with store.transaction(engine) as session:
        store.record_feedback(session, body.id, body.score, body.reason)


def _key_check(settings: GatewaySettings, admin: bool) -> Any:
    async def check(request: Request) -> None:
        header = request.headers.get("authorization", "")
        key = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if admin:
            if key in settings.admin_keys:
                return
            if key and key in settings.user_keys:
                raise HTTPException(403, "this key may not use admin routes")
            raise HTTPException(401, "missing or unknown admin key")
        if not settings.user_keys or key in settings.user_keys or key in settings.admin_keys:
            return
        raise HTTPException(401, "missing or unknown API key")

    return check
