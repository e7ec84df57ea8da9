"""Routing over a model fleet: which endpoint an attempt goes to, and when none may take it.

Users serve a model as several replicas (vLLM pods behind no load balancer, one per GPU) or
mix a hosted API with a local fallback. `Fleet` keeps, per endpoint of `model.endpoints`
(and `model.fallback.endpoints`), the calls in flight, an adaptive concurrency limit (AIMD:
an overload answer from one endpoint shrinks that one only), a `Retry-After` pause and a
`Circuit`. What each attempt's `Outcome` does to them is `release`'s business; which answers
are which outcome is `udfs/inference/statuses.py`'s table. It holds no sockets and reads time
only through its `clock`, so it is unit-tested with a fake clock; `InferenceClient`
(`udfs/inference/client.py`) sends the attempts it routes.

Every call goes through a fleet: `model.endpoint` (without a fallback) is a fleet of one,
built with `circuit=None`, whose circuit never opens. A circuit is there to send calls
elsewhere; with nowhere else to send them, an open circuit would only add its cooldown to the
failures' own cost and keep a recovered server idle until the cooldown ends. The fleet of
one's AIMD limit and `Retry-After` pause are then every call's.

Routing (`Fleet.choose`): weighted least-outstanding requests. Among the endpoints that may
take a call now (circuit closed, or open past its cooldown and free for one probe; not
paused by a `Retry-After`; fewer calls in flight than its limit) the one with the smallest
(in flight + 1) / weight wins; an endpoint that already failed this record is skipped while
another can take it, so a retry goes elsewhere. Probes come first, so a revived endpoint
rejoins as soon as its cooldown ends.

Groups: the primaries take the traffic while any of their circuits is closed. When every
primary circuit is open (or a record's attempt number passes `fallback.after_attempts`), the
fallback group takes it, and the primaries still get their probes. With no endpoint able to
take a call, `acquire` waits (the stage stops admitting: backpressure, never a dead letter);
a record whose first attempt was already sent keeps its deadline (`udfs/inference/retry.py`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from udfs.clock import Clock
from udfs.config import CircuitConfig
from udfs.inference.ratelimit import AdaptiveConcurrency
from udfs.inference.statuses import Outcome
from udfs.metrics import Distribution

log = logging.getLogger(__name__)


class CircuitState(enum.IntEnum):
    """Exported as a number: 0 closed, 1 half-open (one probe allowed), 2 open."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class Circuit:
    """Consecutive failures open it; after a cooldown one probe may pass (half-open); a failed
    probe opens it again for twice the cooldown (up to the maximum), a success closes it.
    Without a `config` it never opens (the fleet of one of `model.endpoint`)."""

    def __init__(self, config: CircuitConfig | None) -> None:
        self.config = config
        self.state = CircuitState.CLOSED
        self.failures = 0
        self.cooldown_s = config.cooldown_s if config is not None else 0.0
        self.opened_at = 0.0
        self.probing = False
        self.opened = 0  # times it opened

    def may_probe(self, now: float) -> bool:
        """An open circuit whose cooldown has passed, with no probe out."""
        return (self.state is not CircuitState.CLOSED and not self.probing
                and now >= self.opened_at + self.cooldown_s)

    def reopens_at(self) -> float | None:
        return None if self.state is CircuitState.CLOSED else self.opened_at + self.cooldown_s

    def on_probe(self) -> None:
        self.state = CircuitState.HALF_OPEN
        self.probing = True

    def on_success(self) -> bool:
        """Returns whether it closed now."""
        was_open = self.state is not CircuitState.CLOSED
        self.state = CircuitState.CLOSED
        self.failures = 0
        self.probing = False
        if self.config is not None:
            self.cooldown_s = self.config.cooldown_s
        return was_open

    def on_failure(self, now: float) -> bool:
        """Returns whether it opened now."""
        if self.config is None:
            return False
        if self.state is not CircuitState.CLOSED:
            if self.probing:  # the probe failed: longer cooldown
                self.probing = False
                self.cooldown_s = min(self.config.max_cooldown_s, self.cooldown_s * 2)
                self.state, self.opened_at = CircuitState.OPEN, now
            return False
        self.failures += 1
        if self.failures < self.config.failures:
            return False
        self.state, self.opened_at, self.opened = CircuitState.OPEN, now, self.opened + 1
        self.cooldown_s = self.config.cooldown_s
        return True

    def on_neutral(self) -> None:
        """The probe neither proved nor disproved health (a 4xx, a deadline): probe again."""
        if self.probing:
            self.probing = False
            self.state = CircuitState.OPEN


