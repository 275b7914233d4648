"""The page in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`)
driven by Selenium loads every view, signs in from the link `flywheel ui` prints, rates a
session and rolls back, and the store and the next round's rows show it. Screenshots of each view
are kept (`FLYWHEEL_TEST_ARTIFACTS`, default `.flywheel/test-artifacts/ui`). Skips, saying why,
where no browser is installed; CI installs one and requires it (FLYWHEEL_REQUIRE_BROWSER)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from memory import store
from memory.records import UNRATED, GroupPlan
from memory.sessions import episode_groups
from serving import promotion
from serving.gateway import running
from serving.ui import Page, add_ui
from tests.helpers import ADMIN, chromium, free_port, make_group, seed_page
from trainer.dataset import build_rows
from trainer.settings import TrainSettings

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("FLYWHEEL_TEST_ARTIFACTS", ROOT / ".flywheel/test-artifacts/ui"))


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def said(browser: Any) -> str:
    """The line the page answers an action with, once the redirect after the post has loaded."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.wait import WebDriverWait

    located = expected_conditions.presence_of_element_located((By.ID, "said"))
    return str(WebDriverWait(browser, 30).until(located).text)


def pair_of_sessions(engine) -> None:
    """Two one-turn sessions of one task: one already rated 0, one not yet rated."""
    with store.transaction(engine) as session:
        for name in ("k:pair-rated", "k:pair-open"):
            group = make_group([0.0], task_id=f"capture:{name}")
            turn = group.attempts[0].model_copy(update={"reason": UNRATED})
            plan = GroupPlan(session=name, task="k:pair")
            captured = {"purpose": "capture", "round_index": 0, "plan": plan, "attempts": [turn]}
            store.save_group(session, group.model_copy(update=captured))
        store.record_session_feedback(session, "k:pair-rated", 0.0, "user feedback")


def test_the_page_in_a_browser_rates_a_session_and_rolls_back(browser, db_url: str) -> None:
    from selenium.webdriver.common.by import By

    engine = store.open_store(db_url)
    seed_page(engine)
    pair_of_sessions(engine)
    app = FastAPI()
    add_ui(app, Page(engine, frozenset({ADMIN}), promotion.Gate()))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with store.transaction(engine) as session:
        assert episode_groups(session) == []  # one rated session of the task: no group yet
    with running(app, port=free_port()) as url:
        browser.get(f"{url}/ui")
        assert browser.find_elements(By.ID, "token")  # signed out: the sign-in form
        browser.get(f"{url}/ui/login?token={ADMIN}")
        for view, marker in (("", "versions"), ("/rounds", "rounds"), ("/sessions", "sessions"),
                             ("/exploration", "exploration")):  # fmt: skip
            browser.get(f"{url}/ui{view}")
            assert browser.find_element(By.ID, marker).is_displayed()
            browser.save_screenshot(str(ARTIFACTS / f"{marker}.png"))
        browser.get(f"{url}/ui")
        assert browser.find_element(By.ID, "serving").text == "policy-r1"
        assert browser.find_elements(By.CSS_SELECTOR, "svg circle")  # the held-out curve

        browser.get(f"{url}/ui/session?name=k:pair-open")
        score = browser.find_element(By.ID, "score")
        score.clear()
        score.send_keys("1")
        browser.find_element(By.ID, "rate").click()
        assert "rated 1 (1 turns)" in said(browser)
        browser.save_screenshot(str(ARTIFACTS / "session.png"))

        browser.get(f"{url}/ui")
        browser.find_element(By.ID, "rollback").click()
        assert "base-model now serves" in said(browser)
        assert browser.find_element(By.ID, "serving").text == "base-model"
        browser.save_screenshot(str(ARTIFACTS / "rolled-back.png"))
    with store.transaction(engine) as session:
        assert store.promoted_policy(session).name == "base-model"
        (group,) = episode_groups(session)  # the next round's group: both sessions, now rated
    assert sorted(a.reward for a in group.attempts) == [0.0, 1.0]
    rows = build_rows([group], TrainSettings(mode="grpo"))
    assert len(rows) == 2 and {r.advantages[-1] > 0 for r in rows} == {True, False}
    assert sorted(p.name for p in ARTIFACTS.glob("*.png")) == [
        "exploration.png", "rolled-back.png", "rounds.png", "session.png", "sessions.png",
        "versions.png",
    ]  # fmt: skip
