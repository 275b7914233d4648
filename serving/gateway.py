"""The OpenAI-compatible gateway in front of one or more vLLM servers.

1. Inference routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), streaming or not,
   are proxied to the upstream servers that answer, in turn (`serving.router`). A request for
   the stable alias (`policy`) is rewritten to the version the alias points at when it starts.
2. Failures have clear statuses and lose nothing: an unknown model or version 404; no upstream
   answering 503; an upstream that fails before or in the middle of an answer 502, or, once a
   stream has begun, an error event that ends the stream cleanly.
3. Admin routes load adapters (validated and confined to the checkpoint root, then canaried on
   every upstream), promote through the evaluation gate, and roll back; every decision is
   recorded in the store.
4. With capture on, chat completions, streamed or not, are stored as trajectories
   (`serving.capture`), tagged with their session and task; a capture that cannot be stored is
   logged and the answer still goes out. `/v1/feedback` scores one captured turn (`id`) or a
   whole session (`session`: every turn of it).
5. Keys: user keys for inference (none configured: inference is open), admin keys for admin
   routes. Missing or unknown key: 401; a user key on an admin route: 403. Other routes: 404.
6. The flywheel's page, `/ui` (`serving.ui`), behind the admin keys.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, model_validator
from sqlalchemy import Engine

from memory import store
from memory.errors import NotFound
from memory.records import GroupPlan
from serving import access, capture
from serving.errors import ServingError, UpstreamError
from serving.limits import Limited
from serving.router import GatewaySettings, NoUpstream, Router
from serving.ui import Page, add_ui
from verifiers.catalog import averify
from verifiers.errors import TaskFault
from verifiers.reasoning import MAX_MATH_ANSWER

__all__ = ["GatewaySettings", "create_app", "running"]

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"


class LoadRequest(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,120}$")
    path: str


class FeedbackRequest(BaseModel):
    """A score for one captured turn (`id`, its capture id) or a whole session (`session`):
    given (`score`), or the gateway's verifier's, of the last answer against `reference`."""

    id: str | None = None
    session: str | None = None
    score: float | None = Field(None, ge=0.0, le=1.0)
    reference: str | None = Field(None, max_length=MAX_MATH_ANSWER)
    reason: str = "user feedback"

    @model_validator(mode="after")
    def _one_target(self) -> FeedbackRequest:
        if (self.id is None) == (self.session is None):
            raise ValueError("give either id (a capture id) or session")
        if (self.score is None) == (self.reference is None):
            raise ValueError("give either score or reference (for the gateway's verifier)")
        return self


class PromoteRequest(BaseModel):
    version: str
    force: bool = False


def create_app(
    settings: GatewaySettings,
    engine: Engine,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The gateway app; `transport` replaces the network to the upstreams (tests)."""
    client = httpx.AsyncClient(
        timeout=settings.timeout_s,
        headers=access.headers(),  # the model servers' own key: callers' keys never go upstream
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        transport=transport,
    )
    router = Router(settings, engine, client)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            await router.sync_from_store()
        except (ServingError, httpx.HTTPError) as exc:
            log.warning("serving the store's version failed at start, will retry: %s", exc)
            router.target = router.target or router.base_name
        async with anyio.create_task_group() as background:
            background.start_soon(router.follow_store)
            background.start_soon(router.watch_upstreams)
            yield
            background.cancel_scope.cancel()
        await client.aclose()

    app = FastAPI(
        title="flywheel gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.router = router
    app.add_middleware(Limited, limits=settings.limits)
    _error_handlers(app)
    _inference_routes(app, router, client, engine)
    _admin_routes(app, router)
    add_ui(app, Page(engine, settings.admin_keys, settings.gate, router))
    return app


def _inference_routes(
    app: FastAPI, router: Router, client: httpx.AsyncClient, engine: Engine
) -> None:
    settings = router.settings
    user = Depends(_key_check(settings, admin=False))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "alias": settings.alias, "target": router.target}

    @app.get("/v1/models", dependencies=[user])
    async def models() -> dict[str, Any]:
        names = [settings.alias, router.base_name, *router.versions]
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "owned_by": "flywheel"} for n in names],
        }

    @app.post("/v1/feedback", dependencies=[user])
    async def feedback(request: Request, body: FeedbackRequest) -> dict[str, Any]:
        asked = body.session
        owner = capture.owner(_key(request))
        if body.session is not None:  # the caller's session: another key's is another session
            body = body.model_copy(update={"session": capture.owned(owner, body.session)})
        if body.reference is not None:
            body = await _verified(engine, settings.taskset, body, owner)
        turns = await anyio.to_thread.run_sync(_save_feedback, engine, body, owner)  # unknown: 404
        return {"status": "recorded", "id": body.id, "session": asked, "turns": turns,
                "score": body.score, "reason": body.reason}  # fmt: skip

    @app.post(CHAT, dependencies=[user])
    async def chat(request: Request) -> Response:
        return await _proxy(request, CHAT, router, client, engine)

    @app.post("/v1/completions", dependencies=[user])
    async def completions(request: Request) -> Response:
        return await _proxy(request, "/v1/completions", router, client, engine)


