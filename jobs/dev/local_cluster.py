"""`llmstream cluster`: a local standalone Flink cluster from the pip package.

The apache-flink wheel is a complete FLINK_HOME (``<site-packages>/pyflink``: ``bin/``,
``lib/``, ``opt/``), so no Flink distribution is downloaded. A cluster here is a work dir
(default ``<repo>/var/flink``, git-ignored) holding:

- ``conf/``: generated from the repo's ``flink-conf/`` at every start: the same files, with
  ``config.yaml`` overridden only in ports and paths (REST and RPC ports, checkpoint,
  savepoint and tmp dirs). So what the tests run is ``flink-conf/`` itself.
- ``lib/`` (``FLINK_LIB_DIR``): links to the package's ``lib/`` jars plus flink-python and the
  Kafka connector, so those load once per cluster, not in every job's classloader (`write_lib_dir`).
- ``plugins/`` (``FLINK_PLUGINS_DIR``): ``s3-fs-hadoop/``, Flink's S3 file system, which loads
  only as a plugin, for jobs whose state is on ``s3://`` (`write_plugins_dir`). Its ``s3.*``
  settings are the cluster's (``llmstream cluster start --setting s3.endpoint=...``), its
  credentials the daemons' environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``).
- ``log/`` (``FLINK_LOG_DIR``), ``pid/`` (``FLINK_PID_DIR``: the daemons' pid files; one per
  cluster, so stopping one cluster never touches another's processes), ``tmp/``,
  ``checkpoints/`` and ``savepoints/``.

Daemons are started with Flink's own ``jobmanager.sh start`` / ``taskmanager.sh start`` and
a cluster counts as up when its REST API answers and the TaskManagers have registered.
Once its REST API answers, it records its address in ``cluster.json`` in the work dir
(`jobs/clients/cluster_address.py`), through which `jobs/launch/submit.py` (``llmstream submit``) and
``llmstream status`` find it.

A highly available cluster (``llmstream cluster start --ha``, ``ClusterConfig(ha=True)``) adds a
ZooKeeper server (`jobs/dev/zookeeper.py`, data in ``zookeeper/``) and a second, standby
JobManager (``jobmanager.sh start localhost <rest port>``, each with its own
``high-availability.jobmanager.port``); its job graphs, checkpoint pointers and leader addresses are
in ZooKeeper, their data in ``ha/`` (``high-availability.storageDir``; an ``s3://`` one with
``--setting high-availability.storageDir=s3://...``). Its record lists both REST addresses, and
`LocalCluster` and every client follow the leader (`jobs/clients/cluster_address.py`).

``llmstream cluster start`` also starts a supervisor (`jobs/dev/cluster_supervisor.py`, pid in
``pid/supervisor.pid``, its record ``supervisor.json``): a TaskManager process that dies, killed or
stopped by Flink after a fatal task error, is started again; ``cluster stop`` stops it first,
``--no-supervisor`` does without. `LocalCluster.start` (the tests') starts none, so a test that
kills a TaskManager decides itself whether one comes back.

`LocalCluster` is the programmatic API (tests use it: kill a TaskManager, read restarts,
cancel, stop with a savepoint); `main` is ``llmstream cluster start|stop|status``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import requests
import yaml

from jobs.clients.cluster_address import ClusterAddress, default_work_dir, leader_of
from jobs.clients.flink_cli import (
    JOB_SCRIPT,
    client_env,
    flink_home,
    python_jar,
    run_job_script,
)
from jobs.clients.flink_cli import flink_conf_dir as conf_source_dir
from jobs.clients.flink_rest import TERMINAL_STATES, ClusterError, FlinkRest
from jobs.dev.processes import children, cmdline, log_tail, terminate
from jobs.dev.zookeeper import ZooKeeper, ZooKeeperConfig
from jobs.runtime import jars
from jobs.runtime.pids import pid_alive, wait_gone
from jobs.runtime.ports import free_ports, port_in_use

log = logging.getLogger("llmstream.cluster")

DEFAULT_REST_PORT = 8081
DEFAULT_RPC_PORT = 6123
DEFAULT_STANDBY_REST_PORT = 8082
DEFAULT_STANDBY_RPC_PORT = 6124
DEFAULT_ZOOKEEPER_PORT = 2181
HA_CLUSTER_ID = "/llmstream"
LEADER_GRANTED = re.compile(r"^(\S+ \S+) .*DispatcherRestEndpoint.* - https?://[^:]+:(\d+) was granted leadership")
SUPERVISOR_MODULE = "jobs.dev.cluster_supervisor"
SUPERVISOR_RECORD = "supervisor.json"
IDENT = "llmstream"  # FLINK_IDENT_STRING: names pid and log files (instead of $USER, unset in containers)

__all__ = [
    "ClusterConfig",
    "ClusterError",
    "LocalCluster",
    "conf_source_dir",
    "default_work_dir",
    "main",
    "render_config",
    "write_lib_dir",
]


PLUGINS = {"s3-fs-hadoop": "s3"}
"""Plugin folder -> pom-free jar set of each plugin the daemons load."""


def write_plugins_dir(target: Path) -> Path:
    """A ``FLINK_PLUGINS_DIR``: one folder per plugin (`PLUGINS`) linking its pinned jars. The S3
    file system must be a plugin on a cluster: it is not loaded from ``lib/`` or ``pipeline.jars``."""
    for folder, set_name in PLUGINS.items():
        jars.ensure(set_name)
        into = target / folder
        into.mkdir(parents=True, exist_ok=True)
        wanted = {p.name: p for p in jars.jars(set_name)}
        for existing in into.iterdir():
            if existing.name not in wanted or existing.resolve() != wanted[existing.name]:
                existing.unlink()
        for name, source in wanted.items():
            if not (into / name).exists():
                (into / name).symlink_to(source)
    return target


def write_lib_dir(target: Path) -> Path:
    """A ``FLINK_LIB_DIR`` for the daemons: links to the package's ``lib/*.jar``, its
    ``opt/flink-python-*.jar`` and the pinned Kafka connector jar.

    flink-python: every PyFlink job needs it on the JobManager (to deserialize its Python
    operators) and the TaskManagers. ``flink run -py`` ships it per job in ``pipeline.jars``,
    but the llmstream job sets ``pipeline.jars`` itself (the connector), replacing that list.

    Both jars on the cluster's classpath, not per job: a job's user classloader is never
    freed here, so whatever a job loads itself stays in metaspace. With flink-python per job a
    TaskManager died of ``OutOfMemoryError: Metaspace`` after a few jobs; with the connector per
    job metaspace still grew with every job (the figures: docs/operations.md, "Running on a
    Flink cluster"). Loaded from ``lib/`` (Flink's own advice for session
    clusters, and what the Flink Docker docs do for flink-python), nearly nothing is per job:
    the job's copy of the connector in ``pipeline.jars`` is shadowed, because
    ``org.apache.flink.*`` classes load parent-first. The pip package itself is left untouched.
    """
    home = flink_home()
    target.mkdir(parents=True, exist_ok=True)
    jars.ensure("connector")
    jars.ensure("metrics")
    # The Prometheus reporter (flink-conf/config.yaml) is loaded by the daemons at start, so from lib/.
    sources = [*sorted((home / "lib").glob("*.jar")), python_jar(), *jars.jars("connector"), *jars.jars("metrics")]
    wanted = {p.name: p for p in sources}
    for existing in target.iterdir():
        if existing.name not in wanted or not existing.exists() or existing.resolve() != wanted[existing.name]:
            existing.unlink()
    for name, source in wanted.items():
        link = target / name
        if not link.exists():
            link.symlink_to(source)
    return target


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten(value, name))
        else:
            out[name] = value
    return out


def render_config(source: Path, overrides: Mapping[str, Any]) -> str:
    """``source``'s config.yaml as flat keys with ``overrides`` applied, as YAML text."""
    data = yaml.safe_load((source / "config.yaml").read_text()) or {}
    settings = _flatten(data)
    settings.update(overrides)
    header = (
        f"# GENERATED by jobs/dev/local_cluster.py from {source / 'config.yaml'} at every cluster start;\n"
        "# edit that file instead. Overridden here (ports and paths only):\n"
        + "".join(f"#   {k}\n" for k in overrides)
    )
    return header + yaml.safe_dump(settings, sort_keys=False, width=1 << 16, default_flow_style=False)


