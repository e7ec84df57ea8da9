"""A local Confluent-compatible Schema Registry (Apicurio Registry 3.0.9) on loopback, for the Avro
tests and for developers: no Docker, the app from ``pom-free`` (set ``registry``), Java 17.

Apicurio speaks Confluent's REST API under ``/apis/ccompat/v7`` (what `udfs/records/registry.py` and
confluent-kafka's serializers use). Its storage is its in-memory default; what a stopped and
restarted registry (the outage test) must still know, every schema, id and compatibility
level, goes through Apicurio's own export and import: `stop` saves ``/admin/export`` to
``export.zip`` in the data dir and `start` imports it (ids preserved, id sequences moved past
them). Apicurio answers before that import: a client that asked in that window got HTTP 404 for
an id registered before the stop and dead-lettered a good record (one CI run of the outage
test). So Apicurio listens on a private port, and the registry's port is a TCP forwarder in this
process (`_Front`) that opens only once the import is done and closes first at `stop`: clients
see the port refused, as during any outage, never an empty registry. An H2 database file was tried first: twice in CI a restarted registry had lost what was
registered a minute before its SIGTERM (the file reopened at its first, table-only state; H2
2.3's compaction on close is a known cause of such losses, h2database issue 4247); it never
happened in 36 restarts here, 14 of them beside two CPU burners. Two differences from
Confluent's registry matter to tests: the
default compatibility is NONE (Confluent: BACKWARD), so whoever relies on BACKWARD sets it on
the subject (`set_compatibility`); health is on the API port (``/health/ready``) in 3.0.x.

    python -m jobs.dev.schema_registry [--port P] [--data-dir DIR]   # runs until Ctrl-C
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Self

import requests

from jobs.dev.processes import log_tail, terminate
from jobs.runtime import jars
from jobs.runtime.ports import free_port, port_in_use
from udfs.errors import LLMStreamError

SET = "registry"
CCOMPAT = "/apis/ccompat/v7"
ADMIN = "/apis/registry/v3/admin"
DEFAULT_HEAP = "384m"

log = logging.getLogger("llmstream.dev.schema_registry")


class RegistryError(LLMStreamError, RuntimeError):
    """The local registry could not start or stop; the message carries its log's tail."""


def _java() -> str:
    from jobs.dev.local_kafka import (
        _java as java,  # the same rule: JAVA_HOME, else PATH
    )

    return java()


def runner_jar() -> Path:
    """The Quarkus runner jar of the unpacked registry (fetched and unpacked if need be)."""
    jars.ensure(SET)
    mod = jars.fetcher()
    (entry,) = mod.entries_for(SET, mod.read_manifest(jars.repo_root() / "pom-free" / "manifest.tsv"))
    home = jars.jar_dir(SET) / entry.unpacked_name
    found = sorted(home.glob("*-runner.jar"))
    if not found:
        raise RegistryError(f"no *-runner.jar in {home}; run `python pom-free/fetch.py --set {SET}`")
    return found[0]


