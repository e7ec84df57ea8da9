"""Routing over a model fleet (`udfs/inference/fleet.py`), driven by a fake clock: shares by weight and
limit, AIMD and Retry-After per endpoint, circuits opening, probing and closing, waiting while
every circuit is open, and the fallback group. No sleeps: time moves only when a test moves it."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from udfs.config import CircuitConfig
from udfs.inference.fleet import CircuitState, Endpoint, EndpointSpec, Fleet, Outcome


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


CIRCUIT = CircuitConfig(failures=3, cooldown_s=5.0, max_cooldown_s=20.0)


def fleet(*specs: EndpointSpec, clock: FakeClock, after: int | None = None) -> Fleet:
    return Fleet(specs, CIRCUIT, clock=clock, fallback_after_attempts=after)


def fill(f: Fleet, n: int) -> list[Endpoint]:
    taken = []
    for _ in range(n):
        chosen = f.choose()
        assert chosen is not None
        taken.append(chosen)
    return taken


def test_least_outstanding_shares_follow_weights() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("a", weight=3, capacity=100), EndpointSpec("b", weight=1, capacity=100), clock=clock)
    counts = Counter(e.label for e in fill(f, 40))
    assert counts == {"a": 30, "b": 10}


def test_saturated_shares_follow_limits() -> None:
    """Every endpoint kept at its own limit: 4:2:1 of the calls in flight; a slot freed on one
    goes back to it."""
    clock = FakeClock()
    f = fleet(EndpointSpec("big", capacity=8), EndpointSpec("mid", capacity=4), EndpointSpec("small", capacity=2),
              clock=clock)
    taken = fill(f, 14)
    assert Counter(e.label for e in taken) == {"big": 8, "mid": 4, "small": 2}
    assert f.choose() is None
    small = next(e for e in taken if e.label == "small")
    f.release(small, Outcome.SUCCESS, latency_s=0.1)
    again = f.choose()
    assert again is not None and again.label == "small"


def test_aimd_per_endpoint() -> None:
    """A 429 from one endpoint halves that endpoint's limit only."""
    clock = FakeClock()
    f = fleet(EndpointSpec("a", capacity=8), EndpointSpec("b", capacity=8), clock=clock)
    a = next(e for e in fill(f, 2) if e.label == "a")
    f.release(a, Outcome.OVERLOAD)
    assert [e.limit for e in f.endpoints] == [4, 8]
    assert f.endpoints[0].rate_limited == 1 and f.endpoints[0].circuit.state is CircuitState.CLOSED


def test_retry_after_pauses_that_endpoint_only() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("a", capacity=8), EndpointSpec("b", capacity=8), clock=clock)
    a = f.choose()
    assert a is not None and a.label == "a"
    f.release(a, Outcome.OVERLOAD, retry_after_s=2.0)
    assert {f.choose().label for _ in range(4)} == {"b"}  # type: ignore[union-attr]
    assert f.next_change() == pytest.approx(clock.now + 2.0)
    clock.advance(2.0)
    assert f.choose().label == "a"  # type: ignore[union-attr]


def test_a_503_is_overload_and_a_circuit_failure_of_that_endpoint() -> None:
    """The decided behaviour (`udfs/inference/statuses.py`): a 503 halves that endpoint's limit and
    its Retry-After pauses it, as a 429 does, and it counts towards its circuit, as a 500 does."""
    clock = FakeClock()
    f = fleet(EndpointSpec("a", capacity=8), EndpointSpec("b", capacity=8), clock=clock)
    a = f.endpoints[0]
    f.release(f._take(a, "route"), Outcome.UNAVAILABLE, retry_after_s=2.0)
    assert [e.limit for e in f.endpoints] == [4, 8]
    assert a.paused_until == pytest.approx(clock.now + 2.0)
    assert a.failures == 1 and a.rate_limited == 0 and a.circuit.state is CircuitState.CLOSED
    for _ in range(2):
        clock.advance(2.0)
        f.release(f._take(a, "route"), Outcome.UNAVAILABLE)
    assert a.circuit.state is CircuitState.OPEN and a.limit == 1
    clock.advance(5.0)
    probe = f.choose()
    assert probe is a
    f.release(probe, Outcome.UNAVAILABLE)  # a probe answered 503 failed: open again, for longer
    assert a.circuit.state is CircuitState.OPEN and a.circuit.cooldown_s == 10.0


