"""A client of a Confluent-compatible Schema Registry, on the job's path (`input.format: avro`,
`output.format: avro`).

Only what the job needs of Confluent's REST API: a schema by id (`GET /schemas/ids/{id}`, what
decoding a wire-format record needs), registering a schema under a subject
(`POST /subjects/{subject}/versions`, the output schema at start) and a subject's
compatibility (`PUT /config/{subject}`). Apicurio (`/apis/ccompat/v7`), Confluent and Karapace
all serve it. `requests`, not aiohttp: the calls are rare (a schema is fetched once per id and
kept, `schema_registry.cache_size`) and made from the operator thread, where blocking is the
backpressure the stage wants while the registry is down.

Errors are data: a registry that does not answer (connection refused, timeout, 5xx, 429) is
retried with exponential backoff and full jitter for `schema_registry.unavailable_timeout_s`,
then `RegistryUnavailable`; a schema it does not have is `SchemaNotFound`; a registration it
refuses (incompatible, invalid) is `SchemaRejected`; credentials it refuses (401/403) are
`RegistryRefused`, not retried; an answer over `MAX_ANSWER_BYTES` is `RegistryAnswerTooLarge`,
not retried either. Messages name `schema_registry.url` and what happened (the
exception's class, the HTTP status, the registry's own message), never a credential: the URL may
not hold any (checked at load) and basic-auth values are resolved here from their placeholders
and handed to `requests` only.

Bounded reads: answers are streamed and read in chunks, an answer at most `MAX_ANSWER_BYTES`
(refused unread when its Content-Length says more), an error body at most `MAX_ERROR_BODY_BYTES`
(only its message is quoted); what is not read is dropped with the connection, so a registry
or proxy that answers without end cannot fill the worker's memory.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import requests

from udfs import secret_refs
from udfs.errors import LLMStreamError

if TYPE_CHECKING:
    from udfs.config import SchemaRegistryConfig

log = logging.getLogger("llmstream.registry")

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
INITIAL_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_ANSWER_BYTES = 16_777_216
"""The most of one 2xx answer read: far above any schema or subject list a registry holds (a large
Avro schema is some hundreds of KiB), small enough that no answer can take the worker's memory."""
MAX_ERROR_BODY_BYTES = 65_536
"""The most of an error body read, for the registry's `message` (quoted cut to 300 characters)."""
READ_CHUNK_BYTES = 65_536


class RegistryError(LLMStreamError):
    """Base of what the registry client raises; `str()` is safe to log and to put in a dead letter."""


class RegistryUnavailable(RegistryError):
    """The registry did not answer within `schema_registry.unavailable_timeout_s`, retries included."""


class RegistryRefused(RegistryError):
    """The registry refused the credentials (401/403): settings, not luck, so not retried."""


class SchemaNotFound(RegistryError):
    """The registry has no schema with that id (or no such subject)."""


class SchemaRejected(RegistryError):
    """The registry refused to register a schema: incompatible with the subject's versions, or invalid."""


class RegistryAnswerTooLarge(RegistryError):
    """The registry's answer passed `MAX_ANSWER_BYTES`: no schema is that large, so it is a broken
    registry or proxy, and asking again would read the same again."""


