"""Preflight's replication checks against canned admin answers (no broker): acks=all for the
exactly-once sink, min.insync.replicas vs replication factor, replication 1 on several brokers."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from jobs.launch import preflight
from tests.support.configs import MINIMAL_KAFKA, minimal_config
from udfs.errors import ConfigError


class Admin:
    """What `_check_replication` asks kafka-python's admin client, answered from dicts."""

    def __init__(self, replicas: dict[str, int], min_insync: dict[str, str | None], fail: bool = False) -> None:
        self.replicas, self.min_insync, self.fail = replicas, min_insync, fail

    def describe_topics(self, topics: list[str]) -> list[dict[str, Any]]:
        if self.fail:
            raise OSError("connection reset")
        return [{"name": t, "error_code": 0, "partitions": [
                    {"partition_index": p, "replica_nodes": list(range(1, self.replicas[t] + 1))} for p in (0, 1)]}
                if t in self.replicas else {"name": t, "error_code": 3, "partitions": []} for t in topics]

    def describe_configs(self, resources: list[Any], config_filter: str) -> dict[str, Any]:
        return {"topic": {r.name: ({"min.insync.replicas": {"value": self.min_insync[r.name]}}
                                   if r.name in self.min_insync else {}) for r in resources}}


def _config(**properties: str) -> Any:
    return minimal_config(kafka={**MINIMAL_KAFKA, "properties": properties})


def test_replication_3_with_min_isr_2_on_3_brokers_passes_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "llmstream.preflight"):
        preflight._check_replication(_config(), Admin({"out": 3, "dlq": 3}, {"out": "2", "dlq": "2"}), 3)
    assert not caplog.records


def test_min_isr_above_replication_names_the_topic_key() -> None:
    with pytest.raises(ConfigError, match=r"kafka\.dead_letter_topic.*min\.insync\.replicas 2 but replication factor 1"):
        preflight._check_replication(_config(), Admin({"out": 3, "dlq": 1}, {"out": "2", "dlq": "2"}), 3)


def test_replication_1_warns_on_several_brokers_only(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "llmstream.preflight"):
        preflight._check_replication(_config(), Admin({"out": 1, "dlq": 1}, {"out": "1", "dlq": "1"}), 1)
        assert not caplog.records
        preflight._check_replication(_config(), Admin({"out": 1, "dlq": 3}, {"out": "1", "dlq": "2"}), 3)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["kafka.output_topic"]
    assert "\n" not in caplog.records[0].getMessage()


def test_what_cannot_be_read_is_left_unchecked() -> None:
    preflight._check_replication(_config(), Admin({}, {}), 3)  # topics unknown (or not described)
    preflight._check_replication(_config(), Admin({"out": 3, "dlq": 3}, {}), 3)  # configs refused
    preflight._check_replication(_config(), Admin({"out": 3, "dlq": 3}, {"out": None}), 3)
    preflight._check_replication(_config(), Admin({}, {}, fail=True), 3)


@pytest.mark.parametrize(("name", "value"), [("acks", "1"), ("acks", "0"), ("enable.idempotence", "false")])
def test_producer_settings_the_transactional_sink_refuses(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"kafka.properties.{name}"):
        preflight._check_producer_properties(_config(**{name: value}))


@pytest.mark.parametrize("acks", ["all", "-1", "ALL"])
def test_acks_all_in_any_spelling_passes(acks: str) -> None:
    preflight._check_producer_properties(_config(acks=acks))
    preflight._check_producer_properties(_config())
