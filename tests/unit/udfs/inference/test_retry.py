"""The retry layer's decisions, with injected randomness and sleep: no network, no waiting."""

from __future__ import annotations

import asyncio
import logging
import random
from email.utils import formatdate

import pytest

from udfs.config import RetryConfig
from udfs.errors import DeadlineExceeded, PermanentError, RateLimited, RetryableError
from udfs.inference.retry import (
    Deadline,
    RetryPolicy,
    classify,
    parse_duration,
    parse_retry_after,
)


class UpperBound(random.Random):
    """Full jitter's worst case: always the top of the range."""

    def uniform(self, a: float, b: float) -> float:
        return b


class Sleeps:
    """An injected sleep that records what it was asked to wait and returns at once."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


class Script:
    """A call that raises the scripted errors in turn, then returns "ok"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.attempts: list[int] = []

    async def __call__(self, attempt: int) -> str:
        self.attempts.append(attempt)
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def policy(sleeps: Sleeps, **config: float) -> RetryPolicy:
    return RetryPolicy(RetryConfig(**config), rng=UpperBound(), sleep=sleeps)  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [None, 408, 409, 429, 500, 502, 503, 504, 599])
def test_no_response_and_408_409_429_5xx_are_retryable(status: int | None) -> None:
    assert classify(status) == "retryable"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 413, 422, 301])
def test_other_statuses_are_permanent(status: int) -> None:
    assert classify(status) == "permanent"


def test_backoff_doubles_from_initial_up_to_the_cap() -> None:
    retry = RetryPolicy(RetryConfig(initial_backoff_s=0.5, max_backoff_s=3.0), rng=UpperBound())
    assert [retry.backoff(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_backoff_is_full_jitter_between_zero_and_the_ceiling() -> None:
    retry = RetryPolicy(RetryConfig(initial_backoff_s=1.0, max_backoff_s=30.0), rng=random.Random(7))
    waits = [retry.backoff(3) for _ in range(2000)]
    assert 0 <= min(waits) < 0.1 and 3.9 < max(waits) <= 4.0
    assert 1.8 < sum(waits) / len(waits) < 2.2


@pytest.mark.parametrize(("text", "seconds"), [
    ("1s", 1.0), ("6m0s", 360.0), ("250ms", 0.25), ("1m30.5s", 90.5), ("2h", 7200.0), ("0.5", 0.5),
    ("", None), ("soon", None), ("1x", None), ("s1", None),
])
def test_parse_duration_reads_openais_reset_format(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


NOW = 1_700_000_000.0


@pytest.mark.parametrize(("headers", "seconds"), [
    ({"Retry-After": "3"}, 3.0),
    ({"retry-after": "1.5"}, 1.5),
    ({"Retry-After": formatdate(NOW + 20, usegmt=True)}, 20.0),
    ({"Retry-After": formatdate(NOW - 20, usegmt=True)}, 0.0),
    ({"Retry-After": "-4"}, 0.0),
    ({"Retry-After": "whenever"}, None),
    ({"retry-after-ms": "250", "Retry-After": "9"}, 0.25),
    ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m30.5s"}, 90.5),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "250ms",
      "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"}, 2.0),
    ({"x-ratelimit-remaining-requests": "5", "x-ratelimit-reset-requests": "20s"}, None),
    ({"Retry-After": "2", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "9s"}, 2.0),
    ({}, None),
])
def test_parse_retry_after(headers: dict[str, str], seconds: float | None) -> None:
    wait = parse_retry_after(headers, NOW)
    assert wait is None if seconds is None else wait == pytest.approx(seconds)


@pytest.mark.parametrize("headers", [
    {"Retry-After": "3600"},
    {"Retry-After": formatdate(NOW + 3600, usegmt=True)},
    {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0s"},
])
def test_parse_retry_after_is_capped(headers: dict[str, str]) -> None:
    assert parse_retry_after(headers, NOW, max_s=60.0) == 60.0


def test_retries_with_growing_backoff_then_succeeds() -> None:
    sleeps = Sleeps()
    call = Script(RetryableError("e1", status=500), RetryableError("e2", status=502))
    assert asyncio.run(policy(sleeps, initial_backoff_s=0.1).run(call)) == "ok"
    assert call.attempts == [1, 2, 3]
    assert sleeps.waits == [0.1, 0.2]


def test_permanent_error_stops_at_once_with_attempts_set() -> None:
    sleeps = Sleeps()
    call = Script(RetryableError("busy", status=503), PermanentError("bad", status=400))
    with pytest.raises(PermanentError) as caught:
        asyncio.run(policy(sleeps).run(call))
    assert caught.value.attempts == 2 and caught.value.status == 400
    assert len(sleeps.waits) == 1


def test_gives_up_after_max_attempts_with_the_last_retryable_error() -> None:
    sleeps = Sleeps()
    call = Script(*(RetryableError(f"e{n}", status=500 + n) for n in range(10)))
    with pytest.raises(RetryableError) as caught:
        asyncio.run(policy(sleeps, max_attempts=4).run(call))
    assert caught.value.detail == "e3" and caught.value.status == 503
    assert caught.value.attempts == 4
    assert len(sleeps.waits) == 3


def test_retry_after_replaces_the_backoff_only_when_longer() -> None:
    sleeps = Sleeps()
    call = Script(RateLimited("slow down", status=429, retry_after_s=5.0),
                  RateLimited("slow down", status=429, retry_after_s=0.01))
    asyncio.run(policy(sleeps, initial_backoff_s=0.5).run(call))
    assert sleeps.waits == [5.0, 1.0]


def test_stops_with_deadline_exceeded_when_the_next_wait_would_pass_the_deadline() -> None:
    sleeps = Sleeps()
    call = Script(RateLimited("slow down", status=429, retry_after_s=30.0))

    async def run() -> None:
        deadline = Deadline(10.0)
        deadline.start()
        await policy(sleeps).run(call, deadline)

    with pytest.raises(DeadlineExceeded) as caught:
        asyncio.run(run())
    assert caught.value.attempts == 1 and caught.value.status == 429
    assert "slow down" in caught.value.detail
    assert sleeps.waits == []


def test_deadline_cuts_an_attempt_short_even_when_it_started_during_the_attempt() -> None:
    async def slow_call(attempt: int) -> str:
        deadline.start()
        await asyncio.sleep(5)
        return "late"

    async def run() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(DeadlineExceeded) as caught:
            await RetryPolicy(RetryConfig()).run(slow_call, deadline)
        assert caught.value.attempts == 1
        return loop.time() - started

    deadline = Deadline(0.05)
    assert asyncio.run(run()) < 1.0


def test_a_deadline_that_has_not_started_does_not_limit_the_wait_in_line() -> None:
    async def queued_then_fast(attempt: int) -> str:
        await asyncio.sleep(0.1)
        deadline.start()
        return "ok"

    deadline = Deadline(0.02)
    assert asyncio.run(RetryPolicy(RetryConfig()).run(queued_then_fast, deadline)) == "ok"


def test_every_decision_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="udfs.inference.retry")
    call = Script(RetryableError("e", status=500), PermanentError("p", status=404))
    with pytest.raises(PermanentError):
        asyncio.run(policy(Sleeps()).run(call))
    messages = [r.getMessage() for r in caplog.records if r.name == "udfs.inference.retry"]
    assert len(messages) == 2
    assert "retrying in" in messages[0] and "permanently" in messages[1]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "udfs.inference.retry")
