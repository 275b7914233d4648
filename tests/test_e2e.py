"""End to end against a real vLLM server.

The tiny random model (marker `vllm`) checks the mechanics in about two minutes: collection with
sampled token ids and logprobs, storage, training on those ids, hot-loading the adapter under a
versioned name. The real SmolLM2 model (marker `slow`) runs one whole round through the CLI,
starting its own server.
"""

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agents import strategy
from agents.collector import GroupSpec, Hooks, collect_groups
from agents.policy import Endpoint, PolicyClient
from agents.settings import CollectSettings
from cli.main import main
from memory import folders, store
from serving.adapters import ensure_loaded, load_adapter, loaded_models
from tests.helpers import ADMIN, browser_here, chromium, free_port, make_group, run_once
from trainer.round import train_round
from trainer.settings import TrainSettings
from verifiers.reasoning import eval_tasks, train_tasks

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).parent.parent / "examples"


def collect(url: str, model: str, n_tasks: int, group_size: int) -> list:
    async def run():
        client = PolicyClient(url)
        try:
            return await collect_groups(
                Endpoint(client, model),
                eval_tasks("arithmetic", n_tasks),
                GroupSpec(1, "train", CollectSettings(group_size=group_size, max_tokens=16)),
                anyio.CapacityLimiter(16),
                Hooks(lambda g: None),
            )
        finally:
            await client.aclose()

    return anyio.run(run)


