"""R3L's pivot inside a one-step answer: the retry keeps the working up to its first wrong step.

1. A one-step answer's working is its lines; the reviewer sees them numbered from 0 (as an
   episode's turns are) and names the first step that went wrong (`retry_from_step`).
2. The kept prefix is the parent's own sampled ids for steps 0 to n - 1, never a
   re-tokenisation: the prefix text (with its line break, then without it) is tokenized, and a
   pivot is taken only where those ids are exactly the start of what was sampled. Where neither
   is, the retry starts from token 0, as a pivot-0 retry does.
3. The retry continues exactly the guided prompt's ids plus the kept ids (the completions API
   takes ids) with the principle in the system prompt; the server must report running exactly
   that prompt, or the retry is recorded as failed. The kept tokens carry the parent's logprobs
   and are the retry's `pivot_tokens`: pivotal credit masks them in training, in the retry and
   in its parent, and the parent's bare prompt makes the distill copy.
"""

from __future__ import annotations

from agents.attempt import Conditioning, attempt_task
from agents.errors import PolicyError
from agents.policy import Endpoint
from memory.records import Attempt, Sample, SamplingSettings
from verifiers.catalog import averify
from verifiers.errors import TaskFault
from verifiers.task import Task


def working_steps(text: str) -> list[str]:
    """The steps of a one-step answer's working: its non-blank lines."""
    return [line for line in text.splitlines() if line.strip()]


def numbered_working(text: str) -> str:
    """The working as a reviewer sees it when asked for the first wrong step."""
    return "\n".join(f"Step {n}: {line.strip()}" for n, line in enumerate(working_steps(text)))


def prefix_text(text: str, steps: int) -> str:
    """The text of the working's first `steps` steps, up to and with the line break after the
    last of them."""
    seen, end = 0, 0
    for line in text.splitlines(keepends=True):
        if seen == steps:
            break
        end += len(line)
        seen += bool(line.strip())
    return text[:end]


async def kept_prefix(policy: Endpoint, parent: Sample, steps: int) -> tuple[int, str]:
    """How many of the parent's sampled tokens make its first `steps` steps, and their text:
    (0, "") where no tokenization of the step boundary is exactly what was sampled."""
    text = prefix_text(parent.text, steps)
    for candidate in (text, text.rstrip("\n")):
        if not candidate.strip():
            continue
        ids = await policy.client.tokenize_text(policy.model, candidate)
        if ids and parent.completion_token_ids[: len(ids)] == ids:
            return len(ids), candidate
    return 0, ""


async def step_retry(
    policy: Endpoint,
    task: Task,
    messages: list[dict[str, str]],
    parent: Attempt,
    principle: str,
    from_step: int,
    sampling: SamplingSettings,
) -> Attempt:
    """A one-step retry under `messages` (the principle in the system prompt) that keeps the
    parent's working before step `from_step` token for token; from step 0, or where no step
    boundary is token-exact, a retry from scratch."""
    assert parent.sample is not None
    steps = len(working_steps(parent.sample.text))
    from_step = max(0, min(from_step, steps - 1))
    pivot, kept = await kept_prefix(policy, parent.sample, from_step) if from_step else (0, "")
    hint = Conditioning(context="hint", guidance=principle)
    index = parent.sample_index
    pairing = {"parent_index": index, "bare_prompt_token_ids": parent.sample.prompt_token_ids}
    if pivot == 0 or pivot >= sampling.max_tokens:
        retry = await attempt_task(policy, task, messages, sampling, index, hint, "retry")
        return _paired(retry.model_copy(update=pairing), parent)
    record = {"sample_index": index, "policy_version": policy.model, "messages": messages,
              "sampling": sampling, "pivot_tokens": pivot}  # fmt: skip
    record |= hint.fields("retry") | pairing
    try:
        sample = await _continue(policy, messages, parent.sample, pivot, kept, sampling)
    except PolicyError as exc:
        return Attempt.failed(str(exc), **record)
    try:
        verdict = await averify(task, sample.text)
    except TaskFault as fault:
        return Attempt.faulted(str(fault), **record, sample=sample)
    reason = f"{verdict.reason}, retried from step {from_step}"
    if sample.finish_reason == "length":
        reason += ", truncated"
    generated = len(sample.completion_token_ids) - pivot
    retry = Attempt(**record, sample=sample, generated_tokens=generated, reason=reason,
                    **verdict.scores())  # fmt: skip
    return _paired(retry, parent)


async def _continue(
    policy: Endpoint,
    messages: list[dict[str, str]],
    parent: Sample,
    pivot: int,
    kept: str,
    sampling: SamplingSettings,
) -> Sample:
    """The guided prompt's ids and the kept ids, continued; the whole answer as one sample."""
    prompt = await policy.client.tokenize(policy.model, messages)
    ids = parent.completion_token_ids[:pivot]
    budget = sampling.model_copy(update={"max_tokens": sampling.max_tokens - pivot})
    rest = await policy.client.complete_ids(policy.model, [*prompt, *ids], budget)
    if rest.prompt_token_ids != [*prompt, *ids]:
        raise PolicyError("the server ran another prompt than the kept working: not token-exact")
    return Sample(
        text=kept + rest.text,
        prompt_token_ids=prompt,
        completion_token_ids=[*ids, *rest.completion_token_ids],
        logprobs=[*parent.logprobs[:pivot], *rest.logprobs],
        finish_reason=rest.finish_reason,
    )


def _paired(retry: Attempt, parent: Attempt) -> Attempt:
    improved = retry.error is None and retry.reward > parent.reward
    return retry.model_copy(update={"improved": improved})
