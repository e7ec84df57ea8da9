"""The simulator's HTTP server: routing, faults, rate limits, the concurrency limit and its counters.

``SimulatorServer`` runs on one asyncio event loop. An inference request is authorised, parsed
into an ``endpoints.Call`` (400 if invalid), passed through the fault scenario and the
rate-limit buckets, then admitted: answered at once when instant, or held in a concurrency slot
for its sampled latency (queued while every slot is taken).
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import hmac
import json
import logging
import math
import random
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from jobs.dev.simulator.config import (
    SIMULATOR_FINGERPRINT,
    FaultSettings,
    SimulatorConfig,
    check_number,
    parse_latency,
)
from jobs.dev.simulator.endpoints import BadRequest, Call, Chat, Completions, Embeddings

log = logging.getLogger("llmstream.simulator")

_MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 32 * 1024 * 1024
_MAX_PENDING_BYTES = 4 * 1024 * 1024

_REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
    411: "Length Required", 413: "Payload Too Large", 422: "Unprocessable Entity",
    429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
}
_CLOSE = "Connection: close\r\n"
_KEEP = "Connection: keep-alive\r\n"

dumps = json.JSONEncoder(separators=(",", ":")).encode
"""Compact JSON, as the bodies and the stats lines are written."""


def format_reset(seconds: float) -> str:
    """Duration in OpenAI's ``x-ratelimit-reset-*`` style: ``250ms``, ``1.5s``, ``6m0s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


class _Bucket:
    """Token bucket refilled continuously at ``per_minute / 60`` per second, starting full."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.stamp = time.monotonic()

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, cost: float) -> float:
        cost = min(cost, self.capacity)
        return 0.0 if self.level >= cost else (cost - self.level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= min(cost, self.capacity)

    def headers(self, kind: str) -> str:
        full_in = (self.capacity - self.level) / self.rate
        return (
            f"x-ratelimit-limit-{kind}: {int(self.capacity)}\r\n"
            f"x-ratelimit-remaining-{kind}: {max(0, int(self.level))}\r\n"
            f"x-ratelimit-reset-{kind}: {format_reset(full_in)}\r\n"
        )




class _Request:
    __slots__ = ("body", "conn_header", "headers", "keep_alive", "method", "path")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes,
                 keep_alive: bool, conn_header: str) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.conn_header = conn_header


_QUEUED, _RUNNING, _DONE = 0, 1, 2


class _Job:
    """A request holding (or waiting for) a concurrency slot."""

    __slots__ = ("completion_tokens", "conn", "extra_s", "handle", "keep_alive", "response", "state")

    def __init__(self, conn: _Connection, response: bytes, completion_tokens: int, keep_alive: bool,
                 extra_s: float = 0.0) -> None:
        self.conn = conn
        self.extra_s = extra_s
        self.response = response
        self.completion_tokens = completion_tokens
        self.keep_alive = keep_alive
        self.state = _QUEUED
        self.handle: asyncio.Handle | None = None


def _parse_chunked(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at ``pos``; None while incomplete, ValueError if malformed."""
    parts: list[bytes] = []
    total = 0
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            if len(buf) - pos > 1024:
                raise ValueError("chunk size line too long")
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0].strip(), 16)
        if size < 0:
            raise ValueError("negative chunk size")
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)
            if end < 0:
                return None
            return b"".join(parts), end + 4
        start = eol + 2
        stop = start + size
        total += size
        if total > _MAX_BODY_BYTES:
            raise OverflowError
        if len(buf) < stop + 2:
            return None
        if buf[stop:stop + 2] != b"\r\n":
            raise ValueError("chunk not terminated by CRLF")
        parts.append(bytes(buf[start:stop]))
        pos = stop + 2


