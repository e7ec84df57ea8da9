"""A spend budget: at most so many tokens, or so much money, per window (an hour by default).

Past the budget a call waits for the next window instead of failing: the waiting call keeps
its slot in the inference stage, the stage stops admitting records and the Kafka source is
back-pressured. Nothing is dropped or dead-lettered, and the job resumes by itself when the
window rolls over.

Windows are fixed and aligned to the wall clock (`floor(time / window_s)`), so every
subtask of a job rolls over at the same moment; each takes 1/`subtasks` of the job-wide cap,
like `rate_limit.*`. A call is charged its estimate (prompt tokens + max_tokens) when it is
admitted, so concurrent calls cannot all slip under the cap at once, and the charge is
corrected to the usage the server reports. A call larger than the whole share still runs,
alone, at the start of a window, or it would never run at all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from udfs.clock import Clock, Sleep
from udfs.config import BudgetConfig, PriceConfig
from udfs.cost import pricing

log = logging.getLogger(__name__)


class SpendBudget:
    """This subtask's share of `budget.max_tokens_per_hour` / `max_cost_per_hour` per `window_s`.

    `paused` is true while a call waits for the next window; `on_pause` hears every change
    (the `budget_paused` metric). Use from one event loop; the inference stage reads `paused`
    from its own thread (a bool: no lock needed) to close its admission gate (`udfs/lanes/admission.py`).
    """

    def __init__(self, config: BudgetConfig, prices: PriceConfig | None, subtasks: int = 1, *,
                 clock: Clock = time.time, sleep: Sleep = asyncio.sleep,
                 on_pause: Callable[[bool], None] | None = None) -> None:
        self._on_pause = on_pause
        share = 1 / max(1, subtasks)
        self.window_s = config.window_s
        self.max_tokens = None if config.max_tokens_per_hour is None else config.max_tokens_per_hour * share
        self.max_cost = None if config.max_cost_per_hour is None else config.max_cost_per_hour * share
        self.prices = prices or PriceConfig()
        self._clock = clock
        self._sleep = sleep
        self._window = -1
        self.tokens = 0.0
        self.cost = 0.0
        self.paused = False
        self.pauses = 0
        self._waiting = 0  # calls waiting for a window with room

    @property
    def enabled(self) -> bool:
        return self.max_tokens is not None or self.max_cost is not None

    def _roll(self) -> None:
        window = math.floor(self._clock() / self.window_s)
        if window != self._window:
            self._window = window
            self.tokens = 0.0
            self.cost = 0.0

    def price(self, prompt_tokens: float, completion_tokens: float) -> float:
        """`pricing.cost` at `model.prices` (free without them: then only a token cap applies)."""
        return pricing.cost(self.prices, prompt_tokens, completion_tokens)

    def _fits(self, tokens: float, cost: float) -> bool:
        if self.tokens == 0 and self.cost == 0:
            return True
        if self.max_tokens is not None and self.tokens + tokens > self.max_tokens:
            return False
        return self.max_cost is None or self.cost + cost <= self.max_cost

    async def acquire(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Charges an estimated call, first waiting for a window with room; returns the seconds waited.

        `paused` is true while at least one call waits, and turns false when the last one leaves,
        through the window or cancelled (a record deadline, a shutdown): a pause the stage's
        admission gate follows must never outlive its waiters."""
        if not self.enabled:
            return 0.0
        started = time.monotonic()
        tokens, cost = prompt_tokens + completion_tokens, self.price(prompt_tokens, completion_tokens)
        self._roll()
        if not self._fits(tokens, cost):
            self._waiting += 1
            if not self.paused:
                self._set_paused(True)
                self.pauses += 1
                log.warning("spend budget reached (%s); pausing calls until the window rolls over in %.0f s",
                            self._describe(), self._until_next_window())
            try:
                while not self._fits(tokens, cost):
                    await self._sleep(self._until_next_window() + 0.001)
                    self._roll()
            finally:
                self._waiting -= 1
                if self._waiting == 0 and self.paused:
                    self._set_paused(False)
                    log.warning("spend budget: calls resume after %.1f s paused", time.monotonic() - started)
        self.tokens += tokens
        self.cost += cost
        return time.monotonic() - started

    def settle(self, estimated: tuple[int, int], actual: tuple[int, int]) -> None:
        """Corrects a call's charge from its estimate to the usage reported (same window only)."""
        if not self.enabled:
            return
        self._roll()
        self.tokens = max(0.0, self.tokens + sum(actual) - sum(estimated))
        self.cost = max(0.0, self.cost + self.price(*actual) - self.price(*estimated))

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused
        if self._on_pause is not None:
            self._on_pause(paused)

    def _until_next_window(self) -> float:
        return max(0.0, (self._window + 1) * self.window_s - self._clock())

    def _describe(self) -> str:
        parts = []
        if self.max_tokens is not None:
            parts.append(f"{self.tokens:.0f} of {self.max_tokens:.0f} tokens")
        if self.max_cost is not None:
            parts.append(f"cost {self.cost:.4f} of {self.max_cost:.4f}")
        return ", ".join(parts) + f" this subtask's share per {self.window_s:g} s window"
