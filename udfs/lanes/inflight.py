"""Calls in flight outside Flink's bundle: an asyncio loop of its own, admission up to a capacity.

PyFlink's async operator drains every call at each bundle end and checkpoint barrier (docs/architecture.md),
so a checkpoint waits for the slowest model call. `CallRunner` instead runs the calls on an
event loop in a background thread that outlives bundles: the Flink function hands it a
coroutine and returns at once, and collects finished results later, per bucket (the key the
function's state is kept under), from `process_element` or a timer. What is in flight is
also in the function's keyed state, so a checkpoint never waits for it.

`submit` blocks while `capacity` calls are in flight: that wait, on the Flink task's
thread, is the stage's backpressure. Thread contract: `submit`, `take`, `wait` and `close`
come from one thread (the Flink function's); results are added from the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Hashable
from typing import Any

log = logging.getLogger(__name__)

Finished = tuple[Hashable, Any]
"""(handle, value): what one finished call left for its bucket."""


class CallRunner:
    """Runs coroutines on a private event loop; at most `capacity` unfinished at a time.

    Each call belongs to a bucket and has a handle; a finished call's `(handle, value)` waits
    in its bucket's queue until `take(bucket)`. A call counts against capacity from `submit`
    until its value is queued (not until it is taken: a finished call holds no connection).
    """

    def __init__(self, capacity: int, *, name: str = "llmstream-calls") -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._wake_batch = max(1, capacity // 8)
        self._lock = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._done: dict[Hashable, deque[Finished]] = {}
        self._inbox: deque[Callable[[], Coroutine[Any, Any, None]]] = deque()
        self._wake_pending = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def in_flight(self) -> int:
        """Calls submitted and not finished."""
        return self._in_flight

    def done_count(self, bucket: Hashable) -> int:
        """Finished calls of `bucket` not yet taken."""
        queue = self._done.get(bucket)
        return len(queue) if queue else 0

    def has_slot(self) -> bool:
        return self._in_flight < self.capacity

    def wait_for_slot(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for a free slot; True if there is one."""
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight < self.capacity or self._closed, timeout_s) \
                and not self._closed

    def submit(self, bucket: Hashable, handle: Hashable, call: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Starts `call()` on the loop once a slot is free (blocking until then); its value goes
        to `bucket` under `handle`. `call` must not raise (a raise is logged, its value is `None`).
        Raises `RuntimeError` once the runner is closed, also in a submit blocked at capacity."""
        with self._lock:
            while self._closed or self._in_flight >= self.capacity:
                if self._closed:
                    raise RuntimeError("CallRunner is closed")
                self._lock.wait(0.5)
            self._in_flight += 1
            self._inbox.append(lambda: self._finish(bucket, handle, call))
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            self.loop.call_soon_threadsafe(self._start_inbox)

    def _start_inbox(self) -> None:
        with self._lock:
            starting = list(self._inbox)
            self._inbox.clear()
            self._wake_pending = False
        for make in starting:
            task: asyncio.Task[None] = self.loop.create_task(make())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _finish(self, bucket: Hashable, handle: Hashable, call: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        value: Any = None
        try:
            value = await call()
        except asyncio.CancelledError:
            raise
        except BaseException:  # the call's own contract is not to raise; keep the slot accounting right
            log.exception("a call raised instead of returning its outcome; handle %r", handle)
        finally:
            with self._lock:
                self._in_flight -= 1
                if not self._closed:
                    self._done.setdefault(bucket, deque()).append((handle, value))
                # Wake the submitting thread once a batch of slots is free, not per call: one
                # thread switch (and GIL hand-off) per batch instead of per record.
                if self.capacity - self._in_flight >= self._wake_batch or self._in_flight == 0:
                    self._lock.notify_all()

    def take(self, bucket: Hashable) -> list[Finished]:
        """The finished calls of `bucket`, removed from the runner."""
        queue = self._done.get(bucket)
        if not queue:
            return []
        with self._lock:
            out = list(queue)
            queue.clear()
        return out

    def wait(self, timeout_s: float, bucket: Hashable | None = None) -> bool:
        """Waits up to `timeout_s` until a call of `bucket` (any bucket if None) has finished;
        True if one is waiting to be taken."""
        with self._lock:
            if bucket is None:
                return self._lock.wait_for(lambda: any(self._done.values()), timeout_s)
            return self._lock.wait_for(lambda: bool(self._done.get(bucket)), timeout_s)

    def run_sync(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """Runs `coro` on the loop and waits for its value (for set-up and tear-down)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self, before_stop: Callable[[], Coroutine[Any, Any, Any]] | None = None, timeout_s: float = 5.0) -> None:
        """Abandons unfinished calls (they are in the function's state, to be issued again
        after a restore), runs `before_stop()` on the loop, stops it and joins its thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._done.clear()
            self._lock.notify_all()

        async def shut_down() -> None:
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=timeout_s)
            if before_stop is not None:
                try:
                    await asyncio.wait_for(before_stop(), timeout_s)
                except Exception:
                    log.debug("tear-down on the call loop failed", exc_info=True)

        try:
            if self.loop.is_running():
                self.run_sync(shut_down(), timeout_s * 2 + 1)
        except Exception:
            log.debug("stopping the call loop failed", exc_info=True)
        finally:
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
