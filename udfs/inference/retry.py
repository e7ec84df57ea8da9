"""The one retry layer of llmstream: what to retry, how long to wait, when to give up.

`classify` says retryable vs permanent for an HTTP status (as `udfs/inference/statuses.py`'s table
decides); `parse_retry_after` reads the server's hint; `RetryPolicy.run` drives the attempts of one record with exponential
backoff and full jitter, bounded by `retry.max_attempts` and by the record's `Deadline`.
Nothing else in llmstream retries, and nothing else enforces the record deadline.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Literal, TypeVar

from udfs.config import RetryConfig
from udfs.errors import DeadlineExceeded, PermanentError, RetryableError
from udfs.inference.statuses import of_status

log = logging.getLogger(__name__)

T = TypeVar("T")
Verdict = Literal["retryable", "permanent"]



def classify(status: int | None) -> Verdict:
    """Whether an attempt answered with `status` (`None`: no answer) may pass on retry, or its
    record is dead-lettered at once: `statuses.of_status(status).retryable`."""
    return "retryable" if of_status(status).retryable else "permanent"


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(text: str) -> float | None:
    """Seconds in a Go-style duration as OpenAI sends it (`1s`, `6m0s`, `250ms`, `1m30.5s`)."""
    text = text.strip()
    if not text:
        return None
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            return None
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if pos != len(text):
        try:
            return float(text) if pos == 0 else None
        except ValueError:
            return None
    return total


def _seconds_or_date(value: str, now: float) -> float | None:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return when.timestamp() - now


def parse_retry_after(headers: Mapping[str, str], now: float | None = None, *,
                      max_s: float | None = None) -> float | None:
    """How long the server asks us to wait, in seconds, or `None` if it does not say.

    Honours `retry-after-ms`, then `Retry-After` (seconds or HTTP-date, relative to `now`,
    epoch seconds), then OpenAI's `x-ratelimit-reset-requests` / `-tokens` when the matching
    `x-ratelimit-remaining-*` is 0. Never negative; capped at `max_s` so a hostile or broken
    server cannot park a record for an hour.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    now = time.time() if now is None else now
    wait: float | None = None
    if "retry-after-ms" in lower:
        try:
            wait = float(lower["retry-after-ms"]) / 1000
        except ValueError:
            wait = None
    if wait is None and "retry-after" in lower:
        wait = _seconds_or_date(lower["retry-after"], now)
    if wait is None:
        resets = [parse_duration(lower.get(f"x-ratelimit-reset-{kind}", ""))
                  for kind in ("requests", "tokens")
                  if lower.get(f"x-ratelimit-remaining-{kind}", "").strip() == "0"]
        known = [r for r in resets if r is not None]
        wait = max(known) if known else None
    if wait is None or math.isnan(wait):
        return None
    wait = max(0.0, wait)
    return min(wait, max_s) if max_s is not None else wait


class Deadline:
    """A record's overall time budget, covering every attempt, wait and queue after it starts.

    It starts on `start()`, which the client calls when the record's first attempt is
    dispatched (it has a concurrency slot and its rate-limit tokens), so records that merely
    wait in line behind a sustained rate limit are slowed, never dead-lettered. Attempts run
    inside `scope()`, which cancels them when the deadline passes, even if it started mid-way.
    """

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self._expires_at: float | None = None
        self._scope: asyncio.Timeout | None = None

    @property
    def started(self) -> bool:
        return self._expires_at is not None

    def start(self) -> None:
        if self._expires_at is not None:
            return
        self._expires_at = asyncio.get_running_loop().time() + self.budget_s
        if self._scope is not None:
            self._scope.reschedule(self._expires_at)

    def remaining(self) -> float | None:
        """Seconds left, or `None` before it started."""
        if self._expires_at is None:
            return None
        return self._expires_at - asyncio.get_running_loop().time()

    def scope(self) -> _Scope:
        """An `asyncio.timeout_at` the deadline's `start()` reschedules while it is entered."""
        return _Scope(self)


