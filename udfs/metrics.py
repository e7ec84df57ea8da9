"""What the inference stage counts, on Flink's metric system or in plain Python.

With a PyFlink metric group (`runtime_context.get_metrics_group().add_group("llmstream")`)
every metric is registered there and shows in the web UI, the REST API and reporters
(Prometheus: `flink_taskmanager_job_task_operator_llmstream_<name>`); with `group=None`
(tests, benchmarks) the same attributes exist without Flink. Either way `snapshot()`
returns the current values.

Every metric is registered as a Flink **gauge** that reads a plain Python value, counters
included. Measured: PyFlink's Python counters and distributions record into a Beam metrics
container that is thread-local, so an increment made on the inference stage's own asyncio
thread (`requests`, `retries`, `rate_limited`, tokens, latency) never reached Flink; gauges
are read on the operator thread at every bundle end, whichever thread changed the value.
Flink exports counters to Prometheus as gauges anyway, and the REST API shows both alike.
PyFlink has no histogram and its `distribution` (count/sum/min/max) is not a number to
Prometheus, so latency is exported as gauges: count, sum, max, and p50/p99 over the most
recent `LATENCY_WINDOW` answers.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol


class MetricGroup(Protocol):
    """The part of `pyflink.metrics.MetricGroup` used here."""

    def gauge(self, name: str, obj: Any) -> None: ...

    def add_group(self, name: str, extra: str | None = None) -> Any: ...


class Counter:
    """A count, exported to Flink as a gauge (see the module docstring for why)."""

    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


LATENCY_WINDOW = 2048
"""Answers the latency percentiles are taken over (the most recent ones)."""


class Distribution:
    """Count, sum, min and max of a value, and percentiles of its most recent values."""

    def __init__(self, window: int = LATENCY_WINDOW) -> None:
        self.count = 0
        self.sum = 0
        self.min: int | None = None
        self.max: int | None = None
        self._recent: deque[int] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._sorted: list[int] = []
        self._sorted_count = 0

    def update(self, value: int) -> None:
        value = int(value)
        with self._lock:
            self.count += 1
            self.sum += value
            self.min = value if self.min is None else min(self.min, value)
            self.max = value if self.max is None else max(self.max, value)
            self._recent.append(value)

    def percentile(self, q: float) -> int:
        """The q-quantile (0..1) of the recent values by nearest rank; 0 when there are none.
        Sorted again only when values came in: gauges are read at every bundle end, and a sort
        of the window is not free (docs/observe.md, "Prometheus")."""
        with self._lock:
            if self._sorted_count != self.count:
                self._sorted = sorted(self._recent)
                self._sorted_count = self.count
            values = self._sorted
        if not values:
            return 0
        return values[min(len(values) - 1, max(0, int(q * len(values) + 0.5) - 1))]

    def snapshot(self) -> dict[str, float | int | None]:
        return {"count": self.count, "sum": self.sum, "min": self.min, "max": self.max,
                "mean": self.sum / self.count if self.count else None,
                "p50": self.percentile(0.5), "p99": self.percentile(0.99)}


ENDPOINT_GAUGES = ("in_flight", "limit", "circuit", "requests", "rate_limited", "failures",
                   "latency_p50_ms", "latency_p99_ms")
"""Per endpoint of a model fleet (`udfs/inference/fleet.py`): calls in flight, the adaptive concurrency
limit, the circuit (0 closed, 1 half-open, 2 open), attempts sent, 429s, failures (connection
errors, timeouts, 5xx) and the latency of its answers."""

def metric_label(label: str) -> str:
    """`label` with every character other than a letter, digit, `_` or `-` made `_`
    (`127.0.0.1:8000` -> `127_0_0_1_8000`): a metric id splits on dots."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", label)


COUNTERS = ("records_in", "bad_input", "requests", "retries", "reissued", "rate_limited", "dead_lettered",
            "prompt_tokens", "completion_tokens", "cache_hits", "cache_misses", "cache_errors", "invalid_answers", "dropped",
            "batch_requests")


HELD_GAUGES = ("held", "held_oldest_s")
"""Records the stage holds whose outcome has not left it (calls in flight, records waiting for a
slot, for their key's turn or in a provider batch), and the age of the oldest of them in seconds:
what a backfill's drain waits for (`jobs/launch/driver.py`)."""

BATCH_GAUGES = ("batch_records_waiting", "batches_open", "batch_oldest_age_s")
"""The provider-batch lane's gauges (`lane: provider-batch`): records collected and not yet in a batch,
batches created and not yet answered, and the age of the oldest of those in seconds."""


