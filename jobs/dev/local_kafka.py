"""A single-node KRaft Kafka 4.1.1 broker on loopback, for tests, the demo and the benchmarks.

The broker runs from the jars pinned in ``pom-free/`` (no Kafka distribution, no
Docker), detached from the Python process that starts it, so ``llmstream kafka
start`` can return while the broker keeps serving; ``stop`` finds it again via the
pid file in the data dir. Everything lives under the data dir: ``server.properties``,
``log4j2.properties``, ``broker.pid``, ``data/`` (``log.dirs``) and ``logs/``.

``start --secure`` runs the same broker with TLS, SASL/SCRAM, mutual TLS and ACLs instead of
PLAINTEXT: `jobs/dev/secure_kafka.py`; the command line of both is `jobs/dev/kafka_cli.py`. Here, `BrokerConfig` only carries its extra listeners and
`LocalBroker` has two hooks a subclass fills in (format-time arguments, the readiness check).

``start --brokers N`` is `LocalKafkaCluster`: N such nodes, each broker and controller, in one KRaft
quorum (`Quorum`), with replicated internal topics and replication 3 (N < 3: N) for new topics, so
a node can be killed under a running job; `kill` and `restart` do that to one node, `leader` finds
the node to kill.

Topics, produce and read_committed reads are `jobs/clients/kafka_admin.py`'s.
"""
from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from jobs.clients import kafka_admin
from jobs.clients.kafka_admin import answers
from jobs.dev.processes import cmdline, log_tail, terminate
from jobs.runtime import jars
from jobs.runtime.pids import pid_alive, wait_gone
from jobs.runtime.ports import free_ports, port_in_use
from udfs.errors import LLMStreamError

log = logging.getLogger(__name__)

DEFAULT_PORT = 9092
DEFAULT_HEAP = "512m"
DEFAULT_CLUSTER_PORT = 9292
"""A cluster's node i (from 0) listens from ``port + PORT_STRIDE * i`` on: clear of a single broker's 9092."""
CLUSTER_HEAP = "384m"
"""Per node of a cluster: three nodes at 384 MB ran a job with a node killed -9 here (docs/operations.md)."""
PORT_STRIDE = 10
_TOPIC_ALREADY_EXISTS = 36
_UNKNOWN_TOPIC_OR_PARTITION = 3

__all__ = [
    "BrokerConfig",
    "BrokerError",
    "ClusterConfig",
    "Listener",
    "LocalBroker",
    "LocalKafkaCluster",
    "Quorum",
    "default_cluster_dir",
    "default_data_dir",
    "new_cluster_id",
]


class BrokerError(LLMStreamError, RuntimeError):
    """The local broker could not be started, stopped or found; the message says why (log tail included)."""


def default_data_dir() -> Path:
    return jars.repo_root() / "var" / "kafka"


def default_cluster_dir() -> Path:
    return jars.repo_root() / "var" / "kafka-cluster"


