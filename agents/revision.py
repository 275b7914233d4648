"""HeRL's hindsight revision: the reviewer fixes a group's best failed attempt, the verifier
checks the fix, and a fix that passes becomes an off-policy training sample.

1. Only a group whose first attempts all fall short of full reward is revised, and only its
   best attempt (the lowest slot among equals); with `revise_partial`, any group with an
   attempt short of full reward, and its best such attempt.
2. The reviewer sees the task with the instructions the policy answered under (the form the
   answer must take), the attempt and the verifier's verdict and feedback lines, never the
   reference answer, and rewrites the answer (`revisions` draws, at `revise_temperature`, by
   default one at 0.3): it solves the task itself,
   keeps what is right, and answers in the instructions' form. Where the task set has a worked
   example, the reviewer's prompt opens with it as an earlier turn (the example task with no
   attempt, answered by the example's solution), and the reviewer answers as briefly: in the
   policy's own form, with a fifth of the tokens it writes when told to be brief.
   With `revise_blind` the reviewer is not shown the attempt: it answers the bare prompt afresh,
   after the worked example. A small reviewer shown a wrong answer tends to copy it (Qwen2.5-
   Coder-0.5B repeated its parent's wrong answer in most draws); answering afresh, it solved
   nearly twice as many of the groups that all failed (docs/experiments.md).
3. The revision is verified like any answer. Its text is tokenised by the policy's server as the
   policy's own answer to the bare prompt, closed by the template's end-of-turn token, so
   training can score it token for token. The reviewer's sampling probabilities belong
   to another model: the revision's behaviour logprobs are 0 (probability 1), and training weighs
   the best verified draw with HeRL's shaped off-policy weight, or as a distill copy
   (`trainer.dataset`).
4. Each draw is stored as an attempt of kind "revision" (its index the draw's) paired with its
   parent; its tokens (the reviewer's) are its cost.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass

import anyio

from agents.attempt import bare_prompt_ids
from agents.context import Messages, demo_messages
from agents.errors import PolicyError
from agents.policy import Endpoint
from agents.reflection import review_messages, review_prompt
from agents.settings import CollectSettings
from memory.records import FIRST_KINDS, FULL_REWARD, Attempt, Sample, SamplingSettings
from verifiers.catalog import averify, has_worked_example, is_episodic, worked_example
from verifiers.task import Task

REVISE_SYSTEM = (
    "You fix a failed answer to a task. Solve the task yourself, following its instructions "
    "exactly: work it out step by step, briefly, then give the answer in the form they ask for. "
    "Do not comment on the old answer."
)
NO_ANSWER = "The verifier gave reward 0: no answer."


def revisable(attempts: list[Attempt], partial: bool = False) -> Attempt | None:
    """The attempt to revise: the best first attempt of a group none of whose first attempts
    reached full reward (None when one did), or with `partial` the best of those that fell
    short in any group; None too when none has a sample."""
    firsts = [a for a in attempts if a.kind in FIRST_KINDS and a.sample and a.error is None]
    short = [a for a in firsts if a.reward < FULL_REWARD]
    if not short or (len(short) < len(firsts) and not partial):
        return None
    return max(short, key=lambda a: (a.reward, -a.sample_index))


def revise_messages(task: Task, parent: Attempt, instructions: str | None) -> Messages:
    """The reviewer's prompt: the task, the attempt and its verdict, after the task set's worked
    example as a turn of its own where it has one."""
    asked = review_messages(REVISE_SYSTEM, task.question, parent, instructions)
    if is_episodic(task.taskset) or not has_worked_example(task.taskset):
        return asked
    question, solution = worked_example(task.taskset)
    shown = review_prompt(question, "", NO_ANSWER, instructions)
    example = [{"role": "user", "content": shown}, {"role": "assistant", "content": solution}]
    return [asked[0], *example, asked[1]]


def blind_messages(task: Task, bare: Messages) -> Messages:
    """The reviewer's prompt for a fresh answer: the bare prompt, after the task set's worked
    example as a turn of its own where it has one; never the failed attempt."""
    if is_episodic(task.taskset) or not has_worked_example(task.taskset):
        return bare
    return demo_messages(task, bare[0]["content"], worked_example(task.taskset))


def instructions(bare: Messages) -> str | None:
    """The system prompt the policy answered under: the form its answer must take."""
    return bare[0]["content"] if bare and bare[0]["role"] == "system" else None


async def revise(
    policy: Endpoint, reviewer: Endpoint, task: Task, bare: Messages, attempts: list[Attempt],
    settings: CollectSettings, limiter: anyio.CapacityLimiter,
) -> list[Attempt]:  # fmt: skip
    """The group's revisions, `settings.revise.revisions` draws of one (empty when nothing is
    revisable); `bare` is the task's prompt with nothing in context, which they answer.
    Calls to the policy's server take a slot of `limiter`; the reviewer's draws take one only
    when the policy is its own reviewer, so a reviewer of its own writes while the policy's
    slots go on sampling other groups."""
    parent = revisable(attempts, settings.revise.partial)
    if parent is None:
        return []
    messages = (
        blind_messages(task, bare)
        if settings.revise.blind
        else revise_messages(task, parent, instructions(bare))
    )
    sampling = SamplingSettings(
        temperature=settings.revise.temperature, max_tokens=settings.max_tokens
    )
    revisions: list[Attempt] = []
    slots = Slots(limiter, reviewer.client.url == policy.client.url)

    case = _Case(task, bare, attempts, parent, messages, sampling)

    async def draw(index: int) -> None:
        revisions.append(await _revision(policy, reviewer, case, index, slots))

    async with anyio.create_task_group() as group:
        for index in range(settings.revise.revisions):
            group.start_soon(draw, index)
    return sorted(revisions, key=lambda a: a.sample_index)


class Slots:
    """The policy server's request slots, for the policy's calls and, when the policy is its
    own reviewer, the reviewer's."""

    def __init__(self, limiter: anyio.CapacityLimiter, shared: bool) -> None:
        self.policy = limiter
        self._shared = shared

    def reviewer(self) -> AbstractAsyncContextManager[object]:
        return self.policy if self._shared else nullcontext()


