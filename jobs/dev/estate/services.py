"""What runs on the estate's hosts, each process started inside its host's namespace
(``ip netns exec``) and bound to the host's own address:

- `EstateKafka`: `LocalKafkaCluster` with one node per broker host (`EstateBroker`: the same jars,
  properties and storage format as `LocalBroker`, its listeners and quorum voters on host addresses);
- `FlinkDaemon`: a JobManager or a TaskManager from the pip package's ``bin/jobmanager.sh`` /
  ``taskmanager.sh``, with a ``FLINK_CONF_DIR`` per host generated from ``flink-conf/`` (the
  addresses and the shared checkpoint directory changed, as `LocalCluster` changes ports);
- `ModelServer`: the simulator on the model host;
- the object store (`jobs/dev/object_store.py`, s3proxy) on the objects host, made in `Estate`.

Each keeps its files under the estate's work dir, in a folder per host, and is found again by its
pid file, so ``llmstream estate stop|status|fault`` work from another process than ``start``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

from jobs.clients.flink_cli import client_env, flink_home
from jobs.clients.flink_cli import flink_conf_dir as conf_source_dir
from jobs.clients.flink_rest import FlinkRest
from jobs.dev.estate.network import EstateError, Host
from jobs.dev.local_cluster import render_config, write_lib_dir, write_plugins_dir
from jobs.dev.local_kafka import (
    BrokerConfig,
    ClusterConfig,
    LocalBroker,
    LocalKafkaCluster,
    Quorum,
)
from jobs.dev.processes import cmdline, terminate
from jobs.runtime import jars
from jobs.runtime.pids import pid_alive

__all__ = ["EstateBroker", "EstateKafka", "FlinkDaemon", "ModelServer"]

KAFKA_PORT = 9092
CONTROLLER_PORT = 9093
REST_PORT = 8081
RPC_PORT = 6123
MODEL_PORT = 8000
BROKER_HEAP = "384m"
IDENT = "llmstream"


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise EstateError("java not found (need Java 17+ on PATH or JAVA_HOME)")
    return found


# ---------------------------------------------------------------------- Kafka


class EstateBroker(LocalBroker):
    """One KRaft node (broker and controller) on its host's address, ports `KAFKA_PORT` and
    `CONTROLLER_PORT` there; ``voters`` is the quorum's ``controller.quorum.voters``."""

    def __init__(self, config: BrokerConfig, host: Host, voters: str) -> None:
        super().__init__(config)
        self.host = host
        self.voters = voters

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host.address}:{self.config.port}"

    def estate_properties(self) -> dict[str, str]:
        props = self.config.server_properties()
        listeners = (f"PLAINTEXT://{self.host.address}:{self.config.port},"
                     f"CONTROLLER://{self.host.address}:{self.config.controller_port}")
        props.update({"listeners": listeners, "advertised.listeners": listeners,
                      "controller.quorum.voters": self.voters})
        return props

    def _write_config(self) -> None:
        super()._write_config()  # the directories and log4j2 file, as any local broker's
        lines = [f"{k}={v}" for k, v in self.estate_properties().items()]
        self.properties_file.write_text(
            "# Written by jobs/dev/estate/services.py on every start; edits are overwritten.\n"
            + "\n".join(lines) + "\n")

    def launch(self) -> bool:
        """Start the node inside its host's namespace without waiting; False if it already runs."""
        if self.pid() is not None:
            return False
        jars.ensure("broker")
        self._write_config()
        self._format_storage()
        cmd = [*self.host.exec_prefix(), _java(), f"-Xmx{self.config.heap}", f"-Xms{self.config.heap}",
               "-XX:+UseG1GC", "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={self.log4j_file}",
               "-cp", jars.classpath("broker"), "kafka.Kafka", str(self.properties_file)]
        with self.stdout_file.open("ab") as out:
            # `ip netns exec` enters the namespace and execs java: the pid is the broker's.
            self._process = subprocess.Popen(cmd, cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        self.pid_file.write_text(f"{self._process.pid}\n")
        return True


class EstateKafka(LocalKafkaCluster):
    """The brokers of the estate: node i on ``hosts[i-1]``, replication 3 and min ISR 2 for 3 hosts,
    so the job's transactions go on with one broker host down or cut off."""

    def __init__(self, hosts: list[Host], data_dir: Path, heap: str = BROKER_HEAP) -> None:
        self.hosts = hosts
        super().__init__(ClusterConfig(brokers=len(hosts), data_dir=data_dir, heap=heap))

    def _make_nodes(self) -> list[LocalBroker]:
        voters = ",".join(f"{i}@{host.address}:{CONTROLLER_PORT}" for i, host in enumerate(self.hosts, start=1))
        ports = tuple(CONTROLLER_PORT for _ in self.hosts)
        return [EstateBroker(BrokerConfig(port=KAFKA_PORT, controller_port=CONTROLLER_PORT,
                                          data_dir=self.config.node_dir(i), heap=self.config.heap,
                                          quorum=Quorum(i, ports)), host, voters)
                for i, host in enumerate(self.hosts, start=1)]

    def host_of(self, node_id: int) -> Host:
        return self.hosts[node_id - 1]

    def node_of(self, host: Host) -> int | None:
        for i, candidate in enumerate(self.hosts, start=1):
            if candidate.name == host.name:
                return i
        return None


# ---------------------------------------------------------------------- Flink


@dataclass(frozen=True)
class FlinkLayout:
    """Where the estate's Flink cluster answers and keeps its state (a directory every host sees,
    as a shared file system would be)."""

    jobmanager: Host
    work_dir: Path

    @property
    def rest_url(self) -> str:
        return f"http://{self.jobmanager.address}:{REST_PORT}"

    @property
    def address(self) -> str:
        return f"{self.jobmanager.address}:{REST_PORT}"

    @property
    def checkpoint_dir(self) -> Path:
        return self.work_dir / "checkpoints"

    @property
    def savepoint_dir(self) -> Path:
        return self.work_dir / "savepoints"

    @property
    def lib_dir(self) -> Path:
        return self.work_dir / "lib"

    @property
    def plugins_dir(self) -> Path:
        """``FLINK_PLUGINS_DIR``: Flink's S3 file system, for jobs whose state is on the objects host."""
        return self.work_dir / "plugins"


class FlinkDaemon:
    """A JobManager (``role`` ``jobmanager``) or a TaskManager on ``host``, with its own conf, log,
    pid and tmp dirs under ``<work_dir>/<host>/``."""

    def __init__(self, host: Host, role: str, layout: FlinkLayout, settings: dict[str, Any] | None = None,
                 environment: dict[str, str] | None = None) -> None:
        if role not in ("jobmanager", "taskmanager"):
            raise ValueError(f"role must be jobmanager or taskmanager, got {role!r}")
        self.host = host
        self.role = role
        self.layout = layout
        self.settings = dict(settings or {})
        self.environment = dict(environment or {})
        """More environment of the daemon: the object store's key pair (the AWS standard chain)."""
        self.dir = layout.work_dir / host.name

    @property
    def conf_dir(self) -> Path:
        return self.dir / "conf"

    @property
    def log_dir(self) -> Path:
        return self.dir / "log"

    @property
    def pid_dir(self) -> Path:
        return self.dir / "pid"

    @property
    def daemon(self) -> str:
        """The name Flink's scripts give the daemon (pid and log file names)."""
        return "standalonesession" if self.role == "jobmanager" else "taskexecutor"

    def overrides(self) -> dict[str, Any]:
        jm = self.layout.jobmanager.address
        here = self.host.address
        return {
            "jobmanager.rpc.address": jm,
            "jobmanager.rpc.port": RPC_PORT,
            "jobmanager.bind-host": jm if self.role == "jobmanager" else here,
            "rest.address": jm,
            "rest.bind-address": jm,
            "rest.port": REST_PORT,
            "taskmanager.host": here,
            "taskmanager.bind-host": here,
            "execution.checkpointing.dir": self.layout.checkpoint_dir.as_uri(),
            "execution.checkpointing.savepoint-dir": self.layout.savepoint_dir.as_uri(),
            "io.tmp.dirs": str(self.dir / "tmp"),
            **self.settings,
        }

    def env(self) -> dict[str, str]:
        env = client_env(self.conf_dir, self.log_dir)
        env.update(FLINK_LIB_DIR=str(self.layout.lib_dir), FLINK_PLUGINS_DIR=str(self.layout.plugins_dir),
                   FLINK_PID_DIR=str(self.pid_dir), FLINK_IDENT_STRING=IDENT, **self.environment)
        return env

    def write_conf(self) -> None:
        source = conf_source_dir()
        tmp = self.dir / "conf.new"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("kubernetes"))
        (tmp / "config.yaml").write_text(render_config(source, self.overrides()))
        shutil.rmtree(self.conf_dir, ignore_errors=True)
        tmp.rename(self.conf_dir)
        for sub in (self.log_dir, self.pid_dir, self.dir / "tmp", self.layout.checkpoint_dir,
                    self.layout.savepoint_dir):
            sub.mkdir(parents=True, exist_ok=True)

    def configured(self, key: str) -> Any:
        """``key`` of the config the daemon was last started with; None without one."""
        try:
            return (yaml.safe_load((self.conf_dir / "config.yaml").read_text()) or {}).get(key)
        except (OSError, yaml.YAMLError):
            return None

    def pids(self) -> list[int]:
        try:
            words = (self.pid_dir / f"flink-{IDENT}-{self.daemon}.pid").read_text().split()
        except OSError:
            return []
        return [int(w) for w in words if w.isdigit() and pid_alive(int(w))
                and str(self.conf_dir) in " ".join(cmdline(int(w)))]

    def start(self) -> None:
        """Start the daemon on its host (a no-op while one runs); the caller waits for the REST API."""
        if self.pids():
            return
        self.write_conf()
        (self.pid_dir / f"flink-{IDENT}-{self.daemon}.pid").unlink(missing_ok=True)
        script = flink_home() / "bin" / f"{self.role}.sh"
        proc = subprocess.run([*self.host.exec_prefix(), str(script), "start"], env=self.env(), capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
        if proc.returncode != 0:
            raise EstateError(f"{self.role}.sh start on {self.host.name} failed: {(proc.stdout + proc.stderr)[-2000:]}")

    def stop(self, timeout: float = 20.0) -> None:
        terminate(self.pids(), timeout, f"Flink {self.role} on {self.host.name}")

    def log_file(self) -> Path | None:
        found = sorted(self.log_dir.glob(f"flink-{IDENT}-{self.daemon}-*.log"))
        return found[-1] if found else None


def prepare_flink(layout: FlinkLayout) -> None:
    """The cluster's shared ``lib/`` (the package's jars, flink-python, the Kafka connector) and
    ``plugins/`` (the S3 file system)."""
    write_lib_dir(layout.lib_dir)
    write_plugins_dir(layout.plugins_dir)


def flink_rest(layout: FlinkLayout) -> FlinkRest:
    return FlinkRest(layout.rest_url)


# ---------------------------------------------------------------------- the model server


class ModelServer:
    """The model-server simulator on ``host`` (port `MODEL_PORT`), detached, logging to a file."""

    def __init__(self, host: Host, work_dir: Path, args: list[str]) -> None:
        self.host = host
        self.dir = work_dir / host.name
        self.args = list(args)

    @property
    def base_url(self) -> str:
        return f"http://{self.host.address}:{MODEL_PORT}"

    @property
    def url(self) -> str:
        """The OpenAI-compatible endpoint the job calls."""
        return self.base_url + "/v1"

    @property
    def pid_file(self) -> Path:
        return self.dir / "simulator.pid"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) and "jobs.dev.simulator" in " ".join(cmdline(pid)) else None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return requests.get(self.base_url + "/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def start(self, timeout: float = 30.0) -> None:
        if self.pid() is not None and self.healthy():
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        root = str(jars.repo_root())
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [*self.host.exec_prefix(), sys.executable, "-m", "jobs.dev.simulator",
               "--host", self.host.address, "--port", str(MODEL_PORT), *self.args]
        with (self.dir / "simulator.log").open("ab") as out:
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True, env=env, cwd=root)
        self.pid_file.write_text(f"{process.pid}\n")
        deadline = time.monotonic() + timeout
        while not self.healthy(1.0):
            if process.poll() is not None:
                raise EstateError(f"the model server on {self.host.name} exited {process.returncode} "
                                  f"(log: {self.dir / 'simulator.log'})")
            if time.monotonic() > deadline:
                raise EstateError(f"the model server at {self.base_url} not healthy after {timeout:g} s")
            time.sleep(0.2)

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            terminate([pid], 10, "model server")
        self.pid_file.unlink(missing_ok=True)

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        response = requests.get(self.base_url + "/stats", timeout=timeout)
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats

    def calls(self) -> int:
        """Model calls answered: realtime (``served``) plus requests answered inside provider
        batches (both batch APIs' ``requests_succeeded``)."""
        stats = self.stats()
        batches = stats.get("batches") or {}
        return int(stats["served"]) + sum(int(api.get("requests_succeeded") or 0) for api in batches.values()
                                          if isinstance(api, dict))

    def configure(self, path: str, body: dict[str, Any], timeout: float = 5.0) -> None:
        requests.post(self.base_url + path, json=body, timeout=timeout).raise_for_status()
