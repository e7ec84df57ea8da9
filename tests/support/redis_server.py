"""A real `redis-server` (or `valkey-server`) on a free loopback port, for the cache tests.

`make test` installs it (Makefile, `redis` target); without it the tests that need it skip
and say so. `kill()` is a SIGKILL (the outage the cache must survive); `start()` again
brings it back on the same port, empty.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from typing import Self

import pytest

from jobs.runtime.ports import free_port
from tests.support.waiting import wait_until

SERVER_NAMES = ("redis-server", "valkey-server")


def server_binary() -> str | None:
    for name in SERVER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def require_server() -> str:
    binary = server_binary()
    if binary is None:
        pytest.skip("no redis-server or valkey-server on PATH (make test installs redis-server)")
    return binary


class RedisServer:
    """One server process; `url` stays the same across kill/start."""

    def __init__(self, directory: Path, binary: str | None = None) -> None:
        self.binary = binary or require_server()
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT)
        process = self.process

        def answering() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode}; see {self.directory}/redis.log")
            return self.ping()

        wait_until(answering, timeout, interval=0.05, message=f"redis-server to answer PING on port {self.port}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