def new_cluster_id() -> str:
    """A KRaft cluster id as ``StorageTool random-uuid`` prints it (16 random bytes, URL-safe base64
    without padding, never starting with '-'), without starting a JVM for it."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


@dataclass(frozen=True)
class Quorum:
    """One node's place in a KRaft cluster of ``len(voters)`` nodes, each broker and controller.

    ``voters`` are the controller ports of nodes 1, 2, ... (``controller.quorum.voters``, a static
    quorum: every node knows every voter from the start). New topics get replication
    ``min(3, nodes)`` and ``min.insync.replicas`` one less (at least 1): with 3 nodes, RF 3 and
    min ISR 2, so acks=all writes, the job's transactions included, go on while one node is down.
    """

    node_id: int
    voters: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.voters) < 2:
            raise ValueError(f"a quorum needs at least 2 nodes, got {len(self.voters)}")
        if not 1 <= self.node_id <= len(self.voters):
            raise ValueError(f"node_id must be 1..{len(self.voters)}, got {self.node_id}")

    @property
    def replication(self) -> int:
        return min(3, len(self.voters))

    @property
    def min_insync(self) -> int:
        return max(1, self.replication - 1)

    def voters_property(self) -> str:
        return ",".join(f"{node}@127.0.0.1:{port}" for node, port in enumerate(self.voters, start=1))


@dataclass(frozen=True)
class Listener:
    """A client listener on 127.0.0.1 besides the main one: its name, port and security protocol."""

    name: str
    port: int
    protocol: str


@dataclass(frozen=True)
class BrokerConfig:
    """Where and how one local broker runs.

    ``transaction.max.timeout.ms`` is set explicitly to the broker default (15 min)
    because Flink's exactly-once sink must use a ``transaction.timeout.ms`` no larger
    than it; override it through ``extra_properties`` if a job needs longer.
    ``controller_port`` 0 means ``port + 1``. ``listener`` names the listener on ``port``, which
    is also its security protocol and the inter-broker listener; ``extra_listeners`` are more
    client listeners (their TLS/SASL settings go in ``extra_properties``). ``quorum`` makes the broker
    one node of a cluster (`Quorum`; its voter entry must be ``controller_port``); without it, a
    single node whose internal topics have replication 1.
    """

    port: int = DEFAULT_PORT
    controller_port: int = 0
    data_dir: Path = field(default_factory=default_data_dir)
    heap: str = DEFAULT_HEAP
    extra_properties: dict[str, str] = field(default_factory=dict)
    listener: str = "PLAINTEXT"
    extra_listeners: tuple[Listener, ...] = ()
    quorum: Quorum | None = None

    def __post_init__(self) -> None:
        if not self.controller_port:
            object.__setattr__(self, "controller_port", self.port + 1)
        if self.quorum is not None and self.quorum.voters[self.quorum.node_id - 1] != self.controller_port:
            raise ValueError(f"node {self.quorum.node_id}'s voter port {self.quorum.voters[self.quorum.node_id - 1]} "
                             f"is not its controller port {self.controller_port}")
        if len(set(self.ports)) != len(self.ports):
            raise ValueError(f"every port must differ (got {', '.join(map(str, self.ports))})")
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port the broker listens on: the main listener's, the extra ones', the controller's."""
        return (self.port, *(extra.port for extra in self.extra_listeners), self.controller_port)

    @classmethod
    def ephemeral(cls, data_dir: Path, **kwargs: Any) -> BrokerConfig:
        """A config on two fresh free ports, for tests and benchmarks that must not collide."""
        port, controller_port = free_ports(2)
        return cls(port=port, controller_port=controller_port, data_dir=data_dir, **kwargs)

    def server_properties(self) -> dict[str, str]:
        data = self.data_dir / "data"
        names = [(self.listener, self.port, self.listener)] + [
            (extra.name, extra.port, extra.protocol) for extra in self.extra_listeners
        ]
        listeners = ",".join(
            [f"{name}://127.0.0.1:{port}" for name, port, _ in names] + [f"CONTROLLER://127.0.0.1:{self.controller_port}"]
        )
        protocols = ",".join(["CONTROLLER:PLAINTEXT"] + [f"{name}:{protocol}" for name, _, protocol in names])
        quorum = self.quorum
        replication, min_insync = (quorum.replication, quorum.min_insync) if quorum else (1, 1)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(quorum.node_id if quorum else 1),
            **({"controller.quorum.voters": quorum.voters_property()} if quorum
               else {"controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}"}),
            "listeners": listeners,
            "advertised.listeners": listeners,
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": self.listener,
            "listener.security.protocol.map": protocols,
            "log.dirs": str(data),
            "offsets.topic.replication.factor": str(replication),
            "transaction.state.log.replication.factor": str(replication),
            "transaction.state.log.min.isr": str(min_insync),
            "share.coordinator.state.topic.replication.factor": str(replication),
            "share.coordinator.state.topic.min.isr": str(min_insync),
            "group.initial.rebalance.delay.ms": "0",
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            "transaction.max.timeout.ms": "900000",
            # The log cleaner allocates its whole dedupe buffer (128 MB by default) on the heap at
            # start-up, one humongous array: with the tests' 256 MB heaps it once failed with
            # OutOfMemoryError and the broker exited. A local broker's compacted topics (consumer
            # offsets, transaction state) are small; 16 MB holds ~700,000 keys.
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
        }
        if quorum:
            props["default.replication.factor"] = str(replication)
            props["min.insync.replicas"] = str(min_insync)
        props.update({str(k): str(v) for k, v in self.extra_properties.items()})
        return props


