"""A rate-limiting model slows the job down; it never restarts it and never loses a record.

The simulator answers 429 (with Retry-After) to 30% of calls until it has refused
`STORM_REJECTIONS` of them, while the job runs with Flink's restart strategy off, so a single
task failure would fail the job. The storm is counted in refusals, not seconds: on a slow
machine the job's start-up alone can outlast a storm of fixed length.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

from jobs.clients.kafka_admin import consume_committed, produce
from jobs.launch.plan import RunOptions
from jobs.launch.run import run_job
from tests.support.job_setup import JobConfigFactory, scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECORDS = scaled(1500)
"""1,500 straight from pytest, 750 in `make test` (`LLMSTREAM_FAULT_SCALE`; this module is not in
`make fault`): the storm answers a few records a second, so either outlasts it by hundreds."""
STORM_REJECTIONS = scaled(100)
"""The storm's length: 100 refusals straight from pytest, 50 in `make test`. Honouring each
`Retry-After: 1` for the whole endpoint holds the job to a few records a second while 30% of
calls are refused, so the storm is most of the test's time (docs/testing.md); 100 refusals make
one of over a minute, 50 one of about half that (~35 s at load ~20). Either way the
limit halves from 16 to 2 within the first dozen refusals and checkpoints complete throughout the
storm, with Flink's restart strategy off: one failed task or checkpoint would fail the job."""


def end_storm_after(simulator, rejections: int, stop: threading.Event) -> None:  # type: ignore[no-untyped-def]
    """Clears the simulator's faults once it has answered `rejections` calls with 429."""
    while not stop.wait(0.5):
        if int(simulator.stats()["rejected"]) >= rejections:
            simulator.admin({})
            return


def test_429_storm_becomes_backpressure_not_restarts(job_config: JobConfigFactory, fast_simulator) -> None:  # type: ignore[no-untyped-def]
    config = job_config(
        async_={"capacity": 16},
        retry={"initial_backoff_s": 0.2, "max_backoff_s": 5.0, "max_attempts": 12},
        flink={"restart-strategy.type": "none"},
    )
    records = [(f"s-{i}".encode(), json.dumps({"id": f"s-{i}", "prompt": f"storm {i}"}).encode())
               for i in range(RECORDS)]
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, records)
    fast_simulator.configure({"latency": "fixed:100", "concurrency": 32})
    fast_simulator.reset_stats()
    fast_simulator.admin({"rate_limit_rate": 0.3, "retry_after_s": 1})
    stop = threading.Event()
    watcher = threading.Thread(target=end_storm_after, args=(fast_simulator, STORM_REJECTIONS, stop), daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        state = run_job(config, RunOptions(until_end=True), progress_every_s=10)
        elapsed = time.monotonic() - started
        stats = fast_simulator.stats()
    finally:
        stop.set()
        watcher.join(10)
        fast_simulator.admin({})
        fast_simulator.configure({"latency": "fixed:5", "concurrency": 256})

    assert state == "FINISHED"
    out = consume_committed(config.kafka.bootstrap_servers, config.kafka.output_topic, expected=RECORDS,
                            timeout_s=120)
    ids = Counter(json.loads(m.value)["id"] for m in out)
    assert len(ids) == RECORDS and max(ids.values()) == 1
    assert consume_committed(config.kafka.bootstrap_servers, config.kafka.dead_letter_topic, timeout_s=60) == []
    assert stats["rejected"] > 0
    assert stats["max_in_flight"] <= config.async_.capacity
    retried = sum(1 for m in out if json.loads(m.value)["attempts"] > 1)
    print(f"429 storm: {RECORDS} records in {elapsed:.0f} s, {stats['rejected']} answered 429, "
          f"{retried} records needed retries, max in flight {stats['max_in_flight']}")
    assert retried > 0
