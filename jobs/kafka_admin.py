"""The one Kafka admin surface: topics, produce, read_committed reads, offsets and the job's
consumer-group progress, on kafka-python 3.0 (whose admin responses are plain dicts).

Preflight, `llmstream run`/`submit --until-end`, the demo, the benchmarks and the tests all use
these helpers; the local broker itself is `jobs/dev/local_kafka.py`.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kafka import KafkaConsumer, KafkaProducer, TopicPartition  # type: ignore[import-untyped]
from kafka.admin import (  # type: ignore[import-untyped]
    ConfigResource,
    ConfigResourceType,
    KafkaAdminClient,
    OffsetSpec,
)
from kafka.consumer.fetcher import ConsumerRecord  # type: ignore[import-untyped]
from kafka.errors import for_code  # type: ignore[import-untyped]
from kafka.protocol.consumer.offsets import IsolationLevel  # type: ignore[import-untyped]

if TYPE_CHECKING:
    from udfs.config import JobConfig

_TOPIC_ALREADY_EXISTS = 36
_UNKNOWN_TOPIC_OR_PARTITION = 3

__all__ = [
    "GroupProgress",
    "admin",
    "answers",
    "broker_max_transaction_timeout_ms",
    "committed_offsets",
    "connect",
    "consume_committed",
    "create_topics",
    "delete_topics",
    "end_offsets",
    "produce",
]


def answers(bootstrap: str, timeout_s: float) -> bool:
    """Whether a broker at ``bootstrap`` answers a metadata request within ``timeout_s``."""
    ms = max(int(timeout_s * 1000), 500)
    try:
        with KafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=ms, bootstrap_timeout_ms=ms,
            reconnect_backoff_max_ms=200,
        ) as client:
            client.describe_cluster()
            client.list_topics()
        return True
    except Exception:  # noqa: BLE001 - any failure just means "not ready yet"
        return False


def connect(bootstrap: str, timeout_s: float = 30.0, client_id: str = "llmstream-admin") -> KafkaAdminClient:
    """An admin client for ``bootstrap``; raises kafka-python's error if no broker answers."""
    ms = int(timeout_s * 1000)
    return KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=ms, bootstrap_timeout_ms=ms,
                            client_id=client_id)


@contextlib.contextmanager
def admin(bootstrap: str, timeout_s: float = 30.0, client_id: str = "llmstream-admin") -> Iterator[KafkaAdminClient]:
    """`connect`, closed on exit."""
    with connect(bootstrap, timeout_s, client_id) as client:
        yield client


def _raise_for(code: int, message: str | None, what: str) -> None:
    err = for_code(code)
    raise err(f"{what}: {message or err.__name__}")


