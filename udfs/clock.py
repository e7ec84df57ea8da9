"""Time, one name each.

- `Clock`: a function that gives seconds as a float (`time.monotonic` for intervals, `time.time`
  where a window follows the wall clock). Rate limits, the fleet and the spend budget take one, so
  unit tests drive them with a fake clock.
- `Sleep`: an awaitable pause of so many seconds (`asyncio.sleep`), taken for the same reason.
- `now_ms()`: now in milliseconds since the epoch, the clock of every time a record or the state
  carries (a result's `started_ms`/`completed_ms`, a dead letter's `dead_lettered_at`, a provider
  batch's times).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[object]]


def now_ms() -> int:
    """Now, in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000
