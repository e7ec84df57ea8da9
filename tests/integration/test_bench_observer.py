"""The bench's read_committed observer (`jobs/dev/bench/measure.py`) reads on across a broker restart.

`llmstream bench --soak` restarts the broker while the observer counts every id; in the first
30-minute soak the observer's thread died at the second restart (`position()` raised
`KafkaConnectionError`), and the soak waited for ids it could no longer see. A dedicated broker
here, stopped and started on the same ports and data, as the soak does.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from jobs import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.bench.measure import Observer
from jobs.dev.bench.workload import InputProducer
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


def test_the_observer_counts_every_id_once_across_a_broker_restart(tmp_path: Path) -> None:
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # refused connections while the broker is down
    broker = local_kafka.LocalBroker(local_kafka.BrokerConfig.ephemeral(tmp_path / "kafka", heap="384m"))
    broker.start(timeout=120)
    try:
        kafka_admin.create_topics(broker.bootstrap_servers, ["out", "dead"], partitions=1)
        observer = Observer(broker.bootstrap_servers, "out", "dead")
        observer.start()
        producer = InputProducer(broker.bootstrap_servers, "out")
        try:
            producer.preload(100)
            wait_until(lambda: observer.seen >= 100, timeout=120, message="the first 100 ids")
            broker.stop()
            wait_until(lambda: observer.broker_errors > 0, timeout=120, message="the observer to miss the broker")
            broker.start(timeout=120)
            producer.preload(100)
            wait_until(lambda: observer.seen >= 200, timeout=180,
                       message=lambda: f"all 200 ids after the restart ({observer.seen} seen)")
            assert observer.is_alive()
            _, counts = observer.snapshot()
            assert len(counts) == 200 and max(counts.values()) == 1
        finally:
            observer.stop()
            producer.close()
    finally:
        broker.stop()
