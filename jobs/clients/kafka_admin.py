"""The one Kafka admin surface: topics, produce, read_committed reads, offsets and the job's
consumer-group progress, on kafka-python 3.0 (whose admin responses are plain dicts).

Preflight, `llmstream run`/`submit --until-end`, `llmstream status`, the demo, the benchmarks and
the tests all use these helpers; the local broker itself is `jobs/dev/local_kafka.py`.

Every helper takes a `Cluster`: a bootstrap string (an open loopback broker), the job's
`KafkaConfig` (its `kafka.properties` translated by `udfs/config/kafka_security.py`: TLS, SASL, secrets
resolved), or kafka-python keyword arguments. So a secured cluster is reached by every client
llmstream opens exactly as the job's own Kafka ends reach it.
"""
from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

from kafka import KafkaConsumer, KafkaProducer, TopicPartition  # type: ignore[import-untyped]
from kafka.admin import (  # type: ignore[import-untyped]
    ConfigResource,
    ConfigResourceType,
    KafkaAdminClient,
    OffsetSpec,
)
from kafka.consumer.fetcher import ConsumerRecord  # type: ignore[import-untyped]
from kafka.errors import KafkaError, for_code  # type: ignore[import-untyped]
from kafka.protocol.consumer.offsets import IsolationLevel  # type: ignore[import-untyped]

from udfs.config import JobConfig, KafkaConfig, kafka_security
from udfs.errors import ConfigError
from udfs.secret_refs import mask

T = TypeVar("T")
Cluster: TypeAlias = str | KafkaConfig | Mapping[str, Any]
"""A bootstrap string, the job's Kafka config, or kafka-python arguments (`bootstrap_servers` and security)."""

_TOPIC_ALREADY_EXISTS = 36
_UNKNOWN_TOPIC_OR_PARTITION = 3

__all__ = [
    "Cluster",
    "GroupProgress",
    "admin",
    "answers",
    "broker_max_transaction_timeout_ms",
    "client_args",
    "committed_offsets",
    "connect",
    "consume_committed",
    "create_topics",
    "delete_topics",
    "end_offsets",
    "input_topics",
    "produce",
]


def client_args(cluster: Cluster) -> dict[str, Any]:
    """kafka-python keyword arguments for `cluster` (bootstrap servers and security)."""
    if isinstance(cluster, str):
        return {"bootstrap_servers": cluster}
    if isinstance(cluster, KafkaConfig):
        return cluster.client_args()
    return dict(cluster)


class Unreachable(KafkaError):  # type: ignore[misc]
    """No broker of a cluster could be bootstrapped. kafka-python retries every failed connection
    until its deadline and then raises a bare timeout; `causes` are the errors it logged meanwhile
    (a refused TLS handshake, a closed socket), which say why."""

    def __init__(self, message: str, causes: list[str]) -> None:
        super().__init__(message)
        self.causes = causes


class _BootstrapFailures(logging.Handler):
    """Keeps what kafka-python logs about failed bootstrap connections (its only report of them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.causes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.causes += [f"{type(a).__name__}: {a}" for a in record.args or () if isinstance(a, BaseException)]


@contextlib.contextmanager
def _bootstrap_failures() -> Iterator[_BootstrapFailures]:
    """Records kafka-python's bootstrap failures whatever level its logger is set to (the CLI silences
    it), without passing them on to the user's log."""
    logger = logging.getLogger("kafka.net.manager")
    handler = _BootstrapFailures()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    # Passed on only where the user's logging would have shown them (llmstream -v).
    logger.propagate = propagate and logging.getLogger("kafka").getEffectiveLevel() <= logging.WARNING
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _hopeless(causes: list[str]) -> bool:
    """Failures that waiting longer will not cure: TLS refused either way, a refused login, or the
    broker hanging up again and again (wrong SASL credentials, a PLAINTEXT client on a TLS listener);
    a broker that is not up yet refuses the connection instead."""
    if any("SSL" in c or "Handshake failed" in c or "Invalid frame length" in c or "SaslAuthenticationFailed" in c
           for c in causes):
        return True
    disconnects = sum("socket disconnected" in c for c in causes)
    return disconnects >= 3


FIRST_ATTEMPT_S = 5.0
"""How long one bootstrap attempt may take before its failures are looked at."""


def open_client(factory: Callable[..., T], cluster: Cluster, timeout_s: float = 30.0, **kwargs: Any) -> T:
    """``factory(**client_args(cluster), **kwargs)`` (a kafka-python client), retried until ``timeout_s``
    while no broker answers; raises `Unreachable` with the reasons at once when waiting cannot help
    (a certificate refused, credentials refused), so a misconfiguration ends in seconds, not a timeout."""
    args = client_args(cluster)
    deadline = time.monotonic() + timeout_s
    with _bootstrap_failures() as seen:
        while True:
            attempt_s = max(0.5, min(FIRST_ATTEMPT_S, deadline - time.monotonic()))
            try:
                return factory(**args, **kwargs, bootstrap_timeout_ms=int(attempt_s * 1000))
            except KafkaError as err:
                if time.monotonic() >= deadline or _hopeless(seen.causes):
                    raise Unreachable(str(err), list(seen.causes)) from err


