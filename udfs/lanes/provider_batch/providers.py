"""The providers' batch APIs in one shape: OpenAI's `/v1/batches` (and the hosts that copy it) and
Anthropic's Message Batches, as the batch lane (`udfs/lanes/provider_batch/lane.py`) uses them.

A batch is made of request lines, each named `r<index>` (its place in the lane's batch entry, so
an answer finds its record whatever order results come in, and the name fits both providers'
rules for a `custom_id`). The lane asks four things, each answered the same way for both:

- `create(key, lines)`: the batch's id at the provider. OpenAI: the lines uploaded as a JSONL file
  (`purpose: batch`), then a batch of it whose `metadata` carries the lane's `key`. Anthropic: one
  POST of the requests.
- `find(key)`: a batch created for `key` before a restart, so a batch whose creation the last
  checkpoint did not record is adopted, not submitted again (OpenAI: by `metadata`; Anthropic keeps
  no metadata, so there it finds nothing: docs/cost.md says what that window is).
- `view(id)`: the batch's `phase`: `running`, `ended` (its results can be read), `failed` (a
  validation failure: no request ran), or `gone` (the provider no longer knows it).
- `results(view, count)`: one `Answered`, `Refused` or `Unfinished` for every index, read from the
  result files as a bounded stream (`provider_batch.max_result_bytes`). An answer's body is in the
  shape of OpenAI's (Anthropic's Message is translated), so the realtime lane's readers read it.

The HTTP side is the client's own `Transport` (`udfs/inference/transport.py`: its session, TLS,
bounded reads, redaction and the status table), so a provider call fails as a model call does;
`Provider` turns that into a `ProviderError`, `retryable` as the status table
(`udfs/inference/statuses.py`) says; the API key never appears in one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

from udfs.errors import InferenceError, LLMStreamError, ResponseTooLarge, RetryableError
from udfs.inference import statuses
from udfs.inference.transport import API_PATHS, READ_CHUNK_BYTES, server_message

if TYPE_CHECKING:
    from udfs.config import EndpointConfig, JobConfig
    from udfs.inference.transport import Transport

log = logging.getLogger("llmstream.udfs")

Phase = Literal["running", "ended", "failed", "gone"]
Why = Literal["expired", "cancelled"]

MAX_ERROR_BYTES = 65_536
"""The most of an error answer read (only its start reaches a dead letter)."""
FILE_TIMEOUT_S = 600.0
"""Uploads and result downloads of up to a few hundred MB take longer than one model call."""
ANTHROPIC_VERSION = "2023-06-01"
FIND_LOOKBACK_S = 3 * 24 * 3600
"""`find` looks at batches created this long before the one it looks for, newest first."""


@dataclass(frozen=True)
class Answered:
    index: int
    body: dict[str, Any]


@dataclass(frozen=True)
class Refused:
    """One request the provider answered with an error: `code` is the provider's, `retryable` by the
    status table (a 429 or 5xx inside a batch may pass in a later one)."""

    index: int
    code: str
    message: str
    status: int | None
    retryable: bool


@dataclass(frozen=True)
class Unfinished:
    """One request the batch ended without running: the batch expired or was cancelled."""

    index: int
    why: Why


LineResult = Answered | Refused | Unfinished
"""What a provider said to one request line of a batch."""


@dataclass(frozen=True)
class BatchView:
    id: str
    phase: Phase
    status: str
    unfinished: Why | None = None
    errors: tuple[tuple[int | None, str], ...] = ()
    counts: dict[str, int] | None = None
    results_ref: str | None = None
    errors_ref: str | None = None


class ProviderError(LLMStreamError):
    """A call to the provider's batch API failed (no answer, or a non-2xx one)."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = True) -> None:
        super().__init__(message[:500])
        self.status = status
        self.retryable = retryable


def custom_id(index: int) -> str:
    return f"r{index}"


def index_of(name: Any) -> int | None:
    """The index a `custom_id` names, or None for one the lane did not write."""
    if isinstance(name, str) and name.startswith("r") and name[1:].isdigit():
        return int(name[1:])
    return None