@dataclass
class Endpoint:
    """One endpoint's routing state and figures; `index` is its place in the fleet (primaries
    first), `fallback` whether it belongs to the fallback group."""

    index: int
    label: str
    weight: float
    concurrency: AdaptiveConcurrency
    circuit: Circuit
    fallback: bool = False
    in_flight: int = 0
    paused_until: float = 0.0  # Retry-After
    requests: int = 0
    rate_limited: int = 0
    failures: int = 0
    latency_ms: Distribution = field(default_factory=Distribution)

    @property
    def limit(self) -> int:
        return self.concurrency.limit

    def figures(self) -> dict[str, int]:
        """What metrics and `llmstream status` show of it (`metrics.ENDPOINT_GAUGES`)."""
        return {"in_flight": self.in_flight, "limit": self.limit, "circuit": int(self.circuit.state),
                "requests": self.requests, "rate_limited": self.rate_limited, "failures": self.failures,
                "latency_p50_ms": self.latency_ms.percentile(0.5),
                "latency_p99_ms": self.latency_ms.percentile(0.99)}

    def free(self, now: float) -> bool:
        return now >= self.paused_until and self.in_flight < self.limit

    def load(self) -> float:
        return (self.in_flight + 1) / self.weight


@dataclass(frozen=True)
class EndpointSpec:
    """What `Fleet` needs to know of an endpoint from the config."""

    label: str
    weight: float = 1.0
    capacity: int = 64
    fallback: bool = False


