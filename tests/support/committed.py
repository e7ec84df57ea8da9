"""What a downstream consumer sees, for the integration tests: `CommittedReader` reads the output
and dead-letter topics read_committed with arrival times during a run; the exactly-once tally
(`tally`, `final_tally`, `check_exactly_once`) is the history checker's verdict (`jobs/dev/history.py`):
every expected id once in output or dead letters, and per-key order for ``ordering: per_key``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Self

from kafka import KafkaConsumer, TopicPartition

from jobs.clients import kafka_admin
from jobs.dev.history import History, Verdict, read_history
from tests.support.job_setup import JobSetup
from tests.support.waiting import wait_until

log = logging.getLogger("llmstream.tests.cluster")


@dataclass
class Arrival:
    t: float
    topic: str
    key: bytes | None
    id: str | None
    body: dict[str, Any] | None


class CommittedReader(threading.Thread):
    """Reads the output and dead-letter topics with read_committed for the whole test.

    Keeps every record with its arrival time, so a test can tell when output stopped and
    when it flowed again (what a downstream consumer experiences), and count duplicates.
    """

    def __init__(self, bootstrap: str, topics: Iterable[str]) -> None:
        super().__init__(daemon=True, name="committed-reader")
        self.arrivals: list[Arrival] = []
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._topics = list(topics)
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False,
            auto_offset_reset="earliest", reconnect_backoff_max_ms=1000, request_timeout_ms=15000,
            fetch_max_bytes=64 * 1024 * 1024, max_partition_fetch_bytes=16 * 1024 * 1024,
        )
        parts = []
        for topic in self._topics:
            parts += [TopicPartition(topic, p) for p in kafka_admin._partitions(bootstrap, topic, 30.0)]
        self._consumer.assign(parts)
        self._consumer.seek_to_beginning(*parts)
        self.errors = 0

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                try:
                    batches = self._consumer.poll(timeout_ms=300)
                except Exception as err:  # noqa: BLE001 - the broker may be down on purpose
                    self.errors += 1
                    log.debug("reader poll failed: %s", err)
                    time.sleep(0.5)
                    continue
                now = time.monotonic()
                got = []
                for tp, records in batches.items():
                    for record in records:
                        body = None
                        with contextlib.suppress(ValueError, TypeError):
                            body = json.loads(record.value)
                        rid = body.get("id") if isinstance(body, dict) else None
                        got.append(Arrival(now, tp.topic, record.key, rid, body))
                with self._lock:
                    self.arrivals.extend(got)
        finally:
            self._consumer.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> list[Arrival]:
        with self._lock:
            return list(self.arrivals)

    def count(self) -> int:
        with self._lock:
            return len(self.arrivals)

    def unique_ids(self) -> int:
        return len({a.id for a in self.snapshot() if a.id is not None})

    def wait_for(self, n: int, timeout: float, *, unique: bool = True,
                 check: Callable[[], None] | None = None) -> bool:
        """Wait until ``n`` (unique-id) records arrived; ``check`` runs each second (e.g. job not FAILED).
        False at the timeout: the caller's assertion says what it waited for and what arrived."""
        last_check = 0.0

        def arrived() -> bool:
            nonlocal last_check
            if (self.unique_ids() if unique else self.count()) >= n:
                return True
            if check is not None and time.monotonic() - last_check >= 1:
                last_check = time.monotonic()
                check()
            return False

        return wait_until(arrived, timeout, interval=0.2, or_last=True)

    def first_arrival_after(self, t: float) -> float | None:
        times = [a.t for a in self.snapshot() if a.t > t]
        return min(times) if times else None

    def longest_gap(self, start: float | None = None) -> float:
        """Longest time without any committed arrival, from the first arrival on (or from ``start``)."""
        times = sorted(a.t for a in self.snapshot())
        if start is not None:
            times = [start] + [t for t in times if t > start]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


Tally = Verdict
"""A run's verdict (`jobs.dev.history.Verdict`): every test counts through the one history checker."""


def tally(expected_ids: Iterable[str], out_ids: Iterable[str | None], dead: Iterable[dict[str, Any] | None]) -> Tally:
    """The verdict on bare output ids and dead-letter bodies (no keys or offsets: no order check)."""
    return History.from_ids(out_ids, dead).check(expected_ids)


def check_exactly_once(result: Tally) -> None:
    """Every expected id exactly once in output ∪ dead letters, nothing else (and, for a job with
    ``ordering: per_key`` counted by `final_tally`, each key's results in input order)."""
    assert result.lost == 0, f"lost {result.lost}: {result.lost_sample}"
    assert result.duplicates == 0, f"duplicates {result.duplicates}: {result.duplicate_sample}"
    assert result.unexpected == 0, f"unexpected {result.unexpected}: {result.unexpected_sample}"
    assert result.out + result.dead == result.records_in
    assert result.order_violations == 0, f"per-key order violated: {result.order_sample}"


def final_tally(setup: JobSetup, expected_ids: Iterable[str], *, timeout_s: float = 60,
                model_calls: int | None = None) -> Tally:
    """An independent read_committed pass over both topics, to the last stable offset, judged by
    the history checker (per-key order too when the job asks for it)."""
    history = read_history(setup.bootstrap, setup.output_topic, setup.dead_letter_topic, timeout_s=timeout_s,
                           model_calls=model_calls)
    return history.check(expected_ids, ordering=setup.config.ordering)
