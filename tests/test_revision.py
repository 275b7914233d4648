"""HeRL's hindsight revision: which groups are revised, what the reviewer sees, the revision's
policy token ids, its slot and weight in training, and its place in the store."""

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import anyio
import httpx
import pytest
import torch

from agents.collector import GroupSpec, Hooks, collect_groups
from agents.context import bare_messages
from agents.policy import Endpoint, PolicyClient
from agents.revision import as_policy_sample
from agents.settings import CollectSettings, ReviseSettings
from flows.settings import load_run_settings
from memory import store
from memory.models import VerdictRow
from memory.records import SamplingSettings
from tests.helpers import TASK, client_for, collect_task, scripted
from trainer.dataset import IGNORE, build_rows, member_advantages, winning_revision
from trainer.round import PolicyGradientTrainer
from trainer.settings import TrainSettings
from verifiers.catalog import worked_example

GRPO = TrainSettings(mode="grpo", max_length=64)
WRONG = "<answer>999</answer>"


def revise_with(
    reviewer_answer: str | list[str],
    policy_answer: str | list[str] = WRONG,
    revisions: int = 1,
    partial: bool = False,
    blind: bool = False,
):
    """A group of two collected with revision on: the policy's answers and the reviewer's fixes
    (one, or one per request in the order asked), and the requests each server saw."""
    seen: dict[str, list[dict]] = {"reviewer": [], "tokenize": [], "policy": []}
    answers = [reviewer_answer] if isinstance(reviewer_answer, str) else reviewer_answer
    sampled = [policy_answer] if isinstance(policy_answer, str) else policy_answer

    def reviewer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen["reviewer"].append(body)
        return scripted(body, answers[min(len(seen["reviewer"]), len(answers)) - 1], [3])

    def policy(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            seen["tokenize"].append(body)
            opened = body.get("continue_final_message", False)
            words = len(body["messages"][-1]["content"].split())  # a token more a word
            tokens = [2, 2, 30, 31] + [32] * (words - 1) + ([] if opened else [9, 8])
            return httpx.Response(200, json={"tokens": tokens})
        seen["policy"].append(body)
        return scripted(body, sampled[min(len(seen["policy"]), len(sampled)) - 1], [2, 2])

    herl = ReviseSettings(enabled=True, revisions=revisions, partial=partial, blind=blind)
    settings = CollectSettings(group_size=2, revise=herl)
    group = collect_task(policy, settings, Endpoint(client_for(reviewer), "judge-model"))
    return group, seen


def test_a_group_that_all_failed_is_revised_by_the_reviewer_in_the_policys_ids() -> None:
    group, seen = revise_with(f"<answer>{TASK.answer}</answer>")
    (revision,) = [a for a in group.attempts if a.kind == "revision"]
    assert group.complete and revision.correct and revision.improved
    assert revision.parent_index == revision.sample_index == 0  # the best; the lowest of equals
    assert revision.policy_version == "judge-model" and revision.context == "revision"
    # The reviewer saw the attempt and the verdict, never the reference, at HeRL's temperature.
    (asked,) = seen["reviewer"]
    shown = asked["messages"][-1]["content"]
    assert "999" in shown and "reward 0" in shown and TASK.answer not in shown.replace("999", "")
    assert shown.startswith("Instructions: ") and "answer tags" in shown  # the form to answer in
    assert asked["temperature"] == CollectSettings().revise.temperature == 0.3
    # Before it, the task set's worked example as a turn of its own: how briefly to answer.
    question, solution = worked_example(TASK.taskset)
    example = [m["content"] for m in asked["messages"][1:3]]
    assert question in example[0] and "Attempt: \n" in example[0] and example[1] == solution
    assert [m["role"] for m in asked["messages"]] == ["system", "user", "assistant", "user"]
    # The policy's server tokenised the fix as its own answer, open and closed: the ids are
    # the open turn's, then the one end-of-turn token the closed turn adds.
    opened, closed = sorted(seen["tokenize"], key=lambda b: "continue_final_message" in b)[::-1]
    fix = {"role": "assistant", "content": f"<answer>{TASK.answer}</answer>"}
    assert opened["messages"][-1] == closed["messages"][-1] == fix
    assert opened["continue_final_message"] and not closed["add_generation_prompt"]
    assert revision.sample is not None
    assert revision.sample.prompt_token_ids == [2, 2]
    assert revision.sample.completion_token_ids == [30, 31, 9]
    assert revision.sample.logprobs == [0.0, 0.0, 0.0]


def test_a_blind_reviewer_answers_the_bare_prompt_afresh_after_the_worked_example() -> None:
    group, seen = revise_with(f"<answer>{TASK.answer}</answer>", blind=True)
    (revision,) = [a for a in group.attempts if a.kind == "revision"]
    assert revision.correct and revision.improved and revision.parent_index == 0
    (asked,) = seen["reviewer"]
    shown = json.dumps(asked["messages"])
    assert "999" not in shown and "reward" not in shown  # neither the failure nor its verdict
    bare = bare_messages(TASK, CollectSettings().system(TASK))
    question, solution = worked_example(TASK.taskset)
    example = [{"role": "user", "content": question}, {"role": "assistant", "content": solution}]
    assert asked["messages"] == [bare[0], *example, bare[1]]
    (trained,) = [r for r in build_rows([group], GRPO) if r.context == "revision"]
    assert trained.input_ids == [2, 2, 30, 31, 9]  # the fix, under the bare prompt


def test_a_group_with_a_success_is_not_revised() -> None:
    group, seen = revise_with("unused", policy_answer=[f"<answer>{TASK.answer}</answer>", WRONG])
    assert seen["reviewer"] == [] and all(a.kind == "base" for a in group.attempts)


def test_a_partly_failed_group_is_revised_when_asked_and_the_fix_joins_its_successes() -> None:
    right = f"<answer>{TASK.answer}</answer>"
    group, seen = revise_with(right, policy_answer=[right, WRONG], partial=True)
    (failed,) = [a for a in group.attempts if a.kind == "base" and not a.correct]
    (revision,) = [a for a in group.attempts if a.kind == "revision"]
    assert "999" in seen["reviewer"][0]["messages"][-1]["content"]  # the failure was shown
    assert revision.parent_index == failed.sample_index and revision.correct
    assert winning_revision(group) is revision  # it beats its parent, and nothing beats it
    rows = build_rows([group], GRPO)
    assert sorted(r.context for r in rows) == ["bare", "revision"]  # the failure, pushed down
    assert [r.reward for r in rows if r.context == "bare"] == [0.0]


def test_a_revision_no_better_than_its_parent_is_not_trained() -> None:
    right = f"<answer>{TASK.answer}</answer>"
    group, _ = revise_with("<answer>998</answer>", policy_answer=[right, WRONG], partial=True)
    assert len([a for a in group.attempts if a.kind == "revision"]) == 1
    assert winning_revision(group) is None


def test_a_verified_revision_takes_the_worst_other_slot_and_trains_off_policy() -> None:
    group, _ = revise_with(f"<answer>{TASK.answer}</answer>")
    # The parent (slot 0) earns the bonus towards the revision; slot 1 gives up its place.
    scores = member_advantages(group, GRPO)
    assert set(scores) == {(0, "base"), (0, "revision")}
    assert scores[(0, "revision")] > 0 > scores[(0, "base")]
    rows = build_rows([group], GRPO)
    (revised,) = [r for r in rows if r.context == "revision"]
    assert revised.off_policy and not revised.importance
    assert revised.input_ids == [2, 2, 30, 31, 9]
    assert revised.labels == [IGNORE, IGNORE, 30, 31, 9]
    assert revised.behaviour_logprobs[2:] == [0.0, 0.0, 0.0]
    assert [r.context for r in rows] == ["bare", "revision"]


def test_of_several_drawn_revisions_the_shortest_verified_one_is_trained() -> None:
    right = f"<answer>{TASK.answer}</answer>"
    group, seen = revise_with(["<answer>998</answer>", f"It is {right}", right], revisions=3)
    assert len(seen["reviewer"]) == 3  # three draws of the same revision
    assert len({json.dumps(body["messages"]) for body in seen["reviewer"]}) == 1
    drawn = [a for a in group.attempts if a.kind == "revision"]
    assert [a.sample_index for a in drawn] == [0, 1, 2]  # each draw its own slot
    assert {a.parent_index for a in drawn} == {0}
    assert sorted(a.correct for a in drawn) == [False, True, True]
    winner = winning_revision(group)
    assert winner is not None and winner.sample is not None and winner.sample.text == right
    (trained,) = [r for r in build_rows([group], GRPO) if r.context == "revision"]
    assert trained.input_ids == [2, 2, 30, 31, 9]


def test_a_revision_can_be_trained_as_a_distill_copy() -> None:
    group, _ = revise_with(f"<answer>{TASK.answer}</answer>")
    settings = GRPO.model_copy(update={"revision_weight": "distill"})
    (revised,) = [r for r in build_rows([group], settings) if r.context == "revision"]
    (shaped,) = [r for r in build_rows([group], GRPO) if r.context == "revision"]
    assert not revised.off_policy and not revised.importance  # its advantage alone
    assert revised.advantages == shaped.advantages and revised.input_ids == shaped.input_ids


def test_a_revision_the_verifier_fails_is_kept_but_not_trained() -> None:
    group, _ = revise_with("<answer>998</answer>")
    (revision,) = [a for a in group.attempts if a.kind == "revision"]
    assert not revision.correct and not revision.improved
    assert build_rows([group], GRPO) == []  # all rewards equal: nothing to learn


def test_a_revision_is_stored_with_its_verdict(tmp_path: Path) -> None:
    group, _ = revise_with(f"<answer>{TASK.answer}</answer>")
    engine = store.open_store(f"sqlite:///{tmp_path / 'r.db'}")
    with store.transaction(engine) as session:
        store.save_group(session, group)
    with store.transaction(engine) as session:
        (loaded,) = store.load_groups(session, "train")
        verdicts = session.query(VerdictRow).count()
    (revision,) = [a for a in loaded.attempts if a.kind == "revision"]
    assert revision.sample == next(a for a in group.attempts if a.kind == "revision").sample
    assert verdicts == 3  # two first attempts and the revision


def test_an_off_policy_token_takes_herls_shaped_weight() -> None:
    """L = -A * rho / (rho + gamma), rho = pi / mu: d L / d log pi = -A * gamma * rho /
    (rho + gamma)^2 on an off-policy row; an on-policy row keeps -A * w."""
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9]])).repeat(2, 1).requires_grad_()
    trainer = SimpleNamespace(is_cap=2.0, shaping_gamma=0.1, clip=None, drift=[])
    model = lambda **_: SimpleNamespace(log_probs=logp[:, 1:])  # noqa: E731
    inputs = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "labels": torch.tensor([[IGNORE, 1, 1], [IGNORE, 1, 1]]),
        "advantages": torch.full((2, 3), 2.0),
        "behaviour_logprobs": torch.stack([torch.zeros(3), logp[1].detach()]),
        "importance": torch.tensor([False, True]),
        "off_policy": torch.tensor([True, False]),
    }
    loss = PolicyGradientTrainer.compute_loss(trainer, model, inputs)  # type: ignore[arg-type]
    loss.backward()
    rho = torch.tensor([0.2, 0.9])
    expected = -2.0 * 0.1 * rho / (rho + 0.1) ** 2 / 4
    assert torch.allclose(logp.grad[0, 1:], expected)
    assert torch.allclose(logp.grad[1, 1:], torch.full((2,), -2.0 / 4))


