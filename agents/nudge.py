"""NudgeRL's nudges: for a group whose every first attempt failed, the reviewer writes a hint,
the policy tries again with the hint in context, and the successes are distilled into the bare
prompt.

1. Only a group none of whose first attempts reached full reward is nudged (the reviewer sees
   the task and the group's best attempt with the verifier's verdict and feedback, never the
   reference answer).
2. The hint is one short line: the concept, technique or mistake to avoid, at temperature 0.3
   and at most `HINT_TOKENS` tokens. A hint the verifier accepts as the answer is an answer,
   not a hint: it is recorded and nothing is sampled with it.
3. The policy samples `slots` attempts (half the group) under the bare prompt with the hint
   appended to its system prompt, at the train temperature. They are attempts of kind "nudge",
   stored in their group with the bare prompt's ids, so training distils each success into the
   bare prompt (`trainer.dataset`): in their group they count as members, and the round's
   advantages give the nudged successes a positive and the failed first attempts a negative
   advantage (NudgeRL's decomposition with lambda = 1).
4. The hint itself is stored as an attempt of kind "hint" (the reviewer's model, its text as
   the guidance, no sample, never trained), so its tokens count as the reviewer's; a hint the
   reviewer could not write, or one that states the answer, is recorded as failed with its
   reason, and the group is left as it was.
"""

from __future__ import annotations

import anyio

from agents.attempt import Conditioning, attempt_task, bare_prompt_ids
from agents.context import Messages, hint_messages
from agents.errors import PolicyError
from agents.policy import Endpoint
from agents.reflection import review_messages
from agents.revision import revisable
from agents.settings import CollectSettings
from agents.strategy import states_answer
from memory.records import Attempt, SamplingSettings
from verifiers.task import Task

NUDGE_SYSTEM = (
    "A student failed this task. Write one short hint for their next try: the concept or "
    "technique that solves it, or the mistake to avoid. Never state the final answer. Reply "
    "with the hint only, one sentence."
)
HINT_TEMPERATURE = 0.3
HINT_TOKENS = 48


async def nudge(
    policy: Endpoint,
    reviewer: Endpoint,
    task: Task,
    bare: Messages,
    attempts: list[Attempt],
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
) -> list[Attempt]:
    """The group's nudged attempts (empty when one of its first attempts succeeded)."""
    best = revisable(attempts)  # the group's best attempt, when none reached full reward
    if best is None:
        return []
    sampling = SamplingSettings(temperature=HINT_TEMPERATURE, max_tokens=HINT_TOKENS)
    messages = review_messages(NUDGE_SYSTEM, task.question, best)
    record = {"sample_index": 0, "kind": "hint", "policy_version": reviewer.model,
              "messages": messages, "sampling": sampling, "context": "nudge"}  # fmt: skip
    try:
        async with limiter:
            written = await reviewer.client.sample(reviewer.model, messages, sampling)
    except PolicyError as exc:
        return [Attempt.failed(str(exc), **record)]
    hint = " ".join(written.text.split())
    tokens = len(written.completion_token_ids)
    if not hint or await states_answer(task, hint):
        reason = "the hint states the answer" if hint else "an empty hint"
        return [Attempt.failed(reason, guidance=hint, generated_tokens=tokens, **record)]
    note = Attempt(
        **record, sample=None, reward=0.0, correct=False, format_ok=False, answer=None,
        reason="hint", guidance=hint, generated_tokens=tokens,
    )  # fmt: skip
    nudged = await _sample(policy, task, hint, settings, limiter)
    ids = await bare_prompt_ids(attempts, policy, bare)
    return [note, *(a.model_copy(update={"bare_prompt_token_ids": ids}) for a in nudged)]


async def _sample(
    policy: Endpoint,
    task: Task,
    hint: str,
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
) -> list[Attempt]:
    """Half the group's slots sampled with the hint in the system prompt."""
    messages = hint_messages(task, settings.system(task), hint)
    sampling = SamplingSettings(temperature=settings.temperature, max_tokens=settings.max_tokens)
    conditioning = Conditioning(context="nudge", guidance=hint)
    results: list[Attempt] = []

    async def one(index: int) -> None:
        async with limiter:
            results.append(
                await attempt_task(
                    policy, task, messages, sampling, index, conditioning, kind="nudge"
                )
            )  # fmt: skip

    async with anyio.create_task_group() as tg:
        for index in range(max(1, settings.group_size // 2)):
            tg.start_soon(one, index)
    return sorted(results, key=lambda a: a.sample_index)
