"""Three ways to run a simulator: ``serve`` on a running loop (in ``server``), ``start_in_thread``
(its own loop in a daemon thread, for unit tests) and ``spawn`` (a child process, for tests and
benchmarks that must not share the GIL with it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self

from jobs.dev.simulator.cli import FINAL_STATS_PREFIX, LISTENING_PREFIX
from jobs.dev.simulator.config import SimulatorConfig
from jobs.dev.simulator.fleet import FLEET_PREFIX
from jobs.dev.simulator.server import SimulatorServer, serve
from udfs.errors import LLMStreamError


class SimulatorError(LLMStreamError, RuntimeError):
    """The simulator process could not be started; the message says how it ended."""


class ThreadedSimulator:
    """A simulator running its own event loop in a daemon thread (see ``start_in_thread``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, server: SimulatorServer, thread: threading.Thread) -> None:
        self.loop = loop
        self.server = server
        self.thread = thread
        self.url = server.url
        self.base_url = server.base_url
        self.port = server.port

    def _call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        async def on_loop() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(timeout)

    def stats(self) -> dict[str, Any]:
        return self._call(self.server.stats)

    def reset_stats(self) -> None:
        self._call(self.server.reset_stats)

    def admin(self, faults: dict[str, Any]) -> dict[str, Any]:
        """Apply a fault body, as ``POST /admin/faults`` does."""
        return self._call(lambda: self.server.set_faults(faults))

    def configure(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self._call(lambda: self.server.update_config(dict(changes)))

    def stop(self, timeout: float = 10.0) -> None:
        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(config: SimulatorConfig | None = None, timeout: float = 10.0) -> ThreadedSimulator:
    """Run a simulator in a daemon thread; returns once it listens (no config: a free port). Call ``.stop()``."""
    loop = asyncio.new_event_loop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    thread = threading.Thread(target=run, name="llmstream-simulator", daemon=True)
    thread.start()
    try:
        server = asyncio.run_coroutine_threadsafe(serve(config), loop).result(timeout)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        raise
    return ThreadedSimulator(loop, server, thread)


class SpawnedSimulator:
    """A simulator in a child process (see ``spawn``); admin calls go over HTTP with ``requests``
    (over HTTPS: trusting ``ca_file``, presenting ``client_cert`` when mutual TLS is on)."""

    def __init__(self, process: subprocess.Popen[str], url: str, lines: list[str],
                 reader: threading.Thread, *, ca_file: str | None = None,
                 client_cert: tuple[str, str] | None = None) -> None:
        self.process = process
        self._tls: dict[str, Any] = {"verify": ca_file or True, "cert": client_cert}
        self.url = url
        self.base_url = url[: -len("/v1")]
        self.port = int(self.base_url.rsplit(":", 1)[1])
        self.lines = lines
        self._reader = reader

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        import requests

        response = requests.post(self.base_url + path, json=body, timeout=timeout, **self._tls)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def admin(self, faults: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """Replace the fault scenario (``POST /admin/faults``)."""
        return self._post("/admin/faults", faults, timeout)

    def configure(self, changes: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        return self._post("/admin/config", changes, timeout)

    def configure_batches(self, changes: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """Change the batch APIs' settings for batches made from now on (``POST /admin/batches``)."""
        return self._post("/admin/batches", changes, timeout)

    def reset_stats(self, timeout: float = 5.0) -> dict[str, Any]:
        return self._post("/stats/reset", None, timeout)

    def _get(self, path: str, timeout: float) -> dict[str, Any]:
        import requests

        response = requests.get(self.base_url + path, timeout=timeout, **self._tls)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        return self._get("/stats", timeout)

    def batches(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Every batch of both batch APIs, newest first (``GET /admin/batches``)."""
        batches: list[dict[str, Any]] = self._get("/admin/batches", timeout)["batches"]
        return batches

    def force_batch(self, batch_id: str, action: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Force a batch's outcome (``POST /admin/batches/ID``), e.g. ``{"action": "expire"}``."""
        return self._post(f"/admin/batches/{batch_id}", action, timeout)

    def stop(self, timeout: float = 10.0) -> dict[str, Any] | None:
        """SIGTERM the child (SIGKILL after ``timeout``); returns its final stats line if it printed one."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self._reader.join(2.0)
        for line in reversed(self.lines):
            if line.startswith(FINAL_STATS_PREFIX):
                stats: dict[str, Any] = json.loads(line[len(FINAL_STATS_PREFIX):])
                return stats
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(args: Iterable[str] = (), timeout: float = 10.0, python: str | None = None, *,
          ca_file: str | None = None, client_cert: tuple[str, str] | None = None) -> SpawnedSimulator:
    """Start ``python -m jobs.dev.simulator ARGS`` (``--port 0`` unless given) and wait until it is healthy.

    With ``--tls-cert``, ``ca_file`` is the CA to trust for the health and admin calls and
    ``client_cert`` the (cert, key) they present when ``--tls-client-ca`` is given."""
    import requests

    argv = list(args)
    if not any(a == "--port" or a.startswith("--port=") for a in argv):
        argv += ["--port", "0"]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        [python or sys.executable, "-m", "jobs.dev.simulator", *argv],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    lines: list[str] = []
    found: Future[str] = Future()

    def read() -> None:
        assert process.stdout is not None
        with process.stdout:
            for line in process.stdout:
                line = line.rstrip("\n")
                lines.append(line)
                if line.startswith(LISTENING_PREFIX) and not found.done():
                    found.set_result(line[len(LISTENING_PREFIX):].strip())
        if not found.done():
            found.set_exception(SimulatorError(f"model-server exited with {process.wait()} before listening"))

    reader = threading.Thread(target=read, name="llmstream-simulator-stdout", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        url = found.result(timeout)
        handle = SpawnedSimulator(process, url, lines, reader, ca_file=ca_file, client_cert=client_cert)
        while True:
            try:
                if requests.get(handle.base_url + "/health", timeout=1.0, **handle._tls).status_code == 200:
                    return handle
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"model-server at {url} not healthy after {timeout} s")
            time.sleep(0.05)
    except BaseException:
        process.kill()
        process.wait()
        reader.join(2.0)
        raise


class SpawnedFleet:
    """A fleet of simulated endpoints in a child process (``spawn_fleet``): ``urls`` are the
    endpoints' ``/v1`` URLs; ``kill``, ``revive``, ``faults``, ``configure`` and
    ``endpoint_stats`` go through the control port (``jobs/dev/simulator/fleet.py``).

    It also stands in for one simulator where the bench expects one: ``url`` is the endpoints'
    URLs joined by commas (``Scenario.fleet_model`` splits them), ``stats`` sums the endpoints'
    counters, ``reset_stats`` resets them all, ``process`` is the child."""

    def __init__(self, simulator: SpawnedSimulator) -> None:
        self.simulator = simulator
        self.process = simulator.process
        self.control_url = simulator.base_url
        line = next(line for line in simulator.lines if line.startswith(FLEET_PREFIX))
        self.urls: list[str] = json.loads(line[len(FLEET_PREFIX):])["endpoints"]
        self.url = ",".join(self.urls)

    def _post(self, index: int | str, body: dict[str, Any] | None, timeout: float = 10.0) -> dict[str, Any]:
        return self.simulator._post(f"/fleet/{index}", body, timeout)

    def kill(self, index: int) -> dict[str, Any]:
        """Endpoint ``index`` stops listening and drops its connections, until ``revive``."""
        return self._post(index, {"state": "down"})

    def revive(self, index: int) -> dict[str, Any]:
        return self._post(index, {"state": "up"})

    def faults(self, index: int, faults: dict[str, Any]) -> dict[str, Any]:
        """Replace endpoint ``index``'s fault scenario (``{"error_rate": 1}``: HTTP 500 to all)."""
        return self._post(index, {"faults": faults})

    def configure(self, index: int, changes: dict[str, Any]) -> dict[str, Any]:
        return self._post(index, {"config": changes})

    def endpoint_stats(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Each endpoint's ``/stats``, in order."""
        import requests

        response = requests.get(self.control_url + "/fleet", timeout=timeout)
        response.raise_for_status()
        return [endpoint["stats"] for endpoint in response.json()["endpoints"]]

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The endpoints' counters summed (``since_reset_s``: the longest), and ``endpoints``: each one's."""
        each = self.endpoint_stats(timeout)
        total: dict[str, Any] = {key: sum(s[key] for s in each) for key in SUMMED_STATS}
        total["since_reset_s"] = max(s["since_reset_s"] for s in each)
        total["endpoints"] = each
        return total

    def configure_batches(self, changes: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """Change the batch APIs' settings for batches made from now on (``POST /admin/batches``)."""
        return self._post("/admin/batches", changes, timeout)

    def reset_stats(self, timeout: float = 5.0) -> dict[str, Any]:
        return self._post("reset", None, timeout)

    def shares(self) -> str:
        """Each endpoint's concurrency limit and share of the answers, as one line."""
        each = self.endpoint_stats()
        served = sum(s["served"] for s in each) or 1
        limits = sum(s["concurrency_limit"] for s in each) or 1
        return "; ".join(f"endpoint {i} (limit {s['concurrency_limit']}): {s['served']:,} answers, "
                         f"{s['served'] / served:.1%} (limit share {s['concurrency_limit'] / limits:.1%})"
                         for i, s in enumerate(each))

    def stop(self, timeout: float = 10.0) -> None:
        self.simulator.stop(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


SUMMED_STATS = ("in_flight", "max_in_flight", "mean_in_flight", "queued", "max_queued", "served", "rejected",
                "rate_limited", "errors", "requests_total")
"""Counters a fleet's ``stats`` adds up (every endpoint was reset at the same moment)."""


def spawn_fleet(limits: Iterable[int], args: Iterable[str] = (), timeout: float = 10.0,
                python: str | None = None) -> SpawnedFleet:
    """Start ``python -m jobs.dev.simulator --fleet LIMITS ARGS`` and wait until its control port is healthy."""
    spec = ",".join(str(n) for n in limits)
    return SpawnedFleet(spawn(["--fleet", spec, *args], timeout, python))
