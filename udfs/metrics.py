"""What the inference stage counts, on Flink's metric system or in plain Python.

With a PyFlink metric group (`runtime_context.get_metrics_group().add_group("llmstream")`)
every metric is registered there and shows in the web UI and reporters; with `group=None`
(tests, benchmarks) the same attributes exist without Flink. Either way `snapshot()`
returns the current values, because the Python counters are kept in both cases.
"""

from __future__ import annotations

from typing import Any, Protocol


class MetricGroup(Protocol):
    """The part of `pyflink.metrics.MetricGroup` used here."""

    def counter(self, name: str) -> Any: ...

    def gauge(self, name: str, obj: Any) -> None: ...

    def distribution(self, name: str) -> Any: ...


class Counter:
    """A count that also forwards to a Flink counter when there is one."""

    def __init__(self, flink_counter: Any = None) -> None:
        self.value = 0
        self._flink = flink_counter

    def inc(self, n: int = 1) -> None:
        self.value += n
        if self._flink is not None:
            self._flink.inc(n)


class Distribution:
    """Count, sum, min and max of a value; Flink's Python API has no histogram."""

    def __init__(self, flink_distribution: Any = None) -> None:
        self.count = 0
        self.sum = 0
        self.min: int | None = None
        self.max: int | None = None
        self._flink = flink_distribution

    def update(self, value: int) -> None:
        value = int(value)
        self.count += 1
        self.sum += value
        self.min = value if self.min is None else min(self.min, value)
        self.max = value if self.max is None else max(self.max, value)
        if self._flink is not None:
            self._flink.update(value)

    def snapshot(self) -> dict[str, float | int | None]:
        return {"count": self.count, "sum": self.sum, "min": self.min, "max": self.max,
                "mean": self.sum / self.count if self.count else None}


COUNTERS = ("records_in", "bad_input", "requests", "retries", "reissued", "rate_limited", "dead_lettered",
            "prompt_tokens", "completion_tokens")


class InferenceMetrics:
    """Counters, gauges and the latency distribution of one inference subtask.

    `records_in` counts input records, `bad_input` those dead-lettered by the record contract,
    `reissued` the calls started again after a restore (they were in flight in the snapshot).
    `requests` counts HTTP calls sent (every attempt), `retries` the attempts after the first,
    `rate_limited` the 429 responses, `prompt_tokens`/`completion_tokens` the usage of
    successful calls, `latency_ms` the latency of successful records (first attempt to
    answer). `dead_lettered` is incremented by the operator that writes the dead letter,
    not by the client. The gauges `in_flight` and `concurrency_limit` read the attributes
    of the same names, which the client keeps current; `admitted` (calls started and not
    finished, at most `async.capacity`) is kept by the inference stage.
    """

    def __init__(self, group: MetricGroup | None = None) -> None:
        self.records_in = self._counter(group, "records_in")
        self.bad_input = self._counter(group, "bad_input")
        self.reissued = self._counter(group, "reissued")
        self.requests = self._counter(group, "requests")
        self.retries = self._counter(group, "retries")
        self.rate_limited = self._counter(group, "rate_limited")
        self.dead_lettered = self._counter(group, "dead_lettered")
        self.prompt_tokens = self._counter(group, "prompt_tokens")
        self.completion_tokens = self._counter(group, "completion_tokens")
        self.latency_ms = Distribution(group.distribution("latency_ms") if group is not None else None)
        self.in_flight = 0
        self.concurrency_limit = 0
        self.admitted = 0
        if group is not None:
            group.gauge("admitted", lambda: int(self.admitted))
            group.gauge("in_flight", lambda: int(self.in_flight))
            group.gauge("concurrency_limit", lambda: int(self.concurrency_limit))

    @staticmethod
    def _counter(group: MetricGroup | None, name: str) -> Counter:
        return Counter(group.counter(name) if group is not None else None)

    def snapshot(self) -> dict[str, Any]:
        """Current values: counters by name, the two gauges, and `latency_ms` as a dict."""
        values: dict[str, Any] = {name: getattr(self, name).value for name in COUNTERS}
        values["in_flight"] = self.in_flight
        values["concurrency_limit"] = self.concurrency_limit
        values["admitted"] = self.admitted
        values["latency_ms"] = self.latency_ms.snapshot()
        return values