@pytest.mark.vllm
def test_a_revision_is_token_exact_on_a_real_server(tiny_server: str, tiny_model_path) -> None:
    """On vLLM, a revision's ids extend the prompt the server samples under, and end with the
    model's end-of-turn token."""
    model = tiny_model_path.name
    bare = bare_messages(TASK, "Answer in <answer></answer> tags.")
    text = f"<answer>{TASK.answer}</answer>"

    async def main():
        client = PolicyClient(tiny_server)
        try:
            greedy = SamplingSettings(temperature=0.0, max_tokens=1)
            sampled = await client.sample(model, bare, greedy)
            return sampled, await as_policy_sample(Endpoint(client, model), bare, text, [])
        finally:
            await client.aclose()

    sampled, sample = anyio.run(main)
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert sample is not None
    assert sample.prompt_token_ids == sampled.prompt_token_ids
    assert sample.completion_token_ids[-1] == config["eos_token_id"]
    assert len(sample.completion_token_ids) > 3


def test_the_example_reviewer_config_turns_on_blind_revisions_of_every_failed_group() -> None:
    settings = load_run_settings(Path(__file__).parent.parent / "examples/reviewer.toml", {})
    herl = settings.collect.revise
    assert herl.enabled and herl.blind and herl.partial
    assert herl.revisions == 4 and herl.temperature == 1.0
    assert settings.collect.temperature == 0.7 and settings.collect.guided_fraction == 0.5
    assert settings.train.revision_weight == "distill" and settings.train.mode == "filtered"


