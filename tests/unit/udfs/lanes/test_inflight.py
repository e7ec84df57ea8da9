"""`udfs.lanes.inflight.CallRunner` on its own: admission at capacity, the wake-ups of `take`, `wait`
and `wait_for_slot`, and shutdown with calls in flight. Calls are coroutines held by
`asyncio.Event` gates the test opens, so nothing depends on how fast the machine is: every
wait is for a condition, with a generous deadline.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from tests.support.waiting import wait_until
from udfs.lanes.inflight import CallRunner

DEADLINE_S = 30.0
"""Upper bound for anything the test waits for; reached only when something is broken."""


class GatedCall:
    """A call that starts, waits for its gate, then returns `value` (or raises `error`)."""

    def __init__(self, runner: CallRunner, value: Any = None, error: BaseException | None = None) -> None:
        self._runner = runner
        self.value = value
        self.error = error
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self._gate = asyncio.Event()  # bound to the runner's loop when first awaited there

    def __call__(self) -> Coroutine[Any, Any, Any]:
        return self._run()

    async def _run(self) -> Any:
        self.started.set()
        try:
            await self._gate.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if self.error is not None:
            raise self.error
        return self.value

    def open(self) -> None:
        self._runner.loop.call_soon_threadsafe(self._gate.set)


@pytest.fixture
def make_runner() -> Iterator[Callable[[int], CallRunner]]:
    made: list[CallRunner] = []

    def make(capacity: int) -> CallRunner:
        runner = CallRunner(capacity, name="test-calls")
        made.append(runner)
        return runner

    yield make
    for runner in made:
        runner.close()
        assert not runner._thread.is_alive(), "the runner's loop thread outlived close()"


def submitted(runner: CallRunner, bucket: Any, handle: Any, **kwargs: Any) -> GatedCall:
    call = GatedCall(runner, **kwargs)
    runner.submit(bucket, handle, call)
    assert call.started.wait(DEADLINE_S), "the call never started on the loop"
    return call


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        CallRunner(0)


def test_submit_blocks_at_capacity_until_a_call_finishes(make_runner: Callable[[int], CallRunner]) -> None:
    runner = make_runner(2)
    first = submitted(runner, "b", 1, value="one")
    submitted(runner, "b", 2, value="two")
    assert runner.in_flight == 2 and not runner.has_slot()

    third = GatedCall(runner, value="three")
    returned = threading.Event()

    def admit() -> None:
        runner.submit("b", 3, third)
        returned.set()

    submitter = threading.Thread(target=admit, daemon=True)
    submitter.start()
    assert not runner.wait_for_slot(0.2)  # full: no slot in this window, and no admission either
    assert not returned.is_set() and not third.started.is_set()

    first.open()
    assert returned.wait(DEADLINE_S), "submit stayed blocked after a slot was freed"
    assert third.started.wait(DEADLINE_S)
    submitter.join(DEADLINE_S)
    assert runner.in_flight == 2
    assert runner.take("b") == [(1, "one")]


def test_wait_for_slot_wakes_when_a_call_finishes(make_runner: Callable[[int], CallRunner]) -> None:
    runner = make_runner(1)
    call = submitted(runner, "b", "h")
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: woke.set() if runner.wait_for_slot(DEADLINE_S) else None, daemon=True)
    waiter.start()
    call.open()
    waiter.join(DEADLINE_S)
    assert woke.is_set() and runner.has_slot() and runner.in_flight == 0


def test_take_returns_only_that_buckets_finished_calls_in_finishing_order(
        make_runner: Callable[[int], CallRunner]) -> None:
    runner = make_runner(4)
    a1 = submitted(runner, "a", "a1", value=1)
    a2 = submitted(runner, "a", "a2", value=2)
    b1 = submitted(runner, "b", "b1", value=3)
    assert runner.take("a") == [] and runner.done_count("a") == 0
    for call in (a2, b1, a1):
        call.open()
    wait_until(lambda: runner.done_count("a") == 2 and runner.done_count("b") == 1, DEADLINE_S, interval=0.005,
               message=lambda: f"2 calls done in bucket a, 1 in b ({runner.done_count('a')}, {runner.done_count('b')})")
    assert runner.take("a") == [("a2", 2), ("a1", 1)]
    assert runner.take("a") == [] and runner.done_count("a") == 0
    assert runner.take("b") == [("b1", 3)]
    assert runner.in_flight == 0


def test_wait_wakes_for_its_own_bucket_and_any_bucket_without_one(make_runner: Callable[[int], CallRunner]) -> None:
    runner = make_runner(4)
    mine = submitted(runner, "mine", "m", value="m")
    other = submitted(runner, "other", "o", value="o")
    other.open()
    assert runner.wait(DEADLINE_S) is True  # any bucket: "other" has finished
    assert runner.wait(0.05, "mine") is False  # "other"'s result does not wake "mine"
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(runner.wait(DEADLINE_S, "mine")), daemon=True)
    waiter.start()
    mine.open()
    waiter.join(DEADLINE_S)
    assert result == [True]
    assert runner.take("mine") == [("m", "m")] and runner.take("other") == [("o", "o")]


def test_a_call_that_raises_frees_its_slot_and_leaves_none(make_runner: Callable[[int], CallRunner],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    runner = make_runner(1)
    call = submitted(runner, "b", "h", error=ZeroDivisionError("a bug"))
    with caplog.at_level(logging.ERROR, logger="udfs.lanes.inflight"):
        call.open()
        assert runner.wait(DEADLINE_S, "b")
    assert runner.take("b") == [("h", None)]
    assert runner.has_slot() and runner.in_flight == 0
    assert "raised instead of returning its outcome" in caplog.text


def test_run_sync_runs_a_coroutine_on_the_loop(make_runner: Callable[[int], CallRunner]) -> None:
    runner = make_runner(1)

    async def which_loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    assert runner.run_sync(which_loop(), DEADLINE_S) is runner.loop


def test_close_abandons_calls_in_flight_runs_before_stop_and_ends_the_loop(
        make_runner: Callable[[int], CallRunner]) -> None:
    runner = make_runner(2)
    calls = [submitted(runner, "b", i) for i in range(2)]
    stopped_on: list[asyncio.AbstractEventLoop] = []

    async def before_stop() -> None:
        stopped_on.append(asyncio.get_running_loop())

    loop = runner.loop
    runner.close(before_stop=before_stop)
    assert all(call.cancelled.is_set() for call in calls), "calls in flight were not cancelled"
    assert stopped_on == [loop]
    assert not runner._thread.is_alive() and loop.is_closed()
    assert runner.take("b") == [] and not runner.wait(0.01, "b")
    runner.close()  # twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit("b", "late", GatedCall(runner))


def test_close_releases_a_submitter_blocked_at_capacity(make_runner: Callable[[int], CallRunner]) -> None:
    runner = make_runner(1)
    submitted(runner, "b", "first")
    errors: list[BaseException] = []

    def admit() -> None:
        try:
            runner.submit("b", "second", GatedCall(runner))
        except RuntimeError as err:
            errors.append(err)

    submitter = threading.Thread(target=admit, daemon=True)
    submitter.start()
    assert not runner.wait_for_slot(0.1)
    runner.close()
    submitter.join(DEADLINE_S)
    assert not submitter.is_alive(), "a submitter blocked at capacity stayed blocked after close()"
    assert [str(e) for e in errors] == ["CallRunner is closed"]
    assert runner.wait_for_slot(DEADLINE_S) is False  # closed: never a slot, and no wait either


def test_a_result_that_arrives_after_close_is_dropped(make_runner: Callable[[int], CallRunner]) -> None:
    """Results of abandoned calls must not reappear: their records are in state, to be issued again."""
    runner = make_runner(1)
    started = threading.Event()

    async def ignores_cancellation() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "late"  # swallows the cancel and returns: the runner must still drop it
        return "never"

    runner.submit("b", "h", ignores_cancellation)
    assert started.wait(DEADLINE_S)
    runner.close()
    assert runner.take("b") == [] and runner.in_flight == 0
