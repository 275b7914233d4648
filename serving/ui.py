"""The flywheel's page: watch the loop and steer it. Served by the gateway under `/ui`, or alone
by `flywheel ui --db URL`; server-rendered (Jinja templates in `serving/templates/ui/`), plain
HTML forms, no build step.

1. Views (`reports.views`): versions (the alias, its history, each version's held-out pass@1
   with n and its 95% interval, which evaluations judged it, its parent), rounds (rows trained by
   source, staleness, drift, stage times), captured sessions a page at a time and one turn by
   turn, and exploration (what the policy solved itself, what only the reviewer's revision did).
2. Steering, each a POST answered with a redirect back and one line saying what happened: rate a
   session (the store path `/v1/feedback` takes), hold it out, forget it, promote a version or
   roll back. Promotion goes through the gate, and through the gateway's router when there is
   one, so every model server serves the change before the store records it; the gate's answer
   is shown. Every action is recorded with who took it (`memory.actions`).
3. The page is behind the admin keys, views included (they show users' traffic): a key given
   once (`/ui/login?token=KEY`, the link `flywheel ui` prints, or the form) is kept in an
   HttpOnly, SameSite=Strict cookie, so another site cannot post with it.
"""

from __future__ import annotations

import hashlib
import html
import math
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

import anyio
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import Engine

from memory import actions, sessions, store
from memory.errors import StoreError
from memory.records import Action
from reports import views
from serving import promotion
from serving.errors import ServingError
from serving.router import Router

COOKIE = "flywheel_admin"
PAGE = 50  # sessions per page
MAX_FORM = 4096  # bytes of a posted form read
TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates" / "ui"),
    autoescape=select_autoescape(["jinja"]),
)


class Page:
    """What the page needs: the store, the admin keys, the gate, and the gateway's router when
    it is served by one."""

    def __init__(
        self,
        engine: Engine,
        admin_keys: frozenset[str],
        gate: promotion.Gate,
        router: Router | None = None,
    ) -> None:
        self.engine, self.admin_keys, self.gate, self.router = engine, admin_keys, gate, router

    def who(self, request: Request) -> str:
        """The admin key's fingerprint; 401 without a known key."""
        key = request.cookies.get(COOKIE) or _bearer(request)
        if not key or key not in self.admin_keys:
            raise HTTPException(401, "sign in with an admin key")
        return "admin " + hashlib.sha256(key.encode()).hexdigest()[:8]

    async def promote(self, version: str) -> dict[str, Any]:
        if self.router is not None:
            return await self.router.promote(version, force=False)
        with store.transaction(self.engine) as session:
            return promotion.promote(session, version, self.gate).model_dump(mode="json")

    async def rollback(self) -> dict[str, Any]:
        if self.router is not None:
            return await self.router.rollback()
        with store.transaction(self.engine) as session:
            return promotion.rollback(session).model_dump(mode="json")


def add_ui(app: FastAPI, page: Page) -> None:
    """Mount the page's routes on `app`."""
    ui = APIRouter(prefix="/ui")
    _view_routes(ui, page)
    _steering_routes(ui, page)
    app.include_router(ui)

    @app.exception_handler(HTTPException)
    async def _signed_out(request: Request, exc: HTTPException) -> Response:
        """On the page, a missing key is the sign-in form; elsewhere FastAPI's own answer."""
        if exc.status_code == 401 and request.url.path.startswith("/ui"):
            return _render("login.jinja", said=str(exc.detail), status=401)
        return await http_exception_handler(request, exc)


def _view_routes(ui: APIRouter, page: Page) -> None:
    @ui.get("", response_class=HTMLResponse)
    async def versions(request: Request, said: str = "") -> Response:
        page.who(request)
        view = await _read(page, views.versions)
        return _render("versions.jinja", view=view, curve=curve_svg(view), said=said)

    @ui.get("/rounds", response_class=HTMLResponse)
    async def rounds(request: Request) -> Response:
        page.who(request)
        return _render("rounds.jinja", rounds=await _read(page, views.rounds))

    @ui.get("/exploration", response_class=HTMLResponse)
    async def exploration(request: Request) -> Response:
        page.who(request)
        return _render("exploration.jinja", rounds=await _read(page, views.exploration))

    @ui.get("/sessions", response_class=HTMLResponse)
    async def session_list(request: Request, offset: int = 0, said: str = "") -> Response:
        page.who(request)
        offset = max(0, offset)
        view = await _read(page, lambda s: views.session_list(s, offset, PAGE))
        return _render("sessions.jinja", view=view, said=said)

    @ui.get("/session", response_class=HTMLResponse)
    async def one_session(request: Request, name: str, said: str = "") -> Response:
        page.who(request)
        view = await _read(page, lambda s: views.one_session(s, name))
        if view is None:
            raise HTTPException(404, f"unknown session {name!r}")
        return _render("session.jinja", view=view, said=said)

    @ui.get("/login", response_class=HTMLResponse)
    async def login(token: str = "") -> Response:
        if not token:
            return _render("login.jinja", said="")
        return _signed_in(page, token)

    @ui.post("/login")
    async def login_form(request: Request) -> Response:
        return _signed_in(page, (await _form(request)).get("token", ""))