def test_the_r3l_example_is_the_reviewer_config_with_reflections_and_retries_on_top() -> None:
    examples = Path(__file__).parent.parent / "examples"
    reviewer = load_run_settings(examples / "reviewer.toml", {})
    r3l = load_run_settings(examples / "reviewer-r3l.toml", {})
    assert r3l.collect.retry.enabled and not reviewer.collect.retry.enabled
    assert r3l.collect.model_copy(update={"retry": reviewer.collect.retry}) == reviewer.collect
    assert r3l.train.micro_batch_size == 2  # as the twelve runs behind it were measured
    unbatched = r3l.train.model_copy(update={"micro_batch_size": reviewer.train.micro_batch_size})
    assert unbatched == reviewer.train


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_serves_the_reviewer_with_those_settings_unless_told_not_to() -> None:
    root = Path(__file__).parent.parent

    def run_line(*variables: str) -> str:
        shown = subprocess.run(["make", "-n", "-s", "run", *variables], cwd=root,
                               capture_output=True, text=True, check=True)  # fmt: skip
        (line,) = [ln for ln in shown.stdout.splitlines() if " run --summary-json " in ln]
        return line

    reviewer = "--reviewer qwen2.5-coder-0.5b --config examples/reviewer.toml"
    assert reviewer in run_line()
    assert run_line("ARGS=--rounds 1").endswith(f"{reviewer} --rounds 1")  # flags after it win
    assert "--reviewer" not in run_line("REVIEWER=")  # the policy alone


