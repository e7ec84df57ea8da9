"""Observability on real parts: Flink's Prometheus reporter in a mini cluster, scraped during a run.

The job runs in a background thread (`run_job` with a `StopRequest`), the test scrapes
`metrics.prometheus_port` until the figures show work, then stops the job with a savepoint.
Every wait is for a condition with a generous deadline, never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from jobs.clients.kafka_admin import consume_committed, produce
from jobs.launch.plan import RunOptions
from jobs.launch.run import StopRequest, run_job
from jobs.runtime import jars
from jobs.runtime.ports import free_port
from tests.conftest import SHELL_ENV
from tests.support.job_setup import (
    BAD_RECORDS,
    LLMSTREAM,
    JobConfigFactory,
    write_config,
)
from tests.support.prometheus import parse_prometheus, total
from tests.support.waiting import Hopeless, wait_until
from udfs.config import JobConfig
from udfs.metrics import ENDPOINT_GAUGES

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVED_METRICS = jars.repo_root() / "grafana" / "served-metrics.txt"
"""Names the exporter served in this test's scrape; the dashboard may only query these
(tests/integration/test_compose.py checks it statically)."""

def _stable(name: str) -> bool:
    """Names worth recording: Flink's, llmstream's, and of the Kafka clients' many only the lag."""
    if not name.startswith("flink_"):
        return False
    if "_KafkaProducer_" in name or "_KafkaConsumer_" in name:
        return "records_lag" in name or "records_consumed" in name
    return True


def good_records(n: int, prefix: str) -> list[tuple[bytes, bytes]]:
    return [(f"{prefix}-{i}".encode(), json.dumps({"id": f"{prefix}-{i}", "prompt": f"Question {i}?"}).encode())
            for i in range(n)]


@contextmanager
def running(config: JobConfig) -> Iterator[dict[str, Any]]:
    """`llmstream run` (no backfill) in a thread; stopped with a savepoint on exit."""
    stop = StopRequest.new()
    outcome: dict[str, Any] = {"lines": []}

    def target() -> None:
        try:
            outcome["state"] = run_job(config, RunOptions(), progress_every_s=1.0, stop=stop,
                                       report=outcome["lines"].append)
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name="llmstream-run", daemon=True)
    thread.start()
    outcome["thread"] = thread
    try:
        yield outcome
    finally:
        stop.savepoint.set()
        thread.join(timeout=180)
        assert not thread.is_alive(), "the job did not stop within 180 s; it said: " + " | ".join(outcome["lines"][-5:])
    assert "error" not in outcome, outcome.get("error")
    assert outcome["state"] == "FINISHED", outcome["lines"][-5:]


def still_running(outcome: dict[str, Any]) -> None:
    """Ends a wait at once, with what the run said, when the run's thread has ended: a run that
    failed at start would otherwise look like a metrics endpoint that never answered."""
    if not outcome["thread"].is_alive():
        raise Hopeless(f"the run ended early ({outcome.get('error') or outcome.get('state')}); "
                             "it said: " + " | ".join(outcome["lines"][-5:]))


def said(outcome: dict[str, Any], what: str) -> Callable[[], str]:
    """A wait's message naming ``what`` and the run's last lines at the timeout."""
    return lambda: f"{what}; the run said: " + " | ".join(outcome["lines"][-5:])


def test_prometheus_endpoint_serves_llmstream_and_flink_metrics(job_config: JobConfigFactory, fast_simulator) -> None:  # type: ignore[no-untyped-def]
    """A fleet of two endpoints (both the one simulator), so the per-endpoint gauges the dashboard's
    "Which endpoint?" row reads are served too."""
    port = free_port()
    fleet = [{"url": fast_simulator.url, "name": name, "max_concurrency": 4} for name in ("first", "second")]
    config = job_config(metrics={"prometheus_port": port}, async_={"capacity": 8},
                        model={"endpoint": None, "endpoints": fleet})
    records = good_records(600, "p") + BAD_RECORDS
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, records)
    fast_simulator.configure({"latency": "fixed:20"})
    url = f"http://127.0.0.1:{port}/metrics"
    prefix = "flink_taskmanager_job_task_operator_llmstream_"
    try:
        with running(config) as outcome:
            def worked() -> dict[str, list[tuple[dict[str, str], float]]] | None:
                still_running(outcome)
                samples = parse_prometheus(requests.get(url, timeout=5).text)
                done = (total(samples, prefix + "records_in") >= len(records)
                        and total(samples, prefix + "latency_count") >= 600
                        and total(samples, prefix + "endpoint_requests") >= 600
                        and total(samples, "flink_jobmanager_job_numberOfCompletedCheckpoints") >= 1)
                return samples if done else None

            samples = wait_until(worked, timeout=180, message=said(outcome, "every record counted and a checkpoint "
                                                                   "completed"), ignoring=(Exception,))
    finally:
        fast_simulator.configure({"latency": "fixed:5"})

    names = set(samples)
    for metric in ("records_in", "bad_input", "requests", "retries", "rate_limited", "dead_lettered",
                   "prompt_tokens", "completion_tokens", "in_flight", "admitted", "concurrency_limit",
                   "latency_count", "latency_sum_ms", "latency_max_ms", "latency_p50_ms", "latency_p99_ms"):
        assert prefix + metric in names, f"{prefix + metric} not served"
    assert total(samples, prefix + "records_in") == len(records)
    assert total(samples, prefix + "bad_input") == len(BAD_RECORDS)
    assert total(samples, prefix + "requests") >= 600
    assert total(samples, prefix + "completion_tokens") > 0
    assert total(samples, prefix + "concurrency_limit") == 8
    p50, p99 = total(samples, prefix + "latency_p50_ms"), total(samples, prefix + "latency_p99_ms")
    assert 20 <= p50 <= p99, (p50, p99)
    for gauge in ENDPOINT_GAUGES:
        assert prefix + "endpoint_" + gauge in names, f"{prefix}endpoint_{gauge} not served"
    assert {labels.get("endpoint") for labels, _ in samples[prefix + "endpoint_requests"]} == {"first", "second"}
    # Flink's own: checkpoints, backpressure, Kafka consumer lag, records in/out.
    for name in ("flink_jobmanager_job_numberOfCompletedCheckpoints", "flink_jobmanager_job_lastCheckpointDuration",
                 "flink_jobmanager_job_lastCheckpointSize", "flink_jobmanager_job_numRestarts",
                 "flink_taskmanager_job_task_backPressuredTimeMsPerSecond", "flink_taskmanager_job_task_isBackPressured",
                 "flink_taskmanager_job_task_operator_pendingRecords",
                 "flink_taskmanager_job_task_operator_KafkaSourceReader_KafkaConsumer_records_lag_max",
                 "flink_taskmanager_job_task_operator_numRecordsOut"):
        assert name in names, f"{name} not served"
    # The list the dashboard is checked against: every name in it was served here.
    if os.environ.get("LLMSTREAM_UPDATE_SERVED_METRICS"):  # refresh by hand after a Flink upgrade
        SERVED_METRICS.write_text("\n".join(sorted(n for n in names if _stable(n))) + "\n")
    recorded = set(SERVED_METRICS.read_text().split())
    assert recorded <= names, f"grafana/served-metrics.txt names metrics not served: {sorted(recorded - names)}"