_LOG4J2 = """\
# Written by jobs/dev/local_kafka.py: the broker logs to a rolling file only, never stdout.
status = warn
name = llmstream-local-kafka
# Kafka logs its own shutdown from a JVM hook; log4j's hook would close the file first.
shutdownHook = disable
appender.file.type = RollingFile
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.filePattern = {log}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
"""


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise BrokerError("java not found (need Java 17+ on PATH or JAVA_HOME)")
    return found


class LocalBroker:
    """Start, stop and query one broker whose state lives in ``config.data_dir``."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self._process: subprocess.Popen[bytes] | None = None
        self.cluster_id: str | None = None
        """The id to format the storage with (a cluster's nodes share one); None: a new one."""

    @property
    def data_dir(self) -> Path:
        return self.config.data_dir

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.config.port}"

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def log4j_file(self) -> Path:
        return self.data_dir / "log4j2.properties"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "logs" / "server.log"

    @property
    def stdout_file(self) -> Path:
        return self.data_dir / "logs" / "stdout.log"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    def pid(self) -> int | None:
        """The pid from the pid file if that process is alive and is this data dir's broker."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if not pid_alive(pid):
            return None
        cmd = cmdline(pid)
        if cmd and not ("kafka.Kafka" in cmd and str(self.properties_file) in cmd):
            return None
        return pid

    def is_ready(self, timeout_s: float = 3.0) -> bool:
        """True if our process is alive and the broker answers a metadata request."""
        return self.pid() is not None and self._answers(timeout_s)

    def _answers(self, timeout_s: float) -> bool:
        """Whether the broker answers a metadata request; a secured broker asks with credentials."""
        return answers(self.bootstrap_servers, timeout_s)

    def status(self) -> dict[str, Any]:
        pid = self.pid()
        return {
            "running": pid is not None,
            "ready": pid is not None and self._answers(3.0),
            "pid": pid,
            "bootstrap": self.bootstrap_servers,
            "controller": f"127.0.0.1:{self.config.controller_port}",
            "data_dir": str(self.data_dir),
            "log_file": str(self.log_file),
        }

    def _write_config(self) -> None:
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        lines = [f"{k}={v}" for k, v in self.config.server_properties().items()]
        self.properties_file.write_text(
            "# Written by jobs/dev/local_kafka.py on every start; edits are overwritten.\n" + "\n".join(lines) + "\n"
        )
        self.log4j_file.write_text(_LOG4J2.format(log=self.log_file))

    def _written_listeners(self) -> str | None:
        with contextlib.suppress(OSError):
            for line in self.properties_file.read_text().splitlines():
                if line.startswith("listeners="):
                    return line.split("=", 1)[1]
        return None

    def _java_base(self) -> list[str]:
        return [_java(), f"-Dlog4j2.configurationFile={self.log4j_file}", "-cp", jars.classpath("broker")]

    def _format_args(self) -> list[str]:
        """More ``StorageTool format`` arguments (e.g. ``--add-scram``); they may hold secrets."""
        return []

    def _format_storage(self) -> None:
        """Format ``log.dirs`` once; a formatted dir keeps its cluster id across restarts.

        ``_format_args`` reach the tool through an argument file (its ``@file``, one argument a
        line, mode 0600, removed afterwards), so no password shows in the process list.
        """
        if (self.data_dir / "data" / "meta.properties").exists():
            return
        base = [*self._java_base(), "-Xmx256m", "kafka.tools.StorageTool"]
        cluster_id = self.cluster_id
        if cluster_id is None:
            uuid_proc = subprocess.run([*base, "random-uuid"], check=False, capture_output=True, text=True,
                                       timeout=120)
            cluster_id = uuid_proc.stdout.strip().splitlines()[-1] if uuid_proc.stdout.strip() else ""
            if uuid_proc.returncode != 0 or not cluster_id:
                raise BrokerError(f"kafka StorageTool random-uuid failed:\n{uuid_proc.stdout}{uuid_proc.stderr}")
        # A static quorum (controller.quorum.voters) is formatted without --standalone.
        standalone = [] if self.config.quorum else ["--standalone"]
        cmd = [*base, "format", "-t", cluster_id, "-c", str(self.properties_file), *standalone]
        extra = self._format_args()
        args_file = self.data_dir / "format.args"
        if extra:
            if any("\n" in arg for arg in extra):
                raise BrokerError("a StorageTool format argument holds a newline")
            args_file.unlink(missing_ok=True)
            fd = os.open(args_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write("".join(f"{arg}\n" for arg in extra))
            cmd.append(f"@{args_file}")
        try:
            fmt = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
        finally:
            args_file.unlink(missing_ok=True)
        if fmt.returncode != 0:
            raise BrokerError(f"kafka StorageTool format failed:\n{fmt.stdout}{fmt.stderr}")

    def start(self, timeout: float = 60) -> None:
        """Start the broker and wait until it answers; a no-op if it already runs.

        On timeout or early exit the process is killed and the error carries the
        last lines of the broker log, which is where the reason will be.
        """
        if not self.launch():
            self._wait_ready(timeout)
            return
        self._wait_launched(timeout)

    def launch(self) -> bool:
        """Start the broker's process without waiting for it (a cluster's nodes wait for each
        other's quorum); False if it already runs (with these listeners). Then `_wait_launched`."""
        if self.pid() is not None:
            running = self._written_listeners()
            if running != self.config.server_properties()["listeners"]:
                raise BrokerError(
                    f"a broker for {self.data_dir} already runs with listeners {running}; stop it first"
                )
            return False
        for port in self.config.ports:
            if port_in_use(port):
                raise BrokerError(f"port {port} on 127.0.0.1 is already in use; pick another (--port)")
        jars.ensure("broker")
        self._write_config()
        self._format_storage()
        cmd = [
            _java(), f"-Xmx{self.config.heap}", f"-Xms{self.config.heap}",
            "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.log4j_file}",
            "-cp", jars.classpath("broker"),
            "kafka.Kafka", str(self.properties_file),
        ]
        with self.stdout_file.open("ab") as out:
            self._process = subprocess.Popen(
                cmd, cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid_file.write_text(f"{self._process.pid}\n")
        return True

    def _wait_launched(self, timeout: float) -> None:
        """`_wait_ready` for a process `launch` started; on failure it is killed and forgotten."""
        try:
            self._wait_ready(timeout)
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        self._reap()
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> int | None:
        """SIGKILL the broker (no controlled shutdown: a crash), wait until it is gone; returns its pid."""
        pid = self._process.pid if self._process is not None and self._process.poll() is None else self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if wait_gone([pid], 30):
                raise BrokerError(f"kafka broker pid {pid} survived SIGKILL")
        self._reap()
        self.pid_file.unlink(missing_ok=True)
        return pid

    def _alive(self) -> bool:
        """Our broker runs: by its Popen handle when this object started it (right after the fork,
        /proc still shows the parent's command line, so the pid-file check would say no)."""
        if self._process is not None:
            return self._process.poll() is None
        return self.pid() is not None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self._alive():
                raise BrokerError(
                    f"kafka broker exited during startup; last lines of {self.log_file}:\n{self._log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerError(
                    f"kafka broker not ready after {timeout:g}s at {self.bootstrap_servers}; "
                    f"last lines of {self.log_file}:\n{self._log_tail()}"
                )
            if self._answers(min(3.0, max(remaining, 0.5))):
                return
            time.sleep(0.3)

    def _log_tail(self) -> str:
        tail = log_tail(self.log_file)
        stdout = log_tail(self.stdout_file).strip()
        return tail + (f"\n--- {self.stdout_file.name}:\n{stdout}" if stdout else "")

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM for a clean controlled shutdown, SIGKILL if it does not finish in time."""
        pid = self.pid()
        if pid is not None and terminate([pid], timeout, "kafka broker"):
            raise BrokerError(f"kafka broker pid {pid} survived SIGKILL")
        self._reap()
        self.pid_file.unlink(missing_ok=True)

    def _reap(self) -> None:
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
            self._process = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()




# ---------------------------------------------------------------------- several nodes


@dataclass(frozen=True)
class ClusterConfig:
    """Where and how a cluster of ``brokers`` local nodes runs: node i (1..n) in ``data_dir/node-<i>``,
    its ports ``ports[i-1]`` if given, else consecutive from ``port + PORT_STRIDE * (i-1)``, in the order
    its node config takes them (plain: listener, controller; `SecureKafkaCluster`: four)."""

    brokers: int = 3
    port: int = DEFAULT_CLUSTER_PORT
    data_dir: Path = field(default_factory=default_cluster_dir)
    heap: str = CLUSTER_HEAP
    ports: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.brokers < 2:
            raise ValueError(f"a cluster needs at least 2 brokers, got {self.brokers}")
        if self.ports and len(self.ports) != self.brokers:
            raise ValueError(f"ports for {len(self.ports)} nodes, but {self.brokers} brokers")
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())

    @classmethod
    def ephemeral(cls, data_dir: Path, brokers: int = 3, per_node: int = 2, **kwargs: Any) -> ClusterConfig:
        """Fresh free ports (``per_node`` a node), for tests that must not collide."""
        free = free_ports(brokers * per_node)
        ports = tuple(tuple(free[i * per_node:(i + 1) * per_node]) for i in range(brokers))
        return cls(brokers=brokers, data_dir=data_dir, ports=ports, **kwargs)

    def node_ports(self, per_node: int) -> list[tuple[int, ...]]:
        if self.ports:
            if any(len(p) != per_node for p in self.ports):
                raise ValueError(f"every node needs {per_node} ports")
            return [tuple(p) for p in self.ports]
        return [tuple(self.port + PORT_STRIDE * i + k for k in range(per_node)) for i in range(self.brokers)]

    def node_dir(self, node_id: int) -> Path:
        return self.data_dir / f"node-{node_id}"

    def node_configs(self) -> list[BrokerConfig]:
        """Each node's `BrokerConfig` (PLAINTEXT listener, controller port, `Quorum`)."""
        ports = self.node_ports(2)
        voters = tuple(controller for _, controller in ports)
        return [BrokerConfig(port=port, controller_port=controller, data_dir=self.node_dir(node), heap=self.heap,
                             quorum=Quorum(node, voters))
                for node, (port, controller) in enumerate(ports, start=1)]


class LocalKafkaCluster:
    """Start, stop and query ``len(nodes)`` local KRaft nodes as one cluster; kill and restart one of them.

    Each node is a `LocalBroker` and also a controller (``controller.quorum.voters`` of all of them):
    three JVMs rather than three brokers plus a controller quorum of its own, which would be
    three more on a laptop; a combined quorum of three survives any one node's death, the fault
    the tests inflict. The nodes share one cluster id, kept in ``data_dir/cluster.id``.
    """

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.nodes: list[LocalBroker] = self._make_nodes()

    def _make_nodes(self) -> list[LocalBroker]:
        return [LocalBroker(c) for c in self.config.node_configs()]

    @property
    def data_dir(self) -> Path:
        return self.config.data_dir

    @property
    def bootstrap_servers(self) -> str:
        """Every node's listener, so a client still bootstraps with any one node down."""
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def client_args(self) -> dict[str, Any]:
        """kafka-python arguments reaching the cluster (a subclass adds its security)."""
        return {"bootstrap_servers": self.bootstrap_servers}

    def node(self, node_id: int) -> LocalBroker:
        """The node whose ``node.id`` is ``node_id`` (1..n)."""
        if not 1 <= node_id <= len(self.nodes):
            raise ValueError(f"no node {node_id} (nodes are 1..{len(self.nodes)})")
        return self.nodes[node_id - 1]

    def pids(self) -> list[int | None]:
        return [node.pid() for node in self.nodes]

    def _cluster_id(self) -> str:
        path = self.data_dir / "cluster.id"
        with contextlib.suppress(OSError):
            text = path.read_text().strip()
            if text:
                return text
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cluster_id = new_cluster_id()
        path.write_text(cluster_id + "\n")
        return cluster_id

    def _prepare(self) -> None:
        """Before any node launches (a subclass makes its shared certificates here)."""

    def start(self, timeout: float = 120) -> None:
        """Launch every node not running yet, together (each waits for a quorum of the others), and
        wait until all answer and the cluster lists every broker; a no-op for a running cluster.

        On failure the nodes this call launched are killed; the error names the node and carries its log tail.
        """
        jars.ensure("broker")
        self._prepare()
        cluster_id = self._cluster_id()
        for node in self.nodes:
            node.cluster_id = cluster_id
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            futures = [pool.submit(node.launch) for node in self.nodes]
        launched = [node for node, done in zip(self.nodes, futures) if done.exception() is None and done.result()]
        failed = [err for err in (done.exception() for done in futures) if err is not None]
        try:
            if failed:
                raise failed[0]
            deadline = time.monotonic() + timeout
            for node in self.nodes:
                node._wait_ready(max(1.0, deadline - time.monotonic()))
            self.wait_for_brokers(len(self.nodes), max(1.0, deadline - time.monotonic()))
        except BaseException:
            for node in launched:
                node._discard()
            raise

    def wait_for_brokers(self, count: int, timeout: float) -> None:
        """Until the cluster's metadata lists ``count`` live brokers."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            with contextlib.suppress(Exception):
                with kafka_admin.admin(self.client_args(), timeout_s=min(10.0, timeout)) as client:
                    seen = len(client.describe_cluster().get("brokers") or [])
                if seen >= count:
                    return
            if time.monotonic() >= deadline:
                raise BrokerError(f"the cluster at {self.bootstrap_servers} lists {seen} of {count} brokers "
                                  f"after {timeout:g} s")
            time.sleep(0.3)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM every node at once (one by one, the last ones would wait for a quorum that is leaving),
        SIGKILL those still running after ``timeout``."""
        pids = [pid for pid in self.pids() if pid is not None]
        if pids and terminate(pids, timeout, "kafka broker"):
            raise BrokerError(f"kafka brokers {pids} survived SIGKILL")
        for node in self.nodes:
            node._reap()
            node.pid_file.unlink(missing_ok=True)

    def kill(self, node_id: int) -> int | None:
        """SIGKILL one node (a crash: no controlled shutdown); returns its pid."""
        return self.node(node_id).kill()

    def restart(self, node_id: int, timeout: float = 120) -> None:
        """Start a killed or stopped node again on its ports and data, and wait until the cluster lists it."""
        self.node(node_id).start(timeout)
        self.wait_for_brokers(len(self.nodes), timeout)

    def status(self) -> dict[str, Any]:
        nodes = [node.status() for node in self.nodes]
        return {
            "running": all(n["running"] for n in nodes),
            "ready": all(n["ready"] for n in nodes),
            "bootstrap": self.bootstrap_servers,
            "data_dir": str(self.data_dir),
            "nodes": nodes,
        }

    # -- topics

    def create_topics(self, names: list[str], partitions: int = 1, *, timeout_s: float = 60.0) -> None:
        """Create topics with the cluster's default replication (replication factor -1) and wait for their leaders."""
        with kafka_admin.admin(self.client_args(), timeout_s) as client:
            result = client.create_topics(
                {name: {"num_partitions": partitions, "replication_factor": -1} for name in names},
                timeout_ms=int(timeout_s * 1000), raise_errors=False)
            for topic in result["topics"]:
                if topic["error_code"] and topic["error_code"] != _TOPIC_ALREADY_EXISTS:
                    raise BrokerError(f"create topic {topic['name']}: {topic.get('error_message')}")
            client.wait_for_topics(names, timeout_ms=int(timeout_s * 1000))

    def partition(self, topic: str, partition: int = 0, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """What the cluster's metadata says of one partition: ``leader_id``, ``replica_nodes``, ``isr_nodes``."""
        with kafka_admin.admin(self.client_args(), timeout_s) as client:
            described = client.describe_topics([topic])
        for info in described:
            if info.get("name") == topic and not info.get("error_code"):
                for part in info["partitions"]:
                    if part["partition_index"] == partition:
                        return dict(part)
        raise BrokerError(f"no partition {topic}-{partition} in the cluster's metadata")

    def leader(self, topic: str, partition: int = 0) -> int:
        """The node id leading ``topic``-``partition`` (-1 while it has none)."""
        return int(self.partition(topic, partition)["leader_id"])

    def wait_in_sync(self, topic: str, partition: int = 0, timeout: float = 120) -> list[int]:
        """Until every replica of the partition is in sync again (e.g. a restarted node caught up);
        returns the in-sync replicas."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                part = self.partition(topic, partition)
                if sorted(part["isr_nodes"]) == sorted(part["replica_nodes"]):
                    return list(part["isr_nodes"])
            if time.monotonic() >= deadline:
                raise BrokerError(f"{topic}-{partition} not fully in sync after {timeout:g} s")
            time.sleep(0.5)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