def create_topics(
    bootstrap: str,
    names: Sequence[str],
    partitions: int = 1,
    exist_ok: bool = True,
    *,
    configs: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> None:
    """Create topics (replication factor 1) and wait until every partition has a leader."""
    if not names:
        return
    spec = {n: {"num_partitions": partitions, "replication_factor": 1, "configs": dict(configs or {})} for n in names}
    with admin(bootstrap, timeout_s) as client:
        result = client.create_topics(spec, timeout_ms=int(timeout_s * 1000), raise_errors=False)
        for topic in result["topics"]:
            code = topic["error_code"]
            if code and not (exist_ok and code == _TOPIC_ALREADY_EXISTS):
                _raise_for(code, topic.get("error_message"), f"create topic {topic['name']}")
        client.wait_for_topics(list(names), timeout_ms=int(timeout_s * 1000))


def delete_topics(bootstrap: str, names: Sequence[str], missing_ok: bool = True, *, timeout_s: float = 30.0) -> None:
    if not names:
        return
    with admin(bootstrap, timeout_s) as client:
        result = client.delete_topics(list(names), timeout_ms=int(timeout_s * 1000), raise_errors=False)
        for topic in result["topics"]:
            code = topic["error_code"]
            if code and not (missing_ok and code == _UNKNOWN_TOPIC_OR_PARTITION):
                _raise_for(code, topic.get("error_message"), f"delete topic {topic['name']}")


def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None]],
    *,
    partition: int | None = None,
    timeout_s: float = 30.0,
) -> int:
    """Send ``(key, value)`` pairs with acks=all, flush, and raise if any send failed; returns the count."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        futures = [producer.send(topic, key=k, value=v, partition=partition) for k, v in records]
        producer.flush(timeout=timeout_s)
        for fut in futures:
            fut.get(timeout=timeout_s)
        return len(futures)
    finally:
        producer.close(timeout=timeout_s)


def _partitions(bootstrap: str, topic: str, timeout_s: float) -> list[int]:
    with admin(bootstrap, timeout_s) as client:
        described = client.describe_topics([topic])
    if not described or described[0].get("error_code"):
        code = described[0]["error_code"] if described else _UNKNOWN_TOPIC_OR_PARTITION
        _raise_for(code, None, f"describe topic {topic}")
    return sorted(p["partition_index"] for p in described[0]["partitions"])


def consume_committed(
    bootstrap: str,
    topic: str,
    *,
    expected: int | None = None,
    timeout_s: float,
    group_id: str | None = None,
) -> list[ConsumerRecord]:
    """Read ``topic`` with ``read_committed``, as a downstream exactly-once consumer would.

    Without ``group_id`` it reads every partition from the beginning and commits
    nothing. With one, it starts from that group's committed offsets (the beginning
    for a new group) and commits what it read, so a caller can resume; partitions are
    assigned directly, so there is no group membership or rebalance to wait for.
    Stops once ``expected`` records are seen, or, if ``expected`` is None, once
    every partition reaches its last stable offset as of the call; returns what it
    has when ``timeout_s`` passes rather than raising, so callers assert on counts.
    """
    deadline = time.monotonic() + timeout_s
    parts = [TopicPartition(topic, p) for p in _partitions(bootstrap, topic, timeout_s)]
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group_id,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    records: list[ConsumerRecord] = []
    try:
        consumer.assign(parts)
        if group_id is None:
            consumer.seek_to_beginning(*parts)
        targets = consumer.end_offsets(parts) if expected is None else {}
        while time.monotonic() < deadline:
            if expected is not None and len(records) >= expected:
                break
            if expected is None and all(consumer.position(tp) >= end for tp, end in targets.items()):
                break
            wait_ms = int(max(0.0, min(0.5, deadline - time.monotonic())) * 1000)
            for batch in consumer.poll(timeout_ms=wait_ms).values():
                records.extend(batch)
        if group_id is not None:
            consumer.commit()
    finally:
        consumer.close()
    return sorted(records, key=lambda r: (r.partition, r.offset))


def end_offsets(bootstrap: str, topic: str, *, committed_only: bool = False, timeout_s: float = 30.0) -> dict[int, int]:
    """Per-partition end offsets: the high watermark, or with ``committed_only`` the last stable offset."""
    parts = _partitions(bootstrap, topic, timeout_s)
    isolation = IsolationLevel.READ_COMMITTED if committed_only else IsolationLevel.READ_UNCOMMITTED
    with admin(bootstrap, timeout_s) as client:
        result = client.list_partition_offsets(
            {TopicPartition(topic, p): OffsetSpec.LATEST for p in parts}, isolation_level=isolation,
        )
    return {tp.partition: int(o.offset) for tp, o in sorted(result.items())}


def committed_offsets(bootstrap: str, group: str, topic: str, *, timeout_s: float = 30.0) -> dict[int, int]:
    """The group's committed offsets for ``topic``; partitions without a commit are left out."""
    with admin(bootstrap, timeout_s) as client:
        result = client.list_group_offsets({group: None})
    offsets = result.get(group, {})
    return {
        tp.partition: int(meta.offset)
        for tp, meta in sorted(offsets.items())
        if tp.topic == topic and meta.offset is not None and meta.offset >= 0
    }


def broker_max_transaction_timeout_ms(client: KafkaAdminClient) -> int | None:
    """The broker's `transaction.max.timeout.ms`, or None if it cannot be read."""
    brokers = client.describe_cluster().get("brokers") or []
    if not brokers:
        return None
    broker_id = str(brokers[0]["broker_id"])
    described = client.describe_configs(
        [ConfigResource(ConfigResourceType.BROKER, broker_id, {"transaction.max.timeout.ms": None})],
        config_filter="all",
    )
    entry = described.get("broker", {}).get(broker_id, {}).get("transaction.max.timeout.ms")
    return int(entry["value"]) if entry and entry.get("value") is not None else None


class GroupProgress:
    """The job's consumer group on the input topic: committed offsets vs end offsets."""

    def __init__(self, config: JobConfig) -> None:
        self._topic = config.kafka.input_topic
        self._consumer = KafkaConsumer(
            bootstrap_servers=config.kafka.bootstrap_servers,
            group_id=config.kafka.group_id,
            enable_auto_commit=False,
            client_id="llmstream-progress",
        )

    def _partitions(self) -> list[TopicPartition]:
        partitions = self._consumer.partitions_for_topic(self._topic) or set()
        return [TopicPartition(self._topic, p) for p in sorted(partitions)]

    def end_offsets(self) -> dict[int, int]:
        """The input's end offset per partition, now."""
        tps = self._partitions()
        return {tp.partition: offset for tp, offset in (self._consumer.end_offsets(tps) if tps else {}).items()}

    def committed(self) -> dict[int, int]:
        """The group's committed offset per partition of the input (0 where none)."""
        return {tp.partition: self._consumer.committed(tp) or 0 for tp in self._partitions()}

    def snapshot(self) -> tuple[int, int]:
        """(committed, end) summed over the input's partitions."""
        return sum(self.committed().values()), sum(self.end_offsets().values())

    def reached(self, targets: dict[int, int]) -> bool:
        """Whether the group has committed at least `targets` on every partition."""
        committed = self.committed()
        return all(committed.get(partition, 0) >= offset for partition, offset in targets.items())

    def close(self) -> None:
        self._consumer.close()