class _Scope:
    """`Deadline.scope()`: a class, not an `asynccontextmanager` generator, because it is entered
    once for every attempt of every record, and a generator's set-up is measurable there."""

    __slots__ = ("_deadline", "_timeout")

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline
        self._timeout = asyncio.timeout_at(deadline._expires_at)

    async def __aenter__(self) -> asyncio.Timeout:
        timeout = await self._timeout.__aenter__()
        self._deadline._scope = timeout
        return timeout

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._deadline._scope = None
        await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError when it expired


class RetryPolicy:
    """Exponential backoff with full jitter, from `RetryConfig`; `rng` and `sleep` are for tests."""

    def __init__(self, config: RetryConfig, *, rng: random.Random | None = None,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        self.config = config
        self._rng = rng or random.Random()
        self._sleep = sleep

    def backoff(self, attempt: int) -> float:
        """Wait after failed attempt `attempt` (1-based): uniform in [0, min(max, initial * 2^(attempt-1))]."""
        ceiling = min(self.config.max_backoff_s, self.config.initial_backoff_s * 2 ** (attempt - 1))
        return self._rng.uniform(0, ceiling)

    def wait_after(self, attempt: int, error: RetryableError) -> float:
        """The backoff, or the error's own `retry_after_s` when it carries one that is longer. The
        inference client's errors carry none: a server's `Retry-After` comes back as a value
        (`transport.Reply`) and pauses the endpoint that sent it (`Fleet.release`), which a retry
        waits for only when no other endpoint may take it."""
        wait = self.backoff(attempt)
        if error.retry_after_s is not None and error.retry_after_s > wait:
            return error.retry_after_s
        return wait

    async def run(self, call: Callable[[int], Awaitable[T]], deadline: Deadline | None = None) -> T:
        """Calls `call(attempt)` until it returns, fails permanently, or attempts or time run out.

        `call` raises `RetryableError` or `PermanentError` (anything else passes through).
        Raises the `PermanentError` at once; the last `RetryableError` after `max_attempts`;
        `DeadlineExceeded` when the deadline cuts an attempt short or the next wait would pass
        it. Every raised error has `.attempts` set to the attempts made.
        """
        last: RetryableError | None = None
        attempt = 0
        while True:
            attempt += 1
            scope: asyncio.Timeout | None = None
            try:
                if deadline is None:
                    return await call(attempt)
                async with deadline.scope() as scope:
                    return await call(attempt)
            except TimeoutError as err:
                if scope is None or not scope.expired():
                    raise
                assert deadline is not None
                raise self._deadline_exceeded(deadline, attempt, last, "during an attempt") from err
            except PermanentError as err:
                err.attempts = attempt
                log.debug("attempt %d failed permanently (status %s): giving up", attempt, err.status)
                raise
            except RetryableError as err:
                err.attempts = attempt
                last = err
                if attempt >= self.config.max_attempts:
                    log.debug("attempt %d failed (status %s): max_attempts=%d reached, giving up",
                              attempt, err.status, self.config.max_attempts)
                    raise
                wait = self.wait_after(attempt, err)
                remaining = deadline.remaining() if deadline is not None else None
                if remaining is not None and wait >= remaining:
                    log.debug("attempt %d failed (status %s): next wait %.3f s passes the deadline "
                              "(%.3f s left), giving up", attempt, err.status, wait, remaining)
                    assert deadline is not None
                    raise self._deadline_exceeded(deadline, attempt, err, "before the next attempt") from err
                log.debug("attempt %d failed (status %s, retry-after %s): retrying in %.3f s",
                          attempt, err.status, err.retry_after_s, wait)
                await self._sleep(wait)

    @staticmethod
    def _deadline_exceeded(deadline: Deadline, attempts: int, last: RetryableError | None,
                           when: str) -> DeadlineExceeded:
        detail = f"record deadline of {deadline.budget_s:g} s passed {when} (attempt {attempts})"
        if last is not None:
            detail += f"; last error: {last.detail}"
        log.debug(detail)
        return DeadlineExceeded(detail, status=last.status if last else None,
                                retry_after_s=last.retry_after_s if last else None, attempts=attempts)