@dataclass(frozen=True)
class _Case:
    """What every draw of one revision shares: the task, its bare prompt and the group's
    attempts, the parent revised, and the reviewer's request."""

    task: Task
    bare: Messages
    attempts: list[Attempt]
    parent: Attempt
    messages: Messages
    sampling: SamplingSettings


async def _revision(
    policy: Endpoint, reviewer: Endpoint, case: _Case, index: int, slots: Slots
) -> Attempt:
    """One draw of the reviewer's revision of the case's parent, verified, in the policy's
    ids."""
    task, bare, attempts, parent = case.task, case.bare, case.attempts, case.parent
    messages, sampling = case.messages, case.sampling
    record = {
        "sample_index": index,
        "kind": "revision",
        "policy_version": reviewer.model,
        "messages": messages,
        "sampling": sampling,
        "parent_index": parent.sample_index,
        "context": "revision",
    }
    try:
        async with slots.reviewer():
            written = await reviewer.client.sample(reviewer.model, messages, sampling)
    except PolicyError as exc:
        return Attempt.failed(str(exc), **record)
    verdict = await averify(task, written.text)
    async with slots.policy:
        sample = await as_policy_sample(policy, bare, written.text, attempts)
    reason = verdict.reason + (", truncated" if written.finish_reason == "length" else "")
    return Attempt(
        **record,
        sample=sample,
        generated_tokens=len(written.completion_token_ids),
        reason=reason,
        improved=verdict.reward > parent.reward,
        **verdict.scores(),
    )


async def as_policy_sample(
    policy: Endpoint, bare: Messages, text: str, attempts: list[Attempt]
) -> Sample | None:
    """`text` as the policy's answer to the bare prompt, in the policy's token ids, closed by
    the template's end-of-turn token (the one the policy stops on); None when the server's
    renderings do not extend each other (the revision is then kept for the record, not
    trained)."""
    prompt = await bare_prompt_ids(attempts, policy, bare)
    if prompt is None:
        return None
    turn = [*bare, {"role": "assistant", "content": text}]
    try:
        opened = await policy.client.tokenize_open_turn(policy.model, turn)
        closed = await policy.client.tokenize_closed_turn(policy.model, turn)
    except PolicyError:
        return None
    extends = opened[: len(prompt)] == prompt and closed[: len(opened)] == opened
    if not extends or len(prompt) == len(opened) or len(closed) == len(opened):
        return None
    completion = closed[len(prompt) : len(opened) + 1]
    return Sample(
        text=text,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=[0.0] * len(completion),
        finish_reason="stop",
    )