class _Connection(asyncio.Protocol):
    """One client connection: parses requests in order and answers them in order (pipelining)."""

    def __init__(self, sim: SimulatorServer) -> None:
        self.sim = sim
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.out: list[bytes] = []
        self.busy = False
        self.closed = False
        self.closing = False
        self.eof = False
        self.paused = False
        self.sent_continue = False
        self.job: _Job | None = None
        self.hang_handle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.sim._down_until:
            self.closed = True
            transport.abort()
            return
        self.sim._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.sim._conns.discard(self)
        if self.job is not None:
            self.sim._cancel_job(self.job)
            self.job = None
        if self.hang_handle is not None:
            self.hang_handle.cancel()
            self.hang_handle = None

    def eof_received(self) -> bool:
        """Treat EOF as a disconnect so a waiting or hung request frees its slot at once."""
        self.eof = True
        return False

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.busy:
            if len(self.buf) > _MAX_PENDING_BYTES and self.transport is not None:
                if self.hang_handle is not None:
                    self.abort()
                elif not self.paused:
                    self.paused = True
                    self.transport.pause_reading()
            return
        self.process()

    def process(self) -> None:
        dispatch = self.sim._dispatch
        out = self.out
        while not self.busy and not self.closed and not self.closing and self.buf:
            req = self._parse()
            if req is None:
                break
            response = dispatch(self, req)
            if response is not None:
                out.append(response)
                if not req.keep_alive:
                    self.closing = True
        self.flush()
        if self.closing and not self.busy and self.transport is not None and not self.closed:
            self.transport.close()

    def flush(self) -> None:
        if self.out and self.transport is not None and not self.closed:
            out = self.out
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def _fail(self, status: int, message: str) -> None:
        self.out.append(self.sim._error_response(status, message, "invalid_request_error", None, _CLOSE))
        self.closing = True
        self.buf.clear()

    def _parse(self) -> _Request | None:
        buf = self.buf
        while buf[:2] == b"\r\n":
            del buf[:2]
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEADER_BYTES:
                self._fail(431, "request headers too large")
            return None
        if end > _MAX_HEADER_BYTES:
            self._fail(431, "request headers too large")
            return None
        lines = buf[:end].decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            self._fail(400, "malformed request line")
            return None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                self._fail(400, "malformed header line")
                return None
            headers[name.strip().lower()] = value.strip()
        body_start = end + 4
        te = headers.get("transfer-encoding")
        if te is not None:
            if te.lower().rsplit(",", 1)[-1].strip() != "chunked" or "content-length" in headers:
                self._fail(400, "unsupported transfer-encoding")
                return None
            try:
                parsed = _parse_chunked(buf, body_start)
            except OverflowError:
                self._fail(413, "request body too large")
                return None
            except ValueError:
                self._fail(400, "malformed chunked body")
                return None
            if parsed is None:
                self._maybe_continue(headers)
                return None
            body, consumed = parsed
        else:
            length_text = headers.get("content-length")
            if length_text is None:
                length = 0
            else:
                try:
                    length = int(length_text)
                    if length < 0:
                        raise ValueError
                except ValueError:
                    self._fail(400, "invalid Content-Length")
                    return None
                if length > _MAX_BODY_BYTES:
                    self._fail(413, "request body too large")
                    return None
            consumed = body_start + length
            if len(buf) < consumed:
                self._maybe_continue(headers)
                return None
            body = bytes(buf[body_start:consumed])
        del buf[:consumed]
        self.sent_continue = False
        connection = headers.get("connection", "").lower()
        if version == "HTTP/1.1":
            keep_alive = "close" not in connection
            conn_header = "" if keep_alive else _CLOSE
        elif version == "HTTP/1.0":
            keep_alive = "keep-alive" in connection
            conn_header = _KEEP if keep_alive else _CLOSE
        else:
            self._fail(400, "unsupported HTTP version")
            return None
        if self.eof:
            keep_alive, conn_header = False, _CLOSE
        path = target.split("?", 1)[0]
        if path.startswith(("http://", "https://")):
            path = "/" + path.split("/", 3)[-1] if path.count("/") >= 3 else "/"
        return _Request(method, path, headers, body, keep_alive, conn_header)

    def _maybe_continue(self, headers: dict[str, str]) -> None:
        if not self.sent_continue and headers.get("expect", "").lower() == "100-continue" and self.transport:
            self.sent_continue = True
            self.flush()
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def complete(self, response: bytes, keep_alive: bool) -> None:
        """Send a delayed response and carry on with any pipelined requests."""
        self.job = None
        self.busy = False
        if self.closed or self.transport is None:
            return
        self.out.append(response)
        if not keep_alive or self.eof:
            self.closing = True
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        self.process()
        if self.eof and not self.busy and not self.closed:
            self.transport.close()

    def hang(self, max_s: float) -> None:
        self.busy = True
        self.flush()
        self.hang_handle = asyncio.get_running_loop().call_later(max_s, self.abort)

    def abort(self) -> None:
        """Drop the connection with a TCP RST and no response, like a crashed server."""
        if self.transport is None or self.closed:
            return
        self.flush()
        self.busy = True
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()