def test_sampled_tokens_train_an_adapter_that_vllm_serves(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    groups = collect(tiny_server, tiny_model_path.name, n_tasks=2, group_size=2)
    for group in groups:
        assert group.complete
        for attempt in group.attempts:
            sample = attempt.sample
            assert sample is not None and sample.prompt_token_ids
            assert len(sample.completion_token_ids) == len(sample.logprobs) > 0
            assert all(lp <= 0.0 for lp in sample.logprobs)
    # A random model never answers correctly: give the groups a reward spread by hand.
    graded = [
        g.model_copy(
            update={
                "attempts": [
                    a.model_copy(update={"reward": float(a.sample_index == 0)}) for a in g.attempts
                ]
            }
        )
        for g in groups
    ]
    result = train_round(
        graded,
        base_model=tiny_model_path,
        parent_adapter=None,
        adapters_root=tmp_path,
        name="policy-r1-test",
        settings=TrainSettings(epochs=1, batch_size=4, mode="grpo"),
    )
    assert result.train_tokens == sum(
        len(a.sample.completion_token_ids) for g in groups for a in g.attempts
    )
    load_adapter(tiny_server, "policy-r1-test", Path(result.adapter_path))
    assert "policy-r1-test" in loaded_models(tiny_server)
    adapter = Path(result.adapter_path)
    assert not ensure_loaded(tiny_server, "policy-r1-test", adapter), "already served"
    assert ensure_loaded(tiny_server, "policy-r1-restarted", adapter)
    assert "policy-r1-restarted" in loaded_models(tiny_server)
    served = collect(tiny_server, "policy-r1-test", n_tasks=1, group_size=1)
    assert served[0].attempts[0].policy_version == "policy-r1-test"
    assert served[0].attempts[0].sample is not None


def test_reloading_a_name_or_an_incomplete_checkpoint_is_refused(
    tiny_server: str, tmp_path: Path
) -> None:
    from serving.errors import ServingError

    with pytest.raises(ServingError, match="not a complete checkpoint"):
        load_adapter(tiny_server, "policy-x", tmp_path)
    with pytest.raises(ServingError, match="already loaded"):
        load_adapter(tiny_server, tiny_server_model(tiny_server), _fake_complete(tmp_path))


def test_one_round_through_the_cli(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    db, summary = run_once(
        tmp_path,
        *["--tasks", "3", "--group-size", "2", "--eval-tasks", "4", "--model"],
        str(tiny_model_path),
        *("--server-url", tiny_server),
    )
    assert summary["db_url"] == db
    assert summary["baseline_pass_at_1"] == 0.0
    (round_,) = summary["rounds"]
    assert round_["rollouts"] == 6
    assert set(summary["wall_seconds"]) >= {"collect", "train", "evaluate", "total"}
    engine = store.open_store(db)
    with store.transaction(engine) as session:
        train_groups = store.load_groups(session, "train", round_index=1)
        eval_groups = store.load_groups(session, "eval")
    assert len(train_groups) == 3 and len(eval_groups) == 4
    assert all(
        a.policy_version == tiny_model_path.name and a.sample is not None
        for g in train_groups
        for a in g.attempts
    )
    if round_["policy_version"] is None:
        assert "no trainable rows" in round_["note"]
    else:
        assert round_["policy_version"] in loaded_models(tiny_server)


def test_overlapped_rounds_collect_the_next_round_while_one_trains(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    db, summary = run_once(
        tmp_path,
        *["--rounds", "2", "--overlap", "1", "--tasks", "3", "--group-size", "2"],
        *["--eval-tasks", "4", "--model", str(tiny_model_path), "--server-url", tiny_server],
    )
    first, second = summary["rounds"]
    assert second["started_s"] < first["ended_s"]  # collected while round 1 trained
    assert "hidden" in summary["wall_seconds"] and second["rollouts"] == 6
    with store.transaction(store.open_store(db)) as session:
        groups = store.load_groups(session, "train", round_index=2)
        record = store.training_round(session, 2)
    assert len(groups) == 3 and {g.policy_version for g in groups} == {tiny_model_path.name}
    assert record is not None and record.policy_in == (
        first["policy_version"] if first["promoted"] else tiny_model_path.name
    )
    if record.status == "done":
        stale = 3 if first["promoted"] else 0  # sampled by the version before the promotion
        assert record.metrics.stale_groups == stale and record.metrics.dropped_groups == 0
        assert (second["groups"], second["stale_groups"], second["dropped_groups"]) == (
            len(record.group_ids),
            stale,
            0,
        )  # the summary says it too


def tiny_server_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def _fake_complete(tmp_path: Path) -> Path:
    folder = tmp_path / "complete"
    folder.mkdir()
    (folder / folders.MARKER).write_text("ok\n")
    return folder


@pytest.mark.slow
def test_real_model_round_end_to_end(
    smollm2_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    from tests.helpers import SERVER_PYTHON

    db, summary = run_once(
        tmp_path,
        *["--tasks", "16", "--group-size", "4", "--eval-tasks", "16", "--model"],
        str(smollm2_path),
        *("--server-python", str(SERVER_PYTHON), "--port", str(free_port())),
    )
    assert 0.0 < summary["baseline_pass_at_1"] < 1.0, "real generations, some right, some wrong"
    (round_,) = summary["rounds"]
    # 16 groups of 4 at a success rate near 0.15: some group has reward variance (p > 0.999)
    assert round_["rollouts"] == 64 and round_["successes"] > 0
    assert round_["policy_version"].startswith("policy-r1-")
    assert folders.is_complete(Path(round_["adapter_path"]))
    assert round_["train_tokens"] > 0 and round_["eval_pass_at_1"] is not None
    engine = store.open_store(db)
    with store.transaction(engine) as session:
        version = store.policy_version(session, round_["policy_version"])
        evals = store.load_groups(session, "eval", policy_version=version.name)
    assert version.eval_pass_at_1 == round_["eval_pass_at_1"]
    assert len(evals) == 16 and all(g.attempts[0].sample for g in evals)
    if browser_here():  # the page on the store this real round wrote (CI requires a browser)
        page_shows_the_round(engine, version.name, round_["promoted"])


def page_shows_the_round(engine: Any, name: str, promoted: bool) -> None:
    """The page, in a browser, on a store a real round wrote: the round's version among the
    versions (serving if promoted), its row among the rounds, and its groups explored."""
    from fastapi import FastAPI
    from selenium.webdriver.common.by import By

    from serving import promotion
    from serving.gateway import running
    from serving.ui import Page, add_ui

    app = FastAPI()
    add_ui(app, Page(engine, frozenset({ADMIN}), promotion.Gate()))
    with chromium() as browser, running(app, port=free_port()) as url:
        browser.get(f"{url}/ui/login?token={ADMIN}")
        assert name in browser.find_element(By.ID, "versions").text
        assert (browser.find_element(By.ID, "serving").text == name) == promoted
        browser.get(f"{url}/ui/rounds")
        assert name in browser.find_element(By.ID, "rounds").text
        browser.get(f"{url}/ui/exploration")
        assert "1" in browser.find_element(By.ID, "exploration").text  # round 1's tasks


def test_guided_half_groups_and_reflect_retry_through_the_cli(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    db, summary = run_once(
        tmp_path,
        *["--tasks", "2", "--group-size", "2", "--eval-tasks", "2", "--model"],
        str(tiny_model_path),
        *("--server-url", tiny_server, "--guided-fraction", "0.5", "--reflect-retry", "1"),
        *("--mode", "r3l"),
    )
    engine = store.open_store(db)
    with store.transaction(engine) as session:
        groups = store.load_groups(session, "train", round_index=1)
        (record,) = store.training_rounds(session)
    assert record.method == "r3l"
    for group in groups:
        guided, bare = group.first_attempts
        assert guided.context == "demo" and bare.context == "bare"
        assert bare.sample is not None and guided.sample is not None
        assert guided.bare_prompt_token_ids == bare.sample.prompt_token_ids
        assert len(guided.sample.prompt_token_ids) > len(bare.sample.prompt_token_ids)
        # A random model never earns full reward: its bare attempt is reflected on.
        reflection = next(a for a in group.attempts if a.kind == "reflection")
        assert reflection.parent_index == bare.sample_index and reflection.reason
        assert all(a.context == "bare" for g in [group] for a in g.bare_attempts)
    # The server's /tokenize agrees with the prompt ids it sampled under.
    bare = groups[0].first_attempts[1]

    async def tokenize() -> list[int]:
        client = PolicyClient(tiny_server)
        try:
            return await client.tokenize(tiny_model_path.name, bare.messages)
        finally:
            await client.aclose()

    assert bare.sample is not None
    assert anyio.run(tokenize) == bare.sample.prompt_token_ids


def test_sge_insights_and_outcome_shaping_through_the_cli(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    db, _ = run_once(
        tmp_path,
        *["--tasks", "2", "--group-size", "2", "--eval-tasks", "2", "--model"],
        str(tiny_model_path),
        *("--server-url", tiny_server, "--guided-fraction", "0", "--sge", "1"),
        *("--insights", "1", "--outcome-bonus", "0.1", "--repeat-penalty", "0.1"),
    )
    engine = store.open_store(db)
    with store.transaction(engine) as session:
        groups = store.load_groups(session, "train", round_index=1)
        counts = [store.outcome_counts(session, g.task_id) for g in groups]
    assert len(groups) == 2
    for group, count in zip(groups, counts, strict=True):
        assert sum(count.values()) == 2, "each first attempt's answer counted once"
        for attempt in group.first_attempts:
            sample = attempt.sample
            assert sample is not None and sample.text.startswith(strategy.PREFIX)
            said = sample.text.removeprefix(strategy.PREFIX)
            if attempt.strategy is None:  # a random model may end the line at once: no strategy
                assert not said.split("\n")[0].strip() or "states the answer" in attempt.reason
            else:
                assert said.lstrip().startswith(attempt.strategy)
            # Prompt, "Strategy:", the strategy, "Answer:", the answer: the server's own ids.
            assert attempt.pivot_tokens >= 1 and attempt.generated_tokens > 0
            assert len(sample.completion_token_ids) == len(sample.logprobs)
            assert attempt.shaped_reward is not None and set(attempt.shaping) == {
                "bonus",
                "repeat_penalty",
            }
        # A random model fails: every attempt is judged, valid judgement or not.
        judged = [a for a in group.attempts if a.kind == "insight"]
        assert len(judged) == 2 and all(a.reason for a in judged)


def test_a_run_killed_while_training_resumes_the_round(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Kill -9 `flywheel run` once the trainer has saved, start it again: the round finishes
    on the same groups, under the same name, from the save, and nothing is stored twice."""
    import os
    import signal
    import subprocess
    import sys
    import time

    config = tmp_path / "run.toml"
    config.write_text("[train]\nmode = 'grpo'\nepochs = 25\nbatch_size = 2\nsave_steps = 5\n")
    db = f"sqlite:///{tmp_path / 'fw.db'}"
    # A random model earns no reward: store round 1's groups with a reward spread beforehand,
    # as if collected; the run finds them stored and goes on to train.
    engine = store.open_store(db)
    tasks = train_tasks("arithmetic", 4, seed=1, held_out=eval_tasks("arithmetic", 2))
    with store.transaction(engine) as session:
        for task in tasks:
            group = make_group([1.0, 0.0, 0.0, 1.0], task_id=task.task_id, completion_len=8)
            update = {"policy_version": tiny_model_path.name, "question": task.question}
            store.save_group(session, group.model_copy(update=update))
    command = [
        sys.executable, "-m", "cli", "run", "--config", str(config), "--db", db,
        "--weights", "lora",
        "--workdir", str(tmp_path), "--model", str(tiny_model_path), "--server-url", tiny_server,
        "--rounds", "1", "--tasks", "4", "--group-size", "4", "--eval-tasks", "2",
    ]  # fmt: skip
    log = tmp_path / "first.log"
    with log.open("w") as stderr:
        first = subprocess.Popen(command, start_new_session=True, stderr=stderr)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("adapters/.rounds/*/checkpoint-*/trainer_state.json")):
        if first.poll() is not None:
            pytest.fail("the run ended before the trainer saved:\n" + log.read_text()[-3000:])
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    with store.transaction(engine) as session:
        killed = store.training_round(session, 1)
        attempts_before = store.attempt_counts(session)
    assert killed is not None and killed.status == "running" and killed.group_ids

    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    with store.transaction(engine) as session:
        finished = store.training_round(session, 1)
        attempts_after = store.attempt_counts(session)
        groups = store.load_groups(session, "train", round_index=1)
    assert finished is not None and finished.status == "done"
    assert finished.policy_out == killed.policy_out and finished.group_ids == killed.group_ids
    assert finished.metrics.resumed_from_step >= 5
    assert attempts_after["train"] == attempts_before["train"] == 16
    assert all(len(g.first_attempts) == 4 for g in groups)
    assert folders.is_complete(tmp_path / "adapters" / str(finished.policy_out))


def test_library_lessons_guide_half_of_each_group_and_are_credited(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    from memory import library
    from memory.library import LibrarySettings
    from memory.records import LessonDraft

    engine = store.open_store(f"sqlite:///{tmp_path / 'fw.db'}")
    lesson = LessonDraft(
        kind="insight", scope="task_type", scope_key="arithmetic",
        text="Work out the sign first, then the size.",
    )  # fmt: skip
    with store.transaction(engine) as session:
        (lesson_id,) = library.admit(session, [lesson], LibrarySettings()).added
    run_once(
        tmp_path,
        *["--tasks", "2", "--group-size", "2", "--eval-tasks", "2", "--model"],
        str(tiny_model_path),
        *("--server-url", tiny_server, "--guided-fraction", "0.5", "--library", "1"),
    )
    with store.transaction(engine) as session:
        groups = store.load_groups(session, "train", round_index=1)
        uses = library.uses(session, lesson_id)
        actions = [e.action for e in library.events(session, lesson_id)]
        (entry,) = library.lessons(session)
    for group in groups:
        guided, bare = group.first_attempts
        assert guided.context == "experience" and bare.context == "bare"
        assert (
            "Lessons from earlier attempts:\n- Work out the sign first"
            in guided.messages[0]["content"]
        )
    assert sorted(group_id for group_id, _ in uses) == sorted(g.id for g in groups)
    assert all(gain is not None for _, gain in uses)
    assert actions == ["add", "credit", "credit"] and entry.exposures == 2


@pytest.mark.parametrize("lessons", [False, True], ids=["reply", "reply-and-step-lessons"])
def test_episode_replies_are_token_exact_on_the_real_chat_template(
    tiny_server: str, tiny_model_path: Path, lessons: bool
) -> None:
    """A sampled turn plus the reply's ids is exactly what the server's template makes of the
    transcript: the next turn continues the very tokens the model saw, the step's library
    lessons after the reply included."""
    from agents.episode import _reply_ids
    from agents.lessons import step_message

    model = tiny_model_path.name
    replies = [{"role": "user", "content": "higher"}]
    if lessons:
        replies.append(step_message(["When the reply says higher, guess above your last guess."]))

    async def check() -> tuple[list[int], list[int]]:
        client = PolicyClient(tiny_server)
        try:
            opening = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Go."}]
            prompt = await client.tokenize(model, opening)
            # A clean turn whose text tokenises to its own ids (a random model's need not).
            said = await client.tokenize_text(model, "<guess>50</guess>")
            transcript = [*opening, {"role": "assistant", "content": "<guess>50</guess>"}]
            reply = await _reply_ids(Endpoint(client, model), transcript, replies)
            full = await client.tokenize(model, [*transcript, *replies])
            return prompt + said + reply, full
        finally:
            await client.aclose()

    stitched, full = anyio.run(check)
    assert stitched == full


def test_a_round_of_episodes_through_the_cli(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    db, summary = run_once(
        tmp_path,
        *["--tasks", "2", "--group-size", "2", "--eval-tasks", "2", "--model"],
        str(tiny_model_path),
        *("--server-url", tiny_server, "--taskset", "guess", "--guided-fraction", "0"),
        *("--reflect-retry", "1"),
    )
    engine = store.open_store(db)
    with store.transaction(engine) as session:
        groups = store.load_groups(session, "train", round_index=1)
    assert {g.taskset for g in groups} == {"guess"} and len(groups) == 2
    for group in groups:
        for attempt in group.first_attempts:
            assert attempt.error is None and attempt.sample is not None
            assert "<guess>" in attempt.messages[0]["content"]
            assert attempt.reason.split()[0] in {"invalid", "repeated", "step-limit", "solved"}
        failed = [a for a in group.first_attempts if a.reward < 1]
        reflections = [a for a in group.attempts if a.kind == "reflection"]
        assert len(reflections) == len(failed)  # every failed episode was reflected on
        for retry in (a for a in group.attempts if a.kind == "retry"):
            assert retry.sample is not None and retry.bare_prompt_token_ids is not None
    assert summary["baseline_pass_at_1"] is not None


def test_a_round_on_a_plugin_task_set_through_the_cli(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    name = "examples.tasksets.larger:larger"
    db, summary = run_once(
        tmp_path,
        *["--tasks", "2", "--group-size", "2", "--eval-tasks", "2", "--model"],
        str(tiny_model_path),
        *("--server-url", tiny_server, "--taskset", name),
    )
    assert summary["taskset"] == name and summary["baseline_pass_at_1"] is not None
    with store.transaction(store.open_store(db)) as session:
        groups = store.load_groups(session, "train", round_index=1)
    assert {g.taskset for g in groups} == {name} and len(groups) == 2
    assert all(g.task_id.startswith(f"{name}:") for g in groups)
    assert all(a.reason.startswith(("correct", "wrong")) for g in groups for a in g.attempts)


def test_a_task_whose_verifier_raises_or_hangs_is_left_out_and_the_run_goes_on(
    tiny_server: str, tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    config = tmp_path / "guard.toml"
    config.write_text("[collect.guard]\ndeadline_s = 2\n")
    db, summary = run_once(
        tmp_path,
        *["--tasks", "8", "--group-size", "2", "--eval-tasks", "4", "--model"],
        str(tiny_model_path),
        *("--server-url", tiny_server, "--taskset", "tests.faulty:sums", "--config", str(config)),
    )
    failed = {f["task_id"]: f for f in summary["failed_tasks"]}
    assert len(failed) == 2 and all(f["failures"] == 3 for f in failed.values())
    reasons = " | ".join(f["error"] for f in failed.values())
    assert "verify: no answer within 2 s" in reasons and "verify raised ValueError" in reasons
    with store.transaction(store.open_store(db)) as session:
        groups = store.load_groups(session, "train", round_index=1)
    assert len(groups) == 6 and not {g.task_id for g in groups} & set(failed)


def test_a_server_with_the_wrong_model_ends_the_run_with_one_line(
    tiny_server: str, smollm2_path: Path, tmp_path: Path, capsys
) -> None:
    db = f"sqlite:///{tmp_path / 'wrong.db'}"
    args = ["run", "--db", db, "--workdir", str(tmp_path), "--model", str(smollm2_path),
            "--server-url", tiny_server, "--prefect", "temporary"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"{tiny_server} does not generate with {smollm2_path.name}: 404" in err
    with store.transaction(store.open_store(db)) as session:
        assert store.attempt_counts(session) == {}


@pytest.mark.slow
def test_a_reviewer_model_is_served_beside_the_policy(
    tiny_model_path: Path, tmp_path: Path, prefect_server: None
) -> None:
    """`flywheel run --reviewer` with `make run`'s settings: a second server, on cores of its
    own and with small KV blocks, writes the revisions (and, with R3L, the reflections); both
    servers are stopped when the run ends."""
    import os
    import shutil

    from serving.server import ensure_port_free
    from tests.helpers import SERVER_PYTHON

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a reviewer beside the policy needs two cores, one for each server")

    reviewer = tmp_path / "tiny-reviewer"
    shutil.copytree(tiny_model_path, reviewer)
    port = free_port()
    db, summary = run_once(
        tmp_path,
        *["--tasks", "2", "--group-size", "2", "--eval-tasks", "2", "--model"],
        str(tiny_model_path),
        *("--reviewer", str(reviewer), "--config", str(EXAMPLES / "reviewer.toml")),
        *("--reflect-retry", "1", "--mode", "r3l"),
        *("--server-python", str(SERVER_PYTHON), "--port", str(port)),
    )
    with store.transaction(store.open_store(db)) as session:
        groups = store.load_groups(session, "train", round_index=1)
    for kind in ("reflection", "revision"):
        written = [a for g in groups for a in g.attempts if a.kind == kind]
        assert written and {a.policy_version for a in written} == {"tiny-reviewer"}, kind
    assert summary["wall_seconds"]["server_start"] > 0
    assert "'block_size': 32" in (tmp_path / "logs" / "reviewer.log").read_text()
    for each in (port, port + 1):
        ensure_port_free("127.0.0.1", each)
