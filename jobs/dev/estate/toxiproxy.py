"""Slow links on the estate: toxiproxy (github.com/Shopify/toxiproxy), a TCP proxy whose links take
"toxics" — latency with jitter, a bandwidth cap, a stall (``timeout``), a reset — added and removed
over its HTTP API while connections stay open.

``tc netem`` would slow a veth without a proxy, but this kernel has no netem, so a link is made
slow by routing it through a proxy: the proxy runs on the host whose service it fronts (the model
host: ``10.77.0.30:`` `PROXY_PORT` → the simulator on the same host), and a job that is to feel the
slow link is configured with the proxy's address instead of the service's. Its API listens on
`API_PORT` of that host.

The server is built once per machine from the Go module proxy (`VERSION`, pinned here) into
``~/.cache/llmstream/builds/toxiproxy-<version>/`` (`ensure_built`); ``go`` must be on PATH.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from jobs.dev.estate.network import EstateError, Host
from jobs.dev.processes import cmdline, terminate
from jobs.runtime import jars
from jobs.runtime.pids import pid_alive

__all__ = ["API_PORT", "PROXY_PORT", "VERSION", "Toxiproxy", "ensure_built"]

MODULE = "github.com/Shopify/toxiproxy/v2"
VERSION = "v2.5.0"
"""The newest version the Go module proxy lists for the module (later tags are not v2 modules)."""
API_PORT = 8474
PROXY_PORT = 18000


def build_dir() -> Path:
    return jars.user_cache_dir() / "builds" / f"toxiproxy-{VERSION}"


def ensure_built(timeout: float = 900.0) -> Path:
    """The toxiproxy server binary, built with ``go install`` on first use; its path."""
    binary = build_dir() / "server"
    if binary.is_file():
        return binary
    go = shutil.which("go")
    if go is None:
        raise EstateError("toxiproxy: 'go' is not on PATH; it builds the proxy (go install "
                          f"{MODULE}/cmd/server@{VERSION})")
    tmp = build_dir().with_name(build_dir().name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    proc = subprocess.run([go, "install", f"{MODULE}/cmd/server@{VERSION}"], env={**os.environ, "GOBIN": str(tmp)},
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0 or not (tmp / "server").is_file():
        raise EstateError(f"toxiproxy: go install {MODULE}/cmd/server@{VERSION} failed: "
                          f"{(proc.stdout + proc.stderr).strip()[-500:]}")
    shutil.rmtree(build_dir(), ignore_errors=True)
    tmp.rename(build_dir())
    return binary


class Toxiproxy:
    """A toxiproxy server on ``host`` fronting ``upstream`` (``addr:port`` as seen from that host)."""

    def __init__(self, host: Host, work_dir: Path, name: str, upstream: str) -> None:
        self.host = host
        self.dir = work_dir / host.name
        self.name = name
        self.upstream = upstream

    @property
    def api(self) -> str:
        return f"http://{self.host.address}:{API_PORT}"

    @property
    def listen(self) -> str:
        """``addr:port`` clients use instead of the upstream's."""
        return f"{self.host.address}:{PROXY_PORT}"

    @property
    def pid_file(self) -> Path:
        return self.dir / "toxiproxy.pid"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) and "toxiproxy" in " ".join(cmdline(pid)) else None

    def _answers(self) -> bool:
        try:
            return requests.get(self.api + "/version", timeout=1).ok
        except requests.RequestException:
            return False

    def start(self, timeout: float = 30.0) -> None:
        """The server (built first if needed) and the proxy; the proxy's toxics cleared."""
        binary = ensure_built()
        if self.pid() is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            with (self.dir / "toxiproxy.log").open("ab") as out:
                process = subprocess.Popen([*self.host.exec_prefix(), str(binary), "-host", self.host.address,
                                            "-port", str(API_PORT)], stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            self.pid_file.write_text(f"{process.pid}\n")
        deadline = time.monotonic() + timeout
        while not self._answers():
            if time.monotonic() > deadline:
                raise EstateError(f"toxiproxy on {self.host.name} did not answer at {self.api} "
                                  f"within {timeout:g} s (log {self.dir / 'toxiproxy.log'})")
            time.sleep(0.2)
        with contextlib.suppress(requests.RequestException):
            requests.delete(f"{self.api}/proxies/{self.name}", timeout=5)
        self._call("POST", "/proxies", {"name": self.name, "listen": self.listen, "upstream": self.upstream,
                                        "enabled": True})

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            terminate([pid], 10, "toxiproxy")
        self.pid_file.unlink(missing_ok=True)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        response = requests.request(method, self.api + path, json=body, timeout=10)
        if not response.ok:
            raise EstateError(f"toxiproxy {method} {path}: {response.status_code} {response.text.strip()[:200]}")
        return response.json() if response.content else None

    def add(self, toxic: str, kind: str, stream: str = "downstream", **attributes: Any) -> None:
        """A toxic on the proxy (``latency`` with ``latency``/``jitter`` ms, ``bandwidth`` with ``rate``
        KB/s, ``timeout``, ``reset_peer``, …), on the ``downstream`` (answers) or ``upstream`` side."""
        self._call("POST", f"/proxies/{self.name}/toxics",
                   {"name": toxic, "type": kind, "stream": stream, "toxicity": 1.0, "attributes": attributes})

    def remove(self, toxic: str) -> None:
        self._call("DELETE", f"/proxies/{self.name}/toxics/{toxic}")

    @contextlib.contextmanager
    def toxic(self, toxic: str, kind: str, stream: str = "downstream", **attributes: Any) -> Iterator[None]:
        self.add(toxic, kind, stream, **attributes)
        try:
            yield
        finally:
            self.remove(toxic)

    def served(self) -> dict[str, Any]:
        proxy: dict[str, Any] = self._call("GET", f"/proxies/{self.name}")
        return proxy
