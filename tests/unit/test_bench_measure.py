"""The benchmark's arithmetic: scenario limits from Little's law, the steady-state window."""

from __future__ import annotations

import math

import pytest

from jobs.dev.bench.measure import percentile, steady_window
from jobs.dev.bench.scenarios import SCENARIOS


def test_limits_follow_littles_law() -> None:
    assert SCENARIOS["a"].limit_per_s == pytest.approx(64 / 0.050)
    sigma = math.log(2000 / 200) / 2.3263478740408408
    assert SCENARIOS["b"].mean_latency_ms == pytest.approx(200 * math.exp(sigma**2 / 2))
    assert SCENARIOS["b"].limit_per_s == pytest.approx(196, abs=1)
    assert SCENARIOS["d"].limit_per_s is None


def test_steady_window_leaves_out_start_up_and_drain() -> None:
    # 10 s of start-up with nothing, then 100 completions per second for 10 s.
    completions = [10_000 + i * 10 for i in range(1000)]
    window = steady_window(completions)
    assert window is not None
    assert window.rate == pytest.approx(100, rel=0.02)
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([], 99) is None
