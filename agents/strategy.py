"""Strategy-guided exploration (SGE): a short strategy first, then the answer conditioned on it.

1. Two calls, since temperature cannot change inside one response: the strategy continues an
   assistant turn that starts with "Strategy:" and stops at the end of its line, at a strategy
   temperature spread across the group (0.7 to 1.3); the answer continues from exactly the
   strategy call's prompt and sampled token ids (the completions API takes ids, so nothing is
   re-tokenised) at the lower action temperature.
2. Token bookkeeping: the attempt's completion is the forced "Strategy:" prefix, the strategy
   tokens, the forced "Answer:" cue and the answer tokens, with the server's logprobs; the
   forced parts are never trained. Should the answer call's prompt ever differ from what the
   strategy call produced, the strategy joins the masked prefix and only the answer is trained.
3. A strategy line that the verifier already accepts as the answer is an answer, not a
   strategy, and an empty line is none: the attempt keeps its tokens and reward, but records
   no strategy, so it is neither shown to later attempts nor counted in the per-strategy
   statistics.
4. Strategy reflection: the second half of a group sees the first half's strategies with their
   outcomes, failed ones first ("propose a different one"); those attempts are guided
   (context "strategies") and train as distill copies under the bare prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from agents.attempt import Conditioning
from agents.context import Messages
from agents.errors import PolicyError
from agents.policy import Endpoint
from memory.records import Attempt, Sample, SamplingSettings
from verifiers.catalog import averify, runs_code
from verifiers.task import Task

PREFIX = "Strategy:"
ANSWER_CUE = "Answer:"


class StrategySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="strategy first, then the answer (SGE)")
    low_temperature: float = Field(0.7, ge=0.0)
    high_temperature: float = Field(1.3, ge=0.0)
    action_temperature: float = Field(0.6, ge=0.0)
    max_tokens: int = Field(48, ge=1, description="strategy tokens")
    reflect: bool = True

    def temperature(self, index: int, size: int) -> float:
        """Strategy temperatures spread evenly across a group's slots."""
        if size < 2:
            return self.low_temperature
        step = (self.high_temperature - self.low_temperature) / (size - 1)
        return round(self.low_temperature + step * index, 3)


def reflection_note(earlier: list[Attempt]) -> str:
    """Earlier strategies for this task with outcomes: failures first, then successes."""
    failed = [a.strategy for a in earlier if a.strategy and not a.correct]
    worked = [a.strategy for a in earlier if a.strategy and a.correct]
    lines = ["Earlier strategies for this task:"]
    lines += [f"- failed: {s}" for s in failed] + [f"- worked: {s}" for s in worked]
    if failed:
        lines.append("Propose a different strategy from the ones that failed.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Prompt:
    """A prompt as messages, and the server's ids of them with the generation prompt."""

    messages: Messages
    ids: list[int]


async def strategy_attempt(
    policy: Endpoint,
    task: Task,
    prompt: Prompt,
    index: int,
    sampling: SamplingSettings,
    settings: StrategySettings,
    conditioning: Conditioning,
) -> Attempt:
    """One SGE attempt: strategy call at `sampling.strategy_temperature`, then answer call at
    `sampling`'s own; failures are recorded, never raised."""
    client, model, messages, prompt_ids = policy.client, policy.model, prompt.messages, prompt.ids
    assert sampling.strategy_temperature is not None
    base = {"sample_index": index, "policy_version": model, "messages": messages}
    base |= conditioning.fields()
    strategy_sampling = SamplingSettings(
        temperature=sampling.strategy_temperature, max_tokens=settings.max_tokens
    )
    try:
        strategy = await client.continue_turn(model, messages, PREFIX, strategy_sampling, ["\n"])
        cue = await client.tokenize_text(model, ANSWER_CUE)
        context = strategy.prompt_token_ids + strategy.completion_token_ids + cue
        action = await client.complete_ids(model, context, sampling)
        sample, pivot, exact = join(prompt_ids, strategy, action, len(cue))
    except PolicyError as exc:
        return Attempt.failed(str(exc), **base, sampling=sampling)
    verdict = await averify(task, action.text)
    reason = verdict.reason + ("" if exact else ", strategy not token-exact: answer trained only")
    stated = await states_answer(task, strategy.text)
    if stated:
        reason += ", the strategy states the answer"
    if action.finish_reason == "length":
        reason += ", truncated"
    return Attempt(
        **base,
        sampling=sampling,
        sample=sample,
        generated_tokens=len(strategy.completion_token_ids) + len(action.completion_token_ids),
        reason=reason,
        **verdict.scores(),
        strategy=None if stated else strategy.text.strip() or None,
        pivot_tokens=pivot,
        forced_spans=[_cue_span(sample, action, len(cue))] if exact else [],
    )


async def states_answer(task: Task, strategy: str) -> bool:
    """Whether the verifier accepts the strategy line itself as the answer: then it is an
    answer, not a strategy, and is neither shown to later attempts nor counted per strategy.
    (Code is never run for this: a line is not a program.)"""
    if runs_code(task.taskset):
        return False
    return (await averify(task, strategy)).correct


def _cue_span(sample: Sample, action: Sample, cue: int) -> tuple[int, int]:
    end = len(sample.completion_token_ids) - len(action.completion_token_ids)
    return (end - cue, end)


def join(
    prompt_ids: list[int], strategy: Sample, action: Sample, cue: int
) -> tuple[Sample, int, bool]:
    """One sample from the two calls, its masked prefix length, and whether the strategy
    tokens are exactly the sampled ones (then they are trained too).

    The strategy call's prompt is `prompt_ids` plus the forced prefix; the answer call's prompt
    should be that plus the strategy's sampled tokens and the `cue` forced answer-cue tokens.
    """
    if strategy.prompt_token_ids[: len(prompt_ids)] != prompt_ids:
        raise PolicyError("the strategy call's prompt does not extend the bare prompt")
    forced = len(strategy.prompt_token_ids) - len(prompt_ids)
    expected = strategy.prompt_token_ids + strategy.completion_token_ids
    tail = action.prompt_token_ids[len(prompt_ids) :]
    exact = action.prompt_token_ids[: len(expected)] == expected
    exact = exact and len(action.prompt_token_ids) == len(expected) + cue
    if exact:
        logprobs = [0.0] * forced + strategy.logprobs + [0.0] * cue + action.logprobs
        pivot = forced
    else:
        logprobs = [0.0] * len(tail) + action.logprobs
        pivot = len(tail)
    joined = Sample(
        text=PREFIX + strategy.text + ANSWER_CUE + action.text,
        prompt_token_ids=prompt_ids,
        completion_token_ids=tail + action.completion_token_ids,
        logprobs=logprobs,
        finish_reason=action.finish_reason,
    )
    return joined, pivot, exact
