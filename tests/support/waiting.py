"""Waiting for a condition with a deadline: the tests never sleep a fixed time and hope.

A test waits for what it needs (a connection closed, a job running, a record committed) and fails
with a message that names what it waited for. Timeouts are generous because the 2-core machine
may be busy; a condition that holds early ends the wait early, so a generous timeout costs nothing
when things go well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

T = TypeVar("T")

METRICS_SETTLE_S = 2.0
"""How long a restart count waits for the REST API's metric store to catch up (`FlinkRest.num_restarts`)."""

class Hopeless(AssertionError):
    """Raised by a condition that can no longer come true (e.g. the run it waits on has ended):
    ends the wait at once even when ``ignoring`` would swallow an AssertionError."""


Message = str | Callable[[], str]
"""What was awaited, or a function that says it at the timeout (e.g. with the logs of that moment)."""


def wait_until(condition: Callable[[], T | None], timeout: float, interval: float = 0.5,
               message: Message = "the condition", *,
               ignoring: tuple[type[Exception], ...] = (),
               done: Callable[[T], object] | None = None, or_last: bool = False) -> T:
    """Calls ``condition`` every ``interval`` seconds until it returns something truthy, and
    returns that. After ``timeout`` seconds raises an AssertionError: ``timed out after <timeout>
    s waiting for <message>``.

    The condition is called at least once, and its last call is at or after the deadline, so a
    slow machine's late answer still counts. Exceptions of the ``ignoring`` types count as "not
    yet" (e.g. an endpoint that is not up); the last one is named in the timeout message. Any
    other exception, an assertion in the condition included, ends the wait at once, and so does
    a `Hopeless` whatever ``ignoring`` says.

    ``done`` judges each value instead of its truth (a tally is done when nothing is lost).
    ``or_last`` returns the last value at the timeout instead of raising, for a caller whose own
    assertions on that value say more than a timeout would (the ids lost, the records that did
    arrive); it still raises when no call returned a value (each raised an ignored error).
    """
    finished: Callable[[T], object] = done or bool
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    answered = False
    value: T | None = None
    while True:
        try:
            value = condition()
            answered = True
            if value is not None and finished(value):
                return value
        except Hopeless:
            raise
        except ignoring as err:
            last_error = err
        if time.monotonic() >= deadline:
            if or_last and answered:
                return cast(T, value)
            raise AssertionError(_timed_out(timeout, message, last_error))
        time.sleep(interval)


async def wait_until_async(condition: Callable[[], Awaitable[T | None]], timeout: float, interval: float = 0.5,
                           message: Message = "the condition") -> T:
    """`wait_until` inside a coroutine, for a condition that is awaited; sleeps on the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(timeout, message, None))
        await asyncio.sleep(interval)


def _timed_out(timeout: float, message: Message, last_error: Exception | None) -> str:
    what = message() if callable(message) else message
    text = f"timed out after {timeout:g} s waiting for {what}"
    return text if last_error is None else f"{text} (last error: {last_error})"
