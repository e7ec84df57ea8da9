"""Start-up checks against the real broker: fail fast, naming the setting, before Flink starts.

Each of these problems would otherwise surface minutes later as a failing checkpoint or
a restart loop inside Flink, far from the config key that causes it.
"""

from __future__ import annotations

import contextlib
import logging

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from jobs import kafka_admin
from udfs.config import JobConfig
from udfs.errors import ConfigError

log = logging.getLogger("llmstream.preflight")

TOPIC_KEYS = ("input_topic", "output_topic", "dead_letter_topic")


def _admin(config: JobConfig, timeout_s: float) -> KafkaAdminClient:
    try:
        return kafka_admin.connect(config.kafka.bootstrap_servers, timeout_s, client_id="llmstream-preflight")
    except KafkaError as err:
        raise ConfigError("kafka.bootstrap_servers",
                          f"no Kafka broker answers at {config.kafka.bootstrap_servers} ({err})") from err


def check(config: JobConfig, *, timeout_s: float = 30.0) -> None:
    """Raises `ConfigError` for a setting the broker will reject; creates topics if so configured."""
    kafka = config.kafka
    with contextlib.closing(_admin(config, timeout_s)) as admin:
        limit = kafka_admin.broker_max_transaction_timeout_ms(admin)
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
