"""Helpers the tests share: a scripted OpenAI-compatible server's answers and a client on it, a
group collected from one, a `flywheel serve` process, and a wait on a condition."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from agents.collector import GroupSpec, Hooks, collect_groups
from agents.policy import Endpoint, PolicyClient
from agents.settings import CollectSettings
from agents.watchdog import WatchdogSettings
from memory import store
from memory.records import (
    Attempt,
    Group,
    GroupPlan,
    PolicyVersion,
    Sample,
    SamplingSettings,
    Scorecard,
    TrainingRound,
)
from serving import promotion
from serving.server import free_port as free_port  # the tests take it from here
from verifiers.reasoning import eval_tasks
from verifiers.sandbox import Isolation, Limits, Sandbox
from verifiers.task import Task

ROOT = Path(__file__).resolve().parent.parent
SERVER_PYTHON = ROOT / ".venv-serving" / "bin" / "python"


def require(env: str, reason: str) -> None:
    if os.environ.get(env):
        pytest.fail(f"{reason} ({env} is set, so this may not be skipped)")
    pytest.skip(reason)


@contextmanager
def pg_database(prefix: str) -> Iterator[str]:
    """A fresh PostgreSQL database named `prefix_...`, dropped at the end; a skip (a failure
    where CI requires PostgreSQL) without one."""
    admin_url = os.environ.get("FLYWHEEL_TEST_PG_URL")
    if not admin_url:
        require("FLYWHEEL_REQUIRE_PG", "no PostgreSQL (set FLYWHEEL_TEST_PG_URL)")
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


@contextmanager
def tiny_vllm(tiny_model_path: Path, log_dir: Path, **options: Any) -> Iterator[Any]:
    """A real vLLM server of the tiny model on a free port (`options`: more `ServerSettings`);
    skipped, or failed where CI requires it, without the server's environment."""
    if not SERVER_PYTHON.is_file():
        require("FLYWHEEL_REQUIRE_VLLM", "no model server environment (run `make setup`)")
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
            require("FLYWHEEL_REQUIRE_BWRAP", "bubblewrap is not installed or does not work here")
        pytest.skip(f"{isolation} isolation does not work here")
    return Sandbox(limits=limits, isolation=isolation)


def completion(text: str, token_ids: list[int] | None, finish: str = "stop") -> dict:
    ids = token_ids or []
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "logprobs": {
            "content": [
                {"token": str(t), "logprob": -0.5, "bytes": [], "top_logprobs": []} for t in ids
            ]
        },
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    if token_ids is not None:
        body["prompt_token_ids"] = [1, 2, 3]
    return body


def client_for(handler, watchdog: WatchdogSettings | None = None) -> PolicyClient:
    transport = httpx.MockTransport(handler)
    http = httpx.AsyncClient(transport=transport)
    return PolicyClient("http://scripted", watchdog=watchdog, http_client=http)


TASK = eval_tasks("arithmetic", 1)[0]


def collect_task(
    handler: Callable[[httpx.Request], httpx.Response],
    settings: CollectSettings,
    reviewer: Endpoint | None = None,
    task: Task = TASK,
) -> Group:
    """The one group of `task`, collected from a scripted server."""

    async def main():
        return await collect_groups(
            Endpoint(client_for(handler), "m"),
            [task],
            GroupSpec(1, "train", settings),
            anyio.CapacityLimiter(2),
            Hooks(lambda g: None),
            reviewer=reviewer,
        )

    (group,) = anyio.run(main)
    return group


def scripted(body: dict, text: str, prompt_ids: list[int]) -> httpx.Response:
    reply = completion(text, [5, 6])
    reply["prompt_token_ids"] = prompt_ids
    return httpx.Response(200, json=reply)


def with_attempts(group: Group, attempts: list[Attempt]) -> Group:
    return group.model_copy(update={"attempts": attempts})


class Served(NamedTuple):
    process: subprocess.Popen[bytes]
    db: str
    prefect_port: int
    gateway_port: int
    log: Path


def start_serve(
    server: str, model: Path, tmp_path: Path, flags: list[str], env: dict[str, str] | None = None
) -> Served:
    """`flywheel serve` in its own process group on the tiny server, with a gateway (admin key
    `admin-key`) and a local Prefect server, its output in `serve.log`."""
    prefect_port, gateway_port = free_port(), free_port()
    db = f"sqlite:///{tmp_path / 'fw.db'}"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    environment |= {"PREFECT_HOME": str(tmp_path / "client"), "FLYWHEEL_ADMIN_KEYS": "admin-key"}
    command = [
        sys.executable, "-m", "cli", "serve", "--server-url", server,
        "--model", str(model), "--db", db, "--workdir", str(tmp_path), *flags,
        "--prefect-port", str(prefect_port), "--gateway-port", str(gateway_port),
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        command, env=environment | (env or {}), stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    return Served(process, db, prefect_port, gateway_port, log)


def stop_serve(process: subprocess.Popen, tmp_path: Path) -> None:
    """Stop a `start_serve` process group, and the Prefect server it started."""
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)
    pid_file = tmp_path / "prefect" / "server.pid"
    if pid_file.exists():
        os.killpg(int(pid_file.read_text()), signal.SIGTERM)


