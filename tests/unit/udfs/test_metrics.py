"""udfs/metrics.py without Flink: what the metric group gets, and latency percentiles."""

from __future__ import annotations

import threading

from tests.support.fakes import MetricGroup
from udfs.metrics import COUNTERS, Distribution, InferenceMetrics


def test_every_metric_is_a_gauge_reading_the_python_value() -> None:
    group = MetricGroup()
    metrics = InferenceMetrics(group)
    assert set(COUNTERS) <= set(group.gauges)
    assert {"in_flight", "admitted", "concurrency_limit", "latency_count", "latency_sum_ms", "latency_max_ms",
            "latency_p50_ms", "latency_p99_ms"} <= set(group.gauges)
    metrics.requests.inc(3)
    metrics.in_flight = 2
    assert group.gauges["requests"]() == 3 and group.gauges["in_flight"]() == 2


def test_counts_made_on_another_thread_reach_the_gauges() -> None:
    """The calls run on their own asyncio thread; a gauge read on the operator thread sees them."""
    group = MetricGroup()
    metrics = InferenceMetrics(group)
    worker = threading.Thread(target=lambda: [metrics.requests.inc() for _ in range(1000)])
    worker.start()
    worker.join()
    assert group.gauges["requests"]() == 1000


def test_dead_letters_by_reason_get_a_reason_group() -> None:
    group = MetricGroup()
    metrics = InferenceMetrics(group)
    metrics.dead_letter("invalid_json")
    metrics.dead_letter("invalid_json")
    metrics.dead_letter("inference_rejected")
    assert metrics.dead_lettered.value == 3
    assert group.groups[("reason", "invalid_json")].gauges["dead_letters"]() == 2
    assert group.groups[("reason", "inference_rejected")].gauges["dead_letters"]() == 1
    assert metrics.snapshot()["dead_letters_by_reason"] == {"invalid_json": 2, "inference_rejected": 1}


def test_latency_percentiles_over_the_recent_window() -> None:
    latency = Distribution(window=100)
    assert latency.percentile(0.5) == 0
    for value in range(1, 1001):
        latency.update(value)
    assert latency.count == 1000 and latency.max == 1000 and latency.min == 1
    assert latency.percentile(0.5) == 950   # the window holds 901..1000
    assert latency.percentile(0.99) == 999
    snapshot = latency.snapshot()
    assert snapshot["p50"] == 950 and snapshot["mean"] == 500.5


def test_without_a_group_nothing_is_registered() -> None:
    metrics = InferenceMetrics()
    metrics.dead_letter("null_value")
    metrics.latency_ms.update(12)
    assert metrics.snapshot()["latency_ms"]["p50"] == 12


def test_fleet_endpoints_are_gauges_in_a_labelled_group() -> None:
    from udfs.metrics import ENDPOINT_GAUGES, metric_label

    group = MetricGroup()
    metrics = InferenceMetrics(group)
    figures = dict.fromkeys(ENDPOINT_GAUGES, 0) | {"in_flight": 3, "circuit": 2}
    metrics.add_endpoint("127.0.0.1:8000", lambda: figures)
    assert metric_label("127.0.0.1:8000") == "127_0_0_1_8000" and metric_label("gpu-a_1") == "gpu-a_1"
    assert metrics.snapshot()["endpoints"] == {"127_0_0_1_8000": figures}
    figures["in_flight"] = 5
    assert metrics.snapshot()["endpoints"]["127_0_0_1_8000"]["in_flight"] == 5
    gauges = group.groups[("endpoint", "127_0_0_1_8000")].gauges
    assert set(gauges) == set(ENDPOINT_GAUGES) and gauges["in_flight"]() == 5 and gauges["circuit"]() == 2
