"""A group's slots: what each slot's prompt holds, and its first attempt.

1. Guided half-groups: the first `guided_fraction` of the slots show a worked example (the
   policy's own answer to a similar task when the batch keeps them, `agents.examples`), or the
   library's lessons for the task when it has some (EDGE); the other slots are bare, except that
   RLTLDR's sequential attempts may show the batch's insights, and SGE's second wave sees the
   first wave's strategies with their outcomes.
2. A slot is sampled plainly, or strategy first (SGE, `agents.strategy`); a multi-turn task is
   played as an episode (`agents.episode`), its guided slots shown the task's library lessons
   that fit each step (SLEA-RL, `agents.lessons`), the others bare.
3. `wave` samples a range of slots concurrently, each under the server-slot limiter.
"""

from __future__ import annotations

import anyio

from agents.attempt import BARE, Conditioning, attempt_task
from agents.context import (
    Messages,
    bare_messages,
    demo_messages,
    demo_text,
    experience_messages,
    insight_messages,
    strategies_messages,
)
from agents.episode import run_episode
from agents.errors import PolicyError
from agents.policy import Endpoint
from agents.settings import CollectSettings
from agents.strategy import Prompt, reflection_note, strategy_attempt
from memory.records import EXPERIENCE, INSIGHTS, OWN_EXAMPLE, Attempt, SamplingSettings
from verifiers.catalog import astart, is_episodic, worked_example
from verifiers.errors import TaskFault
from verifiers.task import Task


def conditioning(
    task: Task,
    settings: CollectSettings,
    index: int,
    insights: list[str] | None = None,
    earlier: list[Attempt] | None = None,
) -> tuple[Messages, Conditioning]:
    """Slot `index`'s prompt and what it holds beyond the task (module docstring, 1)."""
    system = settings.system(task)
    tried = [a for a in earlier or [] if a.strategy]
    if index < settings.guided_slots() and settings.lessons:
        lessons = list(settings.lessons)
        held = Conditioning(context=EXPERIENCE, guidance="\n".join(lessons))
        return experience_messages(task, system, lessons), held
    if index < settings.guided_slots():
        example = settings.example or worked_example(task.taskset)
        context = OWN_EXAMPLE if settings.example else "demo"
        held = Conditioning(context=context, guidance=demo_text(example))
        return demo_messages(task, system, example), held
    if insights:
        held = Conditioning(context=INSIGHTS, guidance="\n".join(insights))
        return insight_messages(task, system, insights), held
    if tried:
        note = reflection_note(tried)
        return strategies_messages(task, system, note), Conditioning(
            context="strategies", guidance=note
        )
    return bare_messages(task, system), BARE


async def first_attempt(
    policy: Endpoint,
    task: Task,
    settings: CollectSettings,
    index: int,
    insights: list[str] | None = None,
    earlier: list[Attempt] | None = None,
) -> Attempt:
    """Slot `index`, sampled plainly or strategy first (SGE)."""
    client, model = policy.client, policy.model
    sampling = SamplingSettings(
        temperature=settings.temperature,
        max_tokens=settings.max_tokens,
        annealing=settings.annealing,
    )
    if is_episodic(task.taskset):  # played turn by turn, guided slots shown lessons per step
        try:
            env = await astart(task)
        except TaskFault as fault:
            base = {"sample_index": index, "policy_version": model, "messages": []}
            return Attempt.faulted(str(fault), **base, sampling=sampling)
        lessons = settings.lessons if index < settings.guided_slots() else ()
        return await run_episode(policy, env, sampling, index, lessons)
    messages, held = conditioning(task, settings, index, insights, earlier)
    if not settings.strategy.enabled:
        return await attempt_task(policy, task, messages, sampling, index, held)
    try:
        prompt_ids = await client.tokenize(model, messages)
    except PolicyError as exc:
        base = {"sample_index": index, "policy_version": model, "messages": messages}
        return Attempt.failed(str(exc), **base, **held.fields(), sampling=sampling)
    sampling = SamplingSettings(
        temperature=settings.strategy.action_temperature,
        max_tokens=settings.max_tokens,
        strategy_temperature=settings.strategy.temperature(index, settings.group_size),
    )
    prompt = Prompt(messages, prompt_ids)
    return await strategy_attempt(policy, task, prompt, index, sampling, settings.strategy, held)


async def wave(
    policy: Endpoint,
    task: Task,
    settings: CollectSettings,
    limiter: anyio.CapacityLimiter,
    indices: range,
    earlier: list[Attempt],
) -> list[Attempt]:
    """Slots `indices` sampled concurrently; SGE's second wave sees the first's strategies."""
    attempts_W: dict[int, Attempt] = {}

    async def run_attempt(index: int) -> None:
        async with limiter:
            attempts_W[index] = await first_attempt(policy, task, settings, index, earlier=earlier)

    async with anyio.create_task_group() as tg:
        for index in indices:
            tg.start_soon(run_attempt, index)
    return [attempts_W[i] for i in indices]
