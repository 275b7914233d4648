"""An agent as people write them: the plain openai client, a tool, several turns, streaming on.
It adds four-digit numbers with an `add` tool. Nothing in it knows about flywheel but the base
URL, its key, and two headers (the session and the task); the feedback call sends the answer
it expected, for the gateway's verifier to score the session.

    FLYWHEEL_API_KEYS=k flywheel serve --source captured --gateway-port 8000 \\
        --evaluation examples.agent:evaluate ...
    python examples/agent.py http://127.0.0.1:8000 k

`evaluate(base_url, model, api_key)` is the agent's own evaluation: the same agent, unmodified,
pointed at `model`, on held-out tasks it never trains on, one score per task. The flywheel's gate
calls it for a candidate version and for the serving one (`--evaluation`).

`Sums` is the agent's task set (`--taskset examples.agent:Sums`): its train and held-out sums, and
its own notion of a right answer (`correct`), with which the gateway scores a session whose
feedback sends the expected answer, and the siblings and reviewer's answers grown from it. A
task set's built-in verifier would judge the agent by another rule (answer tags), and rounds
would learn that rule instead of the agent's.
"""

from __future__ import annotations

import json
import random
import sys
import uuid
from typing import Any

import httpx
from openai import OpenAI

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
SYSTEM = "Use the add tool to add numbers, then reply with the result only."
HELD_OUT_SEED = 7_000_003  # held-out tasks come from a seed of their own


def tasks(count: int, seed: int) -> list[tuple[str, str, int]]:
    """`count` sums of two four-digit numbers: (task name, question, answer)."""
    rng = random.Random(seed)
    drawn = []
    for _ in range(count):
        a, b = rng.randrange(1000, 10000), rng.randrange(1000, 10000)
        drawn.append((f"sum-{a}-{b}", f"What is {a} + {b}?", a + b))
    return drawn


def held_out(count: int) -> list[tuple[str, str, int]]:
    return tasks(count, HELD_OUT_SEED)


class Sums:
    """The agent's tasks and its rule for a right answer, as a flywheel task set reads them
    (any object with these names; nothing here imports the flywheel)."""

    system_prompt = SYSTEM

    @staticmethod
    def train_tasks(count: int, seed: int) -> list[tuple[str, str]]:
        return [(question, str(answer)) for _, question, answer in tasks(count, seed)]

    @staticmethod
    def eval_tasks(count: int) -> list[tuple[str, str]]:
        return [(question, str(answer)) for _, question, answer in held_out(count)]

    @staticmethod
    def verify(task: Any, completion: str) -> bool:
        """Right when the reply ends on the expected sum (`task.answer`, as feedback sent it)."""
        expected = str(task.answer).strip()
        return expected.lstrip("-").isdigit() and correct(completion, int(expected))


def solve(
    client: OpenAI, question: str, headers: dict[str, str], turns: int = 3,
    first: str = "required", model: str = "policy",
) -> str:  # fmt: skip
    """Ask, run the tool calls the model makes, and return its final text. `first` is the first
    request's `tool_choice`: "required" (a small model answers sums in its head otherwise, and
    wrongly), or "auto"."""
    return converse(client, question, headers, turns, first, model)[0]


def converse(
    client: OpenAI, question: str, headers: dict[str, str], turns: int = 3,
    first: str = "required", model: str = "policy",
) -> tuple[str, int]:  # fmt: skip
    """`solve`, and how many tool calls the model made."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    calls = 0
    for turn in range(turns):
        stream = client.chat.completions.create(
            model=model, messages=messages, tools=[ADD], max_tokens=48, extra_headers=headers,
            tool_choice=first if turn == 0 else "auto", stream=True,  # type: ignore[arg-type]
        )  # fmt: skip
        reply = gather(stream)
        messages.append(reply)
        if not reply.get("tool_calls"):
            return reply.get("content") or "", calls
        for call in reply["tool_calls"]:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool(call)})
    return "", calls


def gather(stream: Any) -> dict[str, Any]:
    """A streamed reply as one assistant message: its text and its tool calls, put together
    from their pieces."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {
                    "id": "", "type": "function", "function": {"name": "", "arguments": ""},
                })  # fmt: skip
                call["id"] = piece.id or call["id"]
                if piece.function is not None:
                    call["function"]["name"] += piece.function.name or ""
                    call["function"]["arguments"] += piece.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def run_tool(call: dict[str, Any]) -> str:
    try:
        args = json.loads(call["function"]["arguments"])
        total = float(args["a"]) + float(args["b"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"
    return str(int(total)) if total.is_integer() else str(total)


def correct(answer: str, expected: int) -> bool:
    words = answer.replace(",", "").replace("=", " ").split()
    return bool(words) and words[-1].rstrip(".") in (str(expected), f"{expected}.0")


def run(base_url: str, key: str, chosen: list[tuple[str, str, int]], tries: int = 1) -> list[float]:
    """Each task `tries` times through the gateway, each conversation its own session; the
    expected answer goes back as feedback, and the gateway's verifier scores the session."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key=key)
    auth = {"Authorization": f"Bearer {key}"}
    scores = []
    for task, question, expected in chosen:
        for _ in range(tries):
            session = uuid.uuid4().hex
            headers = {"X-Flywheel-Session": session, "X-Flywheel-Task": task}
            solve(client, question, headers)
            feedback = {"session": session, "reference": str(expected)}
            sent = httpx.post(f"{base_url}/v1/feedback", json=feedback, headers=auth, timeout=60)
            scores.append(float(sent.raise_for_status().json()["score"]))
    return scores


def evaluate(base_url: str, model: str, api_key: str, count: int = 16) -> list[float]:
    """The agent on `count` held-out tasks, pointed at `model`: 1 for the right sum, else 0."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    return [
        float(correct(solve(client, question, {}, model=model), expected))
        for _, question, expected in held_out(count)
    ]


if __name__ == "__main__":
    print(run(sys.argv[1], sys.argv[2], tasks(4, seed=0)))  # noqa: T201 - the example's output
