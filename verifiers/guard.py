"""A task set's own code under a deadline: whatever it does to one task is that task's fault.

1. `run(label, function, *args)` calls a task set's code (a verifier, a plugin's
   `verify`, an environment's `reset`, `step` or `verdict`, the sandbox) in a thread of its own
   and waits at most the deadline in force. Any exception it raises, or a deadline it passes,
   becomes one `TaskFault` line that names the part and the reason; cancellation is never
   caught.
2. A thread cannot be killed, but pure-Python code (sympy, math-verify, reasoning-gym, most
   plugins) can be interrupted: past its deadline the thread gets an asynchronous `Overrun`
   exception at its next bytecode and ends. It is a thread of its own, never a pool's, so a late
   interruption can only ever land in it. Code stuck inside a C call keeps its thread until it
   returns; the caller is free either way.
3. `check_text` refuses model-written text longer than `max_chars` before any parser
   sees it (a 10,000-character expression can keep sympy busy for minutes).
4. The limits in force are set once where a batch is collected (`applied(guard)`), and every
   verification under it reads them (`current()`), as a deadline scope would: the settings are
   the batch's, and the dozen calls that verify need not carry them.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
from anyio.from_thread import run_sync as from_thread
from pydantic import BaseModel, ConfigDict, Field

from verifiers.errors import TaskFault, VerifierError

T = TypeVar("T")


class Guard(BaseModel):
    """Limits on a task set's code and on the model text it is handed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deadline_s: float = Field(
        30.0, gt=0, description="the longest a verifier, environment or sandbox call may take"
    )
    max_chars: int = Field(
        20_000, ge=1, description="the longest model-written text handed to a verifier"
    )


DEFAULT = Guard()
_CURRENT: ContextVar[Guard | None] = ContextVar("guard", default=None)


def current() -> Guard:
    """The limits in force here (the defaults outside any `applied`)."""
    return _CURRENT.get() or DEFAULT


@contextmanager
def applied(guard: Guard) -> Iterator[None]:
    """Put `guard` in force for the calls made inside (tasks started inside inherit it)."""
    token = _CURRENT.set(guard)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class Overrun(BaseException):  # noqa: N818 - raised into a thread, never caught by `except Exception`
    """Raised inside a guarded thread that passed its deadline."""


def check_text(label: str, text: str) -> None:
    """`TaskFault` if `text` is longer than the limits in force allow."""
    guard = current()
    if len(text) > guard.max_chars:
        raise TaskFault(f"{label}: {len(text)} characters, over the limit of {guard.max_chars}")


async def run(
    label: str,
    function: Callable[..., T],
    *args: Any,
    limiter: anyio.CapacityLimiter | None = None,
) -> T:
    """`function(*args)` in a thread of its own, within the deadline in force (see the module
    docstring). `limiter`, if given, bounds how many such calls run at once (sandboxes: one per
    core)."""
    guard = current()
    if limiter is None:
        return await _run(guard, label, function, args)
    async with limiter:
        return await _run(guard, label, function, args)


async def _run(guard: Guard, label: str, function: Callable[..., T], args: tuple[Any, ...]) -> T:
    call = _Call(function, args, anyio.Event(), anyio.lowlevel.current_token())
    thread = threading.Thread(target=call.run, name=f"guard {label}", daemon=True)
    thread.start()
    with anyio.move_on_after(guard.deadline_s) as scope:
        await call.done.wait()
    if scope.cancelled_caught:
        call.interrupt(thread)
        raise TaskFault(f"{label}: no answer within {guard.deadline_s:g} s")
    if call.error is not None:
        if isinstance(call.error, VerifierError):  # already one line that names the part
            raise TaskFault(_one_line(str(call.error))) from call.error
        reason = f"{type(call.error).__name__}: {call.error}".strip()
        raise TaskFault(f"{label} raised {_one_line(reason)}") from call.error
    result: T = call.result
    return result


class _Call:
    """One guarded call and what it produced; `finished` guards the interrupt against a race
    with the call's own end."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], done: anyio.Event,
                 token: Any) -> None:  # fmt: skip
        self.function, self.args, self.done, self.token = function, args, done, token
        self.result: Any = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.finished = False

    def run(self) -> None:
        with suppress(Overrun):  # interrupted: nobody waits for it any more
            self._run()

    def _run(self) -> None:
        try:
            self.result = self.function(*self.args)
        except Exception as exc:  # noqa: BLE001 - any failure of a task set's code is the task's
            self.error = exc
        finally:
            with self.lock:
                self.finished = True
        with suppress(RuntimeError):  # the event loop has gone
            from_thread(self.done.set, token=self.token)

    def interrupt(self, thread: threading.Thread) -> None:
        with self.lock:
            if self.finished or thread.ident is None:
                return
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(thread.ident), ctypes.py_object(Overrun)
            )


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    return (lines[0] if lines else "")[:300]
