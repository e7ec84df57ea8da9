"""The tests' own waiting helper: what ends a wait early and what it says at the timeout."""

from __future__ import annotations

import time

import pytest

from tests.support.waiting import Hopeless, wait_until


def test_an_ignored_error_waits_on_and_is_named_at_the_timeout() -> None:
    calls = []

    def flaky() -> None:
        calls.append(1)
        raise ConnectionError("refused")

    with pytest.raises(AssertionError, match=r"timed out after 0.2 s waiting for the port \(last error: refused\)"):
        wait_until(flaky, timeout=0.2, interval=0.05, message="the port", ignoring=(Exception,))
    assert len(calls) >= 2


def test_hopeless_ends_the_wait_at_once_even_when_assertions_are_ignored() -> None:
    calls = []

    def ended() -> None:
        calls.append(1)
        raise Hopeless("the run ended early")

    started = time.monotonic()
    with pytest.raises(Hopeless, match="the run ended early"):
        wait_until(ended, timeout=600, message="never", ignoring=(Exception,))
    assert calls == [1] and time.monotonic() - started < 60


def test_done_judges_each_value_and_the_first_done_one_is_returned() -> None:
    values = iter([{"lost": 3}, {"lost": 1}, {"lost": 0}, {"lost": 0, "late": True}])
    got = wait_until(lambda: next(values), timeout=60, interval=0, done=lambda tally: tally["lost"] == 0)
    assert got == {"lost": 0}


def test_or_last_returns_the_last_value_at_the_timeout_instead_of_raising() -> None:
    calls = []

    def count() -> int:
        calls.append(1)
        return len(calls)

    got = wait_until(count, timeout=0.2, interval=0.05, done=lambda n: n > 10_000, or_last=True)
    assert got == len(calls) >= 2


def test_or_last_still_raises_when_no_call_returned_a_value() -> None:
    def refused() -> int:
        raise ConnectionError("refused")

    with pytest.raises(AssertionError, match=r"timed out after 0.1 s waiting for the port \(last error: refused\)"):
        wait_until(refused, timeout=0.1, interval=0.05, message="the port", ignoring=(ConnectionError,), or_last=True)
