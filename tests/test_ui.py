"""The flywheel's page: its views read the store, its actions change it through the same paths
as the API and the command line, every action is recorded with who took it, and nothing is shown
or changed without an admin key."""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from memory import actions, store
from memory.groups import captured_turns
from serving import promotion, ui
from serving.ui import Page, add_ui
from tests.helpers import ADMIN, seed_page


@pytest.fixture
def page(db_url: str):
    engine = store.open_store(db_url)
    seed_page(engine)
    app = FastAPI()
    add_ui(app, Page(engine, frozenset({ADMIN}), promotion.Gate()))
    client = TestClient(app)
    signed_in = client.get("/ui/login", params={"token": ADMIN}, follow_redirects=False)
    assert signed_in.status_code == 303
    cookie = signed_in.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    return client, engine


def test_nothing_is_shown_or_changed_without_an_admin_key(db_url: str) -> None:
    engine = store.open_store(db_url)
    seed_page(engine)
    app = FastAPI()
    add_ui(app, Page(engine, frozenset({ADMIN}), promotion.Gate()))
    client = TestClient(app)
    for path in ("/ui", "/ui/rounds", "/ui/sessions", "/ui/exploration"):
        refused = client.get(path)
        assert refused.status_code == 401 and 'name="token"' in refused.text
        assert "policy-r1" not in refused.text and "k:chat-1" not in refused.text
    assert client.get("/ui/login", params={"token": "guess"}).status_code == 401
    assert client.post("/ui/forget", data={"name": "k:chat-1"}).status_code == 401
    with store.transaction(engine) as session:
        assert session.scalars(captured_turns("k:chat-1")).all()
    bearer = client.get("/ui", headers={"Authorization": f"Bearer {ADMIN}"})
    assert bearer.status_code == 200


def test_the_views_show_versions_rounds_sessions_and_exploration(page) -> None:
    client, _ = page
    versions = client.get("/ui").text
    assert "<svg" in versions and "policy-r1 (serving)" in versions
    row = versions[versions.index("<td>policy-r1") :].split("</tr>")[0]
    assert "0.750" in row and "0.301-0.954" in row and ">4<" in row  # Wilson over 4 tasks
    assert "held-out tasks of arithmetic: pass@1 0.750 (95% 0.300 to 0.950, n 4)" in row
    assert "base-model" in row  # its parent
    rounds = client.get("/ui/rounds").text
    assert "distill:demo 1" in rounds and "0.1250" in rounds and "0.00" in rounds  # none stale
    exploration = client.get("/ui/exploration").text
    # of round 1's two tasks: one the policy solved, one only the reviewer's revision did
    assert exploration.count("0.500") == 2
    sessions = client.get("/ui/sessions").text
    assert "2 sessions" in sessions and "trained in round 1" in sessions
    one = client.get("/ui/session", params={"name": "k:chat-1"}).text
    assert "add 2 and 0" in one and "add 2 and 1" in one


def test_sessions_are_paged(page, monkeypatch) -> None:
    client, _ = page
    monkeypatch.setattr(ui, "PAGE", 1)
    first = client.get("/ui/sessions").text
    assert "k:chat-1" not in first and 'id="older"' in first  # the last active first
    second = client.get("/ui/sessions", params={"offset": 1}).text
    assert "k:chat-1" in second and 'id="older"' not in second


def test_a_rating_reaches_the_store_through_the_feedback_path_with_who_gave_it(page) -> None:
    client, engine = page
    said = client.post("/ui/rate", data={"name": "k:chat-1", "score": "1"})
    assert "rated 1 (2 turns)" in said.text
    with store.transaction(engine) as session:
        turns = [(row.attempts[0].reward, row.attempts[0].reason)
                 for row in session.scalars(captured_turns("k:chat-1"))]  # fmt: skip
        (action,) = actions.actions(session)
    assert [reward for reward, _ in turns] == [1.0, 1.0]
    assert re.fullmatch(r"rated by admin [0-9a-f]{8}", turns[0][1])
    assert "rated by admin" in client.get("/ui/session", params={"name": "k:chat-1"}).text
    assert (action.action, action.target, action.detail) == (
        "rate",
        "k:chat-1",
        "rated 1 (2 turns)",
    )
    assert (
        "out of range" not in client.post("/ui/rate", data={"name": "k:chat-1", "score": "2"}).text
    )
    with store.transaction(engine) as session:
        assert len(actions.actions(session)) == 1  # a score out of range changed nothing


def test_hold_out_refuses_a_trained_session_and_forget_deletes_one(page) -> None:
    client, engine = page
    assert "held out (2 turns)" in client.post("/ui/hold-out", data={"name": "k:chat-1"}).text
    refused = client.post("/ui/hold-out", data={"name": "k:chat-2"}).text
    assert "nothing changed" in refused and "trained round 1" in refused
    gone = client.post("/ui/forget", data={"name": "k:chat-1"}).text
    assert "forgot k:chat-1: 2 turns" in gone
    with store.transaction(engine) as session:
        assert not session.scalars(captured_turns("k:chat-1")).all()
        assert [a.action for a in actions.actions(session)] == ["forget", "hold out", "hold out"]


def test_promotion_goes_through_the_gate_and_rollback_moves_the_alias(page) -> None:
    client, engine = page
    refused = client.post("/ui/promote", data={"version": "policy-r2"}).text
    assert "the gate refused policy-r2" in refused and 'id="serving">policy-r1<' in refused
    back = client.post("/ui/rollback").text
    assert "base-model now serves (was policy-r1)" in back
    with store.transaction(engine) as session:
        assert store.promoted_policy(session).name == "base-model"
        recorded = [(a.action, a.detail.split(":")[0]) for a in actions.actions(session)]
    assert recorded == [("rollback", "base-model now serves (was policy-r1)"),
                        ("promote", "the gate refused policy-r2")]  # fmt: skip
