"""Capture: gateway traffic recorded as trajectories, so real usage feeds the flywheel.

1. A captured chat completion is stored as a one-attempt group (purpose `capture`) with the
   exact prompt and completion token ids and logprobs the server sampled, reward 0 until
   feedback or a verifier score arrives (`record_feedback`). The fields the gateway added to the
   upstream request to get those ids are removed from the caller's response unless the caller
   asked for them.
2. Turns of one conversation are tied by the `X-Flywheel-Session` header, or, without it, by
   the request's `user` field; episodes of the same task by the `X-Flywheel-Task` header. Both
   belong to the key that sent them: they are kept in the captured group's plan prefixed with
   the key's fingerprint (`{"session": "<owner>:<id>", "task": "<owner>:<tag>", "owner": ...}`),
   so another key's session of the same name is another session, and its feedback never reaches
   this one. `memory.sessions` stitches a session's turns into one token sequence.
   A share of sessions (`held_out_share`, decided by the session's name when it arrives) is
   held out: never trained on, kept to judge new versions on the agent's own work.
3. A request with `X-Flywheel-Capture: off`, or made with a key listed as uncaptured, is
   answered and not recorded.
4. Feedback scores a turn or a session: a score the client gives, or the gateway's task-set
   verifier's score of the last answer against a reference the client sends.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from memory.records import UNRATED, Attempt, Group, GroupPlan, Sample, SamplingSettings
from verifiers.task import Task, task_id

CAPTURE_HEADER = "X-Flywheel-Capture-Id"
SESSION_HEADER = "X-Flywheel-Session"
TASK_HEADER = "X-Flywheel-Task"
OPT_OUT_HEADER = "X-Flywheel-Capture"


def owner(key: str) -> str:
    """The fingerprint a key's captured traffic is filed under (the key itself is never
    stored)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def owned(by: str, name: str) -> str:
    """A session or task name as stored: its owner's fingerprint, then the caller's name."""
    return f"{by}:{name}"[:200]


def tags(
    headers: Mapping[str, str], body: dict[str, Any], by: str, held_out_share: float = 0.0
) -> GroupPlan:
    """The session (header, else the `user` field) and task (header) a request belongs to,
    each filed under its owner `by` (`owner` of the caller's key), and whether the session is
    held out (`held_out`)."""
    session, task = headers.get(SESSION_HEADER) or body.get("user"), headers.get(TASK_HEADER)
    name = owned(by, str(session)) if session else None
    return GroupPlan(
        owner=by,
        session=name,
        task=owned(by, task) if task else None,
        held_out=name is not None and held_out(name, held_out_share),
    )


def held_out(session: str, share: float) -> bool:
    """Whether a session (its stored name) is kept to judge new versions, never to train them:
    decided by its name alone when its first turn arrives, so every turn of it lands on the
    same side, and about `share` of sessions are kept."""
    digest = hashlib.sha256(f"held-out:{session}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def reference_task(taskset: str, question: str, reference: str) -> Task:
    """A captured question as a task of `taskset` with the reference a client sent, for the
    task set's verifier to score the captured answer."""
    return Task(
        task_id=task_id(taskset, question), taskset=taskset, split="train", question=question,
        answer=reference,
    )  # fmt: skip


def opted_out(headers: Mapping[str, str]) -> bool:
    return headers.get(OPT_OUT_HEADER, "").strip().lower() in ("off", "0", "no", "false")


def prepare_request(body: dict[str, Any]) -> dict[str, bool]:
    """Ask the upstream for token ids and logprobs; returns what the caller asked for itself."""
    asked = {"logprobs": bool(body.get("logprobs")), "ids": bool(body.get("return_token_ids"))}
    body["logprobs"] = True
    body["return_token_ids"] = True
    return asked


def captured_group(
    body: dict[str, Any],
    response: dict[str, Any],
    task_id: str,
    tagged: GroupPlan | None = None,
) -> Group | None:
    """The trajectory in a completed chat response (stored under `task_id`, with its session
    and task `tagged`), or None if it lacks token ids."""
    choices = response.get("choices") or []
    prompt_ids = response.get("prompt_token_ids")
    if not choices or prompt_ids is None or choices[0].get("token_ids") is None:
        return None
    choice = choices[0]
    content = (choice.get("logprobs") or {}).get("content") or []
    messages = body.get("messages") or []
    question = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    sample = Sample(
        text=(choice.get("message") or {}).get("content") or "",
        prompt_token_ids=prompt_ids,
        completion_token_ids=choice["token_ids"],
        logprobs=[entry["logprob"] for entry in content],
        finish_reason=choice.get("finish_reason") or "unknown",
    )
    attempt = Attempt(
        sample_index=0,
        policy_version=body["model"],
        messages=messages,
        sampling=SamplingSettings(  # null means the default, as in the OpenAI API
            temperature=_number(body.get("temperature"), 1.0),
            max_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 0),
            top_p=_number(body.get("top_p"), 1.0),
        ),
        sample=sample,
        reward=0.0,
        correct=False,
        format_ok=False,
        answer=None,
        reason=UNRATED,
    )
    return Group(
        round_index=0,
        purpose="capture",
        task_id=task_id,
        taskset="gateway",
        question=str(question),
        policy_version=body["model"],
        size=1,
        attempts=[attempt],
        plan=tagged or GroupPlan(),
    )


class StreamRecorder:
    """The first choice of a streamed chat completion, gathered chunk by chunk."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = None
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None

    def feed(self, chunk: dict[str, Any]) -> None:
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            self.text.append((choice.get("delta") or {}).get("content") or "")
            self.ids.extend(choice.get("token_ids") or [])
            content = (choice.get("logprobs") or {}).get("content") or []
            self.logprobs.extend(entry["logprob"] for entry in content)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def response(self) -> dict[str, Any]:
        """What a non-streamed answer would have held, for `captured_group`."""
        choice = {
            "message": {"role": "assistant", "content": "".join(self.text)},
            "token_ids": self.ids if self.finish_reason else None,  # unfinished: not captured
            "logprobs": {"content": [{"logprob": lp} for lp in self.logprobs]},
            "finish_reason": self.finish_reason,
        }
        return {"prompt_token_ids": self.prompt_ids, "choices": [choice]}


def relay_line(line: str, recorder: StreamRecorder, asked: dict[str, bool]) -> str:
    """One line of a server-sent event stream: its chunk recorded, then passed on without the
    fields the caller did not ask for."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return line
    try:
        chunk = json.loads(line.removeprefix("data: "))
    except ValueError:
        return line
    if not isinstance(chunk, dict):
        return line
    recorder.feed(chunk)
    return "data: " + json.dumps(strip_unasked(chunk, asked))


def _number(value: Any, default: float) -> float:
    return default if value is None else float(value)


def strip_unasked(response: dict[str, Any], asked: dict[str, bool]) -> dict[str, Any]:
    if not asked["ids"]:
        response.pop("prompt_token_ids", None)
    for choice in response.get("choices") or []:
        if not asked["ids"]:
            choice.pop("token_ids", None)
        if not asked["logprobs"]:
            choice["logprobs"] = None
    return response