class _Front:
    """Forwards every connection to 127.0.0.1:``port`` to Apicurio's private port, both ways, until
    `close`, which refuses new connections and cuts the open ones."""

    def __init__(self, port: int, backend_port: int) -> None:
        self._backend_port = backend_port
        self._listener = socket.create_server(("127.0.0.1", port))
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="registry-front", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._backend_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), name="registry-front-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        self._cut(src, dst)

    def _cut(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with self._lock:
                self._open.discard(sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        self._listener.close()
        with self._lock:
            open_now = list(self._open)
        self._cut(*open_now)


class LocalRegistry:
    """One Apicurio process whose database and log live in ``data_dir``, reached on ``port`` (a free
    one if 0) through `_Front` once it holds what the last `stop` exported."""

    def __init__(self, data_dir: Path, port: int = 0, heap: str = DEFAULT_HEAP) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.heap = heap
        self._process: subprocess.Popen[bytes] | None = None
        self._backend_port = 0
        self._front: _Front | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def _backend_url(self) -> str:
        """Apicurio itself, for start-up, import and export: reachable before the front opens."""
        return f"http://127.0.0.1:{self._backend_port}"

    @property
    def url(self) -> str:
        """The Confluent-compatible API: what `schema_registry.url` and confluent-kafka take."""
        return self.base_url + CCOMPAT

    @property
    def log_file(self) -> Path:
        return self.data_dir / "registry.log"

    @property
    def export_file(self) -> Path:
        """What the last `stop` exported and the next `start` imports."""
        return self.data_dir / "export.zip"

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def ready(self, timeout_s: float = 2.0) -> bool:
        try:
            return requests.get(self._backend_url + "/health/ready", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def start(self, timeout: float = 180) -> None:
        """Starts the registry, waits until it is ready (a JVM start, far slower on a loaded
        machine: docs/testing.md) and imports what the last `stop` exported."""
        if self.running():
            return
        if port_in_use(self.port):
            raise RegistryError(f"port {self.port} on 127.0.0.1 is already in use")
        jar = runner_jar()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._backend_port = free_port()
        cmd = [
            _java(), f"-Xmx{self.heap}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Dquarkus.http.host=127.0.0.1", f"-Dquarkus.http.port={self._backend_port}",
            # 3.0.x serves health on the API port; a later version's management port stays on loopback too.
            "-Dquarkus.management.host=127.0.0.1", f"-Dquarkus.management.port={free_port()}",
            "-Dquarkus.log.level=WARN",
            "-jar", str(jar),
        ]
        with self.log_file.open("ab") as out:
            self._process = subprocess.Popen(cmd, cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self.running():
                raise RegistryError(f"the schema registry exited during start-up:\n{log_tail(self.log_file, 20)}")
            if time.monotonic() > deadline:
                self.stop(export=False)
                raise RegistryError(f"the schema registry was not ready after {timeout:g} s:\n{log_tail(self.log_file, 20)}")
            time.sleep(0.3)
        if self.export_file.exists():
            self._import()
        try:
            self._front = _Front(self.port, self._backend_port)
        except OSError as exc:
            self.stop(export=False)
            raise RegistryError(f"port {self.port} on 127.0.0.1 could not be opened: {exc}") from None

    def _import(self) -> None:
        try:
            answer = requests.post(self._backend_url + ADMIN + "/import", data=self.export_file.read_bytes(),
                                   headers={"Content-Type": "application/zip"}, timeout=120)
        except requests.RequestException as exc:
            self.stop(export=False)
            raise RegistryError(f"the schema registry did not take back {self.export_file}: {exc}") from None
        if answer.status_code >= 300:
            self.stop(export=False)
            raise RegistryError(f"the schema registry refused to import {self.export_file} "
                                f"(HTTP {answer.status_code}): {answer.text[:300]}")

    def _export(self) -> None:
        """Saves everything registered so far, atomically; a registry that cannot answer keeps the last export."""
        try:
            answer = requests.get(self._backend_url + ADMIN + "/export", timeout=60)
            answer.raise_for_status()
        except requests.RequestException as exc:
            log.warning("the schema registry could not export its data before stopping (%s); the next start "
                        "imports %s", exc, self.export_file if self.export_file.exists() else "nothing")
            return
        partial = self.export_file.with_suffix(".zip.partial")
        partial.write_bytes(answer.content)
        os.replace(partial, self.export_file)

    def stop(self, timeout: float = 30, *, export: bool = True) -> None:
        """Exports the registry's data, then SIGTERM (it stops in well under a second), SIGKILL if it
        does not. A start that failed stops with `export=False`: its registry is empty or not
        ready, and exporting it would overwrite the data the next start must import. The front
        closes first: from then on clients see the port refused."""
        if self._front is not None:
            self._front.close()
            self._front = None
        if self._process is not None:
            if export and self.running():
                self._export()
            terminate([self._process.pid], timeout, "schema registry")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
            self._process = None

    def set_compatibility(self, subject: str, level: str = "BACKWARD") -> None:
        """Apicurio's default is NONE; a test that relies on Confluent's BACKWARD sets it per subject."""
        response = requests.put(f"{self.url}/config/{subject}", json={"compatibility": level}, timeout=10)
        response.raise_for_status()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A local Apicurio Schema Registry until Ctrl-C.")
    parser.add_argument("--port", type=int, default=8085)
    parser.add_argument("--data-dir", type=Path, default=jars.repo_root() / "var" / "schema-registry")
    args = parser.parse_args(argv)
    with LocalRegistry(args.data_dir, args.port) as registry:
        print(f"schema registry ready: schema_registry.url: {registry.url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while registry.running():
                time.sleep(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
