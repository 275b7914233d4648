"""Code tasks: the model writes a function; hidden tests run it in the sandbox.

1. A completion must hold exactly one fenced code block (```python ... ```). Several blocks
   earn nothing (a model must not hedge with alternatives); code with no fence at all is still
   run, for partial credit, so correctness can be measured before the format is learned.
2. The sandbox receives the candidate code and the test *inputs* only. A fixed harness calls
   the function on each input and reports the return values as one JSON line; the comparison
   with the expected outputs happens here, outside the sandbox. So exiting early, patching
   asserts, printing expected output or reading the test file cannot earn reward: the only way
   to produce the right values is to compute them.
3. Problems are split once, by position, into held-out and train problems; a round draws its
   train tasks from its seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Sequence
from functools import cache
from typing import Any, TypeVar

from verifiers.errors import VerifierError
from verifiers.problems import PROBLEMS, Problem
from verifiers.sandbox import Limits, Sandbox, Status
from verifiers.task import Split, Task
from verifiers.verdict import Verdict

T = TypeVar("T")
TASKSET = "code"
UNFORMATTED_CREDIT = 0.5
EVAL_EVERY = 4  # every fourth problem is held out
FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
EXAMPLE = (
    "Write a Python function `double(x: int) -> int`: Return twice x.",
    "```python\ndef double(x):\n    return 2 * x\n```",
)

HARNESS = r"""
import json, sys
payload = json.loads(sys.stdin.read())
report = sys.stdout
sys.stdout = sys.stderr
def emit(record):
    report.write(json.dumps(record) + "\n")
    report.flush()
def describe(error):
    return (type(error).__name__ + ": " + str(error))[:200]
namespace = {"__name__": "candidate"}
try:
    exec(compile(payload["code"], "<candidate>", "exec"), namespace)
    function = namespace[payload["entry"]]
except BaseException as error:
    emit({"load_error": describe(error)})
    raise SystemExit(0)
results = []
for args in payload["cases"]:
    try:
        results.append({"value": json.loads(json.dumps(function(*args), default=repr))})
    except BaseException as error:
        results.append({"error": describe(error)})
emit({"results": results})
"""


def eval_tasks(count: int) -> list[Task]:
    return [_task("eval", p) for p in split_items(TASKSET, PROBLEMS, "eval", count)]


def train_tasks(count: int, seed: int) -> list[Task]:
    return [_task("train", p) for p in split_items(TASKSET, PROBLEMS, "train", count, seed)]


def split_items(
    taskset: str, items: Sequence[T], split: Split, count: int, seed: int | None = None
) -> list[T]:
    """The first `count` items of a fixed set's split: every `EVAL_EVERY`-th item is held out;
    train items are shuffled by `seed`."""
    held_out = split == "eval"
    chosen = [x for i, x in enumerate(items) if (i % EVAL_EVERY == EVAL_EVERY - 1) == held_out]
    if seed is not None:
        random.Random(seed).shuffle(chosen)
    if not 1 <= count <= len(chosen):
        raise VerifierError(
            f"task set {taskset!r} has {len(chosen)} {split} tasks; asked for {count}"
        )
    return chosen[:count]


def worked_example() -> tuple[str, str]:
    return EXAMPLE


def verify(task: Task, completion: str, sandbox: Sandbox | None = None) -> Verdict:
    code, format_ok, reason = extract_code(completion)
    if code is None:
        return Verdict(reward=0.0, correct=False, format_ok=False, answer=None, reason=reason)
    tests = json.loads(task.answer)
    payload = {"code": code, "entry": tests["entry"], "cases": [a for a, _ in tests["cases"]]}
    execution = (sandbox or _sandbox()).run(HARNESS, json.dumps(payload))
    outcome = _outcome(execution.stdout, execution.status)
    passed, feedback = _compare(tests["entry"], tests["cases"], outcome)
    correct = passed == len(tests["cases"])
    reward = (1.0 if format_ok else UNFORMATTED_CREDIT) if correct else 0.0
    verdict_reason = f"{'correct' if correct else 'wrong'}, {passed}/{len(tests['cases'])} tests"
    first_failure = next((line for line in feedback if not line.startswith("passed")), None)
    return Verdict(
        reward=reward,
        correct=correct,
        format_ok=format_ok,
        answer=_behaviour(outcome),
        reason=f"{verdict_reason}, {reason}" + (f"; {first_failure}" if first_failure else ""),
        feedback=feedback,
    )


def extract_code(completion: str) -> tuple[str | None, bool, str]:
    """(code, format_ok, reason): the one fenced block, or unfenced code, or nothing."""
    text = completion.replace("\x00", "")
    blocks = FENCE.findall(text)
    if len(blocks) > 1:
        return None, False, "multiple code blocks"
    if len(blocks) == 1:
        code = blocks[0][1]
        if not code.strip():
            return None, False, "empty code block"
        return code, True, "fenced code"
    if "```" in text:
        return None, False, "unclosed code fence"
    if "def " not in text:
        return None, False, "no code"
    return text[text.index("def ") :], False, "unfenced code"


def _outcome(stdout: str, status: Status) -> dict[str, Any]:
    """The harness's last report line, or why there is none."""
    for line in reversed(stdout.splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and ("results" in record or "load_error" in record):
            return record
    return {"load_error": f"no test report ({status.value})"}


def _compare(entry: str, cases: list[list[Any]], outcome: dict[str, Any]) -> tuple[int, list[str]]:
    results = outcome.get("results")
    if not isinstance(results, list) or len(results) != len(cases):
        return 0, [f"the code did not run: {outcome.get('load_error', 'malformed report')}"]
    passed, feedback = 0, []
    for (args, expected), result in zip(cases, results, strict=True):
        call = f"{entry}({', '.join(map(repr, args))})"
        if isinstance(result, dict) and "value" in result and _same(result["value"], expected):
            passed += 1
            feedback.append(f"passed: {call}")
        elif isinstance(result, dict) and "error" in result:
            feedback.append(f"failed: {call} raised {result['error']}")
        else:
            got = result.get("value") if isinstance(result, dict) else result
            feedback.append(f"failed: {call} returned {got!r}, expected {expected!r}")
    return passed, feedback


def _same(got: Any, expected: Any) -> bool:
    if isinstance(expected, float) or isinstance(got, float):
        return (
            isinstance(got, int | float)
            and not isinstance(got, bool)
            and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
        )
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(map(_same, got, expected))
    return type(got) is type(expected) and got == expected


def _behaviour(outcome: dict[str, Any]) -> str:
    """An answer key for outcome counting: a fingerprint of what the code returned."""
    digest = hashlib.sha256(json.dumps(outcome, sort_keys=True).encode()).hexdigest()
    return f"behaviour:{digest[:16]}"


def _task(split: Split, problem: Problem) -> Task:
    question = (
        f"Write a Python function `{problem.signature}`: {problem.description} "
        "Reply with the function in one ```python code block."
    )
    tests = {"entry": problem.entry, "cases": problem.cases()}
    return Task(
        task_id=f"{TASKSET}:{problem.entry}",
        taskset=TASKSET,
        split=split,
        question=question,
        answer=json.dumps(tests),
    )


@cache
def _sandbox() -> Sandbox:
    return Sandbox(Limits(wall_s=5.0, cpu_s=5))
