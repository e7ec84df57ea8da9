"""Start-up checks against the real broker: fail fast, naming the setting, before Flink starts.

Each of these problems would otherwise surface minutes later as a failing checkpoint or
a restart loop inside Flink, far from the config key that causes it: a wrong password or
an untrusted certificate (the Kafka clients inside Flink retry them forever), a missing
topic, an ACL the job's principal lacks. The checks connect exactly as the job does
(`kafka.properties`, see `udfs/config/kafka_security.py`) and ask the broker what the principal
may do (the authorized operations of Kafka's Metadata and DescribeGroups answers), so a
missing permission is named as `principal User:job may not WRITE topic llm-results`.

On a replicated cluster it also reads what exactly-once output needs from it (docs/operations.md, "A
replicated Kafka"): the sink's producer writes with acks=all, so a `kafka.properties.acks` other than
`all` is refused here rather than by the producer inside Flink; an output or dead-letter topic whose
`min.insync.replicas` exceeds its replication factor would refuse every write; one with replication 1 on
a multi-broker cluster is a warning (its broker's loss stops the job).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from kafka import KafkaProducer  # type: ignore[import-untyped]
from kafka.admin import (  # type: ignore[import-untyped]
    ACLOperation,
    ConfigResource,
    ConfigResourceType,
    KafkaAdminClient,
    NewTopic,
)
from kafka.errors import (  # type: ignore[import-untyped]
    AuthorizationError,
    CoordinatorNotAvailableError,
    GroupAuthorizationFailedError,
    KafkaError,
    NotCoordinatorError,
    TopicAlreadyExistsError,
    for_code,
)
from kafka.protocol.consumer.group import JoinGroupRequest  # type: ignore[import-untyped]

from jobs.clients import kafka_admin
from udfs.config import JobConfig
from udfs.errors import ConfigError
from udfs.records import formats

log = logging.getLogger("llmstream.preflight")

OUTPUT_KEYS = ("output_topic", "dead_letter_topic")
_UNKNOWN_TOPIC = 3
_TOPIC_AUTHORIZATION_FAILED = 29
JOIN_PROBE_SESSION_MS = 6000
"""The broker's minimum session timeout by default: the probe's pending member is forgotten soonest."""
PREFLIGHT_TRANSACTION_SUFFIX = "-llmstream-preflight"
"""A transactional id under the job's prefix that preflight initializes to check its ACL (the sink's
own ids are `<prefix>-<subtask>-<n>`, so this one is never used by a running job)."""


def _principal(config: JobConfig, args: dict[str, Any]) -> str:
    user = args.get("sasl_plain_username")
    if user:
        return f"User:{user}"
    if args.get("ssl_certfile"):
        return "the principal of the client certificate in kafka.properties.ssl.keystore.location"
    return "User:ANONYMOUS"


def _admin(config: JobConfig, args: dict[str, Any], timeout_s: float) -> KafkaAdminClient:
    try:
        return kafka_admin.connect(args, timeout_s, client_id="llmstream-preflight")
    except (KafkaError, OSError) as err:
        raise kafka_admin.connection_error(config.kafka, args, err) from None


def _operations(info: dict[str, Any], *keys: str) -> set[str] | None:
    """The operations the broker says the principal may perform on a resource (None: not told).
    kafka-python hands them over decoded (names or `ACLOperation`s) or as Kafka's bit field."""
    for key in keys:
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, int):
            if value < 0:  # INT_MIN: the broker was not asked, or will not say
                return None
            names = set()
            for bit in range(3, 32):
                if value >> bit & 1:
                    with contextlib.suppress(ValueError):
                        names.add(ACLOperation(bit).name)
            return names
        return {str(getattr(op, "name", op)).upper() for op in value}
    return None


def _denied(principal: str, operation: str, kind: str, name: str) -> str:
    return f"principal {principal} may not {operation} {kind} {name!r}; grant it with an ACL"