def test_a_probe_answered_429_closes_the_circuit() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("a", capacity=8), EndpointSpec("b", capacity=8), clock=clock)
    a = f.endpoints[0]
    for _ in range(3):
        f.release(f._take(a, "route"), Outcome.FAILURE)
    clock.advance(5.0)
    probe = f.choose()
    assert probe is a
    f.release(probe, Outcome.OVERLOAD)  # alive, only full
    assert a.circuit.state is CircuitState.CLOSED


def test_a_fleet_of_one_without_a_circuit_never_opens_it() -> None:
    """`model.endpoint` is a fleet of one built with no circuit: failures and 503s are counted and
    503s shrink its limit, but its one endpoint always takes the next call."""
    clock = FakeClock()
    f = Fleet([EndpointSpec("solo", capacity=8)], None, clock=clock)
    solo = f.endpoints[0]
    for outcome in [Outcome.FAILURE] * 10 + [Outcome.UNAVAILABLE] * 10:
        chosen = f.choose()
        assert chosen is solo
        f.release(chosen, outcome)
        clock.advance(1.0)
    assert solo.circuit.state is CircuitState.CLOSED and solo.failures == 20
    assert solo.limit == 1 and f.next_change() is None


def test_a_retry_after_on_a_permanent_answer_pauses_nothing() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("a", capacity=8), clock=clock)
    f.release(f._take(f.endpoints[0], "route"), Outcome.NEUTRAL, retry_after_s=30.0)
    assert f.endpoints[0].paused_until == 0.0 and f.choose() is f.endpoints[0]


def test_retry_goes_to_another_endpoint() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("a", weight=10, capacity=8), EndpointSpec("b", capacity=8), clock=clock)
    first = f.choose()
    assert first is not None and first.label == "a"
    f.release(first, Outcome.FAILURE)
    retry = f.choose(avoid=[first.index], attempt=2)
    assert retry is not None and retry.label == "b"
    f.release(retry, Outcome.SUCCESS)
    # with nowhere else to go, the avoided endpoint is still used
    only = fleet(EndpointSpec("solo", capacity=2), clock=clock)
    assert only.choose(avoid=[0], attempt=2) is not None


def test_circuit_opens_probes_with_backoff_and_closes() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("bad", capacity=8), EndpointSpec("good", capacity=8), clock=clock)
    bad = f.endpoints[0]
    for _ in range(3):
        f.release(f._take(bad, "route"), Outcome.FAILURE)
    assert bad.circuit.state is CircuitState.OPEN
    assert {f.choose().label for _ in range(5)} == {"good"}  # type: ignore[union-attr]
    clock.advance(5.0)
    probe = f.choose()
    assert probe is bad and bad.circuit.state is CircuitState.HALF_OPEN
    assert f.choose().label == "good"  # type: ignore[union-attr]  # one probe at a time
    f.release(probe, Outcome.FAILURE)  # failed probe: open for twice as long
    assert bad.circuit.state is CircuitState.OPEN and bad.circuit.cooldown_s == 10.0
    clock.advance(9.9)
    assert f.choose().label == "good"  # type: ignore[union-attr]
    clock.advance(0.1)
    probe = f.choose()
    assert probe is bad
    f.release(probe, Outcome.FAILURE)
    assert bad.circuit.cooldown_s == 20.0  # capped by max_cooldown_s next time
    clock.advance(20.0)
    probe = f.choose()
    assert probe is bad
    f.release(probe, Outcome.SUCCESS, latency_s=0.05)
    assert bad.circuit.state is CircuitState.CLOSED and bad.circuit.cooldown_s == 5.0
    assert bad.figures()["circuit"] == 0 and bad.figures()["failures"] == 5


def test_failures_must_be_consecutive() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("a", capacity=8), clock=clock)
    a = f.endpoints[0]
    for outcome in (Outcome.FAILURE, Outcome.FAILURE, Outcome.SUCCESS, Outcome.FAILURE, Outcome.FAILURE,
                    Outcome.OVERLOAD, Outcome.NEUTRAL):
        f.release(f._take(a, "route"), outcome)
    assert a.circuit.state is CircuitState.CLOSED