def _read_flat(conf_dir: Path) -> dict[str, Any]:
    try:
        return _flatten(yaml.safe_load((conf_dir / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError):
        return {}


@dataclass(frozen=True)
class ClusterConfig:
    """Where one local cluster lives and listens. ``settings`` are extra Flink overrides (tests)."""

    work_dir: Path = field(default_factory=default_work_dir)
    rest_port: int = DEFAULT_REST_PORT
    rpc_port: int = DEFAULT_RPC_PORT
    conf_source: Path = field(default_factory=conf_source_dir)
    settings: dict[str, Any] = field(default_factory=dict)
    ha: bool = False
    standby_rest_port: int = DEFAULT_STANDBY_REST_PORT
    standby_rpc_port: int = DEFAULT_STANDBY_RPC_PORT
    zookeeper_port: int = DEFAULT_ZOOKEEPER_PORT

    def __post_init__(self) -> None:
        object.__setattr__(self, "work_dir", Path(self.work_dir).expanduser().resolve())
        object.__setattr__(self, "conf_source", Path(self.conf_source).expanduser().resolve())

    @classmethod
    def ephemeral(cls, work_dir: Path, **kwargs: Any) -> ClusterConfig:
        """Free REST and RPC ports (and, with ``ha=True``, the standby's and ZooKeeper's), for tests
        that must not collide with anything else."""
        if kwargs.get("ha"):
            rest, rpc, standby_rest, standby_rpc, zookeeper = free_ports(5)
            kwargs.update(standby_rest_port=standby_rest, standby_rpc_port=standby_rpc, zookeeper_port=zookeeper)
        else:
            rest, rpc = free_ports(2)
        return cls(work_dir=work_dir, rest_port=rest, rpc_port=rpc, **kwargs)

    @classmethod
    def existing(cls, work_dir: Path | None = None) -> ClusterConfig:
        """The config of a cluster started earlier from ``work_dir`` (its ports from its generated
        conf; HA and the standby's ports from its generated conf's ``llmstream.ha.*`` comments)."""
        work = Path(work_dir) if work_dir is not None else default_work_dir()
        flat = _read_flat(work / "conf")
        ha = _read_ha(work / "conf")
        return cls(work_dir=work, rest_port=int(flat.get("rest.port", DEFAULT_REST_PORT)),
                   rpc_port=int(flat.get("high-availability.jobmanager.port")
                                or flat.get("jobmanager.rpc.port", DEFAULT_RPC_PORT)),
                   **ha)

    @property
    def checkpoint_dir(self) -> Path:
        return self.work_dir / "checkpoints"

    @property
    def savepoint_dir(self) -> Path:
        return self.work_dir / "savepoints"

    @property
    def ha_dir(self) -> Path:
        """``high-availability.storageDir`` by default: job graphs and checkpoint metadata of HA."""
        return self.work_dir / "ha"

    @property
    def zookeeper(self) -> ZooKeeperConfig:
        return ZooKeeperConfig(port=self.zookeeper_port, data_dir=self.work_dir / "zookeeper")

    def jobmanagers(self) -> list[tuple[int, int]]:
        """``(REST port, RPC port)`` of each JobManager: the first, then the standby (HA only)."""
        first = (self.rest_port, self.rpc_port)
        return [first, (self.standby_rest_port, self.standby_rpc_port)] if self.ha else [first]

    def overrides(self) -> dict[str, Any]:
        """Everything the generated config.yaml changes from ``flink-conf/``."""
        ha: dict[str, Any] = {}
        if self.ha:
            ha = {
                "high-availability.type": "zookeeper",
                "high-availability.zookeeper.quorum": self.zookeeper.quorum,
                "high-availability.storageDir": self.ha_dir.as_uri(),
                "high-availability.cluster-id": HA_CLUSTER_ID,
                # The first JobManager's; the standby's is given on its command line (`LocalCluster.start`).
                "high-availability.jobmanager.port": str(self.rpc_port),
            }
        return {
            "rest.port": self.rest_port,
            "jobmanager.rpc.port": self.rpc_port,
            "execution.checkpointing.dir": self.checkpoint_dir.as_uri(),
            "execution.checkpointing.savepoint-dir": self.savepoint_dir.as_uri(),
            "io.tmp.dirs": str(self.work_dir / "tmp"),
            **ha,
            **self.settings,
        }

    def ha_comment(self) -> str:
        """The generated config.yaml's trailer that `existing` reads back: the standby's ports and ZooKeeper's."""
        if not self.ha:
            return ""
        return (f"# llmstream.ha.standby_rest_port: {self.standby_rest_port}\n"
                f"# llmstream.ha.standby_rpc_port: {self.standby_rpc_port}\n"
                f"# llmstream.ha.zookeeper_port: {self.zookeeper_port}\n")


@dataclass
class Restart:
    """One TaskManager started again: when (UTC), which pid was gone, which started."""

    at: str
    gone: list[int]
    started: int | None
    error: str = ""


@dataclass
class SupervisorRecord:
    """``supervisor.json``: what the supervisor keeps and what it did."""

    pid: int
    taskmanagers: int
    started_at: str
    restarts: list[Restart] = field(default_factory=list)

    def write(self, work_dir: Path) -> None:
        tmp = work_dir / f"{SUPERVISOR_RECORD}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(work_dir / SUPERVISOR_RECORD)

    @classmethod
    def read(cls, work_dir: Path) -> SupervisorRecord | None:
        try:
            data = json.loads((work_dir / SUPERVISOR_RECORD).read_text())
            return cls(pid=int(data["pid"]), taskmanagers=int(data["taskmanagers"]), started_at=str(data["started_at"]),
                       restarts=[Restart(**r) for r in data.get("restarts", [])])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _read_ha(conf_dir: Path) -> dict[str, Any]:
    """`ClusterConfig.ha_comment` of a generated conf, as `ClusterConfig` keyword arguments ({} if not HA)."""
    try:
        text = (conf_dir / "config.yaml").read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        if line.startswith("# llmstream.ha."):
            key, _, value = line.removeprefix("# llmstream.ha.").partition(":")
            with contextlib.suppress(ValueError):
                found[key.strip()] = int(value)
    return {"ha": True, **found} if found else {}


class LocalCluster(FlinkRest):
    """One standalone cluster: a JobManager and TaskManagers started from ``config.work_dir``."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        super().__init__(f"http://localhost:{self.config.rest_port}")
        self._orphans: list[int] = []
        self._leader = f"localhost:{self.config.rest_port}"
        self.zookeeper = ZooKeeper(self.config.zookeeper) if self.config.ha else None

    # ------------------------------------------------------------------ following the leader
    def rest_addresses(self) -> list[str]:
        """``host:port`` of every JobManager's REST API, the first JobManager's first."""
        return [f"localhost:{rest}" for rest, _ in self.config.jobmanagers()]

    @property
    def rest_url(self) -> str:
        return f"http://{self._leader}"

    def find_leader(self) -> str | None:
        """The REST address of the leading JobManager (it is remembered), or None if none leads."""
        leader = leader_of([self._leader, *(a for a in self.rest_addresses() if a != self._leader)])
        if leader is not None:
            self._leader = leader
        return leader

    def rest(self, path: str, *, method: str = "GET", body: Any = None, timeout: float = 10.0) -> Any:
        """`FlinkRest.rest` on the leading JobManager: on a highly available cluster a call that the
        remembered one refuses (dead, or a standby's 503) is made again on the new leader, if any."""
        try:
            return super().rest(path, method=method, body=body, timeout=timeout)
        except ClusterError:
            before = self._leader
            if not self.config.ha or self.find_leader() in (None, before):
                raise
            return super().rest(path, method=method, body=body, timeout=timeout)

    def _diagnostics(self) -> str:
        return f"; JobManager log: {self.jobmanager_log()}\n{self.log_tail()}"

    # ------------------------------------------------------------------ layout
    @property
    def work_dir(self) -> Path:
        return self.config.work_dir

    @property
    def conf_dir(self) -> Path:
        return self.work_dir / "conf"

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "log"

    @property
    def lib_dir(self) -> Path:
        """``FLINK_LIB_DIR`` of the daemons: the package's lib/ plus flink-python (`write_lib_dir`)."""
        return self.work_dir / "lib"

    @property
    def plugins_dir(self) -> Path:
        """``FLINK_PLUGINS_DIR`` of the daemons (`write_plugins_dir`)."""
        return self.work_dir / "plugins"

    @property
    def pid_dir(self) -> Path:
        return self.work_dir / "pid"

    @property
    def address(self) -> str:
        """``host:port`` for ``flink run -m``: the leading JobManager's REST API."""
        return self._leader

    def _pid_file(self, daemon: str) -> Path:
        return self.pid_dir / f"flink-{IDENT}-{daemon}.pid"

    def env(self) -> dict[str, str]:
        """Environment for Flink's bin scripts and CLI: this cluster's conf, lib, log and pid dirs."""
        env = client_env(self.conf_dir, self.log_dir)
        env.update(FLINK_LIB_DIR=str(self.lib_dir), FLINK_PLUGINS_DIR=str(self.plugins_dir),
                   FLINK_PID_DIR=str(self.pid_dir), FLINK_IDENT_STRING=IDENT)
        return env

    def record_address(self) -> None:
        """Say in the work dir where this cluster answers (`jobs/clients/cluster_address.py`): how
        ``llmstream submit | stop | upgrade | status`` find it without --jobmanager."""
        ClusterAddress(address=self.address, conf_dir=str(self.conf_dir), log_dir=str(self.log_dir),
                       addresses=self.rest_addresses() if self.config.ha else []).write(self.work_dir)

    def write_conf(self) -> None:
        """(Re)generate ``conf/`` from ``flink-conf/`` with this cluster's ports and paths."""
        source = self.config.conf_source
        if not (source / "config.yaml").is_file():
            raise ClusterError(f"{source}/config.yaml not found (set LLMSTREAM_HOME to the repo root)")
        tmp = self.work_dir / "conf.new"
        shutil.rmtree(tmp, ignore_errors=True)
        # flink-conf/kubernetes/ holds the operator's manifests, not Flink settings.
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("kubernetes"))
        (tmp / "config.yaml").write_text(render_config(source, self.config.overrides()) + self.config.ha_comment())
        shutil.rmtree(self.conf_dir, ignore_errors=True)
        tmp.rename(self.conf_dir)
        write_lib_dir(self.lib_dir)
        write_plugins_dir(self.plugins_dir)
        for sub in (self.log_dir, self.pid_dir, self.work_dir / "tmp",
                    self.config.checkpoint_dir, self.config.savepoint_dir,
                    *([self.config.ha_dir] if self.config.ha else [])):
            sub.mkdir(parents=True, exist_ok=True)

    def _script(self, name: str, *args: str, timeout: float = 60) -> str:
        script = flink_home() / "bin" / name
        proc = subprocess.run([str(script), *args], env=self.env(), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            raise ClusterError(f"{name} {' '.join(args)} failed ({proc.returncode}): {out[-2000:]}")
        log.debug("%s %s: %s", name, " ".join(args), out)
        return out

    # ------------------------------------------------------------------ processes
    def _pids(self, daemon: str) -> list[int]:
        try:
            lines = self._pid_file(daemon).read_text().split()
        except OSError:
            return []
        pids = []
        for line in lines:
            with contextlib.suppress(ValueError):
                pid = int(line)
                if pid_alive(pid) and str(self.conf_dir) in " ".join(cmdline(pid)):
                    pids.append(pid)
        return pids

    def jobmanager_pid(self) -> int | None:
        """The JobManager JVM (on a highly available cluster the leader's, else the newest)."""
        if self.config.ha:
            leader = self.leader_pid()
            if leader is not None:
                return leader
        pids = self._pids("standalonesession")
        return pids[-1] if pids else None

    def jobmanager_pids(self) -> dict[int, int]:
        """REST port -> pid of each live JobManager of a highly available cluster (each is started
        with ``rest.port`` on its command line)."""
        found = {}
        for pid in self._pids("standalonesession"):
            for arg in cmdline(pid):
                if arg.startswith("rest.port="):
                    found[int(arg.partition("=")[2])] = pid
        return found

    def leading_rest_port(self) -> int | None:
        """The REST port of the JobManager that leads, from the JobManagers' logs: the newest
        ``DispatcherRestEndpoint - http://127.0.0.1:<port> was granted leadership`` of a live one.
        (The REST API does not tell: a standby's forwards every request to the leader.)"""
        live = self.jobmanager_pids()
        grants: list[tuple[str, int]] = []
        for path in self.log_dir.glob(f"flink-{IDENT}-standalonesession-*.log"):
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    match = LEADER_GRANTED.search(line)
                    if match and int(match.group(2)) in live:
                        grants.append((match.group(1), int(match.group(2))))
        return max(grants)[1] if grants else None

    def leader_pid(self) -> int | None:
        """The leading JobManager's pid (None if none leads)."""
        port = self.leading_rest_port()
        return self.jobmanager_pids().get(port) if port is not None else None

    def kill_jobmanager(self, sig: int = signal.SIGKILL, pid: int | None = None) -> int:
        """Signal a JobManager JVM (the leader by default), as a crash would; returns its pid."""
        target = pid if pid is not None else self.leader_pid()
        if target is None:
            raise ClusterError("no leading JobManager is running")
        os.kill(target, sig)
        wait_gone([target], 10)
        self._forget_pid("standalonesession", target)
        return target

    def start_jobmanager(self, rest_port: int, rpc_port: int) -> None:
        """``jobmanager.sh start`` one JobManager of a highly available cluster on these ports."""
        self._script("jobmanager.sh", "start", "localhost", str(rest_port),
                     "-D", f"high-availability.jobmanager.port={rpc_port}")

    def _answers_at(self, rest_port: int) -> bool:
        """Whether the REST server on ``rest_port`` answers at all (a standby answers 503)."""
        try:
            requests.get(f"http://localhost:{rest_port}/config", timeout=3)
        except requests.RequestException:
            return False
        return True

    def _start_missing_jobmanagers(self, timeout: float) -> None:
        running = self.jobmanager_pids()
        for rest_port, rpc_port in self.config.jobmanagers():
            if rest_port not in running:
                self.start_jobmanager(rest_port, rpc_port)
                self._wait(f"the JobManager's REST server on port {rest_port}",
                           lambda port=rest_port: self._answers_at(port), timeout)

    def taskmanager_pids(self) -> list[int]:
        """Live TaskManager JVMs of this cluster, oldest first."""
        return self._pids("taskexecutor")

    def python_worker_pids(self, taskmanager_pid: int | None = None) -> list[int]:
        """Processes started by the TaskManagers (PyFlink's Python workers)."""
        tms = [taskmanager_pid] if taskmanager_pid is not None else self.taskmanager_pids()
        return [c for tm in tms for c in children(tm)]

    def _forget_pid(self, daemon: str, pid: int) -> None:
        path = self._pid_file(daemon)
        with contextlib.suppress(OSError):
            kept = [p for p in path.read_text().split() if p.strip() != str(pid)]
            path.write_text("".join(f"{p}\n" for p in kept))

    def is_running(self) -> bool:
        return self.jobmanager_pid() is not None and self.overview() is not None

    def _wait_taskmanagers(self, count: int, timeout: float) -> None:
        self._wait(f"{count} registered TaskManager(s) with their slots",
                   lambda: len(self.taskmanager_ids()) >= count, timeout)

    def jobmanager_log(self) -> Path:
        found = sorted(self.log_dir.glob(f"flink-{IDENT}-standalonesession-*.log"))
        return found[-1] if found else self.log_dir / "(no jobmanager log)"

    def taskmanager_logs(self) -> list[Path]:
        return sorted(self.log_dir.glob(f"flink-{IDENT}-taskexecutor-*.log"))

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.jobmanager_log().read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ lifecycle
    def start(self, taskmanagers: int = 1, timeout: float = 120.0) -> None:
        """Start the JobManager and ``taskmanagers`` TaskManagers, or top up a running cluster to that many."""
        if self.jobmanager_pid() is not None:
            if self.zookeeper is not None:
                self.zookeeper.start(timeout=timeout)
                self._start_missing_jobmanagers(timeout)
            self._wait("the REST API", self.overview, timeout)
            self.record_address()
            missing = taskmanagers - len(self.taskmanager_pids())
            for _ in range(max(0, missing)):
                self.add_taskmanager(timeout=timeout)
            return
        ports = [port for jobmanager in self.config.jobmanagers() for port in jobmanager]
        if self.config.ha:
            ports.append(self.config.zookeeper_port)
        for port in ports:
            if port_in_use(port):
                raise ClusterError(f"port {port} on localhost is already in use; pick another "
                                   "(--port / --rpc-port / --standby-port / --standby-rpc-port / --zookeeper-port)")
        self.write_conf()
        try:
            if self.zookeeper is not None:
                self.zookeeper.start(timeout=timeout)
                # The first JobManager alone, so it wins the election; then the standby.
                self.start_jobmanager(*self.config.jobmanagers()[0])
                self._wait("the REST API", self.overview, timeout)
                self._start_missing_jobmanagers(timeout)
            else:
                self._script("jobmanager.sh", "start")
            self._wait("the REST API", self.overview, timeout)
            self.record_address()
            for _ in range(taskmanagers):
                self._script("taskmanager.sh", "start")
            self._wait_taskmanagers(taskmanagers, timeout)
        except BaseException:
            self.stop()
            raise

    def taskmanager_ids(self) -> set[str]:
        """Resource ids of the TaskManagers registered with the JobManager (``/taskmanagers``) whose
        slots it knows: a TaskManager registers first and reports its slots a moment later, and until
        then the cluster has none of them (a `status` in between said "slots 2/2" of two TaskManagers)."""
        return {str(tm["id"]) for tm in self.rest("/taskmanagers").get("taskmanagers", [])
                if int(tm.get("slotsNumber") or 0) > 0}

    def add_taskmanager(self, timeout: float = 120.0) -> int:
        """Start one more TaskManager and wait until it registers; returns its pid.

        Waits for a new resource id rather than a count: right after a crash the dead
        TaskManager is still counted until its heartbeat times out.
        """
        before_pids = set(self.taskmanager_pids())
        before_ids = self.taskmanager_ids()
        self._script("taskmanager.sh", "start")
        self._wait("a new TaskManager to register", lambda: self.taskmanager_ids() - before_ids, timeout)
        new = [p for p in self.taskmanager_pids() if p not in before_pids]
        return new[-1] if new else self.taskmanager_pids()[-1]

    def kill_taskmanager(self, sig: int = signal.SIGKILL, pid: int | None = None) -> int:
        """Signal a TaskManager JVM (the newest by default), as a crash would; returns its pid.

        Only the JVM is signalled, so its Python workers lose their connection and exit on their
        own; `reap_orphans` (and `stop`) kills any that do not.
        """
        pids = self.taskmanager_pids()
        if not pids:
            raise ClusterError("no TaskManager is running")
        target = pid if pid is not None else pids[-1]
        self._orphans.extend(children(target))
        os.kill(target, sig)
        wait_gone([target], 10)
        self._forget_pid("taskexecutor", target)
        return target

    def replace_taskmanager(self, job_id: str, *, start_timeout: float = 120.0, running_timeout: float = 180.0) -> int:
        """SIGKILL the (newest) TaskManager, start a new one and wait until `job_id` runs again: a host
        that loses its TaskManager and a supervisor that starts another, as the fault tests make it.
        Returns the killed pid."""
        killed = self.kill_taskmanager()
        self.add_taskmanager(timeout=start_timeout)
        self.wait_for_job_state(job_id, "RUNNING", timeout=running_timeout)
        return killed

    def reap_orphans(self, grace_s: float = 0.0) -> list[int]:
        """Kill Python workers of killed TaskManagers still alive after ``grace_s``; returns their pids."""
        survivors = wait_gone(self._orphans, grace_s, poll_s=0.2)
        for worker in survivors:
            log.warning("python worker %d outlived its TaskManager; killing it", worker)
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        self._orphans.clear()
        return survivors

    # ------------------------------------------------------------------ the supervisor
    @property
    def supervisor_pid_file(self) -> Path:
        return self.pid_dir / "supervisor.pid"

    def supervisor_pid(self) -> int | None:
        """The live supervisor of this cluster (`jobs/dev/cluster_supervisor.py`), if any."""
        try:
            pid = int(self.supervisor_pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        line = " ".join(cmdline(pid))
        return pid if pid_alive(pid) and SUPERVISOR_MODULE in line and str(self.work_dir) in line else None

    def start_supervisor(self, taskmanagers: int, timeout: float = 30.0) -> int:
        """Start the process that keeps ``taskmanagers`` TaskManagers running (`jobs/dev/cluster_supervisor.py`),
        replacing one that keeps another count; returns its pid."""
        running = self.supervisor_pid()
        if running is not None:
            record = SupervisorRecord.read(self.work_dir)
            if record is not None and record.pid == running and record.taskmanagers == taskmanagers:
                return running
            self.stop_supervisor()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYFLINK_", "_PYFLINK", "FLINK_"))}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / "supervisor.log").open("ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", SUPERVISOR_MODULE, "--work-dir", str(self.work_dir),
                 "--taskmanagers", str(taskmanagers)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                cwd=jars.repo_root(), env=env)
        self.supervisor_pid_file.write_text(f"{process.pid}\n")
        # Until it has said what it keeps, so the status printed next is whole; a supervisor that
        # cannot start fails the start with its log, instead of leaving a cluster nobody watches.
        deadline = time.monotonic() + timeout
        while (record := SupervisorRecord.read(self.work_dir)) is None or record.pid != process.pid:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_tail(self.log_dir / "supervisor.log", 5)
                raise ClusterError(f"the cluster supervisor did not start (exit {process.poll()}): {tail}")
            time.sleep(0.1)
        return process.pid

    def stop_supervisor(self, timeout: float = 10.0) -> bool:
        """Stop the supervisor, if one runs (before the daemons, or it would start them again)."""
        pid = self.supervisor_pid()
        if pid is not None:
            terminate([pid], timeout, "cluster supervisor")
        self.supervisor_pid_file.unlink(missing_ok=True)
        return pid is not None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every daemon of this cluster (SIGKILL after ``timeout``), Python workers included;
        the supervisor first."""
        self.stop_supervisor()
        daemons = [p for d in ("taskexecutor", "standalonesession") for p in self._pids(d)]
        workers = [c for p in daemons for c in children(p)]
        terminate(daemons, timeout, "Flink daemon")
        terminate(workers, 1.0, "python worker")
        for daemon in ("taskexecutor", "standalonesession"):
            self._pid_file(daemon).unlink(missing_ok=True)
        self.reap_orphans()
        if self.zookeeper is not None:
            self.zookeeper.stop(timeout)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs
    def submit(self, config_path: str | os.PathLike[str], *, savepoint: str | None = None,
               state_dir: str | None = None, timeout: float = 180.0, script: str = JOB_SCRIPT) -> str:
        """``flink run -d`` the llmstream job (or another job ``script`` of the repository) with
        ``config_path``; returns the job id (no preflight, no automatic resume: ``savepoint`` is
        what it restores)."""
        return run_job_script(config_path, self.address, env=self.env(), savepoint=savepoint,
                              state_dir=state_dir, timeout=timeout, script=script)


# ---------------------------------------------------------------------- command line


def _status_text(cluster: LocalCluster) -> tuple[bool, str]:
    pid = cluster.jobmanager_pid()
    overview = cluster.overview()
    if pid is None and overview is None:
        return False, f"cluster: not running (work dir {cluster.work_dir})"
    if overview is None:
        return False, f"cluster: JobManager pid {pid} runs but its REST API at {cluster.rest_url} does not answer"
    if cluster.config.ha:
        live = cluster.jobmanager_pids()
        leading = cluster.leading_rest_port()
        roles = ", ".join(
            f"{'leader' if rest == leading else 'standby'} "
            f"{'pid ' + str(live[rest]) if rest in live else 'not running'} REST :{rest}"
            for rest, _ in cluster.config.jobmanagers())
        zookeeper = cluster.zookeeper
        zk = (f"ZooKeeper {zookeeper.quorum} pid {zookeeper.pid()}" if zookeeper is not None and zookeeper.ready()
              else "ZooKeeper not serving")
        jobmanagers = f"  jobmanagers: {len(live)} ({roles}; {zk}, Flink {overview.get('flink-version')})"
    else:
        jobmanagers = f"  jobmanagers: 1 (pid {pid}, Flink {overview.get('flink-version')})"
    lines = [
        f"cluster: running, web UI {cluster.rest_url} (work dir {cluster.work_dir})",
        jobmanagers,
        (f"  taskmanagers: {overview.get('taskmanagers')} (pids {cluster.taskmanager_pids()}), "
         f"slots {overview.get('slots-available')}/{overview.get('slots-total')} free"),
        _supervisor_line(cluster),
        (f"  jobs: {overview.get('jobs-running')} running, {overview.get('jobs-finished')} finished, "
         f"{overview.get('jobs-cancelled')} cancelled, {overview.get('jobs-failed')} failed"),
    ]
    for job in cluster.jobs():
        if job.get("state") not in TERMINAL_STATES:
            lines.append(f"    {job['jid']}  {job['state']:<10} {job['name']}  "
                         f"({int(job.get('duration', 0)) // 1000} s)")
    return True, "\n".join(lines)


def _supervisor_line(cluster: LocalCluster) -> str:
    pid = cluster.supervisor_pid()
    if pid is None:
        return "  supervisor: not running (a TaskManager that dies is not started again)"
    record = SupervisorRecord.read(cluster.work_dir)
    if record is None or record.pid != pid:
        return f"  supervisor: pid {pid}"
    line = f"  supervisor: pid {pid}, keeps {record.taskmanagers} TaskManager(s) running; "
    if not record.restarts:
        return line + "none restarted"
    last = record.restarts[-1]
    what = f"started pid {last.started}" if last.started is not None else f"could not start one: {last.error}"
    gone = f"pid {', '.join(map(str, last.gone))} gone, " if last.gone else ""
    return line + f"restarted {len(record.restarts)} (last at {last.at}: {gone}{what})"


DESCRIPTION = "A local standalone Flink cluster from the pip package."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``llmstream cluster start|stop|status`` arguments (dests ``cluster_*`` where they could clash)."""
    parser.add_argument("cluster_command", metavar="{start,stop,status}", choices=["start", "stop", "status"])
    parser.add_argument("--taskmanagers", type=int, default=1,
                        help="start: TaskManagers to run (a running cluster is topped up to this many)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"REST / web UI port (default {DEFAULT_REST_PORT}, or the running cluster's)")
    parser.add_argument("--rpc-port", type=int, default=None, help=f"JobManager RPC port (default {DEFAULT_RPC_PORT})")
    parser.add_argument("--ha", action="store_true",
                        help="start: a highly available cluster: ZooKeeper and a standby JobManager that takes "
                             "over the running jobs when the leader dies")
    parser.add_argument("--standby-port", type=int, default=None,
                        help=f"--ha: the standby JobManager's REST port (default {DEFAULT_STANDBY_REST_PORT})")
    parser.add_argument("--standby-rpc-port", type=int, default=None,
                        help=f"--ha: the standby JobManager's RPC port (default {DEFAULT_STANDBY_RPC_PORT})")
    parser.add_argument("--zookeeper-port", type=int, default=None,
                        help=f"--ha: ZooKeeper's port on 127.0.0.1 (default {DEFAULT_ZOOKEEPER_PORT})")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="conf, logs, pids, checkpoints (default <repo>/var/flink)")
    parser.add_argument("--no-supervisor", dest="supervise", action="store_false",
                        help="start: no supervisor process (by default one starts a TaskManager again "
                             "whenever one dies; `cluster stop` stops it)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for start (default 120)")
    parser.add_argument("--setting", dest="cluster_settings", action="append", default=[], metavar="KEY=VALUE",
                        help="start: a Flink setting of the cluster, e.g. s3.endpoint=http://127.0.0.1:9300 for "
                             "state on S3 (repeatable; credentials belong in the environment, not here)")


def _given(args: argparse.Namespace, name: str, default: int) -> int:
    value = getattr(args, name, None)
    return int(value) if value is not None else default


def run(args: argparse.Namespace) -> int:
    """Execute parsed `add_arguments` flags; status: 0 running, 1 not."""
    existing = ClusterConfig.existing(args.work_dir)
    config = ClusterConfig(
        work_dir=existing.work_dir,
        rest_port=args.port if args.port is not None else existing.rest_port,
        rpc_port=args.rpc_port if args.rpc_port is not None else existing.rpc_port,
        settings=dict(item.partition("=")[::2] for item in args.cluster_settings),
        ha=existing.ha or bool(getattr(args, "ha", False)),
        standby_rest_port=_given(args, "standby_port", existing.standby_rest_port),
        standby_rpc_port=_given(args, "standby_rpc_port", existing.standby_rpc_port),
        zookeeper_port=_given(args, "zookeeper_port", existing.zookeeper_port),
    )
    cluster = LocalCluster(config)
    try:
        if args.cluster_command == "start":
            started = time.monotonic()
            cluster.start(taskmanagers=args.taskmanagers, timeout=args.timeout)
            if args.supervise:
                cluster.start_supervisor(max(args.taskmanagers, len(cluster.taskmanager_pids())))
            else:
                cluster.stop_supervisor()
            print(f"cluster: up in {time.monotonic() - started:.1f} s; logs in {cluster.log_dir}")
            print(_status_text(cluster)[1])
            return 0
        if args.cluster_command == "stop":
            running = (bool(cluster._pids("standalonesession")) or bool(cluster.taskmanager_pids())
                       or cluster.supervisor_pid() is not None
                       or (cluster.zookeeper is not None and cluster.zookeeper.pid() is not None))
            cluster.stop()
            print("cluster: stopped" if running else f"cluster: not running (work dir {cluster.work_dir})")
            return 0
        running, text = _status_text(cluster)
        print(text)
        return 0 if running else 1
    except (ClusterError, OSError, subprocess.SubprocessError) as err:
        print(f"cluster: error: {err}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmstream cluster", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