def _check_topics(config: JobConfig, admin: KafkaAdminClient, principal: str) -> None:
    """Input topics readable, output and dead-letter topics writable, creating missing ones if asked."""
    kafka = config.kafka
    input_key = ("input_topic_pattern" if kafka.input_topic_pattern is not None
                 else "input_topics" if kafka.input_topics else "input_topic")
    inputs = kafka_admin.input_topics(kafka, admin.list_topics() if kafka.input_topic_pattern else ())
    if kafka.input_topic_pattern is not None and not inputs:
        log.warning("kafka.input_topic_pattern %r matches no topic yet; the job reads topics as they appear",
                    kafka.input_topic_pattern)
    wanted = [(input_key, t, "READ") for t in inputs] + [(key, getattr(kafka, key), "WRITE") for key in OUTPUT_KEYS]
    described = {t["name"]: t for t in admin.describe_topics([t for _, t, _ in wanted])}
    missing = []
    for key, topic, operation in wanted:
        info = described.get(topic) or {"error_code": _UNKNOWN_TOPIC}
        code = info.get("error_code") or 0
        if code == _TOPIC_AUTHORIZATION_FAILED:
            raise ConfigError(f"kafka.{key}", _denied(principal, f"{operation} (or even DESCRIBE)", "topic", topic))
        if code == _UNKNOWN_TOPIC:
            missing.append((key, topic))
            continue
        allowed = _operations(info, "authorized_operations", "topic_authorized_operations")
        if allowed is not None and operation not in allowed and "ALL" not in allowed:
            raise ConfigError(f"kafka.{key}", _denied(principal, operation, "topic", topic))
    if missing and not kafka.create_topics:
        key, topic = missing[0]
        raise ConfigError(f"kafka.{key}", f"topic {topic!r} does not exist (set kafka.create_topics: true "
                                          "to create it)")
    for key, topic in missing:
        try:
            # Replication -1: the broker's default.replication.factor (1 on a single broker, 3 on
            # `llmstream kafka start --brokers 3`), so a replicated cluster's topics are replicated.
            admin.create_topics([NewTopic(topic, kafka.topic_partitions, -1)])
            log.info("created topic %s (%s, %d partitions)", topic, key, kafka.topic_partitions)
        except TopicAlreadyExistsError:
            pass
        except AuthorizationError:
            raise ConfigError(f"kafka.{key}", f"topic {topic!r} does not exist and "
                                              + _denied(principal, "CREATE", "topic", topic)) from None


def _check_producer_properties(config: JobConfig) -> None:
    """The exactly-once sink's producer is transactional, hence idempotent, hence acks=all: Kafka's client
    refuses anything else when the sink starts, inside Flink, in a restart loop."""
    props = {k.lower(): str(v).strip().lower() for k, v in config.kafka.properties.items()}
    if props.get("acks", "all") not in ("all", "-1"):
        raise ConfigError("kafka.properties.acks", f"is {props['acks']!r}, but the exactly-once sink's transactional "
                                                   "producer needs acks=all (leave it unset)")
    if props.get("enable.idempotence", "true") != "true":
        raise ConfigError("kafka.properties.enable.idempotence", "must stay true: the exactly-once sink's "
                                                                 "transactions need an idempotent producer")


def _check_replication(config: JobConfig, admin: KafkaAdminClient, brokers: int) -> None:
    """Output and dead-letter topics against the cluster: `min.insync.replicas` above the replication
    factor refuses every acks=all write (a `ConfigError`); replication 1 on a multi-broker cluster is a
    one-line warning. What cannot be read (an ACL, an old broker) is left unchecked, quietly."""
    kafka = config.kafka
    topics = list(dict.fromkeys(getattr(kafka, key) for key in OUTPUT_KEYS))
    keys = {getattr(kafka, key): key for key in reversed(OUTPUT_KEYS)}
    try:
        replicas = {}
        for info in admin.describe_topics(topics):
            parts = info.get("partitions") or []
            if not info.get("error_code") and parts:
                replicas[info["name"]] = min(len(p.get("replica_nodes") or ()) for p in parts)
        if not replicas:
            return
        described = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t, {"min.insync.replicas": None}) for t in replicas],
            config_filter="all").get("topic", {})
    except (KafkaError, OSError, KeyError, TypeError, ValueError) as err:
        log.debug("replication of the output topics unchecked: %s", err)
        return
    for topic, factor in replicas.items():
        entry = (described.get(topic) or {}).get("min.insync.replicas") or {}
        value = str(entry.get("value") or "")
        min_insync = int(value) if value.isdigit() else 0
        if factor and min_insync > factor:
            raise ConfigError(f"kafka.{keys[topic]}", f"topic {topic!r} has min.insync.replicas {min_insync} but "
                              f"replication factor {factor}: every acks=all write, the exactly-once sink's "
                              "included, would be refused")
        if factor == 1 and brokers > 1:
            log.warning("kafka.%s: topic %r has replication factor 1 on a %d-broker cluster: its broker's loss "
                        "stops the job (create it with replication 3, min.insync.replicas 2)", keys[topic], topic,
                        brokers)