Handler = Callable[[_Connection, _Request], "bytes | None"]


class SimulatorServer:
    """A running simulator; create it with ``await serve(config)``."""

    def __init__(self, config: SimulatorConfig) -> None:
        self._loop = asyncio.get_running_loop()
        self._conns: set[_Connection] = set()
        self._listeners: list[asyncio.Server] = []
        self._queue: collections.deque[_Job] = collections.deque()
        self._down_until = 0.0
        self._down_handle: asyncio.TimerHandle | None = None
        self._stats_handle: asyncio.TimerHandle | None = None
        self._closed = False
        self._date_second = -1
        self._date = ""
        self._ids = 0
        self._rl_headers = ""
        self.host = config.host
        self.port = config.port
        self.started = time.monotonic()
        self.config = config
        self._rng = random.Random(config.seed)
        self._apply_config(config, initial=True)
        self._set_faults(config.faults)
        self._reset_counters()
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": self._inference(Chat)},
            "/v1/completions": {"POST": self._inference(Completions)},
            "/v1/embeddings": {"POST": self._inference(Embeddings)},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/stats": {"GET": self._stats_route},
            "/stats/reset": {"POST": self._stats_reset},
            "/admin/faults": {"GET": self._faults_get, "POST": self._faults_post},
            "/admin/config": {"GET": self._config_get, "POST": self._config_post},
        }

    # ----------------------------------------------------------------- lifecycle

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """OpenAI base URL, ending in ``/v1``."""
        return self.base_url + "/v1"

    async def _listen(self) -> None:
        server = await self._loop.create_server(
            lambda: _Connection(self), self.host, self.port, backlog=2048, reuse_address=True
        )
        self._listeners = [server]
        if self.port == 0:
            self.port = server.sockets[0].getsockname()[1]

    async def _startup(self) -> None:
        await self._listen()
        log.info("SIMULATOR (synthetic answers, no real model) listening on %s; config %r", self.url, self.config)
        if self.config.stats_log_interval_s > 0:
            self._stats_handle = self._loop.call_later(self.config.stats_log_interval_s, self._log_stats)

    def _log_stats(self) -> None:
        log.info("simulator stats %s", dumps(self.stats()))
        self._stats_handle = self._loop.call_later(self.config.stats_log_interval_s, self._log_stats)

    async def close(self) -> None:
        """Stop listening and drop every connection; in-flight requests get no answer."""
        if self._closed:
            return
        self._closed = True
        for handle in (self._stats_handle, self._down_handle):
            if handle is not None:
                handle.cancel()
        for server in self._listeners:
            server.close()
        for conn in list(self._conns):
            if conn.busy and conn.transport is not None:
                conn.transport.abort()
            elif conn.transport is not None:
                conn.transport.close()
        for server in self._listeners:
            try:
                await asyncio.wait_for(server.wait_closed(), 2.0)
            except TimeoutError:
                pass
        self._listeners = []
        await asyncio.sleep(0)

    def _go_down(self, seconds: float, keep: _Connection | None) -> None:
        self._down_until = time.monotonic() + seconds
        for server in self._listeners:
            server.close()
        self._listeners = []
        for conn in list(self._conns):
            if conn is not keep:
                conn.abort()
        if self._down_handle is not None:
            self._down_handle.cancel()
        self._down_handle = self._loop.call_later(seconds, self._come_up)
        log.warning("simulated outage: not listening for %.1f s", seconds)

    def _come_up(self) -> None:
        self._down_handle = None

        async def reopen() -> None:
            for attempt in range(100):
                if self._closed:
                    return
                try:
                    await self._listen()
                except OSError as exc:
                    if attempt == 99:
                        log.error("could not listen again on port %s after outage: %s", self.port, exc)
                        return
                    await asyncio.sleep(0.05)
                else:
                    self._down_until = 0.0
                    log.warning("simulated outage over: listening on %s again", self.url)
                    return

        self._loop.create_task(reopen())

    # ----------------------------------------------------------------- config and faults

    def _apply_config(self, config: SimulatorConfig, initial: bool = False) -> None:
        old = self.config
        self.config = config
        self._latency = parse_latency(config.latency)
        self._per_token_s = config.per_token_ms / 1000.0
        self._instant = self._latency.instant and self._per_token_s == 0
        if initial or config.seed != old.seed:
            self._rng = random.Random(config.seed)
        if initial or config.rpm != old.rpm:
            self._rpm = _Bucket(config.rpm) if config.rpm else None
        if initial or config.tpm != old.tpm:
            self._tpm = _Bucket(config.tpm) if config.tpm else None
        self._auth = f"Bearer {config.api_key}" if config.api_key else None
        if not initial:
            self._pump()

    def _set_faults(self, faults: FaultSettings) -> None:
        self._faults = faults
        self._faults_until = time.monotonic() + faults.until_s if faults.until_s is not None else None

    def _current_faults(self) -> FaultSettings:
        if self._faults_until is not None and time.monotonic() >= self._faults_until:
            log.info("fault scenario expired (until_s); faults back to zero")
            self._set_faults(FaultSettings())
        return self._faults

    def set_faults(self, body: dict[str, Any], keep: _Connection | None = None) -> dict[str, Any]:
        """Apply a ``POST /admin/faults`` body; raises ValueError or TypeError on a bad one.

        A body holding only ``down_for_s`` leaves the scenario alone; ``keep`` is the
        connection spared by an outage (the admin request's, so it gets its answer).
        """
        body = dict(body)
        down = body.pop("down_for_s", 0) or 0
        check_number("down_for_s", down)
        if body or not down:
            self._set_faults(FaultSettings.from_dict(body))
            log.info("fault scenario set: %s", dumps(self._faults.to_dict()))
        if down > 0:
            self._go_down(float(down), keep)
        return self.faults_view()

    def update_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply the keys of ``POST /admin/config``; raises ValueError or TypeError on a bad key or value."""
        self._apply_config(self.config.updated(changes))
        log.info("config updated: %r", self.config)
        return self.config_view()

    def config_view(self) -> dict[str, Any]:
        """Current settings without the API key; ``faults`` is the live scenario."""
        view = self.config.public_dict()
        view["faults"] = self.faults_view()
        view["simulator"] = True
        return view

    def faults_view(self) -> dict[str, Any]:
        now = time.monotonic()
        view = self._current_faults().to_dict()
        view["until_remaining_s"] = (
            round(max(0.0, self._faults_until - now), 3) if self._faults_until is not None else None
        )
        view["down_remaining_s"] = round(max(0.0, self._down_until - now), 3) if self._down_until else 0.0
        return view

    # ----------------------------------------------------------------- stats

    def _reset_counters(self) -> None:
        now = time.monotonic()
        self.in_flight = getattr(self, "in_flight", 0)
        self.max_in_flight = self.in_flight
        self.queued = getattr(self, "queued", 0)
        self.max_queued = self.queued
        self.served = 0
        self.rejected = 0
        self.rate_limited = 0
        self.over_limit = 0
        self.errors = 0
        self.resets = 0
        self.hangs = 0
        self.cancelled = 0
        self.bad_requests = 0
        self.requests_total = 0
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.structured_answers = 0
        self.invalid_answers = 0
        self._since = now
        self._area = 0.0
        self._area_stamp = now

    def _account(self, now: float) -> None:
        self._area += self.in_flight * (now - self._area_stamp)
        self._area_stamp = now

    def stats(self) -> dict[str, Any]:
        """Counters since start or the last ``reset_stats`` (uptime_s is since start).

        ``requests_total`` counts inference requests (chat, completions, embeddings) of any
        outcome; ``served`` the ones answered 200; ``rejected`` every 429 sent (injected,
        rpm/tpm in ``rate_limited``, concurrency in ``over_limit``); ``errors`` injected
        error statuses; ``resets``/``hangs`` injected drops and hangs; ``cancelled``
        requests whose client left while queued or in flight. ``in_flight`` counts
        requests holding a concurrency slot, ``queued`` those waiting for one, and
        ``mean_in_flight`` is the time-weighted mean of ``in_flight``. ``structured_answers``
        counts answers sent to requests with a ``response_format`` schema, ``invalid_answers``
        those of them that do not validate against it (``invalid_json_rate``).
        """
        now = time.monotonic()
        self._account(now)
        window = now - self._since
        return {
            "simulator": True,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "mean_in_flight": round(self._area / window, 4) if window > 0 else 0.0,
            "queued": self.queued,
            "max_queued": self.max_queued,
            "served": self.served,
            "rejected": self.rejected,
            "rate_limited": self.rate_limited,
            "over_limit": self.over_limit,
            "errors": self.errors,
            "resets": self.resets,
            "hangs": self.hangs,
            "cancelled": self.cancelled,
            "bad_requests": self.bad_requests,
            "requests_total": self.requests_total,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "structured_answers": self.structured_answers,
            "invalid_answers": self.invalid_answers,
            "open_connections": len(self._conns),
            "uptime_s": round(now - self.started, 3),
            "since_reset_s": round(window, 3),
            "concurrency_limit": self.config.concurrency,
            "latency": self.config.latency,
            "per_token_ms": self.config.per_token_ms,
            "rpm": self.config.rpm,
            "tpm": self.config.tpm,
            "faults": self.faults_view(),
        }

    def reset_stats(self) -> None:
        self._reset_counters()

    # ----------------------------------------------------------------- responses

    def _response(self, status: int, body: bytes, conn_header: str, extra: str = "") -> bytes:
        second = int(time.time())
        if second != self._date_second:
            self._date_second = second
            self._date = email.utils.formatdate(second, usegmt=True)
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nDate: {self._date}\r\n"
            f"Server: llmstream-simulator\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}{conn_header}\r\n"
        )
        return head.encode("latin-1") + body

    def _json(self, status: int, data: Any, req: _Request, extra: str = "") -> bytes:
        return self._response(status, dumps(data).encode(), req.conn_header, extra)

    def _error_response(self, status: int, message: str, kind: str, code: str | None, conn_header: str,
                        extra: str = "", param: str | None = None) -> bytes:
        body = dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
        return self._response(status, body, conn_header, extra)

    def _bad_request(self, req: _Request, message: str, param: str | None = None) -> bytes:
        self.bad_requests += 1
        return self._error_response(400, message, "invalid_request_error", None, req.conn_header, param=param)

    # ----------------------------------------------------------------- dispatch

    def _dispatch(self, conn: _Connection, req: _Request) -> bytes | None:
        methods = self._routes.get(req.path)
        if methods is None:
            if req.path.startswith("/v1/models/") and req.method == "GET":
                return self._model(conn, req)
            return self._error_response(404, f"Unknown request URL: {req.method} {req.path}",
                                        "invalid_request_error", "unknown_url", req.conn_header)
        handler = methods.get(req.method)
        if handler is None:
            return self._error_response(405, f"Method {req.method} not allowed on {req.path}",
                                        "invalid_request_error", "method_not_allowed", req.conn_header,
                                        f"Allow: {', '.join(methods)}\r\n")
        return handler(conn, req)

    def _authorized(self, req: _Request) -> bool:
        if self._auth is None:
            return True
        given = req.headers.get("authorization", "")
        return hmac.compare_digest(given.encode("utf-8", "replace"), self._auth.encode())

    def _unauthorized(self, req: _Request) -> bytes:
        return self._error_response(401, "Incorrect or missing API key (simulator)", "invalid_request_error",
                                    "invalid_api_key", req.conn_header)

    def _load(self, req: _Request) -> dict[str, Any]:
        try:
            payload = json.loads(req.body)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"Request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise BadRequest("Request body must be a JSON object")
        return payload

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-sim{self._ids:x}"

    def _inference(self, endpoint: type[Call]) -> Handler:
        """The handler of an inference endpoint: count, authorise, parse (400 if invalid), gate, answer, admit."""

        def handle(conn: _Connection, req: _Request) -> bytes | None:
            self.requests_total += 1
            if self._auth is not None and not self._authorized(req):
                return self._unauthorized(req)
            try:
                call = endpoint(self.config, self._load(req))
            except BadRequest as exc:
                return self._bad_request(req, str(exc), exc.param)
            early = self._gate(conn, req, call.token_cost)
            if early is not None:
                return early or None
            shaped = call if isinstance(call, (Chat, Completions)) and call.schema is not None else None
            if shaped is not None:
                shaped.spoil = self._rng.random() < self.config.invalid_json_rate
            body = call.respond(self._next_id)
            over_limit = self.over_limit
            response = self._admit(conn, req, body, call.prompt_tokens, call.completion_tokens,
                                   call.extra_latency_s(self.config))
            if shaped is not None and self.over_limit == over_limit:  # sent (now or after its latency)
                valid, invalid = shaped.schema_answers
                self.structured_answers += valid + invalid
                self.invalid_answers += invalid
            return response

        return handle

    # ----------------------------------------------------------------- gate and admission

    def _gate(self, conn: _Connection, req: _Request, token_cost: int) -> bytes | None:
        """Faults, then rate limits. Returns a response, b"" if the connection was taken over, or None to go on."""
        faults = self._faults
        if faults.total_rate > 0 or self._faults_until is not None:
            faults = self._current_faults()
            if faults.total_rate > 0:
                u = self._rng.random()
                if u < faults.reset_rate:
                    self.resets += 1
                    conn.abort()
                    return b""
                u -= faults.reset_rate
                if u < faults.hang_rate:
                    self.hangs += 1
                    conn.hang(self.config.hang_max_s)
                    return b""
                u -= faults.hang_rate
                if u < faults.error_rate:
                    self.errors += 1
                    status = faults.error_status
                    extra = f"Retry-After: {faults.retry_after_s}\r\n" if status in (429, 503) else ""
                    return self._error_response(status, f"Simulated error {status} (fault injection)",
                                                "server_error" if status >= 500 else "invalid_request_error",
                                                "simulated_fault", req.conn_header, extra)
                u -= faults.error_rate
                if u < faults.rate_limit_rate:
                    self.rejected += 1
                    return self._error_response(
                        429, "Simulated rate limit (fault injection); retry later", "requests",
                        "rate_limit_exceeded", req.conn_header, f"Retry-After: {faults.retry_after_s}\r\n")
        self._rl_headers = ""
        if self._rpm is not None or self._tpm is not None:
            now = time.monotonic()
            wait = 0.0
            kind = "requests"
            if self._rpm is not None:
                self._rpm.refill(now)
                wait = self._rpm.wait_for(1)
            if self._tpm is not None:
                self._tpm.refill(now)
                token_wait = self._tpm.wait_for(token_cost)
                if token_wait > wait:
                    wait, kind = token_wait, "tokens"
            if wait > 0:
                self.rejected += 1
                self.rate_limited += 1
                headers = self._limit_headers() + f"Retry-After: {max(1, math.ceil(wait))}\r\n"
                return self._error_response(
                    429, f"Rate limit reached for {kind} (simulator); retry after {wait:.2f} s", kind,
                    "rate_limit_exceeded", req.conn_header, headers)
            if self._rpm is not None:
                self._rpm.take(1)
            if self._tpm is not None:
                self._tpm.take(token_cost)
            self._rl_headers = self._limit_headers()
        return None

    def _limit_headers(self) -> str:
        headers = ""
        if self._rpm is not None:
            headers += self._rpm.headers("requests")
        if self._tpm is not None:
            headers += self._tpm.headers("tokens")
        return headers

    def _admit(self, conn: _Connection, req: _Request, body: dict[str, Any], prompt_tokens: int,
               completion_tokens: int, extra_s: float = 0.0) -> bytes | None:
        config = self.config
        limit = config.concurrency
        if limit and self.in_flight >= limit and config.reject_over_limit:
            self.rejected += 1
            self.over_limit += 1
            return self._error_response(
                429, "Simulator concurrency limit reached; retry later", "requests", "rate_limit_exceeded",
                req.conn_header, self._rl_headers + f"Retry-After: {config.retry_after_s}\r\n")
        self.prompt_tokens += prompt_tokens
        response = self._json(200, body, req, self._rl_headers)
        if self._instant and extra_s <= 0 and not (limit and self.in_flight >= limit):
            self.served += 1
            self.completion_tokens += completion_tokens
            self.max_in_flight = max(self.max_in_flight, 1)
            return response
        job = _Job(conn, response, completion_tokens, req.keep_alive, extra_s)
        conn.job = job
        conn.busy = True
        if limit and self.in_flight >= limit:
            self._queue.append(job)
            self.queued += 1
            self.max_queued = max(self.max_queued, self.queued)
        else:
            self._start(job)
        return None

    def _start(self, job: _Job) -> None:
        self._account(time.monotonic())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        job.state = _RUNNING
        delay = self._latency.sample_ms(self._rng) / 1000.0 + self._per_token_s * job.completion_tokens + job.extra_s
        if delay > 0:
            job.handle = self._loop.call_later(delay, self._finish, job)
        else:
            job.handle = self._loop.call_soon(self._finish, job)

    def _finish(self, job: _Job) -> None:
        self._account(time.monotonic())
        self.in_flight -= 1
        job.state = _DONE
        self.served += 1
        self.completion_tokens += job.completion_tokens
        self._pump()
        job.conn.complete(job.response, job.keep_alive)

    def _pump(self) -> None:
        limit = self.config.concurrency
        queue = self._queue
        while queue and (not limit or self.in_flight < limit):
            job = queue.popleft()
            if job.state != _QUEUED:
                continue
            self.queued -= 1
            self._start(job)

    def _cancel_job(self, job: _Job) -> None:
        """The client left: free the slot (as vLLM aborts a disconnected request)."""
        if job.state == _QUEUED:
            job.state = _DONE
            self.queued -= 1
            self.cancelled += 1
        elif job.state == _RUNNING:
            job.state = _DONE
            if job.handle is not None:
                job.handle.cancel()
            self._account(time.monotonic())
            self.in_flight -= 1
            self.cancelled += 1
            self._pump()

    # ----------------------------------------------------------------- other routes

    def _models(self, conn: _Connection, req: _Request) -> bytes:
        if not self._authorized(req):
            return self._unauthorized(req)
        created = int(time.time() - (time.monotonic() - self.started))
        data = [{"id": name, "object": "model", "created": created, "owned_by": SIMULATOR_FINGERPRINT,
                 "simulator": True} for name in self.config.models]
        return self._json(200, {"object": "list", "data": data, "simulator": True}, req)

    def _model(self, conn: _Connection, req: _Request) -> bytes:
        if not self._authorized(req):
            return self._unauthorized(req)
        name = req.path[len("/v1/models/"):]
        return self._json(200, {"id": name, "object": "model", "created": int(time.time()),
                                "owned_by": SIMULATOR_FINGERPRINT, "simulator": True}, req)

    def _health(self, conn: _Connection, req: _Request) -> bytes:
        return self._json(200, {"status": "ok", "simulator": True}, req)

    def _stats_route(self, conn: _Connection, req: _Request) -> bytes:
        return self._json(200, self.stats(), req)

    def _stats_reset(self, conn: _Connection, req: _Request) -> bytes:
        self.reset_stats()
        return self._json(200, self.stats(), req)

    def _faults_get(self, conn: _Connection, req: _Request) -> bytes:
        return self._json(200, self.faults_view(), req)

    def _faults_post(self, conn: _Connection, req: _Request) -> bytes | None:
        try:
            view = self.set_faults(self._load(req) if req.body.strip() else {}, keep=conn)
        except BadRequest as exc:
            return self._bad_request(req, str(exc))
        except (ValueError, TypeError) as exc:
            return self._bad_request(req, str(exc))
        if self._down_until:
            conn.out.append(self._response(200, dumps(view).encode(), _CLOSE))
            conn.closing = True
            conn.flush()
            return None
        return self._json(200, view, req)

    def _config_get(self, conn: _Connection, req: _Request) -> bytes:
        return self._json(200, self.config_view(), req)

    def _config_post(self, conn: _Connection, req: _Request) -> bytes:
        try:
            return self._json(200, self.update_config(self._load(req)), req)
        except BadRequest as exc:
            return self._bad_request(req, str(exc))
        except (ValueError, TypeError) as exc:
            return self._bad_request(req, str(exc))


async def serve(config: SimulatorConfig | None = None) -> SimulatorServer:
    """Start a simulator on the running event loop and return once it listens (no config: a free port)."""
    server = SimulatorServer(config or SimulatorConfig(port=0))
    await server._startup()
    return server
