"""Start-up checks against the real broker: fail fast, naming the setting, before Flink starts.

Each of these problems would otherwise surface minutes later as a failing checkpoint or
a restart loop inside Flink, far from the config key that causes it.
"""

from __future__ import annotations

import logging

from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from udfs.config import JobConfig
from udfs.errors import ConfigError

log = logging.getLogger("llmstream.preflight")

TOPIC_KEYS = ("input_topic", "output_topic", "dead_letter_topic")


def _admin(config: JobConfig, timeout_s: float) -> KafkaAdminClient:
    try:
        return KafkaAdminClient(
            bootstrap_servers=config.kafka.bootstrap_servers,
            request_timeout_ms=int(timeout_s * 1000),
            client_id="llmstream-preflight",
        )
    except KafkaError as err:
        raise ConfigError("kafka.bootstrap_servers",
                          f"no Kafka broker answers at {config.kafka.bootstrap_servers} ({err})") from err


def broker_max_transaction_timeout_ms(admin: KafkaAdminClient) -> int | None:
    """The broker's `transaction.max.timeout.ms`, or None if it cannot be read."""
    brokers = admin.describe_cluster().get("brokers") or []
    if not brokers:
        return None
    broker_id = str(brokers[0]["broker_id"])
    described = admin.describe_configs(
        [ConfigResource(ConfigResourceType.BROKER, broker_id, {"transaction.max.timeout.ms": None})],
        config_filter="all",
    )
    entry = described.get("broker", {}).get(broker_id, {}).get("transaction.max.timeout.ms")
    return int(entry["value"]) if entry and entry.get("value") is not None else None


def check(config: JobConfig, *, timeout_s: float = 30.0) -> None:
    """Raises `ConfigError` for a setting the broker will reject; creates topics if so configured."""
    kafka = config.kafka
    admin = _admin(config, timeout_s)
    try:
        limit = broker_max_transaction_timeout_ms(admin)
        if limit is not None and kafka.transaction_timeout_ms > limit:
            raise ConfigError(
                "kafka.transaction_timeout_ms",
                f"{kafka.transaction_timeout_ms} exceeds the broker's transaction.max.timeout.ms ({limit}); "
                "the exactly-once sink's transactions would be rejected",
            )
        existing = set(admin.list_topics())
        missing = [(key, getattr(kafka, key)) for key in TOPIC_KEYS if getattr(kafka, key) not in existing]
        if missing and not kafka.create_topics:
            key, topic = missing[0]
            raise ConfigError(f"kafka.{key}", f"topic {topic!r} does not exist (set kafka.create_topics: true "
                                              "to create it)")
        for key, topic in missing:
            try:
                admin.create_topics([NewTopic(topic, kafka.topic_partitions, 1)])
                log.info("created topic %s (%s, %d partitions)", topic, key, kafka.topic_partitions)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()
