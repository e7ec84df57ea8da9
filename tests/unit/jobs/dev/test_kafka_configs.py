"""The local brokers' generated configuration, without a JVM: one node's ``server.properties``, each
node's in a cluster (plain and secured), the cluster's port layout and the CLI's refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs.dev import kafka_cli
from jobs.dev.local_kafka import (
    BrokerConfig,
    ClusterConfig,
    LocalKafkaCluster,
    Quorum,
    new_cluster_id,
)
from jobs.dev.secure_kafka import SecureKafkaCluster

REPLICATION_KEYS = ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                    "share.coordinator.state.topic.replication.factor")
MIN_ISR_KEYS = ("transaction.state.log.min.isr", "share.coordinator.state.topic.min.isr")


def test_a_single_broker_is_its_own_quorum_with_unreplicated_internal_topics(tmp_path: Path) -> None:
    props = BrokerConfig(port=9092, data_dir=tmp_path).server_properties()
    assert props["node.id"] == "1"
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:9093"
    assert "controller.quorum.voters" not in props
    assert all(props[key] == "1" for key in (*REPLICATION_KEYS, *MIN_ISR_KEYS))
    assert "default.replication.factor" not in props and "min.insync.replicas" not in props
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"


def test_three_nodes_share_one_static_quorum_and_replicate_by_three(tmp_path: Path) -> None:
    cluster = LocalKafkaCluster(ClusterConfig(brokers=3, port=19292, data_dir=tmp_path))
    props = [node.config.server_properties() for node in cluster.nodes]
    voters = "1@127.0.0.1:19293,2@127.0.0.1:19303,3@127.0.0.1:19313"
    for node_id, p in enumerate(props, start=1):
        assert p["node.id"] == str(node_id)
        assert p["process.roles"] == "broker,controller"
        assert p["controller.quorum.voters"] == voters
        assert "controller.quorum.bootstrap.servers" not in p
        assert all(p[key] == "3" for key in REPLICATION_KEYS)
        assert all(p[key] == "2" for key in MIN_ISR_KEYS)
        assert p["default.replication.factor"] == "3" and p["min.insync.replicas"] == "2"
        assert p["log.dirs"] == str(tmp_path.resolve() / f"node-{node_id}" / "data")
    assert [p["listeners"] for p in props] == [
        f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{port + 1}" for port in (19292, 19302, 19312)]
    assert cluster.bootstrap_servers == "127.0.0.1:19292,127.0.0.1:19302,127.0.0.1:19312"


@pytest.mark.parametrize(("nodes", "replication", "min_insync"), [(2, 2, 1), (3, 3, 2), (5, 3, 2)])
def test_replication_is_at_most_three_and_one_node_may_be_lost(nodes: int, replication: int, min_insync: int) -> None:
    quorum = Quorum(1, tuple(range(9000, 9000 + nodes)))
    assert (quorum.replication, quorum.min_insync) == (replication, min_insync)


def test_a_quorum_and_its_node_must_agree() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        Quorum(1, (9001,))
    with pytest.raises(ValueError, match="node_id"):
        Quorum(4, (9001, 9002, 9003))
    with pytest.raises(ValueError, match="controller port"):
        BrokerConfig(port=9000, controller_port=9005, quorum=Quorum(1, (9001, 9002, 9003)))
    with pytest.raises(ValueError, match="at least 2 brokers"):
        ClusterConfig(brokers=1)


def test_ephemeral_ports_are_distinct_and_explicit_ports_are_kept(tmp_path: Path) -> None:
    config = ClusterConfig.ephemeral(tmp_path, brokers=3, per_node=4)
    flat = [port for node in config.ports for port in node]
    assert len(flat) == 12 and len(set(flat)) == 12
    assert config.node_ports(4) == [tuple(node) for node in config.ports]
    with pytest.raises(ValueError, match="4 ports"):
        ClusterConfig.ephemeral(tmp_path).node_ports(4)


def test_cluster_ids_look_like_the_storage_tools() -> None:
    ids = {new_cluster_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22}", i) and not i.startswith("-") for i in ids)


def test_secured_nodes_share_one_set_of_certificates_and_passwords(tmp_path: Path) -> None:
    cluster = SecureKafkaCluster(ClusterConfig(brokers=3, port=19392, data_dir=tmp_path))
    props = [node.config.server_properties() for node in cluster.nodes]
    assert {p["ssl.truststore.location"] for p in props} == {str(tmp_path.resolve() / "tls" / "ca.pem")}
    assert {p["ssl.keystore.location"] for p in props} == {str(tmp_path.resolve() / "tls" / "broker.pem")}
    assert {p["controller.quorum.voters"] for p in props} == {"1@127.0.0.1:19394,2@127.0.0.1:19404,3@127.0.0.1:19414"}
    assert [p["inter.broker.listener.name"] for p in props] == ["SASL_SSL"] * 3
    assert props[1]["listeners"].startswith("SASL_SSL://127.0.0.1:19402,SSL://127.0.0.1:19403,")
    assert all(p["default.replication.factor"] == "3" and p["min.insync.replicas"] == "2" for p in props)
    assert cluster.bootstrap_servers == "127.0.0.1:19392,127.0.0.1:19402,127.0.0.1:19412"
    assert cluster.ssl_bootstrap_servers == "127.0.0.1:19393,127.0.0.1:19403,127.0.0.1:19413"
    assert not list(tmp_path.iterdir()), "building the configs wrote files"


def test_cli_cluster_status_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = ["--data-dir", str(tmp_path / "c")]
    assert kafka_cli.main(["status", "--brokers", "3", "--port", "19292", *data]) == 1
    out = capsys.readouterr().out
    assert out.count("not running") == 3 and "bootstrap 127.0.0.1:19292,127.0.0.1:19302,127.0.0.1:19312" in out
    assert kafka_cli.main(["status", "--brokers", "3", "--controller-port", "9999", *data]) == 2
    assert "--controller-port" in capsys.readouterr().err
    assert kafka_cli.main(["status", "--brokers", "0", *data]) == 2