def wait_until(
    condition: Callable[[], bool], timeout_s: float = 10.0, why: Callable[[], str] | None = None
) -> None:
    """Poll `condition` until it holds, at first often, then every half second; past
    `timeout_s`, fail with `why()`."""
    deadline, pause = time.monotonic() + timeout_s, 0.02
    while not condition():
        assert time.monotonic() < deadline, why() if why else "condition not met in time"
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


ADMIN = "admin-key"


def seed_page(engine: Any) -> None:
    """A base model, a promoted round-1 version scored on 4 held-out tasks and a worse round-2
    one, round 1's train groups (one solved by the policy, one only by the reviewer's revision)
    and two captured sessions, one of them trained in round 1."""
    with store.transaction(engine) as session:
        for name, round_index, score in (("base-model", 0, 0.25), ("policy-r1", 1, 0.75),
                                         ("policy-r2", 2, 0.25)):  # fmt: skip
            store.save_policy_version(session, PolicyVersion(
                name=name, base_model="base-model", round_index=round_index))  # fmt: skip
            store.record_evaluation(session, name, score)
        card = Scorecard(evaluation="held-out tasks of arithmetic", figure="pass@1", value=0.75,
                         n=4, low=0.3, high=0.95)  # fmt: skip
        store.record_scorecard(session, "policy-r1", card)
        store.set_promoted(session, "base-model", True)
        promotion.promote(session, "policy-r1", promotion.Gate())
        for index, solved in enumerate([True, True, True, False]):
            held = make_group([float(solved)], task_id=f"held-{index}")
            store.save_group(session, held.model_copy(
                update={"purpose": "eval", "policy_version": "policy-r1"}))  # fmt: skip
        sampled = {"policy_version": "base-model"}
        bare = make_group([1.0, 0.0], task_id="t-own").model_copy(update=sampled)
        failed = make_group([0.0, 0.0], task_id="t-revised").model_copy(update=sampled)
        reviewed = {"kind": "revision", "policy_version": "reviewer", "correct": True,
                    "reward": 1.0}  # fmt: skip
        revision = failed.attempts[0].model_copy(update=reviewed)
        store.save_groups(session, [bare, failed.model_copy(
            update={"attempts": [*failed.attempts, revision]})])  # fmt: skip
        store.save_training_round(session, TrainingRound(
            round_index=1, method="rltldr", policy_in="base-model", policy_out="policy-r1",
            status="done", metrics={"contexts": {"bare": 3, "distill:demo": 1}, "kl_last": 0.125,
                                    "seconds": 12.0}))  # fmt: skip
        for name, turns, trained in (("k:chat-1", 2, None), ("k:chat-2", 1, 1)):
            for turn in range(turns):
                group = make_group([0.0], task_id=f"capture:{name}:{turn}")
                messages = [{"role": "user", "content": f"add 2 and {i}"} for i in range(turn + 1)]
                plan = GroupPlan(session=name, task="k:sums", trained_in=trained)
                asked = group.attempts[0].model_copy(update={"messages": messages})
                turn_of = {
                    "purpose": "capture",
                    "round_index": 0,
                    "plan": plan,
                    "attempts": [asked],
                }
                group = group.model_copy(update=turn_of)
                store.save_group(session, group)


def run_once(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """One `flywheel run` round into a fresh database; returns its URL and the summary."""
    db = f"sqlite:///{tmp_path / 'fw.db'}"
    summary_path = tmp_path / "summary.json"
    if "--server-url" in args:  # the session's server serves LoRA versions
        args = (*args, "--weights", "lora")
    from cli.main import main

    code = main(
        [
            "run",
            "--rounds",
            "1",
            "--db",
            db,
            "--workdir",
            str(tmp_path),
            "--summary-json",
            str(summary_path),
            *args,
        ]
    )
    assert code == 0
    return db, json.loads(summary_path.read_text())


@contextmanager
def chromium() -> Iterator[Any]:
    """Headless Chromium under Selenium (Debian's `chromium` and `chromium-driver`); a skip
    without them, a failure where CI requires a browser (FLYWHEEL_REQUIRE_BROWSER)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (binary and driver_path):
        missing = "no Chromium and chromedriver (apt-get install chromium chromium-driver)"
        require("FLYWHEEL_REQUIRE_BROWSER", missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1280,1400"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def browser_here() -> bool:
    """Whether a browser test can run here, or must (CI)."""
    return bool(shutil.which("chromedriver") or os.environ.get("FLYWHEEL_REQUIRE_BROWSER"))


def random_adapter(
    model_path: Path,
    root: Path,
    name: str = "random",
    std: float = 0.02,
    modules: str | list[str] | None = None,
) -> Path:
    """A LoRA on the model with random weights (`std` sets how far it moves the model; rank 8 on
    q/v by default, or rank 16 on `modules`), published as a complete checkpoint `root/name`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memory import folders

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_path)
    config = (
        LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
        if modules is None
        else LoraConfig(r=16, lora_alpha=32, target_modules=modules)
    )
    peft = get_peft_model(base, config)
    for parameter_name, parameter in peft.named_parameters():
        if "lora_B" in parameter_name:
            torch.nn.init.normal_(parameter, std=std)
    staging = folders.staging_dir(root, name)
    peft.save_pretrained(staging)
    return folders.publish(staging, root, name)
