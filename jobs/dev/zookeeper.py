"""A local ZooKeeper server: the leader election and job registry of a highly available
standalone Flink cluster (`llmstream cluster start --ha`, `jobs/dev/local_cluster.py`).

``org.apache.zookeeper:zookeeper`` is resolved from Maven Central by pom-free (set ``zookeeper``)
and run as a standalone ``ZooKeeperServerMain`` with a ``zoo.cfg`` written into its data dir: one
server on a loopback port, no admin server (Jetty is not on its classpath), the four-letter
commands ``ruok`` and ``srvr`` allowed so `ZooKeeper.ready` can ask it whether it serves. Flink
talks to it with the ZooKeeper client shaded inside flink-dist, so nothing more is installed.

No SLF4J binding is on the server's classpath, so it logs nothing but its start-up errors (to
``zookeeper.log``): its state is in the data dir, and ``srvr`` says how it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from jobs.dev.processes import cmdline, log_tail, terminate
from jobs.runtime import jars
from jobs.runtime.pids import pid_alive
from jobs.runtime.ports import port_in_use
from udfs.errors import LLMStreamError

__all__ = ["MAIN_CLASS", "ZooKeeper", "ZooKeeperConfig", "ZooKeeperError", "four_letter"]

MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
JAR_SET = "zookeeper"


class ZooKeeperError(LLMStreamError, RuntimeError):
    """The local ZooKeeper could not be started or stopped; the message carries its log's tail."""


@dataclass(frozen=True)
class ZooKeeperConfig:
    """Where one server listens (``127.0.0.1:port``) and keeps its snapshots, config, log and pid."""

    port: int
    data_dir: Path
    heap: str = "128m"
    tick_ms: int = 2000
    max_session_timeout_ms: int = 60_000

    @property
    def quorum(self) -> str:
        """``high-availability.zookeeper.quorum`` of a Flink cluster using this server."""
        return f"127.0.0.1:{self.port}"

    def zoo_cfg(self) -> str:
        settings = {
            "tickTime": self.tick_ms,
            "dataDir": self.data_dir / "data",
            "clientPort": self.port,
            "clientPortAddress": "127.0.0.1",
            "maxClientCnxns": 0,
            "maxSessionTimeout": self.max_session_timeout_ms,
            "admin.enableServer": "false",
            "4lw.commands.whitelist": "ruok,srvr",
            # Purge old snapshots and transaction logs every hour; a development server needs only the last few.
            "autopurge.snapRetainCount": 3,
            "autopurge.purgeInterval": 1,
        }
        return "".join(f"{k}={v}\n" for k, v in settings.items())


def four_letter(host: str, port: int, command: str, timeout: float = 2.0) -> str:
    """Send a ZooKeeper four-letter command and return its whole answer ('' if none)."""
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.sendall(command.encode())
        chunks = []
        while True:
            data = conn.recv(4096)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    java = shutil.which("java", path=str(Path(java_home) / "bin")) if java_home else shutil.which("java")
    if java is None:
        raise ZooKeeperError("java not found (need Java 11+ on PATH or JAVA_HOME)")
    return java


class ZooKeeper:
    """Start, stop and query one standalone ZooKeeper server whose state is in ``config.data_dir``.

    The pid file makes it stoppable from another process (``llmstream cluster stop``); a pid whose
    command line is not this server's (a reused pid) is never signalled."""

    def __init__(self, config: ZooKeeperConfig) -> None:
        self.config = config
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def cfg_file(self) -> Path:
        return self.config.data_dir / "zoo.cfg"

    @property
    def log_file(self) -> Path:
        return self.config.data_dir / "zookeeper.log"

    @property
    def pid_file(self) -> Path:
        return self.config.data_dir / "zookeeper.pid"

    @property
    def quorum(self) -> str:
        return self.config.quorum

    def command(self) -> list[str]:
        return [_java(), f"-Xmx{self.config.heap}", "-Dzookeeper.jmx.log4j.disable=true",
                "-cp", jars.classpath(JAR_SET), MAIN_CLASS, str(self.cfg_file)]

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if not pid_alive(pid):
            return None
        cmd = cmdline(pid)
        if cmd and not (MAIN_CLASS in cmd and str(self.cfg_file) in cmd):
            return None
        return pid

    def ready(self) -> bool:
        """Whether the server answers ``ruok`` with ``imok`` and ``srvr`` with its mode (it serves)."""
        try:
            return (four_letter("127.0.0.1", self.config.port, "ruok") == "imok"
                    and "Mode: standalone" in four_letter("127.0.0.1", self.config.port, "srvr"))
        except OSError:
            return False

    def start(self, timeout: float = 60) -> None:
        """Start the server and wait until it serves; a no-op when it already runs."""
        if self.pid() is None:
            if port_in_use(self.config.port):
                raise ZooKeeperError(f"port {self.config.port} on 127.0.0.1 is already in use")
            jars.ensure(JAR_SET)
            (self.config.data_dir / "data").mkdir(parents=True, exist_ok=True)
            self.cfg_file.write_text(self.config.zoo_cfg())
            with self.log_file.open("ab") as out:
                self._process = subprocess.Popen(self.command(), cwd=self.config.data_dir, stdin=subprocess.DEVNULL,
                                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.pid_file.write_text(f"{self._process.pid}\n")
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _alive(self) -> bool:
        if self._process is not None:
            return self._process.poll() is None
        return self.pid() is not None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self._alive():
                raise ZooKeeperError(f"ZooKeeper exited during start-up; last lines of {self.log_file}:\n{log_tail(self.log_file, 15)}")
            if time.monotonic() > deadline:
                raise ZooKeeperError(f"ZooKeeper not serving after {timeout:g} s on {self.quorum}; "
                                     f"last lines of {self.log_file}:\n{log_tail(self.log_file, 15)}")
            time.sleep(0.2)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the server (SIGKILL after ``timeout``); its data dir is kept."""
        pid = self.pid()
        if pid is not None and terminate([pid], timeout, "zookeeper"):
            raise ZooKeeperError(f"ZooKeeper pid {pid} survived SIGKILL")
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
            self._process = None
        self.pid_file.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
