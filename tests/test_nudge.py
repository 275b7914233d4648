"""NudgeRL: which groups are nudged, what the reviewer sees, the hint in the policy's prompt,
a hint that states the answer, and the nudged successes distilled into the bare prompt."""

import json
from pathlib import Path

import httpx
import pytest

from agents.nudge import HINT_TEMPERATURE, HINT_TOKENS
from agents.policy import Endpoint
from agents.settings import CollectSettings
from memory import store
from tests.helpers import TASK, client_for, collect_task, scripted
from trainer.dataset import build_rows, member_advantages
from trainer.settings import TrainSettings

GRPO = TrainSettings(mode="grpo", max_length=64)
WRONG = "<answer>999</answer>"
HINT = "Add the tens first, then the ones."
RIGHT = f"<answer>{TASK.answer}</answer>"


def nudge_with(hint: str, hinted_answer: str = RIGHT, first_answer: str = WRONG):
    """A group of four collected with nudges on: the policy answers `first_answer` under the
    bare prompt and `hinted_answer` when the hint is in its system prompt."""
    seen: dict[str, list[dict]] = {"reviewer": [], "hinted": []}

    def reviewer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen["reviewer"].append(body)
        return scripted(body, hint, [3])

    def policy(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if hint in body["messages"][0]["content"]:
            seen["hinted"].append(body)
            return scripted(body, hinted_answer, [4, 4, 4])
        return scripted(body, first_answer, [2, 2])

    settings = CollectSettings(group_size=4, nudge=True)
    group = collect_task(policy, settings, Endpoint(client_for(reviewer), "judge-model"))
    return group, seen


def test_a_group_that_all_failed_gets_a_hint_and_hinted_attempts() -> None:
    group, seen = nudge_with(HINT)
    (note,) = [a for a in group.attempts if a.kind == "hint"]
    nudged = [a for a in group.attempts if a.kind == "nudge"]
    assert group.complete and note.guidance == HINT and note.policy_version == "judge-model"
    assert note.generated_tokens == 2 and note.sample is None and note.error is None
    # The reviewer saw a failed attempt and its verdict, never the reference answer.
    (asked,) = seen["reviewer"]
    shown = asked["messages"][1]["content"]
    assert "999" in shown and TASK.answer not in shown.replace("999", "")
    assert asked["temperature"] == HINT_TEMPERATURE and asked["max_tokens"] == HINT_TOKENS
    # Half the group tried again with the hint; each keeps the bare prompt's ids to distil.
    assert [a.sample_index for a in nudged] == [0, 1] and len(seen["hinted"]) == 2
    assert all(a.correct and a.context == "nudge" and a.guidance == HINT for a in nudged)
    assert all(a.bare_prompt_token_ids == [2, 2] for a in nudged)


def test_a_group_with_a_success_is_not_nudged() -> None:
    group, seen = nudge_with(HINT, first_answer=RIGHT)
    assert seen["reviewer"] == [] and {a.kind for a in group.attempts} == {"base"}


def test_a_hint_that_states_the_answer_is_refused_and_nothing_is_sampled_with_it() -> None:
    group, seen = nudge_with(f"The answer is {TASK.answer}: <answer>{TASK.answer}</answer>")
    (note,) = [a for a in group.attempts if a.kind == "hint"]
    assert note.error == "the hint states the answer" and seen["hinted"] == []
    assert not [a for a in group.attempts if a.kind == "nudge"]


def test_nudged_successes_are_distilled_into_the_bare_prompt() -> None:
    group, _ = nudge_with(HINT)
    scores = member_advantages(group, GRPO)
    assert all(scores[(i, "base")] < 0 for i in range(4))
    assert all(scores[(i, "nudge")] > 0 for i in range(2))
    rows = build_rows([group], GRPO)
    distilled = [r for r in rows if r.context == "distill:nudge"]
    assert len(distilled) == 2
    assert all(r.input_ids[:2] == [2, 2] and not r.importance for r in distilled)
    assert sorted(r.context for r in rows) == ["bare"] * 4 + ["distill:nudge"] * 2


def test_nudges_are_stored_and_read_back(tmp_path: Path) -> None:
    group, _ = nudge_with(HINT)
    engine = store.open_store(f"sqlite:///{tmp_path / 'n.db'}")
    with store.transaction(engine) as session:
        store.save_group(session, group)
    with store.transaction(engine) as session:
        (loaded,) = store.load_groups(session, "train")
    assert sorted(a.kind for a in loaded.attempts) == ["base"] * 4 + ["hint"] + ["nudge"] * 2
    assert build_rows([loaded], GRPO) == build_rows([group], GRPO)


@pytest.mark.vllm
def test_nudges_and_the_answer_leak_checks_on_a_real_server(
    tiny_server: str, tiny_model_path: Path
) -> None:
    """The policy on vLLM, the reviewer scripted: a group that all failed is nudged with the
    hint in the policy's real prompt and the bare prompt's real ids kept for distilling; a hint,
    or a reflection's principle, that states the answer (checked by the verifier) leads to no
    sampling with it."""
    import anyio

    from agents.collector import GroupSpec, Hooks, collect_groups
    from agents.policy import PolicyClient
    from agents.settings import RetrySettings

    def collect(reviewer_says: str, settings: CollectSettings):
        def reviewer(request: httpx.Request) -> httpx.Response:
            return scripted(json.loads(request.content), reviewer_says, [3])

        async def main():
            policy = PolicyClient(tiny_server)
            try:
                return await collect_groups(
                    Endpoint(policy, tiny_model_path.name), [TASK],
                    GroupSpec(1, "train", settings), anyio.CapacityLimiter(4),
                    Hooks(lambda g: None), reviewer=Endpoint(client_for(reviewer), "judge"),
                )  # fmt: skip
            finally:
                await policy.aclose()

        (group,) = anyio.run(main)
        return group

    nudge = CollectSettings(group_size=4, nudge=True, max_tokens=16, temperature=1.0)
    group = collect(HINT, nudge)
    firsts, nudged = group.first_attempts, [a for a in group.attempts if a.kind == "nudge"]
    assert not any(a.correct for a in firsts) and len(nudged) == 2  # a random model fails
    bare = firsts[0].sample.prompt_token_ids
    for attempt in nudged:
        assert attempt.error is None and attempt.bare_prompt_token_ids == bare
        assert HINT in attempt.messages[0]["content"]
        assert len(attempt.sample.prompt_token_ids) > len(bare)  # the hint, tokenized by vLLM
    leaked = collect(f"The answer is {TASK.answer}.", nudge)
    assert [a.error for a in leaked.attempts if a.kind == "hint"] == ["the hint states the answer"]
    assert not [a for a in leaked.attempts if a.kind == "nudge"]
    principle = json.dumps({"principle": f"It is {TASK.answer}, write that."})
    retry = CollectSettings(group_size=2, retry=RetrySettings(enabled=True), max_tokens=16)
    reflected = collect(principle, retry)
    reasons = {a.reason for a in reflected.attempts if a.kind == "reflection"}
    assert reasons == {"the reflection states the answer"}
    assert not [a for a in reflected.attempts if a.kind == "retry"]