def _admin_routes(app: FastAPI, router: Router) -> None:
    admin = Depends(_key_check(router.settings, admin=True))

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


async def _proxy(
    request: Request, route: str, router: Router, client: httpx.AsyncClient, engine: Engine
) -> Response:
    """One inference request: the alias resolved, sent to an answering upstream, relayed
    (and, with capture on, recorded)."""
    body = await _json_body(request)
    version = router.resolve(body.get("model"))
    if version is None:
        raise HTTPException(404, f"model {body.get('model')!r} is not served here")
    body["model"] = version
    capturing = router.settings.capture and route == CHAT and _captured(request, router.settings)
    share = router.settings.gate.held_out_share
    tagged = capture.tags(request.headers, body, capture.owner(_key(request)), share)
    asked = capture.prepare_request(body) if capturing else None
    router.inflight[version] += 1
    try:
        upstream = await _send(client, router, route, body)
    except BaseException:
        router.inflight[version] -= 1
        raise
    if body.get("stream"):
        return _relay(upstream, router, version, engine, body, asked, tagged)
    try:
        content = await upstream.aread()
    except httpx.HTTPError as exc:
        raise UpstreamError(f"the model server failed mid-answer: {exc}") from exc
    finally:
        await upstream.aclose()
        router.inflight[version] -= 1
    if asked is not None and upstream.status_code == 200:
        return await _recorded(engine, body, content, asked, tagged)
    return Response(
        content,
        status_code=upstream.status_code,
        media_type=upstream.headers.get("content-type"),
    )


def _error_handlers(app: FastAPI) -> None:
    def error(status: int, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=status)

    @app.exception_handler(NoUpstream)
    async def _no_upstream(_request: Request, exc: NoUpstream) -> JSONResponse:
        return error(503, exc)

    @app.exception_handler(UpstreamError)
    async def _upstream(_request: Request, exc: UpstreamError) -> JSONResponse:
        return error(502, exc)

    @app.exception_handler(ServingError)
    async def _serving(_request: Request, exc: ServingError) -> JSONResponse:
        return error(400, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # One line, and never the input echoed back: it may not even be valid JSON (Infinity).
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return error(422, ValueError(f"{where}: {message}" if where else message))

    @app.exception_handler(NotFound)
    async def _not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return error(404, exc)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise HTTPException(400, "request body is not JSON") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "request body must be a JSON object")
    return body


async def _send(
    client: httpx.AsyncClient, router: Router, route: str, body: dict[str, Any]
) -> httpx.Response:
    """Send to the next answering upstream; one that refuses the connection (nothing reached
    it) leaves the rotation and the next is tried."""
    for _ in router.settings.upstreams:
        upstream = router.next_upstream()
        request = client.build_request("POST", upstream + route, json=body)
        try:
            return await client.send(request, stream=True)
        except httpx.ConnectError as exc:
            router.mark_down(upstream, f"connection refused: {exc}")
        except httpx.HTTPError as exc:
            raise UpstreamError(f"the model server failed: {type(exc).__name__}: {exc}") from exc
    raise NoUpstream("no model server accepted the connection")


