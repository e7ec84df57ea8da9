"""Token buckets and AIMD concurrency on a fake clock: the arithmetic, the order, no leaks."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from udfs.config import RateLimitConfig
from udfs.inference.ratelimit import (
    MAX_DEBT_S,
    AdaptiveConcurrency,
    RateLimiter,
    TokenBucket,
)


class FakeClock:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def bucket(rate: float, burst: float, clock: FakeClock) -> TokenBucket:
    return TokenBucket(rate, burst, clock=clock, sleep=clock.sleep)


def test_bucket_gives_the_burst_at_once_then_paces_at_the_rate() -> None:
    clock = FakeClock()

    async def run() -> list[float]:
        tokens = bucket(rate=10, burst=5, clock=clock)
        granted = []
        for _ in range(25):
            await tokens.acquire(1)
            granted.append(clock.now)
        return granted

    granted = asyncio.run(run())
    assert granted[:5] == [0.0] * 5
    assert granted[-1] == pytest.approx(2.0)
    assert [round(b - a, 6) for a, b in itertools.pairwise(granted[4:])] == [0.1] * 20


def test_a_cost_above_the_burst_waits_for_a_full_bucket_and_leaves_debt() -> None:
    clock = FakeClock()

    async def run() -> list[float]:
        tokens = bucket(rate=10, burst=10, clock=clock)
        await tokens.acquire(30)
        first = clock.now
        await tokens.acquire(10)
        return [first, clock.now]

    assert asyncio.run(run()) == pytest.approx([0.0, 3.0])


def test_adjust_refunds_and_charges_but_never_overfills() -> None:
    clock = FakeClock()
    tokens = bucket(rate=1, burst=100, clock=clock)
    asyncio.run(tokens.acquire(100))
    tokens.adjust(40)
    assert tokens.tokens == 40
    tokens.adjust(-50)
    assert tokens.tokens == -10
    tokens.adjust(1000)
    assert tokens.tokens == 100


def test_one_correction_owes_at_most_a_minute_of_the_rate_and_keeps_an_earlier_debt() -> None:
    """A server's `usage` may be absurd (2^63 tokens): believed whole, every later call would wait
    for ever. A debt that `acquire` left (a call larger than the burst) is the rate's own: kept,
    and no correction deepens it."""
    clock = FakeClock()
    tokens = bucket(rate=10, burst=10, clock=clock)
    tokens.adjust(-(2**63))
    assert tokens.tokens == -MAX_DEBT_S * 10
    clock.now += MAX_DEBT_S
    assert tokens.tokens == 0
    asyncio.run(tokens.acquire(10_000))  # waits for a full bucket, then owes 9,990
    tokens.adjust(-(2**63))
    assert tokens.tokens == -9_990
    tokens.adjust(90)
    assert tokens.tokens == -9_900


def test_waiters_are_served_first_come_first_served() -> None:
    clock = FakeClock()

    async def run() -> list[int]:
        tokens = bucket(rate=1, burst=1, clock=clock)
        order: list[int] = []

        async def take(n: int, cost: float) -> None:
            await tokens.acquire(cost)
            order.append(n)

        tasks = []
        for n, cost in enumerate([1, 3, 1, 1, 2]):
            tasks.append(asyncio.create_task(take(n, cost)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_wait_s_is_what_the_queued_callers_still_need_and_a_cancelled_one_owes_nothing() -> None:
    clock = FakeClock()
    held = asyncio.Event()  # the bucket's sleeps never end: the callers stay queued

    async def never(seconds: float) -> None:
        await held.wait()

    async def run() -> tuple[float, float, float]:
        tokens = TokenBucket(2, 2, clock=clock, sleep=never)
        await tokens.acquire(2)  # the burst, at once
        idle = tokens.wait_s
        waiting = [asyncio.create_task(tokens.acquire(1)) for _ in range(5)]
        await asyncio.sleep(0)
        queued = tokens.wait_s
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return idle, queued, tokens.wait_s

    # 5 tokens owed at 2 a second; the clock has not moved, so nothing has refilled.
    assert asyncio.run(run()) == pytest.approx((0.0, 2.5, 0.0))


def test_limiter_splits_the_job_wide_limits_across_subtasks() -> None:
    limiter = RateLimiter(RateLimitConfig(requests_per_minute=600, tokens_per_minute=60_000), subtasks=4)
    assert limiter.requests is not None and limiter.tokens is not None
    assert limiter.requests.rate_per_s == 2.5
    assert limiter.tokens.rate_per_s == 250
    assert limiter.requests.burst == 2.5 and limiter.tokens.burst == 250


def test_limiter_without_limits_never_waits() -> None:
    limiter = RateLimiter(RateLimitConfig())
    assert not limiter.enabled
    assert asyncio.run(limiter.acquire(10**9)) == 0.0


def test_limiter_corrects_the_token_estimate_from_usage() -> None:
    clock = FakeClock()
    limiter = RateLimiter(RateLimitConfig(tokens_per_minute=6000), clock=clock, sleep=clock.sleep)
    assert limiter.tokens is not None
    asyncio.run(limiter.acquire(100))
    assert limiter.tokens.tokens == 0
    limiter.settle(estimated_tokens=100, actual_tokens=30)
    assert limiter.tokens.tokens == 70


def test_aimd_halves_on_overload_at_most_once_per_window() -> None:
    clock = FakeClock()
    limiter = AdaptiveConcurrency(64, 3, clock=clock, min_decrease_interval_s=1.0)
    assert limiter.on_overload() and limiter.limit == 32
    for _ in range(20):
        assert not limiter.on_overload()
    assert limiter.limit == 32
    clock.now = 1.0
    limiter.on_overload()
    assert limiter.limit == 16
    for step in range(2, 10):
        clock.now = float(step)
        limiter.on_overload()
    assert limiter.limit == 3


def test_aimd_window_grows_with_the_observed_latency() -> None:
    clock = FakeClock()
    limiter = AdaptiveConcurrency(64, clock=clock)
    for _ in range(50):
        limiter.on_success(latency_s=4.0)
    limiter.on_overload()
    clock.now = 2.0
    assert not limiter.on_overload()
    clock.now = 4.1
    assert limiter.on_overload()


def test_aimd_adds_one_slot_per_window_of_successes_up_to_capacity() -> None:
    clock = FakeClock()
    limiter = AdaptiveConcurrency(10, clock=clock)
    limiter.on_overload()
    assert limiter.limit == 5
    for _ in range(5):
        limiter.on_success()
    assert limiter.limit == 5
    limiter.on_success()
    assert limiter.limit == 6
    for _ in range(6):
        limiter.on_success()
    assert limiter.limit == 7
    for _ in range(200):
        limiter.on_success()
    assert limiter.limit == 10


def test_fixed_concurrency_ignores_pushback() -> None:
    limiter = AdaptiveConcurrency(8, adaptive=False)
    limiter.on_overload()
    assert limiter.limit == 8


def test_slot_blocks_at_the_limit_and_hands_over_in_order() -> None:
    async def run() -> tuple[int, list[int]]:
        limiter = AdaptiveConcurrency(2)
        release = asyncio.Event()
        order: list[int] = []
        peak = 0

        async def work(n: int) -> None:
            nonlocal peak
            async with limiter.slot():
                order.append(n)
                peak = max(peak, limiter.in_flight)
                await release.wait()

        tasks = [asyncio.create_task(work(n)) for n in range(6)]
        await asyncio.sleep(0.01)
        assert order == [0, 1] and limiter.waiting == 4
        release.set()
        await asyncio.gather(*tasks)
        assert limiter.in_flight == 0
        return peak, order

    peak, order = asyncio.run(run())
    assert peak == 2 and order == list(range(6))


def test_a_lower_limit_applies_to_new_slots_and_growth_wakes_waiters() -> None:
    async def run() -> None:
        limiter = AdaptiveConcurrency(4, clock=FakeClock())
        gate = asyncio.Event()

        async def hold() -> None:
            async with limiter.slot():
                await gate.wait()

        holders = [asyncio.create_task(hold()) for _ in range(4)]
        await asyncio.sleep(0)
        limiter.on_overload()
        assert limiter.limit == 2
        late = asyncio.create_task(hold())
        await asyncio.sleep(0)
        assert limiter.in_flight == 4 and limiter.waiting == 1
        for _ in range(4):
            limiter.on_success()
        assert limiter.limit == 3
        gate.set()
        await asyncio.gather(*holders, late)
        assert limiter.in_flight == 0

    asyncio.run(run())


def test_a_cancelled_waiter_leaks_no_slot() -> None:
    async def run() -> None:
        limiter = AdaptiveConcurrency(1)
        gate = asyncio.Event()

        async def hold() -> None:
            async with limiter.slot():
                await gate.wait()

        first = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(hold()) for _ in range(3)]
        await asyncio.sleep(0)
        waiting[0].cancel()
        gate.set()
        await asyncio.sleep(0)
        waiting[1].cancel()
        await asyncio.gather(first, *waiting, return_exceptions=True)
        assert limiter.in_flight == 0 and limiter.waiting == 0
        async with limiter.slot():
            assert limiter.in_flight == 1

    asyncio.run(run())