def connection_error(kafka: KafkaConfig, args: dict[str, Any], err: BaseException) -> ConfigError:
    """The one-line reason a connection to `kafka` failed (credentials refused, an untrusted or
    mismatched certificate, TLS or not, no broker), naming the setting to change; `args` are the
    client arguments used, whose secrets are masked in anything quoted."""
    causes = getattr(err, "causes", None) or [f"{type(err).__name__}: {err}"]
    text = mask(" | ".join(dict.fromkeys(causes)), kafka_security.secret_values(args))
    last = text.rsplit(" | ", 1)[-1][:200]
    bootstrap = kafka.bootstrap_servers
    protocol = args.get("security_protocol", "PLAINTEXT")
    if "CERTIFICATE_VERIFY_FAILED" in text:
        if re.search(r"(?i)hostname mismatch|ip address mismatch|not valid for", text):
            return ConfigError("kafka.bootstrap_servers",
                               f"the TLS certificate of the broker at {bootstrap} does not name that host; connect "
                               "by a name the certificate has (or, at your own risk, set kafka.properties."
                               "ssl.endpoint.identification.algorithm to '')")
        return ConfigError("kafka.properties.ssl.truststore.location",
                           f"the broker at {bootstrap} presented a TLS certificate not signed by a CA in "
                           f"{args.get('ssl_cafile') or 'the system CA store'}")
    if re.search(r"ALERT_(BAD_CERTIFICATE|CERTIFICATE_REQUIRED|CERTIFICATE_UNKNOWN|UNKNOWN_CA)", text):
        return ConfigError("kafka.properties.ssl.keystore.location",
                           f"the broker at {bootstrap} refused this client's certificate (or its absence): the "
                           "listener requires mutual TLS with a certificate its CA signed")
    if "Invalid frame length" in text or (protocol == "PLAINTEXT" and "socket disconnected" in text):
        return ConfigError("kafka.properties.security.protocol",
                           f"the listener at {bootstrap} does not speak {protocol} (does it need SSL or SASL_SSL?)")
    if "SSL" in text or "Handshake failed" in text:
        return ConfigError("kafka.properties.security.protocol", f"TLS with the broker at {bootstrap} failed: {last}")
    if protocol.startswith("SASL_") and ("socket disconnected" in text or "SaslAuthenticationFailed" in text):
        return ConfigError("kafka.properties.sasl.jaas.config",
                           f"the broker at {bootstrap} closed every connection while authenticating user "
                           f"{args.get('sasl_plain_username')!r} with {args.get('sasl_mechanism')}: wrong password "
                           "or unknown user (or the listener does not offer that mechanism)")
    return ConfigError("kafka.bootstrap_servers", f"no Kafka broker answers at {bootstrap} ({last})")


def answers(cluster: Cluster, timeout_s: float) -> bool:
    """Whether a broker of ``cluster`` answers a metadata request within ``timeout_s``."""
    ms = max(int(timeout_s * 1000), 500)
    try:
        with KafkaAdminClient(
            **client_args(cluster), request_timeout_ms=ms, bootstrap_timeout_ms=ms,
            reconnect_backoff_max_ms=200,
        ) as client:
            client.describe_cluster()
            client.list_topics()
        return True
    except Exception:  # noqa: BLE001 - any failure just means "not ready yet"
        return False


def connect(cluster: Cluster, timeout_s: float = 30.0, client_id: str = "llmstream-admin") -> KafkaAdminClient:
    """An admin client for ``cluster``; raises `Unreachable` (a `KafkaError`) if no broker answers."""
    return open_client(KafkaAdminClient, cluster, timeout_s, request_timeout_ms=int(timeout_s * 1000),
                       client_id=client_id)


@contextlib.contextmanager
def admin(cluster: Cluster, timeout_s: float = 30.0, client_id: str = "llmstream-admin") -> Iterator[KafkaAdminClient]:
    """`connect`, closed on exit."""
    with connect(cluster, timeout_s, client_id) as client:
        yield client


def _raise_for(code: int, message: str | None, what: str) -> None:
    err = for_code(code)
    raise err(f"{what}: {message or err.__name__}")


