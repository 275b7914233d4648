"""Answer extraction that resists format hacks.

1. Exactly one `<answer>...</answer>` pair with non-empty content is a formatted answer.
2. Several answer tags, an empty pair, or an unbalanced tag earn nothing: a model must not be
   able to collect reward by listing candidates or by emitting the tags alone.
3. Text inside code fences does not count: an answer tag or a number hidden in a fenced block
   earns nothing.
4. With no tags at all, the last number in the text is taken as an unformatted answer, so that
   correctness can be measured on a model that has not learned the format yet.
5. The working's own result is read too: a tagged answer right after `... = 7.` that is not 7
   contradicts it (`Extraction.contradicted`). Reward-only verifiers pay such a lucky answer as
   if its working were right, which teaches a model that the answer is free of the working.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

OPEN_TAG = re.compile(r"<answer>", re.IGNORECASE)
CLOSE_TAG = re.compile(r"</answer>", re.IGNORECASE)
TAGGED = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FENCED = re.compile(r"```.*?(?:```|$)", re.DOTALL)
STATED = re.compile(rf"=\s*\(?\s*({NUMBER.pattern})\s*\)?\s*\.?\s*$")  # `... = 7.` at the end


class Extraction(BaseModel):
    model_config = ConfigDict(frozen=True)

    answer: str | None
    format_ok: bool
    reason: str
    stated: str | None = None  # the number the working ends on, right before the answer tag

    @property
    def contradicted(self) -> bool:
        """Whether the tagged answer is a number other than the one its working ends on."""
        if self.stated is None or self.answer is None or not NUMBER.fullmatch(self.answer):
            return False
        return float(self.stated) != float(self.answer)


def extract_answer(text: str) -> Extraction:
    text = text.replace("\x00", "")
    outside = FENCED.sub(" ", text)
    if outside != text and not TAGGED.search(outside) and TAGGED.search(text):
        return Extraction(answer=None, format_ok=False, reason="answer inside a code fence")
    text = outside
    opens, closes = len(OPEN_TAG.findall(text)), len(CLOSE_TAG.findall(text))
    if opens == 0 and closes == 0:
        return _last_number(text)
    if opens > 1 or closes > 1:
        return Extraction(answer=None, format_ok=False, reason="multiple answer tags")
    match = TAGGED.search(text)
    if match is None:
        return Extraction(answer=None, format_ok=False, reason="unbalanced answer tag")
    content = match.group(1).strip()
    if not content:
        return Extraction(answer=None, format_ok=False, reason="empty answer")
    stated = STATED.search(text[: match.start()])
    return Extraction(
        answer=content,
        format_ok=True,
        reason="tagged answer",
        stated=stated.group(1) if stated else None,
    )


def _last_number(text: str) -> Extraction:
    numbers = NUMBER.findall(text)
    if not numbers:
        return Extraction(answer=None, format_ok=False, reason="no answer")
    return Extraction(answer=numbers[-1], format_ok=False, reason="last number (untagged)")