class Fleet:
    """The routing state of one inference subtask's fleet; see the module docstring.

    Use `acquire`/`release` from one event loop; `choose` and `release` alone are the pure
    part the unit tests drive with a fake `clock`.
    """

    def __init__(self, specs: Iterable[EndpointSpec], circuit: CircuitConfig | None, *, min_concurrency: int = 1,
                 adaptive: bool = True, fallback_after_attempts: int | None = None,
                 clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.endpoints = [
            Endpoint(i, spec.label, spec.weight,
                     AdaptiveConcurrency(spec.capacity, min_concurrency, adaptive=adaptive, clock=clock),
                     Circuit(circuit), fallback=spec.fallback)
            for i, spec in enumerate(specs)]
        # The groups are fixed for the fleet's life; every attempt asks for them (tuples: what
        # `candidates` hands out is the group itself).
        self.primaries = tuple(e for e in self.endpoints if not e.fallback)
        self.fallbacks = tuple(e for e in self.endpoints if e.fallback)
        if not self.primaries:
            raise ValueError("a fleet needs at least one primary endpoint")
        self.fallback_after_attempts = fallback_after_attempts
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # ------------------------------------------------------------------ the pure part

    def candidates(self, attempt: int = 1) -> tuple[Endpoint, ...]:
        """The group an attempt may go to, before looking at slots: closed primaries; else (every
        primary open, or past `fallback.after_attempts`) the fallback group plus primaries that
        may be probed. Without a fallback group, the primaries."""
        primaries, fallbacks = self.primaries, self.fallbacks
        late = self.fallback_after_attempts is not None and attempt > self.fallback_after_attempts
        closed = [e for e in primaries if e.circuit.state is CircuitState.CLOSED]
        if fallbacks and (late or not closed):
            return primaries + fallbacks
        return primaries

    def choose(self, avoid: Iterable[int] = (), attempt: int = 1) -> Endpoint | None:
        """The endpoint for an attempt, its slot taken (call `release` after), or None when none
        may take it now. `avoid`: indexes of endpoints that failed this record."""
        now = self._clock()
        avoided = set(avoid)
        group = self.candidates(attempt)
        for e in group:  # a probe first: it is how an endpoint comes back
            if e.circuit.may_probe(now) and now >= e.paused_until:
                e.circuit.on_probe()
                return self._take(e, "probe")
        late = self.fallback_after_attempts is not None and attempt > self.fallback_after_attempts
        usable = [e for e in group if e.circuit.state is CircuitState.CLOSED and e.free(now)]
        if late and any(e.fallback for e in usable):
            usable = [e for e in usable if e.fallback]
        elif any(not e.fallback for e in usable):
            usable = [e for e in usable if not e.fallback]
        if not usable:
            return None
        fresh = [e for e in usable if e.index not in avoided] or usable
        return self._take(min(fresh, key=lambda e: (e.load(), e.in_flight, e.index)), "route")

    def _take(self, endpoint: Endpoint, why: str) -> Endpoint:
        endpoint.in_flight += 1
        endpoint.requests += 1
        if why == "probe":
            log.info("endpoint %s: circuit half-open, sending a probe", endpoint.label)
        return endpoint

    def next_change(self) -> float | None:
        """When, by `clock`, waiting callers should look again without a release: the end of a
        cooldown or a Retry-After pause."""
        now = self._clock()
        times = [t for e in self.endpoints for t in (e.circuit.reopens_at(), e.paused_until)
                 if t is not None and t > now]
        return min(times) if times else None

    def release(self, endpoint: Endpoint, outcome: Outcome, *, latency_s: float | None = None,
                retry_after_s: float | None = None) -> None:
        """The attempt on `endpoint` ended with `outcome`: frees its slot, feeds AIMD and the
        circuit as the outcome's flags say (`udfs/inference/statuses.py`), and wakes waiting
        callers. `retry_after_s`, the server's `Retry-After` on a retryable answer, pauses the
        endpoint: the one place llmstream waits for that hint. A record's retry waits for it
        only when no other endpoint may take the call (always, in a fleet of one)."""
        now = self._clock()
        endpoint.in_flight -= 1
        if outcome is Outcome.SUCCESS:
            endpoint.concurrency.on_success(latency_s)
            if latency_s is not None:
                endpoint.latency_ms.update(int(latency_s * 1000))
            if endpoint.circuit.on_success():
                log.warning("endpoint %s: circuit closed, taking traffic again", endpoint.label)
        if outcome is Outcome.OVERLOAD:
            endpoint.rate_limited += 1
        if outcome.overload:
            endpoint.concurrency.on_overload()
        if retry_after_s and outcome.retryable:
            endpoint.paused_until = max(endpoint.paused_until, now + retry_after_s)
        if outcome.circuit_failure:
            endpoint.failures += 1
            if endpoint.circuit.on_failure(now):
                assert endpoint.circuit.config is not None
                log.warning("endpoint %s: circuit open after %d consecutive failures; no traffic for %.1f s",
                            endpoint.label, endpoint.circuit.config.failures, endpoint.circuit.cooldown_s)
        elif outcome.overload:
            if endpoint.circuit.probing:  # alive, only full: it may take traffic again
                endpoint.circuit.on_success()
        elif outcome is not Outcome.SUCCESS:
            endpoint.circuit.on_neutral()
        self._wake(all_=outcome is not Outcome.SUCCESS or endpoint.circuit.state is CircuitState.CLOSED)

    @property
    def stalled(self) -> bool:
        """Calls wait and no endpoint may take one before a cooldown or a `Retry-After` ends:
        every circuit open (a probe out, or none due yet) or paused. Endpoints that are only
        full do not stall the fleet: a slot frees within a call's latency. The inference stage
        reads this from Flink's thread to close its admission gate (`udfs/lanes/admission.py`): reads only."""
        if not self._waiters:
            return False
        now = self._clock()
        return not any(now >= e.paused_until and (e.circuit.state is CircuitState.CLOSED or e.circuit.may_probe(now))
                       for e in self.endpoints)

    # ------------------------------------------------------------------ waiting

    async def acquire(self, avoid: Iterable[int] = (), attempt: int = 1) -> Endpoint:
        """`choose`, waiting (FIFO) while no endpoint may take the call: backpressure."""
        avoided = tuple(avoid)
        if not self._waiters:
            chosen = self.choose(avoided, attempt)
            if chosen is not None:
                return chosen
        while True:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            self._arm_timer()
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                else:
                    self._wake()  # pass the wake-up on
                raise
            chosen = self.choose(avoided, attempt)
            if chosen is not None:
                if self._waiters:
                    self._wake()  # there may be room for the next one too
                return chosen

    def wake_all(self) -> None:
        """Lets every waiting caller look again (the clock moved past a cooldown)."""
        self._wake(all_=True)

    def _wake(self, all_: bool = False) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                if not all_:
                    return

    def _arm_timer(self) -> None:
        """Wakes the waiters when a cooldown or a pause ends (no release may come then)."""
        at = self.next_change()
        if at is None or (self._timer is not None and self._timer_at <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timer = None
            self.wake_all()
            if self._waiters:
                self._arm_timer()

        self._timer_at = at
        self._timer = loop.call_later(max(0.0, at - self._clock()) + 0.001, fire)