def create_topics(
    cluster: Cluster,
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
    with admin(cluster, timeout_s) as client:
        result = client.create_topics(spec, timeout_ms=int(timeout_s * 1000), raise_errors=False)
        for topic in result["topics"]:
            code = topic["error_code"]
            if code and not (exist_ok and code == _TOPIC_ALREADY_EXISTS):
                _raise_for(code, topic.get("error_message"), f"create topic {topic['name']}")
        client.wait_for_topics(list(names), timeout_ms=int(timeout_s * 1000))


def delete_topics(cluster: Cluster, names: Sequence[str], missing_ok: bool = True, *, timeout_s: float = 30.0) -> None:
    if not names:
        return
    with admin(cluster, timeout_s) as client:
        result = client.delete_topics(list(names), timeout_ms=int(timeout_s * 1000), raise_errors=False)
        for topic in result["topics"]:
            code = topic["error_code"]
            if code and not (missing_ok and code == _UNKNOWN_TOPIC_OR_PARTITION):
                _raise_for(code, topic.get("error_message"), f"delete topic {topic['name']}")


def produce(
    cluster: Cluster,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None]] | Iterable[tuple[bytes | None, bytes | None,
                                                                         list[tuple[str, bytes]]]],
    *,
    partition: int | None = None,
    timeout_s: float = 30.0,
) -> int:
    """Send ``(key, value)`` pairs (or ``(key, value, headers)``) with acks=all, flush, and raise if any send
    failed; returns the count."""
    producer = KafkaProducer(**client_args(cluster), acks="all", linger_ms=5)
    try:
        futures = [producer.send(topic, key=r[0], value=r[1], partition=partition,
                                 headers=list(r[2]) if len(r) > 2 else None)  # type: ignore[misc]
                   for r in records]
        producer.flush(timeout=timeout_s)
        for fut in futures:
            fut.get(timeout=timeout_s)
        return len(futures)
    finally:
        producer.close(timeout=timeout_s)


def _partitions(cluster: Cluster, topic: str, timeout_s: float) -> list[int]:
    with admin(cluster, timeout_s) as client:
        described = client.describe_topics([topic])
    if not described or described[0].get("error_code"):
        code = described[0]["error_code"] if described else _UNKNOWN_TOPIC_OR_PARTITION
        _raise_for(code, None, f"describe topic {topic}")
    return sorted(p["partition_index"] for p in described[0]["partitions"])


def consume_committed(
    cluster: Cluster,
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
    parts = [TopicPartition(topic, p) for p in _partitions(cluster, topic, timeout_s)]
    consumer = KafkaConsumer(
        **client_args(cluster),
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


def end_offsets(cluster: Cluster, topic: str, *, committed_only: bool = False, timeout_s: float = 30.0) -> dict[int, int]:
    """Per-partition end offsets: the high watermark, or with ``committed_only`` the last stable offset."""
    parts = _partitions(cluster, topic, timeout_s)
    isolation = IsolationLevel.READ_COMMITTED if committed_only else IsolationLevel.READ_UNCOMMITTED
    with admin(cluster, timeout_s) as client:
        result = client.list_partition_offsets(
            {TopicPartition(topic, p): OffsetSpec.LATEST for p in parts}, isolation_level=isolation,
        )
    return {tp.partition: int(o.offset) for tp, o in sorted(result.items())}


def committed_offsets(cluster: Cluster, group: str, topic: str, *, timeout_s: float = 30.0) -> dict[int, int]:
    """The group's committed offsets for ``topic``; partitions without a commit are left out."""
    with admin(cluster, timeout_s) as client:
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


def input_topics(kafka: KafkaConfig, existing: Iterable[str]) -> list[str]:
    """The job's input topics among ``existing``: those it names, or those its pattern matches in full
    (as Flink's source matches `topic-pattern`)."""
    if kafka.input_topic_pattern is None:
        return kafka.topics()
    pattern = re.compile(kafka.input_topic_pattern)
    return sorted(t for t in existing if pattern.fullmatch(t) and not t.startswith("__"))


class GroupProgress:
    """The job's consumer group on its input topics: committed offsets vs end offsets.

    Partitions are `TopicPartition`s: with several input topics (or a pattern, resolved again on
    every call, so a topic that appears later counts) one topic's partition 0 is not another's."""

    def __init__(self, config: JobConfig) -> None:
        self._kafka = config.kafka
        try:
            self._consumer = open_client(KafkaConsumer, config.kafka, group_id=config.kafka.group_id,
                                         enable_auto_commit=False, client_id="llmstream-progress")
        except KafkaError as err:
            raise connection_error(config.kafka, config.kafka.client_args(), err) from None

    def _partitions(self) -> list[TopicPartition]:
        existing = self._consumer.topics() if self._kafka.input_topic_pattern is not None else ()
        out = []
        for topic in input_topics(self._kafka, existing):
            partitions = self._consumer.partitions_for_topic(topic) or set()
            out += [TopicPartition(topic, p) for p in sorted(partitions)]
        return out

    def end_offsets(self) -> dict[TopicPartition, int]:
        """The input's end offset per partition, now."""
        tps = self._partitions()
        return dict(self._consumer.end_offsets(tps)) if tps else {}

    def committed(self) -> dict[TopicPartition, int]:
        """The group's committed offset per partition of the input (0 where none)."""
        return {tp: self._consumer.committed(tp) or 0 for tp in self._partitions()}

    def snapshot(self) -> tuple[int, int]:
        """(committed, end) summed over the input's partitions."""
        return sum(self.committed().values()), sum(self.end_offsets().values())

    def reached(self, targets: dict[TopicPartition, int]) -> bool:
        """Whether the group has committed at least `targets` on every partition."""
        committed = self.committed()
        return all(committed.get(tp, 0) >= offset for tp, offset in targets.items())

    def close(self) -> None:
        self._consumer.close()
