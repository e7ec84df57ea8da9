"""What a downstream consumer sees, for the integration tests: `CommittedReader` reads the output
and dead-letter topics read_committed with arrival times during a run, and the exactly-once tally
(`tally`, `final_tally`, `check_exactly_once`) counts every expected id in output or dead letters.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Self

from kafka import KafkaConsumer, TopicPartition

from jobs.clients import kafka_admin
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


@dataclass
class Tally:
    """Every expected id exactly once in output ∪ dead letters?"""

    records_in: int
    out: int
    dead: int
    duplicates: int
    lost: int
    unexpected: int
    dead_reasons: dict[str, int] = field(default_factory=dict)
    lost_sample: list[str] = field(default_factory=list)
    cached: int = 0
    duplicate_sample: list[str] = field(default_factory=list)


def tally(expected_ids: Iterable[str], out_ids: Iterable[str | None], dead: Iterable[dict[str, Any] | None]) -> Tally:
    expected = set(expected_ids)
    dead_bodies = [d or {} for d in dead]
    outs = [i for i in out_ids]
    seen = Counter([i for i in outs] + [d.get("id") for d in dead_bodies])
    duplicates = sorted(i for i, c in seen.items() if c > 1 and i is not None)
    lost = sorted(expected - set(seen))
    return Tally(
        records_in=len(expected), out=len(outs), dead=len(dead_bodies),
        duplicates=sum(seen[i] - 1 for i in duplicates), lost=len(lost),
        unexpected=len([i for i in seen if i not in expected]),
        dead_reasons=dict(Counter(str(d.get("reason")) for d in dead_bodies)),
        lost_sample=lost[:10], duplicate_sample=duplicates[:10],
    )


def check_exactly_once(result: Tally) -> None:
    """Every expected id exactly once in output ∪ dead letters, nothing else."""
    assert result.lost == 0, f"lost {result.lost}: {result.lost_sample}"
    assert result.duplicates == 0, f"duplicates {result.duplicates}: {result.duplicate_sample}"
    assert result.unexpected == 0
    assert result.out + result.dead == result.records_in


def final_tally(setup: JobSetup, expected_ids: Iterable[str], *, timeout_s: float = 60) -> Tally:
    """An independent read_committed pass over both topics, to the last stable offset."""
    out = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, timeout_s=timeout_s)
    dead = kafka_admin.consume_committed(setup.bootstrap, setup.dead_letter_topic, timeout_s=timeout_s)
    bodies = [json.loads(r.value) for r in out]
    result = tally(expected_ids, [b.get("id") for b in bodies], [json.loads(r.value) for r in dead])
    result.cached = sum(1 for b in bodies if b.get("cached") is True)
    return result