class InferenceMetrics:
    """Counters, gauges and the latency distribution of one inference subtask.

    `records_in` counts input records, `bad_input` those dead-lettered by the record contract,
    `reissued` the calls started again after a restore (they were in flight in the snapshot).
    `requests` counts HTTP calls sent (every attempt), `retries` the attempts after the first,
    `rate_limited` the 429 responses, `prompt_tokens`/`completion_tokens` the usage of
    successful calls, `latency_ms` the latency of successful records (first attempt to
    answer). `dead_lettered` is incremented by the operator that writes the dead letter,
    not by the client; `dead_letter(reason)` also counts it by reason. The gauges `in_flight` and `concurrency_limit` read the attributes
    of the same names, which the client keeps current; `admitted` (calls started and not
    finished, at most `async.capacity`) is kept by the inference stage.
    `cache_hits` / `cache_misses` count lookups in the result cache (requests it may hold),
    `cache_errors` its failed operations (an outage: the model is called instead);
    `budget_paused` is 1 while calls wait for the spend budget's next window.
    `invalid_answers` counts answers that did not validate against `model.response_format`
    (each one asked again, or the record dead-lettered as `invalid_model_output`).
    `batch_requests` counts requests submitted in provider batches (`lane: provider-batch`), with the
    `BATCH_GAUGES`.
    `dropped` counts records that leave nothing by the user's own functions (`model.skipped: drop`,
    a postprocess that returns None; docs/user-functions.md).
    `held` and `held_oldest_s` (`HELD_GAUGES`) read `holding`, which the stage keeps.
    """

    def __init__(self, group: MetricGroup | None = None) -> None:
        self._group = group
        self.records_in = Counter()
        self.bad_input = Counter()
        self.reissued = Counter()
        self.requests = Counter()
        self.retries = Counter()
        self.rate_limited = Counter()
        self.dead_lettered = Counter()
        self.prompt_tokens = Counter()
        self.completion_tokens = Counter()
        self.cache_hits = Counter()
        self.cache_misses = Counter()
        self.cache_errors = Counter()
        self.invalid_answers = Counter()
        self.dropped = Counter()
        self.batch_requests = Counter()
        self.batch_records_waiting = 0
        self.batches_open = 0
        self.batch_oldest_age_s = 0
        self.budget_paused = False
        self.latency_ms = Distribution()
        self.in_flight = 0
        self.concurrency_limit = 0
        self.admitted = 0
        self.holding = Holding()
        self.dead_letters_by_reason: dict[str, Counter] = {}
        self.endpoints: dict[str, Callable[[], dict[str, int]]] = {}
        if group is not None:
            for name in COUNTERS:
                counter: Counter = getattr(self, name)
                group.gauge(name, lambda c=counter: int(c.value))
            for name in ("admitted", "in_flight", "concurrency_limit", "budget_paused", *BATCH_GAUGES):
                group.gauge(name, lambda n=name: int(getattr(self, n)))
            holding = self.holding
            group.gauge("held", lambda: holding.count)
            group.gauge("held_oldest_s", holding.oldest_s)
            latency = self.latency_ms
            group.gauge("latency_count", lambda: int(latency.count))
            group.gauge("latency_sum_ms", lambda: int(latency.sum))
            group.gauge("latency_max_ms", lambda: int(latency.max or 0))
            group.gauge("latency_p50_ms", lambda: latency.percentile(0.5))
            group.gauge("latency_p99_ms", lambda: latency.percentile(0.99))

    def dead_letter(self, reason: str) -> None:
        """One dead letter with its reason: `dead_lettered`, and `dead_letters{reason=...}` (a
        Flink key/value group, so Prometheus gets a `reason` label). Call on the operator thread."""
        self.dead_lettered.inc()
        counter = self.dead_letters_by_reason.get(reason)
        if counter is None:
            counter = self.dead_letters_by_reason[reason] = Counter()
            if self._group is not None:
                self._group.add_group("reason", reason).gauge("dead_letters", lambda: int(counter.value))
        counter.inc()

    def add_endpoint(self, label: str, figures: Callable[[], dict[str, int]]) -> None:
        """An endpoint of a model fleet, its `ENDPOINT_GAUGES` read from `figures()`: a Flink
        key/value group `endpoint=<label>` (`metric_label`: letters, digits, `_` and `-`), so
        Prometheus gets an `endpoint` label and the REST API an id `...endpoint.<label>.<gauge>`."""
        label = metric_label(label)
        self.endpoints[label] = figures
        if self._group is not None:
            group = self._group.add_group("endpoint", label)
            for name in ENDPOINT_GAUGES:
                group.gauge(name, lambda n=name: int(figures()[n]))

    def snapshot(self) -> dict[str, Any]:
        """Current values: counters by name, the gauges, `latency_ms` and dead letters by reason as dicts."""
        values: dict[str, Any] = {name: getattr(self, name).value for name in COUNTERS}
        values["in_flight"] = self.in_flight
        values["concurrency_limit"] = self.concurrency_limit
        values["admitted"] = self.admitted
        values["budget_paused"] = self.budget_paused
        for name in BATCH_GAUGES:
            values[name] = getattr(self, name)
        values["held"] = self.holding.count
        values["held_oldest_s"] = self.holding.oldest_s()
        values["latency_ms"] = self.latency_ms.snapshot()
        values["dead_letters_by_reason"] = {r: c.value for r, c in self.dead_letters_by_reason.items()}
        if self.endpoints:
            values["endpoints"] = {label: figures() for label, figures in self.endpoints.items()}
        return values


class Holding:
    """The records a stage holds whose outcome has not left it, each since it was taken in (by this
    instance: a record restored from state counts from its restore). The oldest is the first in
    insertion order, so reading it costs nothing whatever the count. Operator thread only.

    A stage that counts what it holds itself (the provider-batch lane, whose records wait in
    collections and batches) says so with `set` instead of holding each record."""

    def __init__(self) -> None:
        self._since: dict[Any, float] = {}
        self._counted: tuple[int, float] | None = None

    @property
    def count(self) -> int:
        return self._counted[0] if self._counted is not None else len(self._since)

    def hold(self, handle: Any) -> None:
        self._since.setdefault(handle, time.monotonic())

    def release(self, handle: Any) -> None:
        self._since.pop(handle, None)

    def set(self, count: int, oldest_s: float) -> None:
        """`count` records held, the oldest for `oldest_s` seconds."""
        self._counted = (count, time.monotonic() - oldest_s if count else 0.0)

    def oldest_s(self) -> int:
        """Whole seconds the oldest record has been held (0 when none is)."""
        if self._counted is not None:
            count, since = self._counted
        else:
            count, since = len(self._since), next(iter(self._since.values()), 0.0)
        return int(time.monotonic() - since) if count else 0