def most_in_flight(own_reviewer: bool) -> dict[str, int]:
    """Four groups that all fail, revised under a policy limiter of one slot: the most requests
    each server had in flight at once. A reviewer request waits (up to a second) for a second
    one to join it, so overlapping revisions show."""
    now = {"policy": 0, "reviewer": 0}
    most = dict(now)
    joined: dict[str, anyio.Event] = {}

    async def serve(server: str, body: dict, text: str, together: int) -> httpx.Response:
        now[server] += 1
        most[server] = max(most[server], now[server])
        if now[server] >= together:
            joined[server].set()
        with anyio.move_on_after(1.0):
            await joined[server].wait()
        now[server] -= 1
        return scripted(body, text, [3])

    async def reviewer(request: httpx.Request) -> httpx.Response:
        return await serve("reviewer", json.loads(request.content), WRONG, together=2)

    async def policy(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            words = len(body["messages"][-1]["content"].split())
            ends = [] if body.get("continue_final_message") else [9, 8]
            return httpx.Response(200, json={"tokens": [2, 2, 30, *[32] * words, *ends]})
        return await serve("policy", body, WRONG, together=1)

    tasks = [TASK.model_copy(update={"task_id": f"{TASK.task_id}-{i}"}) for i in range(4)]
    settings = CollectSettings(group_size=2, revise=ReviseSettings(enabled=True))
    policy_client = client_for(policy)
    reviewer_client = PolicyClient(
        "http://reviewer", http_client=httpx.AsyncClient(transport=httpx.MockTransport(reviewer))
    )
    own = Endpoint(reviewer_client, "judge-model") if own_reviewer else None

    async def main() -> None:
        joined.update(policy=anyio.Event(), reviewer=anyio.Event())
        await collect_groups(
            Endpoint(policy_client, "m"), tasks, GroupSpec(1, "train", settings),
            anyio.CapacityLimiter(1), Hooks(lambda g: None), reviewer=own,
        )  # fmt: skip

    anyio.run(main)
    return most


def test_a_reviewer_of_its_own_writes_without_taking_the_policys_slots() -> None:
    """Revisions waiting on a reviewer server do not hold the policy's request slots (which would
    idle the policy while the reviewer writes); the policy's own calls still keep within them."""
    most = most_in_flight(own_reviewer=True)
    assert most["policy"] == 1  # the limiter's one slot bounds the policy's server
    assert most["reviewer"] >= 2  # revisions of several groups at once, none holding a slot
    alone = most_in_flight(own_reviewer=False)
    assert alone["policy"] == 1 and alone["reviewer"] == 0  # its own reviewer: within the slot