def test_all_open_waits_then_a_probe_goes() -> None:
    """Every circuit open: `acquire` waits (backpressure) and nothing fails; once the cooldown
    has passed, a probe is let through and its success lets the waiters go."""
    clock = FakeClock()
    f = fleet(EndpointSpec("a", capacity=4), EndpointSpec("b", capacity=4), clock=clock)
    for e in f.endpoints:
        for _ in range(3):
            f.release(f._take(e, "route"), Outcome.FAILURE)
    assert f.choose() is None

    async def scenario() -> None:
        waiting = [asyncio.ensure_future(f.acquire()) for _ in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert not any(w.done() for w in waiting)
        clock.advance(5.0)
        f.wake_all()
        for _ in range(5):
            await asyncio.sleep(0)
        probes = [w.result() for w in waiting if w.done()]
        assert sorted(p.label for p in probes) == ["a", "b"]  # one probe per endpoint
        assert sum(not w.done() for w in waiting) == 1
        f.release(probes[0], Outcome.SUCCESS, latency_s=0.01)
        for _ in range(5):
            await asyncio.sleep(0)
        assert all(w.done() for w in waiting)
        assert waiting[2].result() is probes[0]

    asyncio.run(scenario())


def test_stalled_only_while_calls_wait_for_a_cooldown_or_a_pause() -> None:
    """`stalled` closes the stage's admission gate: true while calls wait and no endpoint may take
    one before a Retry-After or a cooldown ends (every one paused, open or probing); never for
    a fleet that is only full, nor for one that nobody waits on."""
    clock = FakeClock()

    async def paused_not_full() -> None:
        f = fleet(EndpointSpec("a", capacity=1), EndpointSpec("b", capacity=1), clock=clock)
        held = [await f.acquire(), await f.acquire()]
        waiter = asyncio.ensure_future(f.acquire())
        await asyncio.sleep(0)
        assert not f.stalled  # full, not down: a slot frees within a call
        f.release(held[0], Outcome.OVERLOAD, retry_after_s=30.0)
        await asyncio.sleep(0)
        assert not waiter.done() and not f.stalled  # a is paused, b only full
        f.release(held[1], Outcome.OVERLOAD, retry_after_s=30.0)
        await asyncio.sleep(0)
        assert not waiter.done() and f.stalled  # both paused
        clock.advance(30.0)
        assert not f.stalled
        waiter.cancel()

    async def every_circuit_open() -> None:
        f = fleet(EndpointSpec("a", capacity=4), EndpointSpec("b", capacity=4), clock=clock)
        for e in f.endpoints:
            for _ in range(3):
                f.release(f._take(e, "route"), Outcome.FAILURE)
        assert not f.stalled  # every circuit open, but nobody waits
        waiting = asyncio.ensure_future(f.acquire())
        await asyncio.sleep(0)
        assert f.stalled
        clock.advance(5.0)
        assert not f.stalled  # due for probes: the next look sends one
        f.wake_all()
        await asyncio.sleep(0)
        probes = [waiting.result(), await f.acquire()]  # one probe per endpoint
        assert sorted(p.label for p in probes) == ["a", "b"]
        third = asyncio.ensure_future(f.acquire())
        await asyncio.sleep(0)
        assert not third.done() and f.stalled  # both probing
        f.release(probes[0], Outcome.SUCCESS, latency_s=0.01)
        await asyncio.sleep(0)
        assert third.done() and not f.stalled

    asyncio.run(paused_not_full())
    asyncio.run(every_circuit_open())


def test_acquire_waits_for_a_free_slot_fifo() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("a", capacity=1), clock=clock)

    async def scenario() -> None:
        held = await f.acquire()
        first = asyncio.ensure_future(f.acquire())
        second = asyncio.ensure_future(f.acquire())
        await asyncio.sleep(0)
        assert not first.done() and not second.done()
        f.release(held, Outcome.SUCCESS)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert first.done() and not second.done()
        second.cancel()
        f.release(first.result(), Outcome.SUCCESS)
        assert f.endpoints[0].in_flight == 0

    asyncio.run(scenario())


def test_fallback_takes_over_when_every_primary_is_open_and_gives_back() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("p1", capacity=4), EndpointSpec("p2", capacity=4),
              EndpointSpec("fb", capacity=4, fallback=True), clock=clock)
    assert {f.choose().label for _ in range(6)} == {"p1", "p2"}  # type: ignore[union-attr]
    for e in f.primaries:
        e.in_flight = 0
        for _ in range(3):
            f.release(f._take(e, "route"), Outcome.FAILURE)
    chosen = f.choose()
    assert chosen is not None and chosen.label == "fb"
    clock.advance(5.0)
    probe = f.choose()
    assert probe is not None and probe.label in ("p1", "p2")  # the primaries still get their probes
    assert f.choose().label in ("p1", "p2")  # type: ignore[union-attr]
    assert f.choose().label == "fb"  # type: ignore[union-attr]
    f.release(probe, Outcome.SUCCESS)
    assert {f.choose().label for _ in range(2)} <= {"p1", "p2"}  # type: ignore[union-attr]


