"""One attempt at a task: the prompt's conditioning, one sample from the policy, the verdict.

`Conditioning` names what the prompt holds beyond the task (the attempt's `context`, with its
`guidance` text): nothing (`bare`), a worked example, library lessons, insights, earlier
strategies, or a reflection's principle. It decides the attempt's kind: `base` when bare,
`guided` otherwise (a retry says so itself).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

from agents import annealing
from agents.context import Messages
from agents.errors import PolicyError
from agents.policy import Endpoint
from memory.records import Attempt, AttemptKind, SamplingSettings
from verifiers.catalog import averify
from verifiers.errors import TaskFault
from verifiers.task import Task

log = logging.getLogger(__name__)


class Conditioning(BaseModel):
    """What an attempt's prompt holds beyond the task (see the module docstring)."""

    model_config = ConfigDict(frozen=True)

    context: str = "bare"
    guidance: str | None = None

    @property
    def kind(self) -> AttemptKind:
        return "base" if self.context == "bare" else "guided"

    def fields(self, kind: AttemptKind | None = None) -> dict[str, Any]:
        """The attempt fields this conditioning sets."""
        return {"kind": kind or self.kind, "context": self.context, "guidance": self.guidance}


BARE = Conditioning()


async def attempt_task(
    policy: Endpoint,
    task: Task,
    messages: Messages,
    sampling: SamplingSettings,
    index: int,
    conditioning: Conditioning = BARE,
    kind: AttemptKind | None = None,
) -> Attempt:
    """Sample `messages` once and verify the answer; a refused call, or a verifier that raised or
    hung on the answer, is recorded on the attempt (`ServerUnavailable` propagates: it is no
    attempt's answer)."""
    base = {"sample_index": index, "policy_version": policy.model, "messages": messages}
    base |= conditioning.fields(kind)
    try:
        sample = await annealing.sample(policy, messages, sampling)
    except PolicyError as exc:
        return Attempt.failed(str(exc), **base, sampling=sampling)
    try:
        verdict = await averify(task, sample.text)
    except TaskFault as fault:
        return Attempt.faulted(str(fault), **base, sampling=sampling, sample=sample)
    reason = verdict.reason
    if sample.finish_reason == "length":
        reason += ", truncated"
    return Attempt(
        **base,
        sampling=sampling,
        sample=sample,
        generated_tokens=len(sample.completion_token_ids),
        reason=reason,
        **verdict.scores(),
    )


async def bare_prompt_ids(
    attempts: list[Attempt], policy: Endpoint, bare: Messages
) -> list[int] | None:
    """The bare prompt's ids: from an unguided sample, else /tokenize; None if that fails."""
    ids = next((a.sample.prompt_token_ids for a in attempts if a.sample and not a.guided), None)
    if ids is not None:
        return ids
    try:
        return await policy.client.tokenize(policy.model, bare)
    except PolicyError as exc:
        log.warning("no bare prompt ids; guided attempts will not be distilled: %s", exc)
        return None
