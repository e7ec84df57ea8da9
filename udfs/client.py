"""The inference call: one `Request` in, one `Completion` out, or an `InferenceError`.

`InferenceClient` lives inside PyFlink's `AsyncFunction` and is used from `async_invoke`,
whose event loop starts only after `open()`; so it does no I/O in `__init__` and creates
its `aiohttp` session (pool sized to `async.capacity`) on first use, in the running loop.
aiohttp because the client is the hot path (NOTES: ~6,800 req/s vs ~820 for requests).

One record goes: build the body (prompts) -> wait for a concurrency slot (AIMD) -> wait for
rate-limit tokens -> send, with `async.request_timeout_s` per attempt; failures go through
`RetryPolicy`, the one retry layer. `async.record_deadline_s` covers every attempt, wait
and queue from the moment the first attempt is dispatched; time spent waiting in line for a
slot or tokens before that is backpressure, not failure, and does not count.

With `api: embeddings` and `model.batch.max_size` > 1, records pass through a `Batcher`
(`udfs/batching.py`) after the cache: up to `max_size` inputs go in one request, which takes
that path as one call (one budget, slot, rate-limit and retry sequence), and each record gets
its own vector and its share of the usage. A batch rejected with a permanent 4xx is sent
again record by record, so one bad input is dead-lettered alone.

The API key is read (`JobConfig.api_key()`: its variable or file) for each call and put only
in the request's `Authorization` header: never stored on the object, logged, or left in an
error detail. `model.headers` placeholders (`${env:}`, `${file:}`) are resolved once per
client, on the worker, and the resolved values are kept off reprs, logs and error details
in the same way. HTTPS uses the `ssl.SSLContext` of `model.tls` (`udfs/transport.py`); a TLS
failure is a `TlsError`, dead-lettered after one attempt.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import json
import logging
import time
from typing import Any, Self
from urllib.parse import urlsplit

import aiohttp

from udfs import secrets
from udfs.batching import Batcher, share_usage, split_on_rejection
from udfs.budget import SpendBudget
from udfs.cache import cache_key, cacheable, open_cache
from udfs.config import JobConfig
from udfs.errors import (
    InferenceError,
    InternalError,
    InvalidModelOutput,
    PermanentError,
    RateLimited,
    RecordError,
    RetryableError,
    UnsupportedResponse,
)
from udfs.metrics import InferenceMetrics
from udfs.prompts import build_payload, estimate_tokens, input_tokens
from udfs.ratelimit import AdaptiveConcurrency, RateLimiter
from udfs.records import Completion, Request
from udfs.retry import Deadline, RetryPolicy, classify, parse_retry_after
from udfs.structured import Invalid, StructuredOutput
from udfs.transport import tls_context, tls_failure

log = logging.getLogger(__name__)

API_PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}
OVERLOAD_STATUSES = frozenset({429, 503})
MAX_DETAIL_CHARS = 300
SECRET_HEADER_WORDS = ("auth", "key", "token", "secret", "cookie", "signature")


def _epoch_ms() -> int:
    return time.time_ns() // 1_000_000


def batch_group(payload: dict[str, Any]) -> str:
    """Records whose bodies differ only in `input` can share a batch request."""
    if len(payload) == 2 and "input" in payload and "model" in payload:  # the usual embeddings body
        return str(payload["model"])
    return json.dumps({k: v for k, v in payload.items() if k != "input"}, sort_keys=True)


def _server_message(body: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the body's start."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.strip()[:MAX_DETAIL_CHARS]
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:MAX_DETAIL_CHARS]
        if isinstance(error, str):
            return error[:MAX_DETAIL_CHARS]
    return body.strip()[:MAX_DETAIL_CHARS]


class InferenceClient:
    """Calls an OpenAI-compatible server for one inference subtask.

    `subtasks` is the parallelism of the inference operator: each subtask paces itself to
    its share of the job-wide rate limits. `complete` raises only `InferenceError`
    subclasses (call failures) and `BadInput` (a record that cannot become a request, e.g.
    a template field it lacks); anything unexpected is a bug, an `InternalError`. Token
    counts come from the response's `usage`, estimated (chars / 4) when a server omits it.
    Use it from one event loop; `close()` may come from another (see there).
    """

    def __init__(self, config: JobConfig, *, subtasks: int = 1, metrics: InferenceMetrics | None = None) -> None:
        self._config = config
        self.metrics = metrics if metrics is not None else InferenceMetrics()
        self.url = config.model.endpoint.rstrip("/") + API_PATHS[config.model.api]
        self.retry = RetryPolicy(config.retry)
        self.rate_limiter = RateLimiter(config.rate_limit, subtasks)
        self.concurrency = AdaptiveConcurrency(
            config.async_.capacity, config.rate_limit.min_concurrency,
            adaptive=config.rate_limit.adaptive_concurrency)
        self.metrics.concurrency_limit = self.concurrency.limit
        self.cache = open_cache(config, self.metrics)
        self.budget = SpendBudget(config.budget, config.model.prices, subtasks, on_pause=self._on_budget_pause)
        self.structured = StructuredOutput.from_config(config.model)
        self._leaders: dict[str, asyncio.Future[dict[str, Any] | None]] = {}
        batch = config.model.batch
        self._batcher: Batcher[tuple[Request, dict[str, Any]], Completion] | None = None
        if config.model.api == "embeddings" and batch.max_size > 1:
            self._batcher = Batcher(split_on_rejection(self._call_batch, self._call_one_entry),
                                    max_size=batch.max_size, max_wait_s=batch.max_wait_ms / 1000)
        self._timeout = aiohttp.ClientTimeout(total=config.async_.request_timeout_s)
        self._ssl = tls_context(config.model.tls)
        parts = urlsplit(self.url)
        self._host = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
        self._extra_headers = secrets.resolve_all(config.model.headers, "model.headers")
        self._secret_headers = [self._extra_headers[name] for name, value in config.model.headers.items()
                                if secrets.has_placeholder(value)
                                or any(word in name.lower() for word in SECRET_HEADER_WORDS)]
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"InferenceClient(url={self.url!r}, capacity={self._config.async_.capacity})"

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

    def _headers(self) -> dict[str, str]:
        headers = dict(self._extra_headers)
        key = self._config.api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _redact(self, text: str) -> str:
        """`text` without the API key or the value of a configured header that came from a
        placeholder or whose name looks secret."""
        for secret in [self._config.api_key() or "", *self._secret_headers]:
            if len(secret) >= 4:
                text = text.replace(secret, "***")
        return text

    def _on_budget_pause(self, paused: bool) -> None:
        self.metrics.budget_paused = paused

    async def _call_one_entry(self, entry: tuple[Request, dict[str, Any]]) -> Completion:
        return await self._call_one(*entry)

    async def close(self) -> None:
        """Closes the session and its pooled connections; the client may be used again after.

        Safe from another event loop: PyFlink stops and closes the `async_invoke` loop before
        it calls the function's `close()`. If that loop still runs, the session is closed on
        it; if it is closed, the sockets cannot be closed through it, so the session drops
        them and a garbage collection closes them now rather than at some later collection.
        """
        if self._batcher is not None:
            await self._batcher.close()
        if self.cache is not None:
            await self.cache.close()
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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def complete(self, request: Request) -> Completion:
        """The model's answer to `request`, after any retries; see the class for what it raises."""
        try:
            return await self._complete(request)
        except InferenceError as err:
            log.debug("request %s failed after %d attempt(s): %s", request.id, err.attempts, err.reason)
            raise self._redacted(err) from None
        except RecordError:  # bad input, or already a known kind
            raise
        except Exception as err:
            log.debug("request %s: unexpected %s", request.id, type(err).__name__, exc_info=True)
            raise InternalError(self._redact(InternalError.from_exception(err).detail)) from None

    def _redacted(self, err: InferenceError) -> InferenceError:
        clean = self._redact(err.detail)
        if clean == err.detail:
            return err
        redacted = copy.copy(err)  # keeps every attribute, e.g. an invalid answer's last output
        redacted.detail, redacted.args = clean, (clean,)
        return redacted

    async def _complete(self, request: Request) -> Completion:
        """The answer from the result cache when it has one (see `udfs/cache.py`), else from the
        model, stored in the cache before it is returned. Identical requests in flight at once
        in this subtask share one call: the first calls, the others wait for its answer."""
        payload = build_payload(request, self._config.model)
        api = self._config.model.api
        if self.cache is None or not cacheable(self._config.cache, api, payload):
            return await self._answer(request, payload)
        key = cache_key(api, payload)
        looked_up = time.perf_counter()
        leader = self._leaders.get(key)
        if leader is not None:
            shared = await asyncio.shield(leader)
            if shared is not None:
                self.metrics.cache_hits.inc()
                return self._from_cache(payload, shared, looked_up)
            return await self._answer(request, payload)
        future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._leaders[key] = future
        stored: dict[str, Any] | None = None
        try:
            stored = await self.cache.get(key)
            if stored is not None:
                self.metrics.cache_hits.inc()
                return self._from_cache(payload, stored, looked_up)
            self.metrics.cache_misses.inc()
            completion = await self._answer(request, payload)
            stored = {"output": completion.output, "model": completion.model,
                      "finish_reason": completion.finish_reason, "prompt_tokens": completion.prompt_tokens,
                      "completion_tokens": completion.completion_tokens}
            await self.cache.put(key, stored)
            return completion
        finally:
            del self._leaders[key]
            future.set_result(stored)

    async def _answer(self, request: Request, payload: dict[str, Any]) -> Completion:
        """The model's answer; with `model.response_format`, a valid one (`StructuredOutput.until_valid`
        asks again, above the retry layer, when an answer does not validate)."""
        if self.structured is None:
            return await self._call(request, payload)
        return await self.structured.until_valid(lambda: self._call(request, payload),
                                                 on_invalid=self.metrics.invalid_answers.inc)

    def _from_cache(self, payload: dict[str, Any], stored: dict[str, Any], looked_up: float) -> Completion:
        """A stored answer as this record's completion: no attempt made, nothing paid. Only valid
        answers are stored, under a key that covers the schema; a structured one is parsed again."""
        completion = self._stored_completion(payload, stored, looked_up)
        if self.structured is None:
            return completion
        checked = self.structured.check(completion.output)
        if isinstance(checked, Invalid):
            raise InvalidModelOutput(f"cached answer: {checked.message}", last_output=completion.output, attempts=0)
        return dataclasses.replace(completion, output_json=checked, structured=True)

    def _stored_completion(self, payload: dict[str, Any], stored: dict[str, Any], looked_up: float) -> Completion:
        now = _epoch_ms()
        return Completion(
            output=stored["output"], model=str(stored.get("model") or payload["model"]),
            finish_reason=stored.get("finish_reason"), prompt_tokens=int(stored.get("prompt_tokens") or 0),
            completion_tokens=int(stored.get("completion_tokens") or 0),
            latency_ms=(time.perf_counter() - looked_up) * 1000, attempts=0, endpoint=self.url, started_ms=now,
            completed_ms=now, cost=0.0 if self._config.model.prices is not None else None, cached=True)

    async def _call(self, request: Request, payload: dict[str, Any]) -> Completion:
        """The model's answer to one record: alone, or in a micro-batch when `model.batch` says so."""
        if self._batcher is not None:
            return await self._batcher.submit((request, payload), batch_group(payload))
        return await self._call_one(request, payload)

    async def _call_one(self, request: Request, payload: dict[str, Any]) -> Completion:
        estimated = input_tokens(payload) + int(payload.get("max_tokens") or 0)
        budgeted = (input_tokens(payload), int(payload.get("max_tokens") or 0))
        body, latency_ms, attempts, started_ms = await self._attempts(payload, request.id, estimated, budgeted)
        completion = self._completion(payload, body, estimated, latency_ms=latency_ms, attempts=attempts,
                                      started_ms=started_ms)
        self.budget.settle(budgeted, (completion.prompt_tokens, completion.completion_tokens))
        return completion

    async def _attempts(self, payload: dict[str, Any], label: str, estimated: int,
                        budgeted: tuple[int, int]) -> tuple[dict[str, Any], float, int, int]:
        """One request through budget, concurrency, rate limit and the retry layer:
        (2xx body, latency ms from the first attempt, attempts, epoch ms of the first attempt)."""
        deadline = Deadline(self._config.async_.record_deadline_s)
        sent: list[float] = []
        started_ms = 0
        await self.budget.acquire(*budgeted)

        async def attempt(number: int) -> dict[str, Any]:
            nonlocal started_ms
            async with self.concurrency.slot():
                await self.rate_limiter.acquire(estimated)
                deadline.start()
                if not sent:
                    started_ms = _epoch_ms()
                else:
                    self.metrics.retries.inc()
                sent.append(time.perf_counter())
                body = await self._send(payload, label, number)
                self.concurrency.on_success(time.perf_counter() - sent[-1])
                self.metrics.concurrency_limit = self.concurrency.limit
                return body

        try:
            body = await self.retry.run(attempt, deadline)
        except InferenceError as err:
            err.attempts = len(sent)
            raise
        return body, (time.perf_counter() - sent[0]) * 1000, len(sent), started_ms

    async def _call_batch(self, entries: list[tuple[Request, dict[str, Any]]]) -> list[Completion | BaseException]:
        """One embeddings request for `entries` (same `batch_group`), retried as a batch; one
        completion per entry, in order, with its share of the batch's usage and cost."""
        payloads = [payload for _, payload in entries]
        estimates = [input_tokens(payload) for payload in payloads]
        estimated = sum(estimates)
        batch_payload = {**payloads[0], "input": [payload["input"] for payload in payloads]}
        label = f"{entries[0][0].id} (+{len(entries) - 1} in batch)"
        body, latency_ms, attempts, started_ms = await self._attempts(batch_payload, label, estimated, (estimated, 0))
        vectors = self._batch_vectors(body, len(entries), attempts)
        usage = body.get("usage")
        total = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            total = estimated
        self.rate_limiter.settle(estimated, total)
        self.budget.settle((estimated, 0), (total, 0))
        self.metrics.prompt_tokens.inc(total)
        prices = self._config.model.prices
        model = str(body.get("model") or batch_payload["model"])
        completed_ms = _epoch_ms()
        out: list[Completion | BaseException] = []
        for vector, share in zip(vectors, share_usage(total, estimates), strict=True):
            self.metrics.latency_ms.update(int(latency_ms))
            out.append(Completion(
                output=vector, model=model, finish_reason=None, prompt_tokens=share, completion_tokens=0,
                latency_ms=latency_ms, attempts=attempts, endpoint=self.url, started_ms=started_ms,
                completed_ms=completed_ms, cost=share / 1000 * prices.prompt_per_1k if prices is not None else None))
        return out

    def _batch_vectors(self, body: dict[str, Any], count: int, attempts: int) -> list[Any]:
        """The `count` vectors of a batch response, in input order (by each item's `index`)."""
        data = body.get("data")
        if not isinstance(data, list) or len(data) != count:
            got = len(data) if isinstance(data, list) else type(data).__name__
            raise PermanentError(f"unexpected embeddings response: {got} items for a batch of {count} inputs",
                                 status=200, attempts=attempts)
        try:
            if all(isinstance(item.get("index"), int) for item in data):
                data = sorted(data, key=lambda item: item["index"])
            vectors = [item["embedding"] for item in data]
        except (AttributeError, KeyError, TypeError) as err:
            raise PermanentError(f"unexpected embeddings response shape ({type(err).__name__}: {err})"[:MAX_DETAIL_CHARS],
                                 status=200, attempts=attempts) from None
        for vector in vectors:
            if vector and isinstance(vector, list) and isinstance(vector[0], list):
                raise UnsupportedResponse(
                    f"the server returned {len(vector)} vectors (one per token) for one input, not one "
                    "pooled embedding; use an embedding model or server that pools (e.g. mean pooling)",
                    status=200, attempts=attempts)
        return vectors

    async def _send(self, payload: dict[str, Any], request_id: str, attempt: int) -> dict[str, Any]:
        """One HTTP call; returns the parsed 2xx body or raises `RetryableError`/`PermanentError`."""
        session = self._session_in_loop()
        self.metrics.requests.inc()
        self.metrics.in_flight += 1
        log.debug("request %s attempt %d: POST %s", request_id, attempt, self.url)
        try:
            async with session.post(self.url, json=payload, headers=self._headers(),
                                    allow_redirects=False) as response:
                status = response.status
                if 200 <= status < 300:
                    try:
                        body = await response.json(content_type=None)
                    except ValueError as err:
                        raise PermanentError(f"HTTP {status} with a body that is not JSON: {err}"[:MAX_DETAIL_CHARS],
                                             status=status) from None
                    if not isinstance(body, dict):
                        raise PermanentError(f"HTTP {status} with a JSON {type(body).__name__}, expected an object",
                                             status=status)
                    log.debug("request %s attempt %d: HTTP %d", request_id, attempt, status)
                    return body
                text = await response.text(errors="replace")
                location = response.headers.get("Location")
                retry_after = parse_retry_after(response.headers, max_s=self._config.retry.max_retry_after_s)
        except InferenceError:
            raise
        except TimeoutError:
            raise RetryableError(f"no response within {self._config.async_.request_timeout_s:g} s") from None
        except aiohttp.InvalidURL as err:
            raise PermanentError(f"invalid URL: {err}") from None
        except aiohttp.ClientError as err:
            tls = tls_failure(err, self._host)
            if tls is not None:
                raise tls from None
            raise RetryableError(f"{type(err).__name__}: {err}"[:MAX_DETAIL_CHARS]) from None
        finally:
            self.metrics.in_flight -= 1
        detail = f"HTTP {status}: {_server_message(text)}"
        if 300 <= status < 400:
            detail += f" (redirect to {location!r}: set model.endpoint to the final URL)"
        log.debug("request %s attempt %d: HTTP %d, retry-after %s", request_id, attempt, status, retry_after)
        if status == 429:
            self.metrics.rate_limited.inc()
        if status in OVERLOAD_STATUSES:
            self.concurrency.on_overload()
            self.metrics.concurrency_limit = self.concurrency.limit
            raise RateLimited(detail, status=status, retry_after_s=retry_after)
        if classify(status) == "retryable":
            raise RetryableError(detail, status=status, retry_after_s=retry_after)
        raise PermanentError(detail, status=status)

    def _completion(self, payload: dict[str, Any], body: dict[str, Any], estimated: int, *,
                    latency_ms: float, attempts: int, started_ms: int) -> Completion:
        api = self._config.model.api
        try:
            if api == "embeddings":
                output: Any = body["data"][0]["embedding"]
                finish_reason = None
                if output and isinstance(output[0], list):
                    raise UnsupportedResponse(
                        f"the server returned {len(output)} vectors (one per token) for one input, not one "
                        "pooled embedding; use an embedding model or server that pools (e.g. mean pooling)",
                        status=200, attempts=attempts)
            else:
                choice = body["choices"][0]
                output = choice["message"]["content"] if api == "chat" else choice["text"]
                finish_reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError) as err:
            raise PermanentError(f"unexpected {api} response shape ({type(err).__name__}: {err})"[:MAX_DETAIL_CHARS],
                                 status=200, attempts=attempts) from None
        usage = body.get("usage")
        if not isinstance(usage, dict):
            usage = {}
        prompt_tokens = usage.get("prompt_tokens")
        if not isinstance(prompt_tokens, int):
            prompt_tokens = input_tokens(payload)
        completion_tokens = usage.get("completion_tokens")
        if not isinstance(completion_tokens, int):
            completion_tokens = 0 if api == "embeddings" else estimate_tokens(output if isinstance(output, str) else "")
        self.rate_limiter.settle(estimated, prompt_tokens + completion_tokens)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.completion_tokens.inc(completion_tokens)
        self.metrics.latency_ms.update(int(latency_ms))
        prices = self._config.model.prices
        cost = None
        if prices is not None:
            cost = prompt_tokens / 1000 * prices.prompt_per_1k + completion_tokens / 1000 * prices.completion_per_1k
        return Completion(
            output=output, model=str(body.get("model") or payload["model"]), finish_reason=finish_reason,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, latency_ms=latency_ms,
            attempts=attempts, endpoint=self.url, started_ms=started_ms, completed_ms=_epoch_ms(), cost=cost)