def test_fallback_after_attempts() -> None:
    clock = FakeClock()
    f = fleet(EndpointSpec("p", capacity=4), EndpointSpec("fb", capacity=4, fallback=True), clock=clock, after=2)
    assert f.choose(attempt=1).label == "p"  # type: ignore[union-attr]
    assert f.choose(attempt=2).label == "p"  # type: ignore[union-attr]
    assert f.choose(attempt=3).label == "fb"  # type: ignore[union-attr]


def test_no_fallback_without_a_group() -> None:
    with pytest.raises(ValueError):
        Fleet([EndpointSpec("fb", fallback=True)], CIRCUIT)


# ------------------------------------------------------------------ model.endpoints in the config


def _config(model: dict[str, object]) -> object:
    from tests.support.configs import job_config

    return job_config("http://127.0.0.1:1/v1", model=model)


@pytest.mark.parametrize(("model", "key", "problem"), [
    ({"endpoints": [{"url": "http://a:1/v1"}]}, "model.endpoint", "exactly one of"),
    ({"endpoint": None}, "model.endpoint", "exactly one of"),
    ({"endpoint": None, "endpoints": [{"url": "a:1"}]}, "model.endpoints[0].url", "http(s) URL"),
    ({"endpoint": None, "endpoints": [{"url": "http://a:1/v1", "headers": {"Authorization": "Bearer sk-1"}}]},
     "model.endpoints[0].headers.Authorization", "literal credential"),
    ({"endpoint": None, "endpoints": [{"url": "http://a:1/v1", "api_key_env": "K", "api_key_file": "/nope"}]},
     "model.endpoints[0].api_key_file", "not both"),
    ({"endpoint": None, "endpoints": [{"url": "http://a:1/v1", "api_key_file": "/nonexistent/key"}]},
     "model.endpoints[0].api_key_file", ""),
    ({"endpoint": None, "endpoints": [{"url": "http://a:1/v1"}, {"url": "http://a:1/v2"}]},
     "model.endpoints[1].name", "distinct name"),
    ({"endpoint": None, "endpoints": [{"url": "http://a:1/v1", "weight": 0}]}, "model.endpoints[0].weight", "> 0"),
    ({"circuit": {"cooldown_s": 10, "max_cooldown_s": 5}}, "model.circuit.max_cooldown_s", ">="),
    ({"fallback": {"endpoints": [{"url": "http://b:1/v1"}], "after_attempts": 0}},
     "model.fallback.after_attempts", "> 0"),
])
def test_fleet_config_errors_name_the_key(model: dict[str, object], key: str, problem: str) -> None:
    from udfs.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        _config(model)
    assert caught.value.key == key and problem in caught.value.problem


def test_the_shorthand_is_a_fleet_of_one_and_endpoints_take_their_own_keys(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from udfs.config import JobConfig

    key_file = Path(str(tmp_path)) / "key"
    key_file.write_text("sk-file\n")
    key_file.chmod(0o600)
    monkeypatch.setenv("FLEET_KEY", "sk-env")
    shorthand = _config({"api_key_env": "FLEET_KEY"})
    assert isinstance(shorthand, JobConfig)
    primaries, fallbacks = shorthand.fleet()
    assert [e.url for e in primaries] == ["http://127.0.0.1:1/v1"] and primaries[0].api_key() == "sk-env"
    assert fallbacks == []
    fleet_config = _config({"endpoint": None, "endpoints": [
        {"url": "http://a:1/v1", "api_key_file": str(key_file), "name": "gpu-a"},
        {"url": "http://b:2/v1", "api_key_env": "FLEET_KEY", "model": "other"}]})
    assert isinstance(fleet_config, JobConfig)
    primaries, _ = fleet_config.fleet()
    assert [e.label for e in primaries] == ["gpu-a", "b:2"]
    assert [e.api_key() for e in primaries] == ["sk-file", "sk-env"]
    assert "sk-file" not in repr(fleet_config) and "sk-env" not in repr(fleet_config)