class Provider:
    """What both providers share: the client's `Transport` (one session on the lane's loop, TLS,
    redaction, bounded reads), the API key read for each call and kept out of every error."""

    name = "provider"

    def __init__(self, config: JobConfig, transport: Transport | None, endpoint: EndpointConfig | None = None) -> None:
        """`transport`: the client's (the route's, in a fleet); none at launch (`preflight`), where
        nothing is called through it. `endpoint`: the fleet endpoint this provider's batches are made
        at (its URL and key); none: `model.endpoint`."""
        base = endpoint.url if endpoint is not None else config.model.endpoint
        assert base is not None, "model.endpoint or an endpoint of model.endpoints"
        self._config = config
        self._transport = transport
        self._fleet_endpoint = endpoint
        self.base = base.rstrip("/")
        self.label = endpoint.label if endpoint is not None else self.base
        self._timeout_s = max(FILE_TIMEOUT_S, config.async_.request_timeout_s)

    def _key(self) -> str | None:
        """The API key, read for each call and never stored: the endpoint's own in a fleet."""
        return self._fleet_endpoint.api_key() if self._fleet_endpoint is not None else self._config.api_key()

    def _headers(self) -> dict[str, str]:
        raise NotImplementedError

    def _clean(self, text: str) -> str:
        if self._transport is not None:
            return self._transport.redact(text)
        secret = self._key() or ""
        return text.replace(secret, "***") if len(secret) >= 4 else text

    @property
    def _http(self) -> Transport:
        assert self._transport is not None, "a provider made for preflight calls nothing"
        return self._transport

    async def close(self) -> None:
        """Nothing of its own to close: the session is the client's."""

    def _failed(self, method: str, url: str, err: InferenceError) -> ProviderError:
        """A transport failure as the lane reads it: retryable as the status table says; an answer
        over its bound is not (it would be as large the next time)."""
        retryable = isinstance(err, RetryableError) and not isinstance(err, ResponseTooLarge)
        detail = err.detail if err.detail.startswith(method) else f"{method} {url}: {err.detail}"
        return ProviderError(self._clean(detail), status=err.status, retryable=retryable)

    async def _call(self, method: str, url: str, *, limit: int = 16 * 1024 * 1024, **kwargs: Any) -> Any:
        """The parsed JSON answer of one call; `ProviderError` for anything else."""
        headers = {**self._headers(), **kwargs.pop("headers", {})}
        try:
            status, body = await self._http.exchange(method, url, headers=headers, limit=limit,
                                                          timeout_s=self._timeout_s, **kwargs)
        except InferenceError as err:
            raise self._failed(method, url, err) from None
        try:
            return json.loads(body)
        except ValueError:
            raise ProviderError(f"{method} {url}: HTTP {status} answer is not JSON", status=status,
                                retryable=False) from None

    async def _batch(self, url: str) -> dict[str, Any] | None:
        """A batch as the provider describes it at `url`, or None when it no longer knows it (404)."""
        try:
            batch = await self._call("GET", url)
        except ProviderError as err:
            if err.status == 404:
                return None
            raise
        return batch if isinstance(batch, dict) else {}

    async def _lines(self, url: str, budget: list[int]) -> list[dict[str, Any]]:
        """The JSON lines of a result file, read as a stream within the lane's byte budget."""
        out: list[dict[str, Any]] = []
        try:
            async with self._http.streamed("GET", url, headers=self._headers(),
                                                timeout_s=self._timeout_s) as response:
                pending = b""
                async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
                    budget[0] -= len(chunk)
                    if budget[0] < 0:
                        response.close()
                        raise ProviderError(f"GET {url}: the results passed provider_batch.max_result_bytes",
                                            status=response.status, retryable=False)
                    pending += chunk
                    *whole, pending = pending.split(b"\n")
                    out.extend(_parsed(line) for line in whole if line.strip())
                if pending.strip():
                    out.append(_parsed(pending))
        except InferenceError as err:
            raise self._failed("GET", url, err) from None
        return out

    # The lane's four questions (see the module docstring) and a cancel. `view`, `results` and
    # `cancel` are the same for both providers but for the hooks below them.
    def line(self, index: int, payload: dict[str, Any]) -> bytes:
        raise NotImplementedError

    async def create(self, key: str, lines: list[bytes]) -> str:
        raise NotImplementedError

    async def find(self, key: str, created_after_s: float) -> str | None:
        raise NotImplementedError

    async def view(self, batch_id: str) -> BatchView:
        batch = await self._batch(self._batch_url(batch_id))
        if batch is None:
            return BatchView(batch_id, "gone", "not found")
        return self._view_of(batch_id, batch)

    async def results(self, view: BatchView, count: int) -> list[LineResult]:
        budget = [self._config.provider_batch.max_result_bytes]
        found: dict[int, LineResult] = {}
        for url in self._result_urls(view):
            for line in await self._lines(url, budget):
                index = index_of(line.get("custom_id"))
                if index is not None and index < count:
                    found[index] = self._line_result(index, line, view)
        return _completed(found, count, view.unfinished or "expired")

    async def cancel(self, batch_id: str) -> None:
        await self._call("POST", f"{self._batch_url(batch_id)}/cancel")

    # What each provider says its own way.
    def _batch_url(self, batch_id: str) -> str:
        """Where the provider describes the batch `batch_id` (and, below it, cancels it)."""
        raise NotImplementedError

    def _view_of(self, batch_id: str, batch: dict[str, Any]) -> BatchView:
        """The batch as the provider describes it, as a `BatchView`."""
        raise NotImplementedError

    def _result_urls(self, view: BatchView) -> list[str]:
        """The result files of an ended batch, in the order they are read."""
        raise NotImplementedError

    def _line_result(self, index: int, line: dict[str, Any], view: BatchView) -> LineResult:
        """One line of a result file (whose `custom_id` names `index`) as a `LineResult`."""
        raise NotImplementedError


