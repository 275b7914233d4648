"""An agent on the plain openai client, pointed at the flywheel gateway: it answers sums with an
`add` tool over a few turns, and reports each conversation's outcome as feedback. Nothing in it
knows about flywheel but two headers (the session and the task) and the feedback call.

    FLYWHEEL_API_KEYS=k flywheel gateway --capture ... &
    python examples/agent.py http://127.0.0.1:8000 k
"""

from __future__ import annotations

import json
import sys
import uuid

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


def solve(
    client: OpenAI, question: str, headers: dict[str, str], turns: int = 3, first: str = "auto"
) -> str:
    """Ask, run the tool calls the model makes, and return its final text. `first` is the first
    request's `tool_choice` ("required" makes a small model call the tool at least once)."""
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    for turn in range(turns):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[ADD], max_tokens=48, extra_headers=headers,
            tool_choice=first if turn == 0 else "auto",  # type: ignore[arg-type]
        ).choices[0].message  # fmt: skip
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(float(args["a"]) + float(args["b"]))
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def run(base_url: str, key: str, tasks: dict[str, tuple[str, float]], tries: int) -> list[float]:
    """`tries` conversations per task, each scored 1 if its answer is the sum, as feedback."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key=key)
    scores = []
    for task, (question, expected) in tasks.items():
        for _ in range(tries):
            session = uuid.uuid4().hex
            headers = {"X-Flywheel-Session": session, "X-Flywheel-Task": task}
            answer = solve(client, question, headers)
            right = answer.strip().rstrip(".") in (str(expected), str(int(expected)))
            score = 1.0 if right else 0.0
            feedback = {"session": session, "score": score}
            auth = {"Authorization": f"Bearer {key}"}
            sent = httpx.post(f"{base_url}/v1/feedback", json=feedback, headers=auth, timeout=30)
            sent.raise_for_status()
            scores.append(score)
    return scores


if __name__ == "__main__":
    sums = {"sum-2-3": ("What is 2 + 3?", 5.0), "sum-7-8": ("What is 7 + 8?", 15.0)}
    print(run(sys.argv[1], sys.argv[2], sums, tries=2))  # noqa: T201 - the example's output
