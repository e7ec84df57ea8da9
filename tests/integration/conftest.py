"""Fixtures for tests that need a real Kafka broker.

One broker per test session (starting one costs a few seconds and ~0.5 GB), on free
ports and a temp data dir so parallel checkouts and a developer's own
``llmstream kafka start`` on 9092 never collide.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from jobs.local_kafka import BrokerConfig, LocalBroker, delete_topics


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs Java and a local Kafka broker")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    broker = LocalBroker(BrokerConfig.ephemeral(tmp_path_factory.mktemp("kafka"), heap="512m"))
    broker.start(timeout=90)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def bootstrap(kafka_broker: LocalBroker) -> str:
    return kafka_broker.bootstrap_servers


@pytest.fixture
def topic_names(kafka_broker: LocalBroker) -> Iterator[Callable[..., list[str]]]:
    """Factory ``topic_names(n=1, prefix="t")`` of unique names; the topics are deleted after the test."""
    made: list[str] = []

    def make(n: int = 1, prefix: str = "t") -> list[str]:
        names = [f"{prefix}-{uuid.uuid4().hex[:12]}" for _ in range(n)]
        made.extend(names)
        return names

    yield make
    if made:
        delete_topics(kafka_broker.bootstrap_servers, made, missing_ok=True)