def _parsed(line: bytes) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _counts(batch: dict[str, Any]) -> dict[str, int] | None:
    counts = batch.get("request_counts")
    return counts if isinstance(counts, dict) else None


def _completed(results: dict[int, LineResult], count: int, why: Why) -> list[LineResult]:
    """Every index in order: its result, or `Unfinished(why)` where the files have none."""
    return [results.get(i) or Unfinished(i, why) for i in range(count)]


class OpenAIBatches(Provider):
    """OpenAI's Batch API: files of JSONL request lines, `/v1/batches`, result and error files."""

    name = "openai"

    def _headers(self) -> dict[str, str]:
        key = self._key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _endpoint(self) -> str:
        return "/v1" + API_PATHS[self._config.model.api]

    def line(self, index: int, payload: dict[str, Any]) -> bytes:
        return json.dumps({"custom_id": custom_id(index), "method": "POST", "url": self._endpoint(),
                           "body": payload}, separators=(",", ":")).encode() + b"\n"

    async def create(self, key: str, lines: list[bytes]) -> str:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"".join(lines), filename=f"llmstream-{key}.jsonl", content_type="application/jsonl")
        uploaded = await self._call("POST", f"{self.base}/files", data=form)
        file_id = uploaded.get("id") if isinstance(uploaded, dict) else None
        if not isinstance(file_id, str):
            raise ProviderError("POST /files: the answer names no file id", retryable=False)
        try:
            batch = await self._call("POST", f"{self.base}/batches", json={
                "input_file_id": file_id, "endpoint": self._endpoint(),
                "completion_window": self._config.provider_batch.completion_window,
                "metadata": {"llmstream_batch": key, "llmstream_job": self._config.name}})
        except ProviderError:
            await self._forget_file(file_id)  # never a file left behind that no batch uses
            raise
        batch_id = batch.get("id") if isinstance(batch, dict) else None
        if not isinstance(batch_id, str):
            raise ProviderError("POST /batches: the answer names no batch id", retryable=False)
        return batch_id

    async def _forget_file(self, file_id: str) -> None:
        try:
            await self._call("DELETE", f"{self.base}/files/{file_id}")
        except ProviderError as err:
            log.warning("batch lane: deleting the unused file %s failed: %s", file_id, err)

    async def find(self, key: str, created_after_s: float) -> str | None:
        after: str | None = None
        while True:
            query = {"limit": "100", **({"after": after} if after else {})}
            page = await self._call("GET", f"{self.base}/batches", params=query)
            data = page.get("data") if isinstance(page, dict) else None
            if not isinstance(data, list) or not data:
                return None
            for batch in data:
                if not isinstance(batch, dict):
                    continue
                metadata = batch.get("metadata") or {}
                if isinstance(metadata, dict) and metadata.get("llmstream_batch") == key:
                    return str(batch.get("id"))
            oldest = min((b.get("created_at") or 0) for b in data if isinstance(b, dict))
            if not page.get("has_more") or oldest < created_after_s - FIND_LOOKBACK_S:
                return None
            after = str(data[-1].get("id"))

    def _batch_url(self, batch_id: str) -> str:
        return f"{self.base}/batches/{batch_id}"

    def _view_of(self, batch_id: str, batch: dict[str, Any]) -> BatchView:
        status = str(batch.get("status"))
        counts = _counts(batch)
        refs: dict[str, Any] = {"results_ref": batch.get("output_file_id"), "errors_ref": batch.get("error_file_id")}
        if status == "failed":
            errors = (batch.get("errors") or {}).get("data") or []
            found = tuple((e.get("line"), f"{e.get('code')}: {e.get('message')}") for e in errors if isinstance(e, dict))
            return BatchView(batch_id, "failed", status, errors=found or ((None, "the batch failed"),), counts=counts)
        if status in ("completed", "expired", "cancelled"):
            why: Why | None = {"expired": "expired", "cancelled": "cancelled"}.get(status)  # type: ignore[assignment]
            return BatchView(batch_id, "ended", status, unfinished=why, counts=counts, **refs)
        return BatchView(batch_id, "running", status, counts=counts)

    def _result_urls(self, view: BatchView) -> list[str]:
        return [f"{self.base}/files/{ref}/content" for ref in (view.results_ref, view.errors_ref) if ref]

    def _line_result(self, index: int, line: dict[str, Any], view: BatchView) -> LineResult:
        return _openai_result(index, line, view.unfinished)


