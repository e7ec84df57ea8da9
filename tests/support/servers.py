"""In-process model servers of the unit tests, on free loopback ports: the simulator in a thread
(fixtures ``make_sim`` and ``sim``, a plugin listed in ``tests/conftest.py``), any aiohttp app
(``serve_app``) for answers the simulator does not give, and ``FloodServer``, which answers with
bodies as large as asked or without end and counts what it managed to send. And ``object_store``:
a real S3-compatible server (s3proxy, `jobs/dev/object_store.py`), one per session and worker."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any, Literal, Self

import pytest
from aiohttp import web

from jobs.dev.object_store import ObjectStore, ObjectStoreConfig
from jobs.dev.simulator import SimulatorConfig, ThreadedSimulator, start_in_thread
from jobs.runtime.ports import free_port


@pytest.fixture
def make_sim() -> Iterator[Callable[..., ThreadedSimulator]]:
    """Start simulators on free ports and always stop them, so a failing test leaks no thread."""
    started: list[ThreadedSimulator] = []

    def make(**overrides: Any) -> ThreadedSimulator:
        sim = start_in_thread(SimulatorConfig(port=0, stats_log_interval_s=0, **overrides))
        started.append(sim)
        return sim

    yield make
    for sim in started:
        sim.stop()


@pytest.fixture
def sim(make_sim: Callable[..., ThreadedSimulator]) -> ThreadedSimulator:
    return make_sim()


@pytest.fixture(scope="session")
def object_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    """s3proxy on a free loopback port with the bucket ``llmstream``, for this session (and xdist worker)."""
    store = ObjectStore(ObjectStoreConfig(port=free_port(), data_dir=tmp_path_factory.mktemp("object-store")))
    store.start(timeout=90)
    try:
        yield store
    finally:
        store.stop()


async def serve_app(routes: list[web.RouteDef]) -> tuple[web.AppRunner, str]:
    """An aiohttp app with ``routes`` on a free loopback port: its runner (``cleanup()`` it) and
    its ``/v1`` base URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1"


FLOOD_CHUNK = b"x" * 65_536
FLOOD_CAP_BYTES = 1 << 30
"""The most body bytes a `FloodServer` answer sends: "without end" still ends, if no client stops it."""
FLOOD_STALL_S = 30.0
"""How long a `FloodServer` send may block on a client that neither reads nor closes before the
answer gives up: a bound for a broken client, never reached by a working one."""


@dataclass(frozen=True)
class Flood:
    """What a `FloodServer` answers every request with: `status`; `body`, then `size - len(body)`
    bytes of filler (`size` none: filler without end, up to `FLOOD_CAP_BYTES`); framed by a
    Content-Length (`length`), chunked encoding (`chunked`) or the connection's end (`close`);
    `headers` are sent as well (e.g. a Content-Encoding for a `body` already compressed)."""

    status: int = 200
    size: int | None = None
    framing: Literal["length", "chunked", "close"] = "chunked"
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


class FloodServer:
    """A loopback HTTP/1.1 server in threads that answers every GET and POST with `flood`.

    `sent` holds, per answer, the body bytes the kernel took (`sendall` returned) before the body
    ended or the client stopped it (a reset or closed connection); `connections` counts the
    connections accepted. A client that reads a body only up to a bound leaves `sent` near that
    bound plus the socket buffers, far below what the server would have sent."""

    def __init__(self, flood: Flood) -> None:
        self.flood = flood
        self.sent: list[int] = []
        self.connections = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = FLOOD_STALL_S

            def setup(self) -> None:
                super().setup()
                with server._lock:
                    server.connections += 1

            def do_GET(self) -> None:
                server._answer(self)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server._answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="flood-server", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        flood = self.flood
        handler.send_response(flood.status)
        handler.send_header("Content-Type", flood.content_type)
        for name, value in flood.headers:
            handler.send_header(name, value)
        if flood.framing == "length":
            handler.send_header("Content-Length", str(flood.size if flood.size is not None else len(flood.body)))
        elif flood.framing == "chunked":
            handler.send_header("Transfer-Encoding", "chunked")
        else:
            handler.send_header("Connection", "close")
            handler.close_connection = True
        handler.end_headers()
        sent = 0
        try:
            for piece in self._pieces():
                data = b"%x\r\n%s\r\n" % (len(piece), piece) if flood.framing == "chunked" else piece
                handler.wfile.write(data)
                sent += len(piece)
            if flood.framing == "chunked":
                handler.wfile.write(b"0\r\n\r\n")
        except (TimeoutError, ConnectionError):
            handler.close_connection = True
        with self._lock:
            self.sent.append(sent)

    def _pieces(self) -> Iterator[bytes]:
        """The body in pieces: `body`, then filler up to `size` (or the cap)."""
        flood = self.flood
        if flood.body:
            yield flood.body
        left = (flood.size if flood.size is not None else FLOOD_CAP_BYTES) - len(flood.body)
        while left > 0:
            piece = FLOOD_CHUNK[:left]
            left -= len(piece)
            yield piece
