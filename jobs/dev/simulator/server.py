"""The simulator's HTTP server: routing, faults, rate limits, the concurrency limit and its counters.

``SimulatorServer`` runs on one asyncio event loop, on aiohttp's low-level ``web.Server`` (HTTP/1.1
keep-alive, pipelining, chunked bodies, ``Expect: 100-continue``). An inference request is
authorised, parsed into an ``endpoints.Call`` (400 if invalid), passed through the fault scenario
and the rate-limit buckets, given a hostile answer when the scenario says so (``hostile.py``),
then admitted: answered at once when instant, or held in a concurrency slot for its sampled
latency (queued while every slot is taken). Each request runs in its own handler task, cancelled
when its client leaves, so a hung, queued or in-flight request frees what it holds at once.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import math
import random
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NoReturn

from aiohttp import web
from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from jobs.dev.simulator import hostile
from jobs.dev.simulator.batches import BatchApis
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
_HEADERS = {"Server": "llmstream-simulator", "Content-Type": "application/json"}
_KEEP_ALIVE_10 = "llmstream.keep_alive_10"
"""Request key marking an HTTP/1.0 request that asked for keep-alive (answered ``Connection: keep-alive``)."""

dumps = json.JSONEncoder(separators=(",", ":")).encode
"""Compact JSON, as the bodies and the stats lines are written."""

Headers = dict[str, str]
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


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

    def headers(self, kind: str, into: Headers) -> None:
        full_in = (self.capacity - self.level) / self.rate
        into[f"x-ratelimit-limit-{kind}"] = str(int(self.capacity))
        into[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(self.level)))
        into[f"x-ratelimit-reset-{kind}"] = format_reset(full_in)


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """Drop a connection with a TCP RST and no response, like a crashed server."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    assert isinstance(transport, asyncio.Transport)
    transport.abort()


async def _until_cancelled(limit_s: float) -> NoReturn:
    """Wait for the handler to be cancelled (its client left, or the connection was dropped)."""
    await asyncio.sleep(limit_s)
    raise ConnectionResetError("simulated connection drop")


_Fault = Literal["reset", "hang"]