def _status_json(config_file: Path) -> dict[str, Any]:
    """`llmstream status --json`, as a user runs it (a child process, the installed entry point)."""
    result = subprocess.run([str(LLMSTREAM), "status", "--config", str(config_file), "--json"],
                            check=False, capture_output=True, text=True, timeout=120, env=SHELL_ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    figures: dict[str, Any] = json.loads(result.stdout)
    return figures


def test_status_json_agrees_with_the_simulator_and_the_topics(  # type: ignore[no-untyped-def]
        job_config: JobConfigFactory, fast_simulator, tmp_path: Path) -> None:
    config = job_config(async_={"capacity": 8})
    config_file = write_config(config, tmp_path)
    good = 300
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, good_records(good, "s") + BAD_RECORDS)
    fast_simulator.configure({"latency": "fixed:20"})
    fast_simulator.reset_stats()
    seen: list[dict[str, Any]] = []
    try:
        with running(config) as outcome:
            def caught_up() -> dict[str, Any] | None:
                still_running(outcome)
                figures = _status_json(config_file)
                seen.append(figures)
                calls = fast_simulator.stats()["requests_total"]
                done = (figures["job"]["state"] == "RUNNING"
                        and figures["records"]["processed"] == good + len(BAD_RECORDS)
                        and figures["calls"]["requests"] == calls == good
                        and figures["records"]["results"] == good
                        and sum(figures["dead_letters"]["by_reason"].values()) == len(BAD_RECORDS)
                        and (figures["checkpoint"]["completed"] or 0) >= 1)
                return figures if done else None

            try:
                during = wait_until(caught_up, timeout=300, interval=1.0,
                                    message="llmstream status to show every record processed", ignoring=(Exception,))
            except AssertionError as err:
                last = seen[-1] if seen else {}
                raise AssertionError(f"{err}; simulator {fast_simulator.stats()['requests_total']} calls; last status: "
                                     + json.dumps({k: last.get(k) for k in ("job", "records", "calls", "dead_letters",
                                                                             "checkpoint")})) from None
    finally:
        fast_simulator.configure({"latency": "fixed:5"})
    lines = [line for line in outcome["lines"] if line.startswith("llmstream: ") and "s  " in line]
    assert lines and "committed" not in lines[-1], lines[-3:]
    assert during["calls"]["capacity"] == 8 and during["calls"]["concurrency_limit"] == 8
    assert during["calls"]["latency_p50_ms"] >= 20 and during["calls"]["latency_p99_ms"] >= during["calls"]["latency_p50_ms"]
    assert during["cost"]["prompt_tokens"] > 0 and during["cost"]["tokens_per_min"] > 0
    assert during["job"]["uptime_s"] > 0 and during["job"]["restarts"] == 0
    assert not any(f["calls"]["requests"] and f["calls"]["requests"] > good for f in seen)

    after = _status_json(config_file)
    assert after["job"]["state"] == "ENDED" and after["job"]["id"] == during["job"]["id"]
    assert after["calls"]["requests"] == fast_simulator.stats()["requests_total"] == good
    out = consume_committed(config.kafka.bootstrap_servers, config.kafka.output_topic, expected=good, timeout_s=60)
    dead = consume_committed(config.kafka.bootstrap_servers, config.kafka.dead_letter_topic, timeout_s=60)
    assert after["records"]["results"] == len(out) == good
    assert after["records"]["dead_letters"] == len(dead) == len(BAD_RECORDS)
    assert after["dead_letters"]["by_reason"] == dict(Counter(json.loads(m.value)["reason"] for m in dead))
    assert after["dead_letters"]["by_reason"] == {"invalid_json": 1, "not_an_object": 1, "missing_field": 1}
    # The source had read everything; the group's own offsets may lag (the next run resumes from state).
    assert after["input"]["lag_records"] == 0