class RegistryClient:
    """Confluent's schema API at `config.url`, with a schema cache by id and one retry loop.

    `sleep` and `clock` are injectable so tests need not wait for real backoffs."""

    def __init__(self, config: SchemaRegistryConfig, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._base = config.url.rstrip("/")
        self._sleep = sleep
        self._clock = clock
        self._session = requests.Session()
        self._session.headers["Accept"] = f"{CONTENT_TYPE}, application/json"
        if config.username is not None and config.password is not None:
            self._session.auth = (secret_refs.resolve(config.username, "schema_registry.username"),
                                  secret_refs.resolve(config.password, "schema_registry.password"))
        self._schemas: OrderedDict[int, tuple[str, Any]] = OrderedDict()

    def close(self) -> None:
        self._session.close()

    # ------------------------------------------------------------------ the API
    def schema(self, schema_id: int) -> tuple[str, Any]:
        """(schema type, parsed schema JSON) of `schema_id`, from the cache or the registry.
        The type is `AVRO` unless the registry says otherwise (Confluent omits it for Avro)."""
        found = self._schemas.get(schema_id)
        if found is not None:
            self._schemas.move_to_end(schema_id)
            return found
        body = self._request("GET", f"/schemas/ids/{schema_id}", what=f"schema id {schema_id}")
        try:
            parsed = (str(body.get("schemaType") or "AVRO"), json.loads(body["schema"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise SchemaNotFound(f"schema_registry.url answered for schema id {schema_id} without a "
                                 "readable schema") from None
        self._schemas[schema_id] = parsed
        while len(self._schemas) > self._config.cache_size:
            self._schemas.popitem(last=False)
        return parsed

    def register(self, subject: str, schema: Any) -> int:
        """Registers `schema` (Avro, as JSON data) under `subject` and returns its id; the same
        schema registered again returns the same id."""
        body = self._request("POST", f"/subjects/{quote(subject, safe='')}/versions",
                             payload={"schema": json.dumps(schema, separators=(",", ":"))},
                             what=f"registering under subject {subject!r}")
        try:
            schema_id = int(body["id"])
        except (KeyError, TypeError, ValueError):
            raise SchemaRejected(f"schema_registry.url answered the registration under {subject!r} "
                                 "without an id") from None
        self._schemas[schema_id] = ("AVRO", schema)
        return schema_id

    def subject_exists(self, subject: str) -> bool:
        try:
            self._request("GET", f"/subjects/{quote(subject, safe='')}/versions", what=f"subject {subject!r}")
        except SchemaNotFound:
            return False
        return True

    def set_compatibility(self, subject: str, level: str) -> None:
        """Sets a subject's compatibility level (`BACKWARD`, ...)."""
        self._request("PUT", f"/config/{quote(subject, safe='')}", payload={"compatibility": level},
                      what=f"compatibility of subject {subject!r}")

    def ping(self) -> None:
        """One request, no retries: raises `RegistryUnavailable`/`RegistryRefused` if it fails (preflight)."""
        self._request("GET", "/subjects", what="the subject list", retry=False)

    # ------------------------------------------------------------------ transport and retries
    def _request(self, method: str, path: str, *, what: str, payload: Any = None, retry: bool = True) -> Any:
        """One call with retries while the registry does not answer; the parsed JSON answer."""
        started = self._clock()
        attempt = 0
        while True:
            attempt += 1
            problem = self._attempt(method, path, payload, what)
            if not isinstance(problem, str):
                return problem[0]
            waited = self._clock() - started
            if not retry or waited >= self._config.unavailable_timeout_s:
                raise RegistryUnavailable(
                    f"schema_registry.url did not answer ({what}) after {attempt} attempt(s) in {waited:.1f} s: "
                    f"{problem}")
            backoff = random.uniform(0, min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** min(attempt - 1, 16)))
            backoff = min(backoff, max(0.0, self._config.unavailable_timeout_s - waited))
            log.debug("schema registry: %s failed (%s); retry %d in %.2f s", what, problem, attempt, backoff)
            self._sleep(backoff)

    def _attempt(self, method: str, path: str, payload: Any, what: str) -> tuple[Any] | str:
        """(answer,) on success, a retryable problem as text, or raises for an answer that is final."""
        try:
            response = self._session.request(
                method, self._base + path, timeout=self._config.timeout_s, stream=True,
                data=None if payload is None else json.dumps(payload),
                headers=None if payload is None else {"Content-Type": CONTENT_TYPE})
        except requests.RequestException as err:
            return type(err).__name__
        with response:  # closes the connection unless the body was read to its end
            status = response.status_code
            if status in RETRY_STATUS:
                return f"HTTP {status}"
            if status in (401, 403):
                raise RegistryRefused(f"schema_registry.url refused the credentials ({what}): HTTP {status}; "
                                      "check schema_registry.username and schema_registry.password")
            try:
                if status >= 400:
                    body, _ = read_bounded(response, MAX_ERROR_BODY_BYTES)
                else:
                    body = self._answer(response, what)
            except requests.RequestException as err:
                return type(err).__name__
        if status == 404:
            raise SchemaNotFound(f"schema_registry.url has no {what} (HTTP 404{_message(body)})")
        if status >= 400:
            raise SchemaRejected(f"schema_registry.url refused {what}: HTTP {status}{_message(body)}")
        try:
            return (json.loads(body),)
        except ValueError:
            return f"HTTP {status} with a body that is not JSON"

    @staticmethod
    def _answer(response: requests.Response, what: str) -> bytes:
        """The whole body of a 2xx answer, or `RegistryAnswerTooLarge` once it passes `MAX_ANSWER_BYTES`."""
        too_large = (f"schema_registry.url answered ({what}) with more than {MAX_ANSWER_BYTES} bytes "
                     f"(HTTP {response.status_code}")
        declared = response.headers.get("Content-Length", "")
        encoded = response.headers.get("Content-Encoding", "identity").strip().lower() != "identity"
        if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES and not encoded:
            raise RegistryAnswerTooLarge(f"{too_large}, Content-Length {declared}); not read")
        body, complete = read_bounded(response, MAX_ANSWER_BYTES)
        if not complete:
            raise RegistryAnswerTooLarge(f"{too_large}); the rest was not read")
        return body


def read_bounded(response: requests.Response, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of a streamed body (decoded from any Content-Encoding) and whether that
    is all of it; `False`: the body is longer and reading stopped within a chunk past the bound
    (closing the response then drops the connection with the rest)."""
    chunks: list[bytes] = []
    total = 0
    for chunk in response.iter_content(READ_CHUNK_BYTES):
        total += len(chunk)
        chunks.append(chunk)
        if total > limit:
            return b"".join(chunks)[:limit], False
    return b"".join(chunks), True


def _message(body: bytes) -> str:
    """The registry's own error message (Confluent's `message`), cut short."""
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        return ""
    return f": {str(message)[:300]}" if message else ""