def _steering_routes(ui: APIRouter, page: Page) -> None:
    @ui.post("/rate")
    async def rate(request: Request) -> Response:
        who = page.who(request)
        form = await _form(request)
        name = form.get("name", "")
        try:
            score = float(form.get("score", ""))
        except ValueError:
            score = math.nan
        if not 0.0 <= score <= 1.0:
            return _back_to(name, "nothing changed: a score is a number from 0 to 1")

        def save(session: Any) -> str:
            turns = store.record_session_feedback(session, name, score, f"rated by {who}")
            return f"rated {score:g} ({turns} turns)"

        return _back_to(name, await _act(page, Action(actor=who, action="rate", target=name), save))

    @ui.post("/hold-out")
    async def hold_out(request: Request) -> Response:
        who = page.who(request)
        name = (await _form(request)).get("name", "")

        def mark(session: Any) -> str:
            return f"held out ({sessions.hold_out(session, name)} turns): it will judge, not train"

        done = await _act(page, Action(actor=who, action="hold out", target=name), mark)
        return _back_to(name, done)

    @ui.post("/forget")
    async def forget(request: Request) -> Response:
        who = page.who(request)
        name = (await _form(request)).get("name", "")

        def delete(session: Any) -> str:
            turns, groups = sessions.forget(session, name)
            return f"forgot {name}: {turns} turns and {groups} train groups deleted"

        done = await _act(page, Action(actor=who, action="forget", target=name), delete)
        return RedirectResponse(f"/ui/sessions?said={quote(done)}", status_code=303)

    @ui.post("/promote")
    async def promote(request: Request) -> Response:
        who = page.who(request)
        version = (await _form(request)).get("version", "")
        done = await _decide(page, who, "promote", version, lambda: page.promote(version))
        return RedirectResponse(f"/ui?said={quote(done)}", status_code=303)

    @ui.post("/rollback")
    async def rollback(request: Request) -> Response:
        who = page.who(request)
        done = await _decide(page, who, "rollback", "the alias", page.rollback)
        return RedirectResponse(f"/ui?said={quote(done)}", status_code=303)


async def _read(page: Page, build: Any) -> Any:
    def run() -> Any:
        with store.transaction(page.engine) as session:
            return build(session)

    return await anyio.to_thread.run_sync(run)


async def _act(page: Page, action: Action, change: Any) -> str:
    """Make the change and record the action, in one transaction; a refusal is the answer, and
    is recorded too."""

    def run() -> str:
        try:
            with store.transaction(page.engine) as session:
                done = str(change(session))
                actions.record_action(session, action.model_copy(update={"detail": done}))
                return done
        except StoreError as exc:  # refused: the change is rolled back, the asking recorded
            refused = f"nothing changed: {exc}"
            with store.transaction(page.engine) as session:
                actions.record_action(session, action.model_copy(update={"detail": refused}))
            return refused

    return await anyio.to_thread.run_sync(run)


async def _decide(page: Page, who: str, action: str, target: str, move: Any) -> str:
    """Promote or roll back through the gate; the gate's answer, recorded with who asked."""
    try:
        event = await move()
        if event["action"] == "refuse":
            done = f"the gate refused {event['to_version']}: {event['reason']}"
        else:
            done = f"{event['to_version']} now serves (was {event['from_version']})"
    except (StoreError, ServingError) as exc:
        done = f"nothing changed: {exc}"
    record = Action(actor=who, action=action, target=target, detail=done)
    await _act(page, record, lambda _session: done)
    return done


async def _form(request: Request) -> dict[str, str]:
    """A posted HTML form's fields (URL-encoded; the page posts nothing else)."""
    body = (await request.body())[:MAX_FORM]
    return {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}


def _signed_in(page: Page, token: str) -> Response:
    if token not in page.admin_keys:
        return _render("login.jinja", said="that is not an admin key", status=401)
    response = RedirectResponse("/ui", status_code=303)
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/ui")
    return response


def _back_to(name: str, said: str) -> Response:
    return RedirectResponse(f"/ui/session?name={quote(name)}&said={quote(said)}", status_code=303)


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    return header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""


def _render(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(TEMPLATES.get_template(template).render(**context), status_code=status)


def curve_svg(view: views.VersionsView, width: int = 640, height: int = 220) -> str:
    """The held-out curve: each version's pass@1 by round, with its 95% interval as a bar;
    an inline SVG (promoted versions filled)."""
    points = sorted(
        ((v.round_index, v) for v in view.versions if v.pass_at_1 is not None),
        key=lambda p: (p[0], p[1].name),
    )
    if not points:
        return ""
    last = max(r for r, _ in points) or 1
    pad = 36

    def x(r: int) -> float:
        return pad + (width - 2 * pad) * r / last

    def y(p: float) -> float:
        return height - pad - (height - 2 * pad) * p

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'role="img" aria-label="held-out pass@1 by round">',
        f'<line x1="{pad}" y1="{y(0)}" x2="{width - pad}" y2="{y(0)}" stroke="#999"/>',
    ]
    for tick in (0.0, 0.5, 1.0):
        parts.append(f'<text x="4" y="{y(tick) + 4}" font-size="11">{tick:.1f}</text>')
    for r, v in points:
        share = v.pass_at_1
        assert share is not None
        parts.append(f'<line x1="{x(r)}" y1="{y(share.low)}" x2="{x(r)}" y2="{y(share.high)}" '
                     'stroke="#4c72b0"/>')  # fmt: skip
        fill = "#4c72b0" if v.promoted else "white"
        title = f"{html.escape(v.name)}: {share.value:.3f}"
        parts.append(
            f'<circle cx="{x(r)}" cy="{y(share.value)}" r="4" fill="{fill}" stroke="#4c72b0">'
            f"<title>{title}</title></circle>"
        )
        parts.append(f'<text x="{x(r) - 4}" y="{height - 12}" font-size="11">{r}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
