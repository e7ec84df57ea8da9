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