async def _join_probe(admin: KafkaAdminClient, group: str, request: Any) -> Any:
    coordinator = await admin._find_coordinator_id(group)
    return await admin._manager.send(request, node_id=coordinator)


def _check_group(config: JobConfig, admin: KafkaAdminClient, principal: str, timeout_s: float) -> None:
    """READ on the job's group (the source commits offsets to it), asked without joining it.

    DescribeGroups reports authorized operations only for a group that exists, and a new job's group
    does not. So preflight sends the JoinGroup a consumer would, with no member id: the broker checks
    READ on the group first (GROUP_AUTHORIZATION_FAILED), and an authorized request is answered
    MEMBER_ID_REQUIRED without joining anything (KIP-394). Uses kafka-python's internals (pinned).
    """
    group = config.kafka.group_id
    request = JoinGroupRequest(
        group_id=group, session_timeout_ms=JOIN_PROBE_SESSION_MS, rebalance_timeout_ms=JOIN_PROBE_SESSION_MS,
        member_id="", group_instance_id=None, protocol_type="consumer",
        protocols=[JoinGroupRequest.JoinGroupRequestProtocol(name="range", metadata=b"")], max_version=7)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = admin._manager.run(_join_probe, admin, group, request)
            error = for_code(response.error_code)
        except AuthorizationError:
            error = GroupAuthorizationFailedError
        except (CoordinatorNotAvailableError, NotCoordinatorError) as err:
            error = type(err)
        if error is GroupAuthorizationFailedError:
            raise ConfigError("kafka.group_id", _denied(principal, "READ", "group", group))
        if error not in (CoordinatorNotAvailableError, NotCoordinatorError):
            return
        # A fresh cluster creates its offsets topic on the first group request.
        if time.monotonic() >= deadline:
            log.warning("could not check the group ACL of %r: %s", group, error.__name__)
            return
        time.sleep(0.2)


def _check_transactions(config: JobConfig, args: dict[str, Any], principal: str, timeout_s: float) -> None:
    """The exactly-once sink's transactional ids (`<prefix>-...`) may be written: one of them is initialized."""
    prefix = config.kafka.transactional_id_prefix
    tid = prefix + PREFLIGHT_TRANSACTION_SUFFIX
    producer = None
    try:
        producer = KafkaProducer(**args, transactional_id=tid, client_id="llmstream-preflight",
                                 max_block_ms=int(timeout_s * 1000))
        producer.init_transactions()
    except AuthorizationError:
        raise ConfigError("kafka.transactional_id_prefix",
                          _denied(principal, "WRITE", "transactional id", tid)
                          + f" (the exactly-once sink needs WRITE on transactional ids with prefix {prefix!r})") from None
    except KafkaError as err:
        log.warning("could not check the transactional-id ACL for prefix %r: %s", prefix, err)
    finally:
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=5)


def check(config: JobConfig, *, timeout_s: float = 30.0) -> None:
    """Raises `ConfigError` for a setting the broker will reject; creates topics if so configured."""
    kafka = config.kafka
    args = kafka.client_args()
    principal = _principal(config, args)
    _check_producer_properties(config)
    with contextlib.closing(_admin(config, args, timeout_s)) as admin:
        try:
            brokers = len(admin.describe_cluster().get("brokers") or ())
        except (KafkaError, OSError) as err:
            if isinstance(err, AuthorizationError):
                raise
            raise kafka_admin.connection_error(config.kafka, args, err) from None
        try:
            limit = kafka_admin.broker_max_transaction_timeout_ms(admin)
        except AuthorizationError:
            limit = None
            log.info("principal %s may not read the broker's configuration: transaction.max.timeout.ms unchecked",
                     principal)
        if limit is not None and kafka.transaction_timeout_ms > limit:
            raise ConfigError(
                "kafka.transaction_timeout_ms",
                f"{kafka.transaction_timeout_ms} exceeds the broker's transaction.max.timeout.ms ({limit}); "
                "the exactly-once sink's transactions would be rejected",
            )
        _check_topics(config, admin, principal)
        _check_replication(config, admin, brokers)
        _check_group(config, admin, principal, timeout_s)
    if args.get("security_protocol", "PLAINTEXT") != "PLAINTEXT":
        # An open broker has no ACLs worth a transactional round trip at every start.
        _check_transactions(config, args, principal, timeout_s)
    formats.preflight(config, timeout_s=timeout_s)  # e.g. Avro's registry and its output schema
    if config.model.mode == "batch":
        from udfs.lanes.provider_batch import providers

        providers.preflight(config, timeout_s=timeout_s)  # the batch API answers and takes the key

