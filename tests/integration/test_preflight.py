"""Start-up checks fail fast, before Flink is involved, with a message naming the setting.

Broker-side checks (jobs/launch/preflight.py) run against real brokers: one whose
``transaction.max.timeout.ms`` is lower than the job's ``kafka.transaction_timeout_ms``, and
the session broker without the job's topics. Config-side checks (udfs/config/sections.py) go through
the same `llmstream submit` command a user runs; none of these tests needs a Flink cluster
(the --jobmanager given is a closed port, so reaching Flink would fail differently).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs import cli
from jobs.clients import kafka_admin
from jobs.dev.local_kafka import BrokerConfig, LocalBroker
from jobs.launch import preflight
from jobs.runtime.ports import free_port
from udfs.config import load_config, to_dict, with_overrides
from udfs.errors import ConfigError


def _job(tmp_path: Path, bootstrap: str, **sections: dict[str, Any]) -> Path:
    tag = uuid.uuid4().hex[:8]
    config = with_overrides(load_config(), kafka={
        "bootstrap_servers": bootstrap, "input_topic": f"pf-{tag}-in", "output_topic": f"pf-{tag}-out",
        "dead_letter_topic": f"pf-{tag}-dead", "group_id": f"pf-{tag}", "transactional_id_prefix": f"pf-{tag}",
        "create_topics": False})
    data = to_dict(config)
    for section, values in sections.items():
        data[section] = {**data[section], **values}
    path = tmp_path / f"job-{tag}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _submit(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["submit", "--config", str(path), "--jobmanager", f"localhost:{free_port()}"])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------------- broker-side (jobs/launch/preflight.py)


@pytest.fixture(scope="module")
def strict_broker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A broker that allows transactions of at most 60 s."""
    broker = LocalBroker(BrokerConfig.ephemeral(tmp_path_factory.mktemp("strict-kafka"), heap="256m",
                                                extra_properties={"transaction.max.timeout.ms": "60000"}))
    broker.start(timeout=90)
    yield broker
    broker.stop()


@pytest.mark.integration
def test_transaction_timeout_above_the_brokers_maximum_fails_fast(
        strict_broker: LocalBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short_checkpoints = {"interval_ms": 2000, "timeout_ms": 20_000, "max_restart_ms": 20_000}
    path = _job(tmp_path, strict_broker.bootstrap_servers, kafka={"create_topics": True},
                checkpointing=short_checkpoints, **{"async": {"record_deadline_s": 30}})
    with pytest.raises(ConfigError) as err:
        preflight.check(load_config(path))
    assert err.value.key == "kafka.transaction_timeout_ms"
    assert "transaction.max.timeout.ms (60000)" in str(err.value)

    code, stderr = _submit(path, capsys)
    assert code == 2
    assert "kafka.transaction_timeout_ms" in stderr and "60000" in stderr

    # Within the broker's limit (and above a transaction's lifetime: 2 + 20 + 20 s) it passes,
    # and create_topics makes the topics.
    ok = _job(tmp_path, strict_broker.bootstrap_servers, kafka={"create_topics": True, "transaction_timeout_ms": 50_000,
                                                                "topic_partitions": 3},
              checkpointing=short_checkpoints, **{"async": {"record_deadline_s": 30}})
    config = load_config(ok)
    preflight.check(config)
    assert kafka_admin.end_offsets(strict_broker.bootstrap_servers, config.kafka.input_topic) == {0: 0, 1: 0, 2: 0}


@pytest.mark.integration
def test_missing_topics_without_create_topics_fail_fast_naming_the_key(
        kafka_broker: LocalBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _job(tmp_path, kafka_broker.bootstrap_servers)
    config = load_config(path)
    with pytest.raises(ConfigError) as err:
        preflight.check(config)
    assert err.value.key == "kafka.input_topic"
    assert config.kafka.input_topic in str(err.value) and "create_topics" in str(err.value)

    code, stderr = _submit(path, capsys)
    assert code == 2 and "kafka.input_topic" in stderr

    # the input exists but the dead-letter topic does not: named as such
    kafka_admin.create_topics(kafka_broker.bootstrap_servers, [config.kafka.input_topic, config.kafka.output_topic])
    with pytest.raises(ConfigError) as err:
        preflight.check(config)
    assert err.value.key == "kafka.dead_letter_topic"


@pytest.mark.integration
def test_no_broker_at_bootstrap_servers_fails_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _job(tmp_path, f"127.0.0.1:{free_port()}")
    code, stderr = _submit(path, capsys)
    assert code == 2 and "kafka.bootstrap_servers" in stderr


# ---------------------------------------------------------------------- config-side (udfs/config/sections.py)


@pytest.mark.parametrize(("sections", "key", "words"), [
    ({"kafka": {"transactional_id_prefix": ""}}, "kafka.transactional_id_prefix", "must not be empty"),
    ({"kafka": {"transactional_id_prefix": "   "}}, "kafka.transactional_id_prefix", "must not be empty"),
    ({"kafka": {"output_topic": "same"}, "_input": "same"}, "kafka.output_topic", "must differ"),
    ({"kafka": {"dead_letter_topic": "same"}, "_input": "same"}, "kafka.dead_letter_topic", "must differ"),
    ({"kafka": {"transaction_timeout_ms": 60_000}, "checkpointing": {"interval_ms": 30_000}},
     "kafka.transaction_timeout_ms", "checkpointing.max_restart_ms"),
])
def test_config_mistakes_fail_at_submit_naming_the_key(
        sections: dict[str, Any], key: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _job(tmp_path, f"127.0.0.1:{free_port()}")
    data = yaml.safe_load(path.read_text())
    same = sections.pop("_input", None)
    if same:
        data["kafka"]["input_topic"] = same
    for section, values in sections.items():
        data[section] = {**data[section], **values}
    path.write_text(yaml.safe_dump(data))
    code, stderr = _submit(path, capsys)
    assert code == 2
    assert key in stderr and words in stderr, stderr
