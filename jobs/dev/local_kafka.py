"""A single-node KRaft Kafka 4.1.1 broker on loopback, for tests, the demo and the benchmarks.

The broker runs from the jars pinned in ``pom-free/`` (no Kafka distribution, no
Docker), detached from the Python process that starts it, so ``llmstream kafka
start`` can return while the broker keeps serving; ``stop`` finds it again via the
pid file in the data dir. Everything lives under the data dir: ``server.properties``,
``log4j2.properties``, ``broker.pid``, ``data/`` (``log.dirs``) and ``logs/``.

``start --secure`` runs the same broker with TLS, SASL/SCRAM, mutual TLS and ACLs instead of
PLAINTEXT: `jobs/dev/secure_kafka.py`; the command line of both is `jobs/dev/kafka_cli.py`. Here, `BrokerConfig` only carries its extra listeners and
`LocalBroker` has two hooks a subclass fills in (format-time arguments, the readiness check).

Topics, produce and read_committed reads are `jobs/clients/kafka_admin.py`'s.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from jobs.clients.kafka_admin import answers
from jobs.dev.processes import cmdline, terminate
from jobs.runtime import jars
from jobs.runtime.pids import pid_alive
from jobs.runtime.ports import free_ports, port_in_use
from udfs.errors import LLMStreamError

log = logging.getLogger(__name__)

DEFAULT_PORT = 9092
DEFAULT_HEAP = "512m"
_TOPIC_ALREADY_EXISTS = 36
_UNKNOWN_TOPIC_OR_PARTITION = 3

__all__ = [
    "BrokerConfig",
    "BrokerError",
    "Listener",
    "LocalBroker",
    "default_data_dir",
]


class BrokerError(LLMStreamError, RuntimeError):
    """The local broker could not be started, stopped or found; the message says why (log tail included)."""


def default_data_dir() -> Path:
    return jars.repo_root() / "var" / "kafka"


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
    client listeners (their TLS/SASL settings go in ``extra_properties``).
    """

    port: int = DEFAULT_PORT
    controller_port: int = 0
    data_dir: Path = field(default_factory=default_data_dir)
    heap: str = DEFAULT_HEAP
    extra_properties: dict[str, str] = field(default_factory=dict)
    listener: str = "PLAINTEXT"
    extra_listeners: tuple[Listener, ...] = ()

    def __post_init__(self) -> None:
        if not self.controller_port:
            object.__setattr__(self, "controller_port", self.port + 1)
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
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "listeners": listeners,
            "advertised.listeners": listeners,
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": self.listener,
            "listener.security.protocol.map": protocols,
            "log.dirs": str(data),
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            "transaction.max.timeout.ms": "900000",
        }
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


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name})"


class LocalBroker:
    """Start, stop and query one broker whose state lives in ``config.data_dir``."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self._process: subprocess.Popen[bytes] | None = None

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
        uuid_proc = subprocess.run([*base, "random-uuid"], check=False, capture_output=True, text=True, timeout=120)
        cluster_id = uuid_proc.stdout.strip().splitlines()[-1] if uuid_proc.stdout.strip() else ""
        if uuid_proc.returncode != 0 or not cluster_id:
            raise BrokerError(f"kafka StorageTool random-uuid failed:\n{uuid_proc.stdout}{uuid_proc.stderr}")
        cmd = [*base, "format", "-t", cluster_id, "-c", str(self.properties_file), "--standalone"]
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
        if self.pid() is not None:
            running = self._written_listeners()
            if running != self.config.server_properties()["listeners"]:
                raise BrokerError(
                    f"a broker for {self.data_dir} already runs with listeners {running}; stop it first"
                )
            self._wait_ready(timeout)
            return
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
        try:
            self._wait_ready(timeout)
        except BaseException:
            if self._process.poll() is None:
                self._process.kill()
            self._reap()
            self.pid_file.unlink(missing_ok=True)
            raise

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
        tail = _tail(self.log_file)
        stdout = _tail(self.stdout_file).strip()
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


