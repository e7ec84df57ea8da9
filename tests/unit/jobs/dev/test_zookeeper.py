"""`jobs/dev/zookeeper.py` and the highly available cluster's configuration
(`jobs/dev/local_cluster.py`, ``ClusterConfig(ha=True)``), without starting a JVM: the server runs in
`tests/integration/test_ha_cluster.py`."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import yaml

from jobs.dev import local_cluster
from jobs.dev.local_cluster import ClusterConfig, render_config
from jobs.dev.zookeeper import ZooKeeper, ZooKeeperConfig, four_letter
from jobs.runtime.ports import free_port


def _cfg(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def test_zoo_cfg_is_one_loopback_server_with_its_data_in_its_dir(tmp_path: Path) -> None:
    config = ZooKeeperConfig(port=12345, data_dir=tmp_path)
    cfg = _cfg(config.zoo_cfg())
    assert cfg["clientPort"] == "12345" and cfg["clientPortAddress"] == "127.0.0.1"
    assert cfg["dataDir"] == str(tmp_path / "data")
    assert cfg["admin.enableServer"] == "false"  # Jetty is not on its classpath
    assert set(cfg["4lw.commands.whitelist"].split(",")) == {"ruok", "srvr"}  # what `ready` asks
    # Flink asks for a session timeout of 15 s (flink-conf/config.yaml): within ZooKeeper's bounds.
    assert 2 * config.tick_ms <= 15_000 <= int(cfg["maxSessionTimeout"])
    assert config.quorum == "127.0.0.1:12345"


def test_four_letter_reads_the_whole_answer() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            assert conn.recv(4) == b"srvr"
            conn.sendall(b"Zookeeper version: 3.9.4\n")
            conn.sendall(b"Mode: standalone\n")

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        assert four_letter("127.0.0.1", port, "srvr") == "Zookeeper version: 3.9.4\nMode: standalone\n"
    finally:
        thread.join(5)
        server.close()


def test_not_ready_when_nothing_listens_and_a_foreign_pid_is_not_its(tmp_path: Path) -> None:
    zookeeper = ZooKeeper(ZooKeeperConfig(port=free_port(), data_dir=tmp_path))
    assert not zookeeper.ready()
    zookeeper.pid_file.write_text(f"{os.getpid()}\n")  # alive, but not ZooKeeperServerMain on this zoo.cfg
    assert zookeeper.pid() is None
    zookeeper.stop()  # signals nothing, forgets the pid file
    assert not zookeeper.pid_file.exists()


def test_ha_overrides_point_flink_at_zookeeper_and_the_ha_dir(tmp_path: Path) -> None:
    config = ClusterConfig.ephemeral(tmp_path, ha=True)
    ports = [config.rest_port, config.rpc_port, config.standby_rest_port, config.standby_rpc_port,
             config.zookeeper_port]
    assert len(set(ports)) == 5
    assert config.jobmanagers() == [(config.rest_port, config.rpc_port),
                                    (config.standby_rest_port, config.standby_rpc_port)]
    overrides = config.overrides()
    assert overrides["high-availability.type"] == "zookeeper"
    assert overrides["high-availability.zookeeper.quorum"] == f"127.0.0.1:{config.zookeeper_port}"
    assert overrides["high-availability.storageDir"] == (tmp_path.resolve() / "ha").as_uri()
    assert overrides["high-availability.jobmanager.port"] == str(config.rpc_port)
    # --setting wins, e.g. the HA storage on S3.
    on_s3 = ClusterConfig(work_dir=tmp_path, ha=True, settings={"high-availability.storageDir": "s3://b/ha"})
    assert on_s3.overrides()["high-availability.storageDir"] == "s3://b/ha"
    assert not any(k.startswith("high-availability.") for k in ClusterConfig(work_dir=tmp_path).overrides())


def test_a_started_ha_config_is_read_back_from_its_generated_conf(tmp_path: Path) -> None:
    config = ClusterConfig.ephemeral(tmp_path, ha=True)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text(render_config(local_cluster.conf_source_dir(), config.overrides())
                                      + config.ha_comment())
    assert yaml.safe_load((conf / "config.yaml").read_text())["high-availability.type"] == "zookeeper"
    again = ClusterConfig.existing(tmp_path)
    assert (again.ha, again.rest_port, again.rpc_port, again.standby_rest_port, again.standby_rpc_port,
            again.zookeeper_port) == (True, config.rest_port, config.rpc_port, config.standby_rest_port,
                                      config.standby_rpc_port, config.zookeeper_port)
    single = ClusterConfig(work_dir=tmp_path / "single")
    (tmp_path / "single" / "conf").mkdir(parents=True)
    (tmp_path / "single" / "conf" / "config.yaml").write_text(
        render_config(local_cluster.conf_source_dir(), single.overrides()) + single.ha_comment())
    assert not ClusterConfig.existing(tmp_path / "single").ha