class SimulatorServer:
    """A running simulator; create it with ``await serve(config)``."""

    def __init__(self, config: SimulatorConfig) -> None:
        self._loop = asyncio.get_running_loop()
        self._web = web.Server(self._handle, request_factory=self._make_request, handler_cancellation=True,
                               access_log=None, max_line_size=_MAX_HEADER_BYTES, max_field_size=_MAX_HEADER_BYTES)
        self._listeners: list[asyncio.Server] = []
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()
        self._down_until = 0.0
        self._down_handle: asyncio.TimerHandle | None = None
        self._stats_handle: asyncio.TimerHandle | None = None
        self._closed = False
        self._ids = 0
        self.host = config.host
        self.port = config.port
        self.started = time.monotonic()
        self.config = config
        self._ssl = config.ssl_context()
        self._hostile_ssl = config.hostile_ssl_context()
        if self._ssl is not None and self._hostile_ssl is not None:
            self._ssl.sni_callback = self._choose_certificate  # called on every handshake, SNI or not
        self._hostile_turn = 0
        self._rng = random.Random(config.seed)
        self._apply_config(config, initial=True)
        self._set_faults(config.faults)
        self._reset_counters()
        self.batch_apis = BatchApis(self)  # files, batches, message batches: every path not routed below
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
        return f"{self.config.scheme}://{host}:{self.port}"

    @property
    def url(self) -> str:
        """OpenAI base URL, ending in ``/v1``."""
        return self.base_url + "/v1"

    async def _listen(self) -> None:
        server = await self._loop.create_server(
            self._web, self.host, self.port, backlog=2048, reuse_address=True, ssl=self._ssl
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
        for conn in self._web.connections:
            if conn.transport is not None:
                conn.transport.abort()
        for server in self._listeners:
            try:
                await asyncio.wait_for(server.wait_closed(), 2.0)
            except TimeoutError:
                pass
        self._listeners = []
        await asyncio.sleep(0)

    @property
    def up(self) -> bool:
        """Listening (not in an outage, not killed)."""
        return not self._down_until

    def kill(self) -> None:
        """Go down until ``revive``: stop listening and drop every connection, as a dead replica does."""
        self._go_down(None, None)

    def revive(self) -> None:
        """End an outage (``kill`` or ``down_for_s``) now: listen again on the same port."""
        if self._down_handle is not None:
            self._down_handle.cancel()
            self._down_handle = None
        if self._down_until:
            self._come_up()

    def _go_down(self, seconds: float | None, keep: RequestHandler | None) -> None:
        """Down for ``seconds``, or until ``revive`` when None."""
        self._down_until = time.monotonic() + seconds if seconds is not None else math.inf
        for server in self._listeners:
            server.close()
        self._listeners = []
        for conn in self._web.connections:
            if conn is not keep:
                _reset(conn.transport)
        if self._down_handle is not None:
            self._down_handle.cancel()
            self._down_handle = None
        if seconds is not None:
            self._down_handle = self._loop.call_later(seconds, self._come_up)
            log.warning("simulated outage: not listening for %.1f s", seconds)
        else:
            log.warning("simulated outage: not listening until revived")

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

    def set_faults(self, body: dict[str, Any], keep: RequestHandler | None = None) -> dict[str, Any]:
        """Apply a ``POST /admin/faults`` body; raises ValueError or TypeError on a bad one.

        A body holding only ``down_for_s`` leaves the scenario alone; ``keep`` is the
        connection spared by an outage (the admin request's, so it gets its answer).
        """
        body = dict(body)
        down = body.pop("down_for_s", 0) or 0
        check_number("down_for_s", down)
        if body or not down:
            faults = FaultSettings.from_dict(body)
            if "tls-cert-change" in faults.hostile and self._hostile_ssl is None:
                raise ValueError("hostile kind tls-cert-change needs --hostile-tls-cert and --hostile-tls-key at start")
            self._set_faults(faults)
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
        view["down_remaining_s"] = (None if self._down_until == math.inf else
                                    round(max(0.0, self._down_until - now), 3) if self._down_until else 0.0)
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
        self.hostile = 0
        self.hostile_kinds: dict[str, int] = {}
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
        those of them that do not validate against it (``invalid_json_rate``). ``hostile`` counts
        hostile answers and handshakes (``hostile.py``), ``hostile_kinds`` each kind's.
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
            "hostile": self.hostile,
            "hostile_kinds": dict(self.hostile_kinds),
            "open_connections": len(self._web.connections),
            "uptime_s": round(now - self.started, 3),
            "since_reset_s": round(window, 3),
            "concurrency_limit": self.config.concurrency,
            "latency": self.config.latency,
            "per_token_ms": self.config.per_token_ms,
            "rpm": self.config.rpm,
            "tpm": self.config.tpm,
            "faults": self.faults_view(),
            "batches": self.batch_apis.stats(),
        }

    def reset_stats(self) -> None:
        self._reset_counters()
        self.batch_apis.reset_stats()

    # ----------------------------------------------------------------- responses

    def _make_request(self, message: RawRequestMessage, payload: StreamReader, protocol: RequestHandler,
                      writer: Any, task: asyncio.Task[None]) -> web.BaseRequest:
        """aiohttp's request, with a 32 MiB body limit; an HTTP/1.0 request is answered as HTTP/1.1
        (RFC 9110 section 6.2) with an explicit ``Connection`` header."""
        keep_alive_10 = False
        if message.version == HttpVersion10:
            keep_alive_10 = not message.should_close
            message = message._replace(version=HttpVersion11)
        request = web.BaseRequest(message, payload, protocol, writer, task, self._loop,
                                  client_max_size=_MAX_BODY_BYTES)
        if keep_alive_10:
            request[_KEEP_ALIVE_10] = True
        return request

    def _json(self, status: int, data: Any, extra: Headers | None = None) -> web.Response:
        headers = _HEADERS if extra is None else {**_HEADERS, **extra}
        return web.Response(status=status, body=dumps(data).encode(), headers=headers)

    def _error_response(self, status: int, message: str, kind: str, code: str | None,
                        extra: Headers | None = None, param: str | None = None) -> web.Response:
        return self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": code}},
                          extra)

    def _bad_request(self, message: str, param: str | None = None) -> web.Response:
        self.bad_requests += 1
        return self._error_response(400, message, "invalid_request_error", None, param=param)

    # ----------------------------------------------------------------- dispatch

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._down_until:  # accepted just before an outage began: no answer
            _reset(request.transport)
            await _until_cancelled(1.0)
        path = request.path
        methods = self._routes.get(path)
        response: web.StreamResponse
        if self.config.tls_client_ca is not None and not (request.transport and request.transport.get_extra_info("peercert")):
            response = self._error_response(400, "No required SSL certificate was sent (simulator: mutual TLS, "
                                                 "a client certificate signed by --tls-client-ca is required)",
                                            "invalid_request_error", "client_certificate_required")
        elif methods is None:
            if path.startswith("/v1/models/") and request.method == "GET":
                response = self._model(request)
            elif (batch_answer := await self.batch_apis.handle(request)) is not None:
                response = batch_answer
            else:
                response = self._error_response(404, f"Unknown request URL: {request.method} {path}",
                                                "invalid_request_error", "unknown_url")
        else:
            handler = methods.get(request.method)
            if handler is None:
                response = self._error_response(405, f"Method {request.method} not allowed on {path}",
                                                "invalid_request_error", "method_not_allowed",
                                                {"Allow": ", ".join(methods)})
            else:
                response = await handler(request)
        if _KEEP_ALIVE_10 in request and response.keep_alive is not False:
            response.headers["Connection"] = "keep-alive"
        if "tls-cert-change" in self._faults.hostile and not response.prepared:
            response.force_close()  # so the next request shakes hands, and may meet the other certificate
        return response

    def authorized(self, request: web.BaseRequest) -> bool:
        if self._auth is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode("utf-8", "replace"), self._auth.encode())

    def _unauthorized(self) -> web.Response:
        return self._error_response(401, "Incorrect or missing API key (simulator)", "invalid_request_error",
                                    "invalid_api_key")

    def _missing_header(self, request: web.BaseRequest) -> web.Response | None:
        """401 naming the first of ``required_headers`` the request lacks or carries another value of."""
        for name, value in self.config.required_headers:
            given = request.headers.get(name, "")
            if not hmac.compare_digest(given.encode("utf-8", "replace"), value.encode()):
                return self._error_response(401, f"Missing or wrong header {name} (simulator)",
                                            "invalid_request_error", "missing_header")
        return None

    async def _load(self, request: web.BaseRequest, empty_ok: bool = False) -> dict[str, Any]:
        """The JSON object of the body (``{}`` for an empty one if ``empty_ok``); answers
        ``Expect: 100-continue`` before reading it."""
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        body = await request.read()  # over _MAX_BODY_BYTES: aiohttp answers 413
        if empty_ok and not body.strip():
            return {}
        try:
            payload = json.loads(body)
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

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            self.requests_total += 1
            if self._auth is not None and not self.authorized(request):
                return self._unauthorized()
            if self.config.required_headers and (refused := self._missing_header(request)) is not None:
                return refused
            try:
                call = endpoint(self.config, await self._load(request))
            except BadRequest as exc:
                return self._bad_request(str(exc), exc.param)
            limit_headers: Headers = {}
            early = self._gate(call.token_cost, limit_headers)
            if isinstance(early, str):
                return await self._take_over(request, early)
            if early is not None:
                return early
            kind = self._hostile_kind()
            if kind is not None:
                return await self._hostile(request, kind, call)
            shaped = call if isinstance(call, (Chat, Completions)) and call.schema is not None else None
            if shaped is not None:
                shaped.spoil = self._rng.random() < self.config.invalid_json_rate
            body = call.respond(self._next_id)
            response = await self._admit(body, call.prompt_tokens, call.completion_tokens, limit_headers,
                                         call.extra_latency_s(self.config))
            if shaped is not None and response.status == 200:  # sent (now or after its latency)
                valid, invalid = shaped.schema_answers
                self.structured_answers += valid + invalid
                self.invalid_answers += invalid
            return response

        return handle

    # ----------------------------------------------------------------- gate and admission

    def _gate(self, token_cost: int, limit_headers: Headers) -> web.Response | _Fault | None:
        """Faults, then rate limits: a response, a fault that takes the connection over, or None to go on.

        While a rate limit is set, its ``x-ratelimit-*`` headers are put in ``limit_headers``."""
        faults = self._faults
        if faults.total_rate > 0 or self._faults_until is not None:
            faults = self._current_faults()
            if faults.total_rate > 0:
                u = self._rng.random()
                if u < faults.reset_rate:
                    self.resets += 1
                    return "reset"
                u -= faults.reset_rate
                if u < faults.hang_rate:
                    self.hangs += 1
                    return "hang"
                u -= faults.hang_rate
                if u < faults.error_rate:
                    self.errors += 1
                    status = faults.error_status
                    extra = {"Retry-After": str(faults.retry_after_s)} if status in (429, 503) else None
                    return self._error_response(status, f"Simulated error {status} (fault injection)",
                                                "server_error" if status >= 500 else "invalid_request_error",
                                                "simulated_fault", extra)
                u -= faults.error_rate
                if u < faults.rate_limit_rate:
                    self.rejected += 1
                    return self._error_response(
                        429, "Simulated rate limit (fault injection); retry later", "requests",
                        "rate_limit_exceeded", {"Retry-After": str(faults.retry_after_s)})
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
                headers: Headers = {}
                self._limit_headers(headers)
                headers["Retry-After"] = str(max(1, math.ceil(wait)))
                return self._error_response(
                    429, f"Rate limit reached for {kind} (simulator); retry after {wait:.2f} s", kind,
                    "rate_limit_exceeded", headers)
            if self._rpm is not None:
                self._rpm.take(1)
            if self._tpm is not None:
                self._tpm.take(token_cost)
            self._limit_headers(limit_headers)
        return None

    def _hostile_kind(self) -> str | None:
        """The hostile kind this request's answer is (the next in turn), or None for the usual answer."""
        if not self._faults.hostile:
            return None
        faults = self._current_faults()
        kinds = faults.hostile_answers
        if not kinds or self._rng.random() >= faults.hostile_rate:
            return None
        kind = kinds[self._hostile_turn % len(kinds)]
        self._hostile_turn += 1
        self._count_hostile(kind)
        return kind

    def _count_hostile(self, kind: str) -> None:
        self.hostile += 1
        self.hostile_kinds[kind] = self.hostile_kinds.get(kind, 0) + 1

    async def _hostile(self, request: web.BaseRequest, kind: str, call: Call) -> web.StreamResponse:
        """The hostile answer of ``kind``; one left unfinished ends with the connection reset."""
        try:
            response = await hostile.answer(kind, request, call, call.respond(self._next_id),
                                            size_bytes=self.config.hostile_size_bytes,
                                            hang_max_s=self.config.hang_max_s)
        except ConnectionError:  # the client left while it was written
            response = None
        if response is None:
            _reset(request.transport)
            await _until_cancelled(1.0)
        return response

    def _choose_certificate(self, sslobj: ssl.SSLObject, server_name: str | None,
                            context: ssl.SSLContext) -> None:
        """The TLS handshake's certificate: ``--hostile-tls-cert`` for ``hostile_rate`` of the
        handshakes while ``tls-cert-change`` is set, else the usual one."""
        if "tls-cert-change" not in self._faults.hostile or self._hostile_ssl is None:
            return
        faults = self._current_faults()
        if "tls-cert-change" in faults.hostile and self._rng.random() < faults.hostile_rate:
            self._count_hostile("tls-cert-change")
            sslobj.context = self._hostile_ssl

    def _limit_headers(self, into: Headers) -> None:
        if self._rpm is not None:
            self._rpm.headers("requests", into)
        if self._tpm is not None:
            self._tpm.headers("tokens", into)

    async def _take_over(self, request: web.BaseRequest, fault: _Fault) -> web.StreamResponse:
        """Reset the connection now, or hang: hold it unanswered until the client leaves or
        ``hang_max_s`` passes, then reset it. Either way the client gets no response."""
        if fault == "hang":
            await asyncio.sleep(self.config.hang_max_s)
        _reset(request.transport)
        await _until_cancelled(1.0)

    async def _admit(self, body: dict[str, Any], prompt_tokens: int, completion_tokens: int,
                     limit_headers: Headers, extra_s: float = 0.0) -> web.Response:
        """Answer over the concurrency limit (429), at once, or after holding a slot for the latency."""
        config = self.config
        limit = config.concurrency
        if limit and self.in_flight >= limit and config.reject_over_limit:
            self.rejected += 1
            self.over_limit += 1
            return self._error_response(
                429, "Simulator concurrency limit reached; retry later", "requests", "rate_limit_exceeded",
                {**limit_headers, "Retry-After": str(config.retry_after_s)})
        self.prompt_tokens += prompt_tokens
        response = self._json(200, body, limit_headers or None)
        if self._instant and extra_s <= 0 and not (limit and self.in_flight >= limit):
            self.served += 1
            self.completion_tokens += completion_tokens
            self.max_in_flight = max(self.max_in_flight, 1)
            return response
        if limit and self.in_flight >= limit:
            await self._wait_for_slot()
        else:
            self._take_slot()
        try:
            delay = self._latency.sample_ms(self._rng) / 1000.0 + self._per_token_s * completion_tokens + extra_s
            if delay > 0:
                await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            self._release_slot()
            raise
        self.served += 1
        self.completion_tokens += completion_tokens
        self._release_slot()
        return response

    async def _wait_for_slot(self) -> None:
        """Queue (FIFO) until ``_pump`` hands this request a slot; leaving the queue counts as cancelled."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._queue.append(waiter)
        self.queued += 1
        self.max_queued = max(self.max_queued, self.queued)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # the slot was handed over as the client left
                self.cancelled += 1
                self._release_slot()
            else:
                waiter.cancel()
                self.queued -= 1
                self.cancelled += 1
            raise

    def _take_slot(self) -> None:
        self._account(time.monotonic())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _release_slot(self) -> None:
        self._account(time.monotonic())
        self.in_flight -= 1
        self._pump()

    def _pump(self) -> None:
        limit = self.config.concurrency
        queue = self._queue
        while queue and (not limit or self.in_flight < limit):
            waiter = queue.popleft()
            if waiter.done():
                continue
            self.queued -= 1
            self._take_slot()
            waiter.set_result(None)

    # ----------------------------------------------------------------- other routes

    async def _models(self, request: web.BaseRequest) -> web.Response:
        if not self.authorized(request):
            return self._unauthorized()
        created = int(time.time() - (time.monotonic() - self.started))
        data = [{"id": name, "object": "model", "created": created, "owned_by": SIMULATOR_FINGERPRINT,
                 "simulator": True} for name in self.config.models]
        return self._json(200, {"object": "list", "data": data, "simulator": True})

    def _model(self, request: web.BaseRequest) -> web.Response:
        if not self.authorized(request):
            return self._unauthorized()
        name = request.path[len("/v1/models/"):]
        return self._json(200, {"id": name, "object": "model", "created": int(time.time()),
                                "owned_by": SIMULATOR_FINGERPRINT, "simulator": True})

    async def _health(self, request: web.BaseRequest) -> web.Response:
        return self._json(200, {"status": "ok", "simulator": True})

    async def _stats_route(self, request: web.BaseRequest) -> web.Response:
        return self._json(200, self.stats())

    async def _stats_reset(self, request: web.BaseRequest) -> web.Response:
        self.reset_stats()
        return self._json(200, self.stats())

    async def _faults_get(self, request: web.BaseRequest) -> web.Response:
        return self._json(200, self.faults_view())

    async def _faults_post(self, request: web.BaseRequest) -> web.Response:
        """Answered before an outage (``down_for_s``) takes the listener down, then the connection closes."""
        try:
            view = self.set_faults(await self._load(request, empty_ok=True), keep=request.protocol)
        except (BadRequest, ValueError, TypeError) as exc:
            return self._bad_request(str(exc))
        response = self._json(200, view)
        if self._down_until:
            response.force_close()
        return response

    async def _config_get(self, request: web.BaseRequest) -> web.Response:
        return self._json(200, self.config_view())

    async def _config_post(self, request: web.BaseRequest) -> web.Response:
        try:
            return self._json(200, self.update_config(await self._load(request)))
        except (BadRequest, ValueError, TypeError) as exc:
            return self._bad_request(str(exc))


async def serve(config: SimulatorConfig | None = None) -> SimulatorServer:
    """Start a simulator on the running event loop and return once it listens (no config: a free port)."""
    server = SimulatorServer(config or SimulatorConfig(port=0))
    await server._startup()
    return server
