"""Keep one inference subtask within its share of the provider's limits, by waiting.

Waiting is the point: a coroutine that waits here keeps its record in the async operator's
queue, the queue fills to capacity and Flink backpressures the Kafka source. A provider
limit thus slows the job instead of timing out records or restarting it.

`RateLimiter` paces requests and tokens per minute (client-side, from config);
`AdaptiveConcurrency` cuts the number of calls in flight when the server pushes back (an
overload answer, as `udfs/inference/statuses.py` says) and grows it again while calls succeed
(AIMD, as TCP does); `Fleet` keeps one per endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from udfs.clock import Clock, Sleep
from udfs.config import RateLimitConfig

log = logging.getLogger(__name__)

_EPSILON = 1e-9
MAX_DEBT_S = 60.0
"""The longest wait one correction (`TokenBucket.adjust`) can cause."""


class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst` saved up; callers wait in FIFO order.

    A request larger than `burst` waits for a full bucket and leaves it in debt, so the long
    run rate still holds. `adjust` corrects a cost once the real one is known (positive gives
    tokens back, negative charges more). `clock` and `sleep` are injectable for tests.
    """

    def __init__(self, rate_per_s: float, burst: float, clock: Clock = time.monotonic,
                 sleep: Sleep = asyncio.sleep) -> None:
        if rate_per_s <= 0 or burst <= 0:
            raise ValueError(f"rate_per_s and burst must be > 0, got {rate_per_s} and {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = burst
        self._updated = clock()
        self._queue = asyncio.Lock()
        self._owed = 0.0  # tokens the callers waiting in `acquire` still need

    @property
    def wait_s(self) -> float:
        """How long the callers waiting now will take to be served: the wait a new caller would
        start behind. Reads only, so another thread may ask (the stage's, `InferenceClient.pause_reason`)."""
        return max(0.0, self._owed - self._available(self._clock())) / self.rate_per_s

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def _available(self, now: float) -> float:
        """The tokens at `now`: what was left, plus what has refilled since, at most `burst`."""
        return min(self.burst, self._tokens + (now - self._updated) * self.rate_per_s)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = self._available(now)
        self._updated = now

    async def acquire(self, n: float = 1) -> float:
        """Takes `n` tokens, waiting first if needed; returns the seconds waited."""
        started = self._clock()
        need = min(n, self.burst)
        self._owed += need
        try:
            async with self._queue:
                self._refill()
                while self._tokens < need - _EPSILON:
                    await self._sleep((need - self._tokens) / self.rate_per_s)
                    self._refill()
                self._tokens -= n
        finally:
            self._owed -= need
        return self._clock() - started

    def adjust(self, delta: float) -> None:
        """Adds `delta` tokens (may be negative), never above `burst`, and never into a debt of more
        than `MAX_DEBT_S` of the rate (a debt `acquire` left is kept): one call's usage, as a server
        reports it, can hold later calls back for at most that long, whatever it says."""
        self._refill()
        floor = min(self._tokens, -MAX_DEBT_S * self.rate_per_s)
        self._tokens = min(self.burst, max(floor, self._tokens + delta))


class RateLimiter:
    """This subtask's share (1/`subtasks`) of the job-wide requests- and tokens-per-minute.

    Each bucket holds at most one second of its rate, so the pace is smooth: providers
    enforce per-minute limits over shorter windows too. A call's token cost is estimated
    up front (prompt chars / 4 + max_tokens) and corrected by `settle` from the usage; a
    failed call keeps its estimated cost, as providers count rejected calls too.
    """

    def __init__(self, config: RateLimitConfig, subtasks: int = 1, *, clock: Clock = time.monotonic,
                 sleep: Sleep = asyncio.sleep) -> None:
        self.requests = self._bucket(config.requests_per_minute, subtasks, clock, sleep)
        self.tokens = self._bucket(config.tokens_per_minute, subtasks, clock, sleep)

    @staticmethod
    def _bucket(per_minute: float | None, subtasks: int, clock: Clock, sleep: Sleep) -> TokenBucket | None:
        if per_minute is None:
            return None
        rate = per_minute / 60 / max(1, subtasks)
        return TokenBucket(rate, burst=max(1.0, rate), clock=clock, sleep=sleep)

    @property
    def enabled(self) -> bool:
        return self.requests is not None or self.tokens is not None

    @property
    def wait_s(self) -> float:
        """The longer of the two buckets' waits (`TokenBucket.wait_s`); 0 without limits."""
        return max((b.wait_s for b in (self.requests, self.tokens) if b is not None), default=0.0)

    async def acquire(self, estimated_tokens: int) -> float:
        """Waits for one request and `estimated_tokens` tokens; returns the seconds waited."""
        waited = 0.0
        if self.requests is not None:
            waited += await self.requests.acquire(1)
        if self.tokens is not None:
            waited += await self.tokens.acquire(estimated_tokens)
        return waited

    def settle(self, estimated_tokens: int, actual_tokens: int) -> None:
        """Corrects the token bucket once the response says what the call really used."""
        if self.tokens is not None and actual_tokens != estimated_tokens:
            self.tokens.adjust(estimated_tokens - actual_tokens)


class AdaptiveConcurrency:
    """A semaphore whose size follows the server's pushback (AIMD).

    The limit starts at `capacity`. An overload answer halves it (`decrease_factor`), at most once per
    `max(min_decrease_interval_s, smoothed latency)`: the calls already in flight when the
    server started refusing will refuse too, and must not halve it again. Each success adds
    `1/limit`, i.e. about +1 per round trip of a full window. Bounds: `min_concurrency` and
    `capacity`. With `adaptive=False` it is a plain semaphore of `capacity`. Waiters are FIFO.
    """

    def __init__(self, capacity: int, min_concurrency: int = 1, *, adaptive: bool = True,
                 decrease_factor: float = 0.5, min_decrease_interval_s: float = 1.0,
                 clock: Clock = time.monotonic) -> None:
        if capacity < 1 or min_concurrency < 1:
            raise ValueError(f"capacity and min_concurrency must be >= 1, got {capacity}, {min_concurrency}")
        self.capacity = capacity
        self.min_concurrency = min(min_concurrency, capacity)
        self.adaptive = adaptive
        self.decrease_factor = decrease_factor
        self.min_decrease_interval_s = min_decrease_interval_s
        self._clock = clock
        self._limit = float(capacity)
        self._latency_s: float | None = None
        self._last_decrease: float | None = None
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int:
        """Calls allowed in flight now."""
        return max(self.min_concurrency, int(self._limit))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def on_success(self, latency_s: float | None = None) -> None:
        """Additive increase; `latency_s` feeds the window that spaces decreases."""
        if latency_s is not None:
            self._latency_s = latency_s if self._latency_s is None else 0.8 * self._latency_s + 0.2 * latency_s
        if not self.adaptive or self._limit >= self.capacity:
            return
        before = self.limit
        self._limit = min(float(self.capacity), self._limit + 1 / self._limit)
        if self.limit != before:
            log.debug("concurrency limit up to %d", self.limit)
            self._wake()

    def on_overload(self) -> bool:
        """Multiplicative decrease after an overload answer; returns whether the limit changed."""
        if not self.adaptive:
            return False
        now = self._clock()
        window = max(self.min_decrease_interval_s, self._latency_s or 0.0)
        if self._last_decrease is not None and now - self._last_decrease < window:
            return False
        self._last_decrease = now
        before = self.limit
        self._limit = max(float(self.min_concurrency), self._limit * self.decrease_factor)
        log.debug("server pushed back: concurrency limit %d -> %d", before, self.limit)
        return self.limit != before

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Holds one of `limit` slots; waits (FIFO) while `limit` calls are in flight."""
        await self._acquire()
        try:
            yield
        finally:
            self._in_flight -= 1
            self._wake()

    async def _acquire(self) -> None:
        if not self._waiters and self._in_flight < self.limit:
            self._in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._in_flight -= 1
                self._wake()
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    def _wake(self) -> None:
        while self._waiters and self._in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._in_flight += 1
                waiter.set_result(None)