def _relay(
    upstream: httpx.Response,
    router: Router,
    version: str,
    engine: Engine,
    body: dict[str, Any],
    asked: dict[str, bool] | None,
    tagged: GroupPlan,
) -> StreamingResponse:
    """Relay a stream; with capture, record it and drop the fields the caller did not ask
    for. An upstream that fails mid-stream ends it with an error event."""
    recording = asked is not None and upstream.status_code == 200
    capture_id = f"capture:{uuid.uuid4().hex}"

    async def events() -> AsyncIterator[bytes]:
        recorder = capture.StreamRecorder()
        try:
            if not recording:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
                return
            assert asked is not None
            stored = False
            async for line in upstream.aiter_lines():
                if line == "data: [DONE]" and not stored:  # stored before the caller is done,
                    stored = True  # so feedback sent right after the stream finds it
                    await _store_capture(engine, body, recorder.response(), capture_id, tagged)
                yield (capture.relay_line(line, recorder, asked) + "\n").encode()
            if not stored:
                await _store_capture(engine, body, recorder.response(), capture_id, tagged)
        except httpx.HTTPError as exc:
            log.warning("upstream failed mid-stream for %s: %s", version, exc)
            message = {"message": f"the model server failed mid-stream: {exc}", "code": 502}
            yield f"data: {json.dumps({'error': message})}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()
            router.inflight[version] -= 1

    headers = {capture.CAPTURE_HEADER: capture_id} if recording else {}
    return StreamingResponse(
        events(),
        status_code=upstream.status_code,
        media_type=upstream.headers.get("content-type"),
        headers=headers,
    )


async def _recorded(
    engine: Engine,
    body: dict[str, Any],
    content: bytes,
    asked: dict[str, bool],
    tagged: GroupPlan,
) -> Response:
    payload = json.loads(content)
    capture_id = f"capture:{uuid.uuid4().hex}"
    stored = await _store_capture(engine, body, payload, capture_id, tagged)
    headers = {capture.CAPTURE_HEADER: capture_id} if stored else {}
    return JSONResponse(capture.strip_unasked(payload, asked), headers=headers)


async def _store_capture(
    engine: Engine,
    body: dict[str, Any],
    payload: dict[str, Any],
    capture_id: str,
    tagged: GroupPlan,
) -> bool:
    """Store a captured trajectory; a failure is logged, never the caller's problem."""
    try:
        group = capture.captured_group(body, payload, capture_id, tagged)
        if group is None:
            return False
        await anyio.to_thread.run_sync(_save_group, engine, group)
    except Exception as exc:  # noqa: BLE001 - the answer goes out whatever the store says
        log.error("capture %s not stored: %s", capture_id, exc)
        return False
    return True


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


async def _verified(
    engine: Engine, taskset: str | None, body: FeedbackRequest, owner: str
) -> FeedbackRequest:
    """The feedback with the verifier's score of the captured answer against the reference."""
    if taskset is None:
        raise ServingError("this gateway has no verifier: start it with --taskset, or send a score")
    assert body.reference is not None
    with store.transaction(engine) as session:  # unknown, or another key's: NotFound, 404
        question, answer = store.captured_exchange(session, body.session, body.id, owner)
    try:
        verdict = await averify(capture.reference_task(taskset, question, body.reference), answer)
    except TaskFault as fault:
        raise ServingError(f"the verifier could not score this answer: {fault}") from fault
    return body.model_copy(
        update={"score": verdict.reward, "reason": f"verified: {verdict.reason}"}
    )


def _save_feedback(engine: Engine, body: FeedbackRequest, owner: str) -> int:
    """Record the score on what `owner`'s key captured; the number of turns it reached."""
    assert body.score is not None
    with store.transaction(engine) as session:
        if body.session is not None:
            return store.record_session_feedback(
                session, body.session, body.score, body.reason, body.reference
            )
        assert body.id is not None
        store.record_feedback(session, body.id, body.score, body.reason, owner)
        return 1


def _captured(request: Request, settings: GatewaySettings) -> bool:
    """Whether this request's traffic may be recorded: it came with a key (capture needs keys),
    and is not opted out by header or by its key."""
    key = _key(request)
    return (
        bool(key) and not capture.opted_out(request.headers) and key not in settings.uncaptured_keys
    )


def _key(request: Request) -> str:
    header = request.headers.get("authorization", "")
    return header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""


def _key_check(settings: GatewaySettings, admin: bool) -> Any:
    async def check(request: Request) -> None:
        key = _key(request)
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
