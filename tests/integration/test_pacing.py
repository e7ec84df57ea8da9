"""The client-side rate limit paces requests to the configured rate, measured over 5 and 30 s.

No JVM: the inference client against a simulator process on loopback. It sits here rather than
in unit/ because it runs for whole windows of wall-clock time. The bounds hold whatever the
machine's speed: never faster than the rate (the limiter's promise), and never slower than the
window plus the time the same calls take without any limit on this machine, right now.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.calls import run
from tests.support.configs import job_config, request
from tests.support.job_setup import SpawnSimulator
from udfs.config import JobConfig
from udfs.inference.client import InferenceClient


def _timed_calls(config: JobConfig, count: int, subtasks: int, timeout: float) -> float:
    async def calls() -> float:
        async with InferenceClient(config, subtasks=subtasks) as client:
            started = time.monotonic()
            await asyncio.gather(*(client.complete(request()) for _ in range(count)))
            return time.monotonic() - started

    return run(calls, timeout=timeout)


@pytest.mark.parametrize(("window_s", "subtasks"), [
    (5, 2),
    pytest.param(30, 1, marks=pytest.mark.slow),
])
def test_rate_limiter_paces_requests_within_ten_percent(spawn_simulator: SpawnSimulator, window_s: int,
                                                        subtasks: int) -> None:
    sim = spawn_simulator([])
    per_subtask_per_s = 20
    rpm = per_subtask_per_s * 60 * subtasks
    count = per_subtask_per_s + per_subtask_per_s * window_s  # the burst, then `window_s` of pacing
    unlimited = _timed_calls(job_config(sim.url, async_={"capacity": 64}), count, subtasks, timeout=600)
    sim.reset_stats()
    paced = job_config(sim.url, async_={"capacity": 64}, rate_limit={"requests_per_minute": rpm})
    elapsed = _timed_calls(paced, count, subtasks, timeout=window_s * 3 + 600)
    assert sim.stats()["served"] == count
    assert window_s * 0.9 <= elapsed <= window_s * 1.1 + unlimited, (elapsed, unlimited)
