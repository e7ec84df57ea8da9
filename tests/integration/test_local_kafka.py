"""The local broker and the admin helpers against a real Kafka 4.1.1, via kafka-python."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import TopicAlreadyExistsError

from jobs.clients import kafka_admin
from jobs.dev import kafka_cli
from jobs.dev import local_kafka as lk
from jobs.runtime.ports import free_port

pytestmark = pytest.mark.integration


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z"


def test_cli_start_is_idempotent_and_stop_leaves_no_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 128 MB of heap: a broker whose log cleaner asked for its default 128 MB dedupe buffer would exit
    # at start-up with OutOfMemoryError (seen once at 256 MB); local brokers ask for 16 MB.
    config = lk.BrokerConfig.ephemeral(tmp_path / "kafka", heap="128m")
    argv = ["--port", str(config.port), "--controller-port", str(config.controller_port),
            "--data-dir", str(config.data_dir), "--heap", "128m"]
    broker = lk.LocalBroker(config)
    try:
        assert kafka_cli.main(["status", *argv]) == 1
        assert kafka_cli.main(["start", *argv]) == 0
        pid = broker.pid()
        assert pid is not None and broker.is_ready()
        assert (config.data_dir / "data" / "meta.properties").exists()
        assert "kafka.Kafka" in (Path(f"/proc/{pid}/cmdline").read_bytes().decode())

        assert kafka_cli.main(["start", *argv]) == 0
        assert broker.pid() == pid
        assert "already running" in capsys.readouterr().out
        other_port = ["--port", str(free_port()), "--data-dir", str(config.data_dir)]
        assert kafka_cli.main(["start", *other_port]) == 1
        assert "already runs with listeners" in capsys.readouterr().err

        assert kafka_cli.main(["status", *argv]) == 0
        status = broker.status()
        assert status["running"] and status["ready"] and status["pid"] == pid
        assert status["bootstrap"] == f"127.0.0.1:{config.port}"
        assert Path(status["log_file"]).stat().st_size > 0
        assert (config.data_dir / "logs" / "stdout.log").read_text() == ""

        assert kafka_cli.main(["stop", *argv]) == 0
        assert _gone(pid)
        assert not broker.pid_file.exists()
        assert kafka_cli.main(["status", *argv]) == 1
        assert kafka_cli.main(["stop", *argv]) == 0
    finally:
        broker.stop()


def test_admin_helpers_round_trip(bootstrap: str, topic_names: Callable[..., list[str]]) -> None:
    topic, other = topic_names(2)
    kafka_admin.create_topics(bootstrap, [topic, other], partitions=2)
    kafka_admin.create_topics(bootstrap, [topic], partitions=2)
    with pytest.raises(TopicAlreadyExistsError):
        kafka_admin.create_topics(bootstrap, [topic], exist_ok=False)

    records = [(f"k{i}".encode(), f"v{i}".encode()) for i in range(10)] + [(None, b"no-key"), (b"tomb", None)]
    assert kafka_admin.produce(bootstrap, topic, records) == 12

    seen = kafka_admin.consume_committed(bootstrap, topic, expected=12, timeout_s=60)
    assert sorted(((r.key, r.value) for r in seen), key=repr) == sorted(records, key=repr)
    ends = kafka_admin.end_offsets(bootstrap, topic)
    assert set(ends) == {0, 1} and sum(ends.values()) == 12
    assert kafka_admin.end_offsets(bootstrap, topic, committed_only=True) == ends

    assert len(kafka_admin.consume_committed(bootstrap, topic, timeout_s=60)) == 12
    assert kafka_admin.consume_committed(bootstrap, other, timeout_s=5) == []

    group = f"g-{topic}"
    assert len(kafka_admin.consume_committed(bootstrap, topic, expected=12, timeout_s=60, group_id=group)) == 12
    assert kafka_admin.committed_offsets(bootstrap, group, topic) == ends
    assert kafka_admin.consume_committed(bootstrap, topic, timeout_s=5, group_id=group) == []

    kafka_admin.delete_topics(bootstrap, [topic, other])
    kafka_admin.delete_topics(bootstrap, [topic])
    with kafka_admin.admin(bootstrap) as admin:
        assert topic not in admin.list_topics()


def test_read_committed_hides_aborted_and_open_transactions(
    bootstrap: str, topic_names: Callable[..., list[str]]
) -> None:
    (topic,) = topic_names(1, "txn")
    kafka_admin.create_topics(bootstrap, [topic], partitions=1)
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"tx-{topic}")
    try:
        producer.init_transactions()
        producer.begin_transaction()
        for i in range(3):
            producer.send(topic, value=b"committed-%d" % i)
        producer.commit_transaction()

        producer.begin_transaction()
        for i in range(4):
            producer.send(topic, value=b"aborted-%d" % i)
        producer.flush()
        producer.abort_transaction()

        producer.begin_transaction()
        producer.send(topic, value=b"open")
        producer.flush()
        assert kafka_admin.end_offsets(bootstrap, topic, committed_only=True)[0] < kafka_admin.end_offsets(bootstrap, topic)[0]
        visible = kafka_admin.consume_committed(bootstrap, topic, timeout_s=60)
        assert [r.value for r in visible] == [b"committed-0", b"committed-1", b"committed-2"]
        producer.commit_transaction()
    finally:
        producer.close()

    values = [r.value for r in kafka_admin.consume_committed(bootstrap, topic, expected=4, timeout_s=60)]
    assert values == [b"committed-0", b"committed-1", b"committed-2", b"open"]
    assert kafka_admin.end_offsets(bootstrap, topic, committed_only=True) == kafka_admin.end_offsets(bootstrap, topic)

    raw = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_uncommitted",
                        auto_offset_reset="earliest", enable_auto_commit=False, consumer_timeout_ms=8000)
    try:
        raw.assign([TopicPartition(topic, 0)])
        uncommitted = [r.value for r in raw]
    finally:
        raw.close()
    assert len(uncommitted) == 8 and b"aborted-0" in uncommitted
