"""The HTTP side of an inference call: one JSON body POSTed to the model server, one parsed
2xx body back, or an `InferenceError` saying what went wrong.

`Transport` owns the pooled `aiohttp` session (aiohttp because this is the hot path, and it
serves many times the requests a second of `requests`: docs/performance.md, "The client's
JSON"), created on first use in the running event loop with
`async.capacity` connections; the request headers (`model.headers`, their `${env:}` /
`${file:}` placeholders resolved once per client, and the API key read for each call by
`JobConfig.api_key()`); `redact`, which keeps those secrets out of every error detail; and
the mapping of an answer to an error: `status_error` (an overload status -> `RateLimited`,
another retryable one -> `RetryableError`, any other non-2xx -> `PermanentError`, as the table
in `udfs/inference/statuses.py` says), timeouts and connection errors -> `RetryableError`, TLS
failures -> `TlsError`. A non-2xx answer is a `Reply` value that carries its error and the
server's `Retry-After`; what pauses for that is the caller's business (`Fleet`, per endpoint).
It sends once: retrying is `RetryPolicy`'s business (`udfs/inference/retry.py`), reading a 2xx
body is `udfs/inference/responses.py`'s.

Bounded reads: whatever a server sends, the worker holds at most `model.max_response_bytes` of
one 2xx answer and `MAX_ERROR_BODY_BYTES` of an error body. A 2xx whose Content-Length is over
the bound is refused unread; one without it (chunked, or streaming without end) is read in
chunks and given up the moment it passes the bound. Either way the connection is closed, not
returned to the pool half-read, and the attempt fails as `ResponseTooLarge` (a retryable error
without an answer, as a timeout is: retried, and counted towards a fleet endpoint's circuit). An error body is read up to its cap and the rest discarded with the connection: only its
start can reach a dead letter (`MAX_DETAIL_CHARS`).

TLS: `tls_context` is built once per client, on the worker: a CA bundle replaces the
system's trust store, a client certificate and key are presented for mutual TLS, and
`verify: false` (allowed only with `allow_insecure`, checked at load) turns certificate
checks off. A key file that is encrypted is refused instead of letting OpenSSL prompt on the
worker's terminal. `tls_failure` tells a TLS failure (untrusted or misnamed certificate, a
refused or missing client certificate, a failed handshake) from a connection that merely
dropped: the first is a setting to fix, a `TlsError` dead-lettered after one attempt; the
second is retried.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import gc
import json
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp

from udfs import secret_refs
from udfs.errors import (
    ConfigError,
    InferenceError,
    PermanentError,
    RateLimited,
    ResponseTooLarge,
    RetryableError,
    TlsError,
    UnsupportedResponse,
)
from udfs.inference.retry import parse_retry_after
from udfs.inference.statuses import of_status
from udfs.metrics import InferenceMetrics
from udfs.records import fastjson

if TYPE_CHECKING:
    from udfs.config import EndpointConfig, JobConfig, ModelTlsConfig

log = logging.getLogger(__name__)

API_PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}
MAX_DETAIL_CHARS = 300
MAX_ERROR_BODY_BYTES = 65_536
"""The most of a non-2xx body read: enough for any error message a dead letter quotes (cut to
`MAX_DETAIL_CHARS`) inside an HTML page or JSON envelope, far too little to matter in memory."""
READ_CHUNK_BYTES = 65_536
SECRET_HEADER_WORDS = ("auth", "key", "token", "secret", "cookie", "signature")


class Transport:
    """POSTs request bodies to the endpoint of `model.api`; see the module for what it raises.

    Counts `requests` (every attempt sent) and `in_flight` in `metrics`. Use from one event
    loop; `close()` may come from another (see there).
    """

    def __init__(self, config: JobConfig, metrics: InferenceMetrics, endpoint: EndpointConfig | None = None) -> None:
        """`endpoint`: one endpoint of a fleet (its URL, headers and key); none: `model.endpoint`."""
        self._config = config
        self._metrics = metrics
        self._endpoint = endpoint
        base = endpoint.url if endpoint is not None else config.model.endpoint
        assert base is not None, "model.endpoint or an endpoint of model.endpoints"
        self.url = base.rstrip("/") + API_PATHS[config.model.api]
        parts = urlsplit(self.url)
        self._host = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
        self._timeout = aiohttp.ClientTimeout(total=config.async_.request_timeout_s)
        self._max_response_bytes = config.model.max_response_bytes
        self._ssl = tls_context(config.model.tls)
        configured = {**config.model.headers, **(endpoint.headers if endpoint is not None else {})}
        self._headers = secret_refs.resolve_all(configured, "model.headers")
        if not any(name.lower() == "content-type" for name in self._headers):
            self._headers["Content-Type"] = "application/json"  # the body is sent as bytes (`post`)
        self._secret_headers = [self._headers[name] for name, value in configured.items()
                                if secret_refs.has_placeholder(value)
                                or any(word in name.lower() for word in SECRET_HEADER_WORDS)]
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"Transport(url={self.url!r})"

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The HTTP session, once the first call created it."""
        return self._session

    def _session_in_loop(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            if self._session is not None and not self._session.closed:
                log.warning("inference client used from a new event loop; its old session is abandoned")
            connector = aiohttp.TCPConnector(limit=self._config.async_.capacity, limit_per_host=0, ssl=self._ssl)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
            self._session_loop = loop
        return self._session

    def request_headers(self) -> dict[str, str]:
        """The headers of a model call, the API key read now: a batch of calls reads them once."""
        headers = dict(self._headers)
        key = self._api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _api_key(self) -> str | None:
        return self._endpoint.api_key() if self._endpoint is not None else self._config.api_key()

    def redact(self, text: str) -> str:
        """`text` without the API key or the value of a configured header that came from a
        placeholder or whose name looks secret."""
        for secret in [self._api_key() or "", *self._secret_headers]:
            if len(secret) >= 4:
                text = text.replace(secret, "***")
        return text

    def _quote(self, text: str) -> str:
        """What a server sent (or an error quoting it), fit for an error detail: redacted, then cut
        to `MAX_DETAIL_CHARS`, in that order, so a cut never leaves part of a secret behind."""
        return self.redact(text)[:MAX_DETAIL_CHARS]

    async def post(self, payload: dict[str, Any], label: str, attempt: int,
                   headers: dict[str, str] | None = None) -> Reply:
        """One HTTP call: the server's answer as a `Reply` (a 2xx's parsed body, or a non-2xx's error
        and `Retry-After`); raises `RetryableError`/`PermanentError` when no usable answer came
        (a timeout, a connection or TLS failure, a 2xx body that is not a JSON object). `headers`:
        `request_headers()` as the caller's batch read them (none: read now)."""
        session = self._session_in_loop()
        self._metrics.requests.inc()
        self._metrics.in_flight += 1
        log.debug("request %s attempt %d: POST %s", label, attempt, self.url)
        try:
            # The body as orjson writes it (`fastjson`): aiohttp's `json=` wants a str, which would
            # be decoded from those bytes only to be encoded again.
            async with session.post(self.url, data=fastjson.dumps(payload),
                                    headers=headers if headers is not None else self.request_headers(),
                                    allow_redirects=False) as response:
                status = response.status
                if 200 <= status < 300:
                    body = _json_object(status, await self._answer(response))
                    log.debug("request %s attempt %d: HTTP %d", label, attempt, status)
                    failed = error_in_answer(body)
                    if failed is not None:  # a 2xx that failed anyway: retried like a 5xx
                        return Reply(refusal=RetryableError(f"HTTP {status} with an error instead of an answer: "
                                                            f"{self._quote(failed)}", status=status))
                    return Reply(body=body)
                text = self.redact(await _error_text(response))
                location = response.headers.get("Location")
                if location is not None:
                    location = self._quote(location)
                retry_after = parse_retry_after(response.headers, max_s=self._config.retry.max_retry_after_s)
        except InferenceError:
            raise
        except aiohttp.InvalidURL as err:
            raise PermanentError(f"invalid URL: {err}") from None
        except (TimeoutError, aiohttp.ClientError) as err:
            raise self._no_answer(err, "", self._config.async_.request_timeout_s) from None
        finally:
            self._metrics.in_flight -= 1
        log.debug("request %s attempt %d: HTTP %d, retry-after %s", label, attempt, status, retry_after)
        return Reply(refusal=status_error(status, server_message(text), location=location), retry_after_s=retry_after)

    async def exchange(self, method: str, url: str, *, headers: dict[str, str], limit: int, timeout_s: float,
                       **kwargs: Any) -> tuple[int, bytes]:
        """One HTTP call that is not a model call (a provider's batch API: files, batches) on the same
        session, TLS and redaction: a 2xx's status and body, at most `limit` bytes (else
        `ResponseTooLarge`); otherwise the error its status means (`status_error`), a timeout or a
        dropped connection as `RetryableError`, a TLS failure as `TlsError`. `headers` are sent as
        given (a provider names its key its own way)."""
        async with self.streamed(method, url, headers=headers, timeout_s=timeout_s, **kwargs) as response:
            body, complete = await read_bounded(response, limit)
            if not complete:
                response.close()
                raise ResponseTooLarge(f"{method} {url}: answer over {limit} bytes", status=response.status)
            return response.status, body

    @contextlib.asynccontextmanager
    async def streamed(self, method: str, url: str, *, headers: dict[str, str], timeout_s: float,
                       **kwargs: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """A 2xx response whose body the caller reads as it likes (a provider's result file, line by
        line), failures raised as `exchange` raises them, also while the body is read."""
        session = self._session_in_loop()
        try:
            async with session.request(method, url, headers=headers, allow_redirects=False,
                                       timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as response:
                if not 200 <= response.status < 300:
                    text = self.redact(await _error_text(response))
                    raise status_error(response.status, server_message(text), location=None)
                yield response
        except InferenceError:
            raise
        except (TimeoutError, aiohttp.ClientError) as err:
            raise self._no_answer(err, f"{method} {url}: ", timeout_s) from None

    def _no_answer(self, err: TimeoutError | aiohttp.ClientError, said: str, timeout_s: float) -> InferenceError:
        """What a call that got no usable answer failed as: a TLS failure (`TlsError`), else a timeout
        or a dropped connection (`RetryableError`); `said` begins its detail."""
        if isinstance(err, TimeoutError):
            return RetryableError(f"{said}no response within {timeout_s:g} s")
        tls = tls_failure(err, self._host)
        if tls is not None:
            return tls
        return RetryableError(self._quote(f"{said}{type(err).__name__}: {err}"))

    async def _answer(self, response: aiohttp.ClientResponse) -> bytes:
        """The whole 2xx body, or `ResponseTooLarge` once it is known to pass
        `model.max_response_bytes` (the connection is then closed)."""
        limit = self._max_response_bytes
        declared = _declared_length(response)
        if declared is not None:
            if declared > limit:
                response.close()
                raise ResponseTooLarge(f"HTTP {response.status} answer of {declared} bytes (Content-Length) is "
                                       f"over model.max_response_bytes ({limit}); not read", status=response.status)
            return await response.read()  # exactly Content-Length bytes: the hot path, as fast as before
        body, complete = await read_bounded(response, limit)
        if not complete:
            response.close()
            raise ResponseTooLarge(f"HTTP {response.status} answer passed model.max_response_bytes ({limit}) "
                                   "while it was read; the rest was not read", status=response.status)
        return body

    async def close(self) -> None:
        """Closes the session and its pooled connections; the transport may be used again after.

        Usually called on the loop the calls ran on (`CallRunner.close` runs the client's
        `close()` there before it stops that loop). Safe from another loop too: if the calls'
        loop still runs, the session is closed on it; if it is closed, the sockets cannot be
        closed through it, so the session drops them and a garbage collection closes them now
        rather than at some later collection.
        """
        session, loop = self._session, self._session_loop
        self._session = self._session_loop = None
        if session is None or session.closed:
            return
        if loop is None or loop is asyncio.get_running_loop():
            await session.close()
        elif loop.is_running():
            done = asyncio.run_coroutine_threadsafe(session.close(), loop)
            await asyncio.wait_for(asyncio.wrap_future(done), timeout=5.0)
        else:
            log.debug("inference client closed after its event loop; collecting its connections")
            await session.close()
            gc.collect()


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the body (as decoded from any Content-Encoding) and whether that is
    all of it. `False`: the body is longer (what was read is its start, and reading stopped
    within one chunk past the bound); the caller closes the response so the rest is never read."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
        total += len(chunk)
        chunks.append(chunk)
        if total > limit:
            return b"".join(chunks)[:limit], False
    return b"".join(chunks), True


def _declared_length(response: aiohttp.ClientResponse) -> int | None:
    """The body's length as Content-Length gives it, when that is the length read (no encoding
    such as gzip in between)."""
    if response.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
        return None
    return response.content_length


async def _error_text(response: aiohttp.ClientResponse) -> str:
    """The start of a non-2xx body (`MAX_ERROR_BODY_BYTES`) as text; the rest is discarded with
    the connection."""
    body, complete = await read_bounded(response, MAX_ERROR_BODY_BYTES)
    if not complete:
        response.close()
    charset = response.charset or "utf-8"
    try:
        if not codecs.lookup(charset)._is_text_encoding:  # e.g. base64 or rot13: a codec, but not of text
            charset = "utf-8"
    except LookupError:
        charset = "utf-8"
    return body.decode(charset, errors="replace")


def _json_object(status: int, raw: bytes) -> dict[str, Any]:
    """A 2xx body as a JSON object, or `UnsupportedResponse` (not UTF-8 JSON, or not an object;
    the parser's message says where, and quotes none of it)."""
    try:
        body = fastjson.loads(raw)
    except (ValueError, RecursionError) as err:
        raise UnsupportedResponse(f"HTTP {status} with a body that is not JSON: {err}"[:MAX_DETAIL_CHARS],
                                  status=status) from None
    if not isinstance(body, dict):
        raise UnsupportedResponse(f"HTTP {status} with a JSON {type(body).__name__}, expected an object",
                                  status=status)
    return body


def error_in_answer(body: dict[str, Any]) -> str | None:
    """The message of an OpenAI error object a 2xx body holds instead of an answer (no `choices`,
    no `data`), else None."""
    if "error" not in body or "choices" in body or "data" in body:
        return None
    return _error_message(body) or "(no message)"


@dataclass(frozen=True)
class Reply:
    """What the server answered to one POST: the parsed `body` of a 2xx, or the `refusal` a non-2xx
    answer becomes (`status_error`) with the server's `retry_after_s` (`parse_retry_after`, capped
    at `retry.max_retry_after_s`). The hint is a value here, never an attribute of the error: one
    place pauses for it (`Fleet.release`, the endpoint that sent it), and the retry layer does not
    wait for it a second time."""

    body: dict[str, Any] | None = None
    refusal: InferenceError | None = None
    retry_after_s: float | None = None


def status_error(status: int, message: str, *, location: str | None = None) -> InferenceError:
    """The error a non-2xx answer becomes, by `statuses.of_status`: `RateLimited` for an overload
    (the endpoint also slows down), `RetryableError` for another retryable outcome, else
    `PermanentError`."""
    detail = f"HTTP {status}: {message}"
    if 300 <= status < 400:
        detail += f" (redirect to {location!r}, not followed: set model.endpoint to the final URL)"
    outcome = of_status(status)
    if outcome.overload:
        return RateLimited(detail, status=status)
    if outcome.retryable:
        return RetryableError(detail, status=status)
    return PermanentError(detail, status=status)


def server_message(body: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the body's start. Redact `body`
    first (`Transport.redact`): what is cut here cannot be redacted after."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # a body nested deeper than the parser goes is not an error object
        return body.strip()[:MAX_DETAIL_CHARS]
    return (_error_message(parsed) or body.strip())[:MAX_DETAIL_CHARS]


def _error_message(parsed: Any) -> str | None:
    """`error.message` (or `error` itself, a string) of a parsed OpenAI-style error body."""
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return None


# ------------------------------------------------------------------ TLS


def _no_password() -> str:
    raise ConfigError("model.tls.client_key_file", "the key is encrypted; give an unencrypted key file "
                                                   "(readable only by the job's user)")


def tls_context(tls: ModelTlsConfig, path: str = "model.tls") -> ssl.SSLContext | bool:
    """The context for HTTPS calls to the model server, or `True` (aiohttp's default verified
    context) when `model.tls` sets nothing. A file that is not a usable certificate or key is a
    `ConfigError` naming its key."""
    if not (tls.ca_file or tls.client_cert_file or not tls.verify):
        return True
    try:
        context = ssl.create_default_context(cafile=str(Path(tls.ca_file).expanduser()) if tls.ca_file else None)
    except (ssl.SSLError, OSError) as err:
        raise ConfigError(f"{path}.ca_file", f"{tls.ca_file} holds no usable CA certificate ({_ssl_text(err)})") from None
    if tls.client_cert_file and tls.client_key_file:
        try:
            context.load_cert_chain(str(Path(tls.client_cert_file).expanduser()),
                                    str(Path(tls.client_key_file).expanduser()), password=_no_password)
        except (ssl.SSLError, OSError) as err:
            raise ConfigError(f"{path}.client_cert_file", f"{tls.client_cert_file} and {tls.client_key_file} are "
                                                          f"not a usable certificate and key ({_ssl_text(err)})") from None
    if not tls.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _ssl_text(err: BaseException) -> str:
    """The readable part of an OpenSSL message (`[SSL: X] text (_ssl.c:N)` -> `text`)."""
    if isinstance(err, ssl.SSLCertVerificationError) and err.verify_message:
        return f"certificate verify failed: {err.verify_message}"
    text = str(err.args[1]) if len(err.args) > 1 and isinstance(err.args[1], str) else str(err)
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.rsplit(" (_ssl.c:", 1)[0]


def _hint(err: ssl.SSLError) -> str:
    reason = (err.reason or "").upper()
    if isinstance(err, ssl.SSLCertVerificationError):
        if "hostname" in (err.verify_message or "").lower() or "IP address mismatch" in (err.verify_message or ""):
            return "the server's certificate does not name this host: fix model.endpoint or the certificate"
        return "the server's certificate is not trusted: set model.tls.ca_file to the CA that signed it"
    if "CERTIFICATE_REQUIRED" in reason:
        return "the server requires a client certificate: set model.tls.client_cert_file and client_key_file"
    if "ALERT" in reason and ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason):
        return "the server refused the client certificate (model.tls.client_cert_file)"
    if "WRONG_VERSION_NUMBER" in reason:
        return "the server does not speak TLS on this port: is model.endpoint http:// rather than https://?"
    return "check model.endpoint and model.tls"


def _is_tls_failure(err: BaseException, during_connect: bool) -> bool:
    if isinstance(err, aiohttp.ClientError):  # some are ssl errors too: what counts is behind them
        return False
    if isinstance(err, ssl.SSLCertVerificationError):
        return True
    # EOF and other ssl.SSLError subclasses are dropped connections; an alert is the server's verdict
    return type(err) is ssl.SSLError and (during_connect or "ALERT" in (err.reason or "").upper())


def _ssl_cause(err: BaseException, during_connect: bool) -> ssl.SSLError | None:
    """The SSL error behind an aiohttp error if it is a TLS failure rather than a dropped
    connection: a certificate check, an alert from the server, or any handshake error
    other than an unexpected EOF."""
    todo: list[BaseException | None] = [err]
    seen: set[int] = set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if _is_tls_failure(current, during_connect):
            assert isinstance(current, ssl.SSLError)
            return current
        todo += [current.__cause__, current.__context__, getattr(current, "certificate_error", None),
                 getattr(current, "os_error", None)]
    return None


def tls_failure(err: aiohttp.ClientError, host: str) -> TlsError | None:
    """A `TlsError` saying what failed and which setting to look at, if `err` is a TLS failure."""
    cause = _ssl_cause(err, during_connect=isinstance(err, aiohttp.ClientSSLError))
    if cause is None:
        return None
    return TlsError(f"TLS with {host} failed: {_ssl_text(cause)}; {_hint(cause)}"[:MAX_DETAIL_CHARS])
