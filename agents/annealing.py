"""EAD: an attempt sampled with its temperature annealed from high to low over its tokens.

1. A request's temperature is fixed, so the schedule (`memory.records.Annealing`) is cut into
   spans: the first span is a chat request for the bare prompt; each later one continues from
   exactly the prompt and the tokens sampled so far through the completions API (token ids in,
   nothing re-tokenised), at the temperature the schedule gives its first token, until the
   answer stops by itself or the token budget is spent. Once the schedule reaches t_min, one
   request samples the rest.
2. Early tokens explore (t_max 1.2), late tokens commit (t_min 0.1): the first steps of an
   answer decide its approach, the last ones should not throw a good approach away.
3. The attempt's sample is the spans joined: the exact ids and the server's logprobs of each
   span; its settings record the schedule, from which each span's temperature follows.
"""

from __future__ import annotations

from agents.context import Messages
from agents.policy import Endpoint
from memory.records import Sample, SamplingSettings


async def sample(policy: Endpoint, messages: Messages, sampling: SamplingSettings) -> Sample:
    """One sample of `messages`: annealed when `sampling` has a schedule, else one request."""
    client, model = policy.client, policy.model
    if sampling.annealing is None:
        return await client.sample(model, messages, sampling)
    (start, end, temperature), *later = sampling.annealing.spans(sampling.max_tokens)
    span = SamplingSettings(temperature=temperature, max_tokens=end - start)
    parts = [await client.sample(model, messages, span)]
    for start, end, temperature in later:
        if parts[-1].finish_reason != "length":
            break
        span = SamplingSettings(temperature=temperature, max_tokens=end - start)
        parts.append(await client.complete_ids(model, _so_far(parts), span))
    return joined(parts)


def _so_far(parts: list[Sample]) -> list[int]:
    return parts[0].prompt_token_ids + [t for part in parts for t in part.completion_token_ids]


def joined(parts: list[Sample]) -> Sample:
    """The spans of one answer as one sample of the first span's prompt."""
    return Sample(
        text="".join(part.text for part in parts),
        prompt_token_ids=parts[0].prompt_token_ids,
        completion_token_ids=[t for part in parts for t in part.completion_token_ids],
        logprobs=[lp for part in parts for lp in part.logprobs],
        finish_reason=parts[-1].finish_reason,
    )