def _openai_result(index: int, line: dict[str, Any], unfinished: Why | None) -> LineResult:
    response = line.get("response") if isinstance(line.get("response"), dict) else None
    error = line.get("error") if isinstance(line.get("error"), dict) else None
    if response is not None and response.get("status_code") == 200 and isinstance(response.get("body"), dict):
        return Answered(index, response["body"])
    if error is not None and error.get("code") in ("batch_expired", "batch_cancelled"):
        return Unfinished(index, "expired" if error.get("code") == "batch_expired" else "cancelled")
    status = response.get("status_code") if response is not None else None
    body = response.get("body") if response is not None else None
    detail = (body or {}).get("error") if isinstance(body, dict) else None
    source = detail if isinstance(detail, dict) else (error or {})
    code = str(source.get("code") or source.get("type") or (f"http_{status}" if status else "error"))
    message = str(source.get("message") or "the provider answered this request with an error")
    return Refused(index, code, message[:500], status if isinstance(status, int) else None,
                   statuses.of_status(status if isinstance(status, int) else None).retryable)


class AnthropicBatches(Provider):
    """Anthropic's Message Batches: one POST of requests, `processing_status`, a JSONL of results."""

    name = "anthropic"

    def _headers(self) -> dict[str, str]:
        key = self._key()
        return {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": key} if key else {})}

    def line(self, index: int, payload: dict[str, Any]) -> bytes:
        return json.dumps({"custom_id": custom_id(index), "params": anthropic_params(payload)},
                          separators=(",", ":")).encode()

    async def create(self, key: str, lines: list[bytes]) -> str:
        body = b'{"requests":[' + b",".join(lines) + b"]}"
        batch = await self._call("POST", f"{self.base}/messages/batches", data=body,
                                 headers={"content-type": "application/json"})
        batch_id = batch.get("id") if isinstance(batch, dict) else None
        if not isinstance(batch_id, str):
            raise ProviderError("POST /messages/batches: the answer names no batch id", retryable=False)
        return batch_id

    async def find(self, key: str, created_after_s: float) -> str | None:
        return None  # Message Batches keep no metadata: nothing names the lane's key

    def _batch_url(self, batch_id: str) -> str:
        return f"{self.base}/messages/batches/{batch_id}"

    def _view_of(self, batch_id: str, batch: dict[str, Any]) -> BatchView:
        status = str(batch.get("processing_status"))
        counts = _counts(batch)
        if status == "ended":
            results_url = batch.get("results_url") or f"{self.base}/messages/batches/{batch_id}/results"
            return BatchView(batch_id, "ended", status, unfinished="expired", counts=counts, results_ref=results_url)
        return BatchView(batch_id, "running", status, counts=counts)

    def _result_urls(self, view: BatchView) -> list[str]:
        return [view.results_ref] if view.results_ref else []

    def _line_result(self, index: int, line: dict[str, Any], view: BatchView) -> LineResult:
        return _anthropic_result(index, line.get("result"))


def anthropic_params(payload: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat body as Anthropic's Messages parameters: the system messages become `system`."""
    messages = payload.get("messages") or []
    system = "\n\n".join(str(m.get("content") or "") for m in messages if m.get("role") in ("system", "developer"))
    params: dict[str, Any] = {
        "model": payload["model"],
        "max_tokens": payload.get("max_tokens") or 1024,
        "messages": [{"role": m.get("role"), "content": m.get("content")} for m in messages
                     if m.get("role") in ("user", "assistant")],
    }
    if system:
        params["system"] = system
    for name in ("temperature", "top_p"):
        if payload.get(name) is not None:
            params[name] = payload[name]
    if payload.get("stop") is not None:
        stop = payload["stop"]
        params["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    return params


def _anthropic_result(index: int, result: Any) -> LineResult:
    if not isinstance(result, dict):
        return Refused(index, "unreadable_result", "the result line has no result", None, False)
    kind = result.get("type")
    if kind == "succeeded" and isinstance(result.get("message"), dict):
        return Answered(index, openai_body(result["message"]))
    if kind in ("expired", "canceled"):
        return Unfinished(index, "expired" if kind == "expired" else "cancelled")
    error: dict[str, Any] = result["error"] if isinstance(result.get("error"), dict) else {}
    inner: dict[str, Any] = error["error"] if isinstance(error.get("error"), dict) else error
    code = str(inner.get("type") or "errored")
    retryable = code in ("overloaded_error", "api_error", "rate_limit_error", "timeout_error")
    return Refused(index, code, str(inner.get("message") or "errored")[:500], None, retryable)


def openai_body(message: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Message in the shape of an OpenAI chat completion (what the lane's readers read)."""
    text = "".join(str(block.get("text", "")) for block in message.get("content") or []
                   if isinstance(block, dict) and block.get("type") == "text")
    usage: dict[str, Any] = message["usage"] if isinstance(message.get("usage"), dict) else {}
    return {"model": message.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": message.get("stop_reason")}],
            "usage": {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}}


def provider_for(config: JobConfig, transport: Transport | None = None,
                 endpoint: EndpointConfig | None = None) -> Provider:
    """The provider `model.provider` names, calling through `transport` (the client's; none at
    launch, where only its URL, headers and redaction are used), at `endpoint` (a fleet's; none:
    `model.endpoint`)."""
    kind = AnthropicBatches if config.model.provider == "anthropic" else OpenAIBatches
    return kind(config, transport, endpoint)


def providers_for(config: JobConfig) -> list[Provider]:
    """One provider per endpoint a batch may be made at, in the fleet's order (primaries, then the
    fallback group): `model.endpoint` alone is one."""
    if not config.model.routed:
        return [provider_for(config)]
    primaries, fallbacks = config.fleet()
    return [provider_for(config, None, endpoint) for endpoint in primaries + fallbacks]


def preflight(config: JobConfig, *, timeout_s: float) -> None:
    """At launch, with `lane: provider-batch`: the provider's batch API answers at `model.endpoint` and
    takes the key, else one `ConfigError` naming the setting (the lane would otherwise retry for ever).
    A fleet: every endpoint that answers serves the batch API and takes its key, and one answers at
    least (one that does not is the circuits' business while the job runs)."""
    import requests

    from udfs.errors import ConfigError

    routed = config.model.routed
    answered: list[str] = []
    unreachable: ConfigError | None = None
    for provider in providers_for(config):
        endpoint_key = "model.endpoints" if routed else "model.endpoint"
        where = f"the {provider.name} batch API of {provider.label}" if routed else f"the {provider.name} batch API"
        url = f"{provider.base}/messages/batches" if provider.name == "anthropic" else f"{provider.base}/batches"
        try:
            tls = config.model.tls
            cert = (tls.client_cert_file, tls.client_key_file) if tls.client_cert_file and tls.client_key_file else None
            response = requests.get(url, params={"limit": "1"}, headers=provider._headers(), timeout=timeout_s,
                                    allow_redirects=False, verify=_requests_verify(config), cert=cert)
        except requests.RequestException as err:
            unreachable = unreachable or ConfigError(endpoint_key, provider._clean(
                f"{where} at {url} does not answer: {type(err).__name__}"))
            continue
        if response.status_code in (401, 403):
            key = endpoint_key if routed else (
                "model.api_key_file" if config.model.api_key_file else "model.api_key_env")
            raise ConfigError(key, f"{where} at {url} refused the key (HTTP {response.status_code})")
        if response.status_code == 404:
            raise ConfigError(endpoint_key if routed else "model.provider",
                              f"{url} answers 404: no {provider.name} batch API at "
                              + (provider.label if routed else "model.endpoint"))
        if not 200 <= response.status_code < 300:
            message = provider._clean(server_message(response.text[:MAX_ERROR_BYTES]))
            raise ConfigError(endpoint_key, f"{where} at {url} answered HTTP {response.status_code}: {message}")
        answered.append(provider.label)
    if not answered and unreachable is not None:
        raise unreachable
    if unreachable is not None:
        log.info("batch lane: %s; its batches go to the endpoints that answer (%s)", unreachable.problem,
                 ", ".join(answered))


def _requests_verify(config: JobConfig) -> bool | str:
    tls = config.model.tls
    if not tls.verify:
        return False
    return tls.ca_file or True
