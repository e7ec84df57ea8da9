"""The inference call: one `Request` in, one `Completion` out, or an `InferenceError`.

`InferenceClient` is created in the inference stage's `open()` (`udfs/lanes/keyed.py`) and its
calls run on the stage's `CallRunner` event loop (`udfs/lanes/inflight.py`), which outlives Flink's
bundles; so it does no network I/O in `__init__` and its HTTP session is created on first
use, in the running loop. What it builds on, each in its own module:

- `udfs/inference/transport.py`: the HTTP session, TLS, request headers and secrets, one POST, the
  mapping of a status or connection failure to an error.
- `udfs/inference/statuses.py`: the one table of what an answer means (retry, overload, circuit
  failure), as an attempt's `Outcome`.
- `udfs/inference/responses.py`: a 2xx body -> output, finish reason, usage (pure functions).
- `udfs/cost/pricing.py`: what the tokens cost (also used by the spend budget and `status`).
- `udfs/cost/single_flight.py`: the result cache, with identical requests sharing one call.
- `udfs/inference/structured.py`, `udfs/inference/batching.py`, `udfs/cost/budget.py`, `udfs/inference/ratelimit.py`,
  `udfs/inference/retry.py`: answers that must validate, micro-batches, the spend budget, the rate
  limit and adaptive concurrency, the one retry layer.
- `udfs/inference/fleet.py`: which endpoint each attempt goes to (weighted least-outstanding, a
  circuit, AIMD and a Retry-After pause per endpoint); each endpoint has its own `Transport` and
  rate limits (a `Route`). Every call goes through it: `model.endpoint` is a fleet of one whose
  circuit never opens, so there is one attempt path (`_attempt`).

One record goes: cache (a hit ends here) -> structured output (asks again when an answer does
not validate) -> micro-batch (embeddings with `model.batch.max_size` > 1) -> spend budget ->
and for each attempt: an endpoint's concurrency slot (AIMD; waiting while no endpoint may take
it) -> rate-limit tokens -> send, with `async.request_timeout_s` per attempt. Failures go
through `RetryPolicy`; its `async.record_deadline_s` covers every attempt, wait and queue from
the moment the first attempt is dispatched; time spent waiting in line for a slot or tokens
before that is backpressure, not failure, and does not count.

A micro-batch takes that path as one call (one budget, slot, rate-limit and retry sequence)
and each record gets its own vector and its share of the usage. A batch rejected with a
permanent 4xx is sent again record by record, so one bad input is dead-lettered alone.

One entry takes a batch: `complete_many(requests)` answers each request with its `Completion`
or the `RecordError` it ended in, and `complete(request)` is a batch of one that raises. Which
layer is paid once a batch and which once a call (each says why where it lives):

- once a client: the plan (`_Plan`: which layers this client has, whether its rate limits and
  spend budget are on, the lane's tag, the part of the request body every record shares), all
  fixed by the config when the client opens.
- once a batch (`_Batch`): the workers (`async.capacity` of them, each taking the next request,
  not a task and a wait in line per request), the request headers with the API key read (a key
  file read once a batch, not once a call; a rotated key is used from the next batch), the
  token counters (figures, never a decision of a later call).
- once a call (a record's own meaning): its request body, cache lookup, structured output, the
  spend budget's charge (each call's estimate, so a window with room for part of a batch lets
  that part through), and for each attempt an endpoint's slot (AIMD and routing react to each
  answer), rate-limit tokens (the pace is a call's), the record deadline (it starts at the
  record's own first dispatch), send, the bounded read and the parse.

Secrets (the API key, resolved `model.headers` placeholders) never reach a repr, a log line
or an error detail: every error `complete_many` returns or `complete` raises is redacted.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Self

import aiohttp

from udfs.clock import now_ms
from udfs.config import EndpointConfig, JobConfig, RateLimitConfig
from udfs.cost import pricing
from udfs.cost.budget import SpendBudget
from udfs.cost.cache import cache_key, cacheable, open_cache
from udfs.cost.single_flight import (
    SingleFlightCache,
    Stored,
    cached_completion,
    stored_answer,
)
from udfs.errors import InferenceError, InternalError, InvalidModelOutput, RecordError
from udfs.inference import responses
from udfs.inference.batching import (
    Batcher,
    SendBatch,
    batch_group,
    batch_payload,
    chunks,
    share_usage,
    split_on_rejection,
)
from udfs.inference.fleet import CircuitState, EndpointSpec, Fleet
from udfs.inference.prompts import Payloads, build_payload, input_tokens
from udfs.inference.ratelimit import AdaptiveConcurrency, RateLimiter
from udfs.inference.retry import Deadline, RetryPolicy
from udfs.inference.statuses import Outcome, of_error
from udfs.inference.structured import Invalid, StructuredOutput
from udfs.inference.transport import Transport
from udfs.metrics import InferenceMetrics
from udfs.records import Completion, Request

log = logging.getLogger(__name__)

Entry = tuple[Request, dict[str, Any]]
"""A record and the request body made of it: what a micro-batch collects."""

MAX_INTERNAL_DETAIL_CHARS = 500
"""As `InternalError.from_exception` cuts, but after the secrets are redacted."""

PAUSE_AFTER_S = 1.0
"""A wait at the rate limit longer than this is a pause (`pause_reason`): the stage parks new
records behind the admission gate instead of waiting for a slot in its bundle. Shorter waits are
pacing, as the stage's own backpressure has always been. (A Retry-After is a pause while calls
wait for it: `Fleet.stalled`.)"""


@dataclass(frozen=True)
class Attempt:
    """A request that got a 2xx answer: its `body`, the `attempts` it took, when the first was
    sent (`started_ms`, epoch ms) and `latency_ms` from then to the answer; the `endpoint` URL
    that answered and the `payload` sent to it (a fleet endpoint may ask for another model)."""

    body: dict[str, Any]
    attempts: int
    started_ms: int
    latency_ms: float
    endpoint: str
    payload: dict[str, Any]


class _Attempts:
    """Counts the attempts of one request as they are sent, for the `Attempt` or the error."""

    def __init__(self, endpoint: str, payload: dict[str, Any]) -> None:
        self.count = 0
        self.started_ms = 0
        self._first_sent = 0.0
        self.endpoint = endpoint
        self.payload = payload
        self.tried: list[int] = []  # fleet endpoints that failed this request

    def sending(self) -> float:
        """Notes an attempt being sent now; returns its `time.perf_counter()`."""
        now = time.perf_counter()
        if self.count == 0:
            self.started_ms, self._first_sent = now_ms(), now
        self.count += 1
        return now

    def answered(self, body: dict[str, Any]) -> Attempt:
        return Attempt(body, self.count, self.started_ms, (time.perf_counter() - self._first_sent) * 1000,
                       self.endpoint, self.payload)


@contextmanager
def _counted(attempts: int) -> Iterator[None]:
    """An error reading an answer counts the attempts that got it."""
    try:
        yield
    except InferenceError as err:
        err.attempts = attempts
        raise


async def _in_parallel(worker: Callable[[], Awaitable[None]], count: int) -> None:
    """`count` runs of `worker` at once (they take their work from one shared iterator); a single
    one is awaited alone, without a gather's task."""
    if count == 1:
        await worker()
    elif count:
        await asyncio.gather(*(worker() for _ in range(count)))


@dataclass(frozen=True)
class _Plan:
    """What every call needs to know about its client, fixed by the config when the client opens
    and so worked out once, not once a call: `layered` (a cache, structured output or
    micro-batches: a call goes through `_complete`'s layers; else straight to `_call_one`),
    `paced` (a job-wide or endpoint rate limit is set), `budgeted` (a spend budget is set), `tag`
    (the `lane` a realtime answer is tagged with in a job with a provider-batch lane, else None),
    `payloads` (the request bodies' shared part)."""

    layered: bool
    paced: bool
    budgeted: bool
    tag: str | None
    payloads: Payloads


class _Batch:
    """What a batch of calls shares while it runs: the `plan`, the request headers of each route
    it sends to (`headers`: the API key read at the batch's first call to that route, not at every
    call), and the tokens its calls counted, added to the job's counters once when it ends
    (`InferenceClient._batch`)."""

    __slots__ = ("_headers", "completion", "plan", "prompt")

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self._headers: dict[int, dict[str, str]] = {}
        self.prompt = 0
        self.completion = 0

    def headers(self, index: int, transport: Transport) -> dict[str, str]:
        """Route `index`'s request headers for this batch."""
        headers = self._headers.get(index)
        if headers is None:
            headers = self._headers[index] = transport.request_headers()
        return headers


class InferenceClient:
    """Calls an OpenAI-compatible server for one inference subtask.

    `subtasks` is the parallelism of the inference operator: each subtask paces itself to
    its share of the job-wide rate limits. `complete` raises only `InferenceError`
    subclasses (call failures) and `BadInput` (a record that cannot become a request, e.g.
    a template field it lacks); anything unexpected is a bug, an `InternalError`. Token
    counts come from the response's `usage`, estimated (chars / 4) when a server omits it.
    Use it from one event loop; `close()` may come from another (see `Transport.close`).
    A bad `model.tls` file or an unresolvable `model.headers` placeholder is a `ConfigError`
    here, at `open()`, rather than on every record. `cache_file`: the local result cache's file
    (`udfs.cost.cache.open_cache`; without one, `cache.path`).
    """

    def __init__(self, config: JobConfig, *, subtasks: int = 1, metrics: InferenceMetrics | None = None,
                 cache_file: str | None = None) -> None:
        self._config = config
        self.metrics = metrics if metrics is not None else InferenceMetrics()
        self.routes: list[Route] = []
        self.fleet = self._open_fleet(config, subtasks)
        self.transport = self.routes[0].transport  # the first primary's: its URL is a cached answer's endpoint
        self.url = self.transport.url
        self.retry = RetryPolicy(config.retry)
        self.rate_limiter = RateLimiter(config.rate_limit, subtasks)
        self.budget = SpendBudget(config.budget, config.model.prices, subtasks, on_pause=self._on_budget_pause)
        self.structured = StructuredOutput.from_config(config.model)
        self.cache = open_cache(config, self.metrics, cache_file)
        self._single_flight = SingleFlightCache(self.cache, self.metrics) if self.cache is not None else None
        batch = config.model.batch
        self._batcher: Batcher[Entry, Completion] | None = None
        self._send_batch: SendBatch[Entry, Completion] | None = None
        if config.model.api == "embeddings" and batch.max_size > 1:
            self._send_batch = split_on_rejection(self._call_batch, self._call_entry)
            self._batcher = Batcher(self._send_batch, max_size=batch.max_size, max_wait_s=batch.max_wait_ms / 1000)
        # A batch handed in whole goes as batch requests at once when nothing answers a record on
        # its own first (no cache lookup, no structured output): `_complete_chunked`.
        self._chunked = self._send_batch is not None and self._single_flight is None and self.structured is None
        self._plan = _Plan(
            layered=self._single_flight is not None or self.structured is not None or self._batcher is not None,
            paced=self.rate_limiter.enabled or any(route.rate_limiter.enabled for route in self.routes),
            budgeted=self.budget.enabled, tag="realtime" if config.lane == "provider-batch" else None,
            payloads=Payloads(config.model))

    def _open_fleet(self, config: JobConfig, subtasks: int) -> Fleet:
        """A route (transport, rate limits) per endpoint of `config.fleet()`, and the `Fleet` that
        chooses among them. `model.endpoint` without a fallback is a fleet of one without a circuit
        (see `udfs/inference/fleet.py` for why), its transport reading the section's own key and
        headers, and it reports no per-endpoint figures: the job's own are that endpoint's."""
        routed = config.model.routed
        primaries, fallbacks = config.fleet()
        for endpoint in primaries + fallbacks:
            limits = RateLimitConfig(requests_per_minute=endpoint.requests_per_minute,
                                     tokens_per_minute=endpoint.tokens_per_minute)
            self.routes.append(Route(endpoint, Transport(config, self.metrics, endpoint if routed else None),
                                     RateLimiter(limits, subtasks)))
        capacity = config.async_.capacity
        specs = [EndpointSpec(e.label, e.weight, min(capacity, e.max_concurrency or capacity), fallback=i >= len(primaries))
                 for i, e in enumerate(primaries + fallbacks)]
        fleet = Fleet(specs, config.model.circuit if routed else None, min_concurrency=config.rate_limit.min_concurrency,
                      adaptive=config.rate_limit.adaptive_concurrency,
                      fallback_after_attempts=config.model.fallback.after_attempts if config.model.fallback else None)
        if routed:
            for state in fleet.endpoints:
                self.metrics.add_endpoint(state.label, state.figures)
        self._fleet_limit(fleet)
        return fleet

    @property
    def concurrency(self) -> AdaptiveConcurrency:
        """The first primary endpoint's AIMD limiter: with `model.endpoint`, the one server's."""
        return self.fleet.endpoints[0].concurrency

    def _fleet_limit(self, fleet: Fleet) -> None:
        """The calls this subtask may have in flight now, for the `concurrency_limit` metric."""
        self.metrics.concurrency_limit = min(self._config.async_.capacity,
                                             sum(e.limit for e in fleet.endpoints
                                                 if e.circuit.state is CircuitState.CLOSED))

    def __repr__(self) -> str:
        return f"InferenceClient(url={self.url!r}, capacity={self._config.async_.capacity})"

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The HTTP session, once the first call created it."""
        return self.transport.session

    @property
    def pause_reason(self) -> str | None:
        """Why no new call can start for a while: a spend-budget window, every endpoint's
        cooldown or Retry-After while calls wait (the fleet's `stalled`; with `model.endpoint`,
        the one server's Retry-After), or the calls already queued at the rate limit taking
        longer than `PAUSE_AFTER_S` to be let through; None when calls can start. The stage parks new records and closes its admission
        gate meanwhile (`udfs/lanes/keyed.py`), rather than waiting for a slot inside a bundle that
        a checkpoint waits for. Read from Flink's thread; reads only."""
        if self.budget.paused:
            return "the spend budget is paused"
        if self.fleet.stalled:
            return "every endpoint's circuit is open or paused by Retry-After"
        if self.rate_limiter.wait_s > PAUSE_AFTER_S:
            return f"the calls queued at rate_limit take over {PAUSE_AFTER_S:g} s to be let through"
        return None

    def _on_budget_pause(self, paused: bool) -> None:
        self.metrics.budget_paused = paused

    async def close(self) -> None:
        """Cancels pending batches, closes the cache and the session; the client may be used again after."""
        if self._batcher is not None:
            await self._batcher.close()
        if self._single_flight is not None:
            await self._single_flight.close()
        for route in self.routes:
            await route.transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ the entry: a batch of requests

    @contextmanager
    def _batch(self) -> Iterator[_Batch]:
        """A batch of calls while it runs; its token counters go to the job's metrics once, when it
        ends, whether it ended well or not."""
        batch = _Batch(self._plan)
        try:
            yield batch
        finally:
            if batch.prompt:
                self.metrics.prompt_tokens.inc(batch.prompt)
            if batch.completion:
                self.metrics.completion_tokens.inc(batch.completion)

    async def complete_many(self, requests: Sequence[Request], *,
                            into: list[Completion | RecordError | None] | None = None,
                            ) -> list[Completion | RecordError | None]:
        """Each request's answer (a `Completion`) or the error it ended in (an `InferenceError`,
        `BadInput` or `InternalError`, redacted), in order; never raises for a request. At most
        `async.capacity` calls run at once, by that many workers each taking the next request (the
        fleet's slots may hold them to fewer). `into`: the list to fill (len(requests), None for a
        request not answered yet), so a caller that gives up on a batch that outlives its guard
        (cancelling this) keeps the answers that came. A batch of one is `complete`."""
        answers: list[Completion | RecordError | None] = into if into is not None else [None] * len(requests)
        if self._chunked and len(requests) > 1:
            await self._complete_chunked(requests, answers)
            return answers
        pending = iter(range(len(requests)))  # shared: each request is taken by one worker
        with self._batch() as batch:
            async def worker() -> None:
                for i in pending:
                    answers[i] = await self._settled(requests[i], batch)

            await _in_parallel(worker, min(self._config.async_.capacity, len(requests)))
        return answers

    async def _complete_chunked(self, requests: Sequence[Request],
                                answers: list[Completion | RecordError | None]) -> None:
        """`complete_many` for micro-batched embeddings (`model.batch.max_size` > 1) without a cache
        or structured output: the whole batch is in hand, so it is cut into as few embeddings
        requests as `max_size` allows (`batching.chunks`) and sent at once, with no record waiting
        for a micro-batch to fill. Each request takes the micro-batch's path (`_send_batch`: one
        budget charge, slot, rate-limit and retry sequence, a rejected batch sent again input by
        input); `async.capacity` still counts records, so at most capacity // max_size requests
        are in flight. Each answer is written as its request ends (`into`, as `complete_many`)."""
        assert self._send_batch is not None
        send = self._send_batch
        made: list[tuple[int, Entry]] = []  # (index in `requests`, its entry) of each request with a body
        for i, request in enumerate(requests):
            try:
                made.append((i, (request, build_payload(request, self._config.model, self._plan.payloads))))
            except Exception as err:  # noqa: BLE001 - this record's outcome, as `_settled` makes it
                answers[i] = self._failure(request, err)
        size = self._config.model.batch.max_size
        cut = chunks([entry[1] for _, entry in made], size)
        pending = iter(cut)  # shared: each request is taken by one worker

        async def worker() -> None:
            for chunk in pending:
                members = [made[at] for at in chunk]
                outcomes: Sequence[Completion | BaseException]
                try:
                    outcomes = await send([entry for _, entry in members])
                except Exception as err:  # noqa: BLE001 - every input of the request fails with it
                    outcomes = [err] * len(members)
                for (i, (request, _)), outcome in zip(members, outcomes, strict=True):
                    answers[i] = (self._failure(request, outcome) if isinstance(outcome, BaseException)
                                  else self._tagged(outcome))

        await _in_parallel(worker, min(max(1, self._config.async_.capacity // size), len(cut)))

    async def complete(self, request: Request) -> Completion:
        """The model's answer to `request`, after any retries: a batch of one (`complete_many`), its
        error raised (see the class for what it raises). In a job with a provider-batch lane the
        answer says it came from a call of its own (`lane`)."""
        with self._batch() as batch:
            answer = await self._settled(request, batch)
        if isinstance(answer, RecordError):
            raise answer from None
        return answer

    async def _settled(self, request: Request, batch: _Batch) -> Completion | RecordError:
        """One request's answer or its error, redacted: what a call pays for itself."""
        plan = batch.plan
        try:
            if plan.layered:
                completion = await self._complete(request, batch)
            else:
                completion = await self._call_one(request, build_payload(request, self._config.model, plan.payloads),
                                                  batch)
            return self._tagged(completion)
        except Exception as err:  # noqa: BLE001 - `_failure` says what each becomes
            return self._failure(request, err)

    def _tagged(self, completion: Completion) -> Completion:
        """`completion` tagged with the client's `lane` (a job with a provider-batch lane)."""
        tag = self._plan.tag
        return dataclasses.replace(completion, lane=tag) if tag is not None else completion

    def _failure(self, request: Request, err: BaseException) -> RecordError:
        """What a request that raised `err` ended in, redacted: a call failure as it is, bad input or
        a known kind as it is, anything else (a bug) an `InternalError`, its traceback logged."""
        if isinstance(err, InferenceError):
            log.debug("request %s failed after %d attempt(s): %s", request.id, err.attempts, err.reason)
            return self._redacted(err)
        if isinstance(err, RecordError):  # bad input, or already a known kind
            return err
        # Redacted before it is cut or logged: the text of an unexpected error may quote a server.
        log.debug("request %s: unexpected %s", request.id, self._redact("".join(traceback.format_exception(err))))
        return InternalError(self._redact(f"{type(err).__name__}: {err}")[:MAX_INTERNAL_DETAIL_CHARS])

    def _redact(self, text: str) -> str:
        for route in self.routes:
            text = route.transport.redact(text)
        return text

    def _redacted(self, err: InferenceError) -> InferenceError:
        clean = self._redact(err.detail)
        if clean == err.detail:
            return err
        redacted = copy.copy(err)  # keeps every attribute, e.g. an invalid answer's last output
        redacted.detail, redacted.args = clean, (clean,)
        return redacted

    async def _complete(self, request: Request, batch: _Batch) -> Completion:
        """From the result cache when it has the answer (see `udfs/cost/single_flight.py`), else from
        the model. Once a call: whether an answer may be cached depends on its own payload."""
        payload = build_payload(request, self._config.model, batch.plan.payloads)
        api = self._config.model.api
        if self._single_flight is None or not cacheable(self._config.cache, api, payload):
            return await self._answer(request, payload, batch)
        key = cache_key(api, self._first_route_payload(payload))
        looked_up = time.perf_counter()

        def store_key(completion: Completion) -> str:
            """The key of the model the answering endpoint was asked for."""
            if completion.requested_model is None:
                return key
            return cache_key(api, {**payload, "model": completion.requested_model})

        return await self._single_flight.answer(key, lambda: self._answer(request, payload, batch),
                                                lambda stored: self._from_cache(payload, stored, looked_up),
                                                store_key)

    def _first_route_payload(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`payload` as the first primary endpoint is asked (its model, if it names one): what the
        cache is looked up under."""
        return self.routes[0].payload(payload)

    def _from_cache(self, payload: dict[str, Any], stored: Stored, looked_up: float) -> Completion:
        """A stored answer as this record's completion. Only valid answers are stored, under a key
        that covers the schema; a structured one is parsed again."""
        completion = cached_completion(stored, model=str(payload["model"]), endpoint=self.url,
                                       priced=self._config.model.prices is not None, looked_up=looked_up)
        return self.validated(completion, "cached answer: ")

    def validated(self, completion: Completion, said: str = "") -> Completion:
        """`completion` with its `output_json`, when `model.response_format` asks for one; an answer
        that does not validate is `InvalidModelOutput` (`said` begins its detail)."""
        if self.structured is None:
            return completion
        checked = self.structured.check(completion.output)
        if isinstance(checked, Invalid):
            raise InvalidModelOutput(f"{said}{checked.message}", last_output=completion.output,
                                     attempts=completion.attempts)
        return dataclasses.replace(completion, output_json=checked, structured=True)

    # ------------------------------------------------------------------ for a lane that calls elsewhere

    def payload(self, request: Request) -> dict[str, Any]:
        """The request body of `request`, as every call of it is made (`build_payload`): the one
        builder, for the realtime calls and a provider's batch lines alike."""
        return build_payload(request, self._config.model, self._plan.payloads)

    def may_cache(self, payload: dict[str, Any]) -> bool:
        """Whether the result cache may hold (and takes) the answer to `payload`."""
        return self.cache is not None and cacheable(self._config.cache, self._config.model.api, payload)

    async def cached(self, payload: dict[str, Any]) -> Completion | None:
        """The result cache's answer to `payload`, validated, or None (no cache, not cacheable, a miss);
        counts the hit or the miss."""
        if self.cache is None or not self.may_cache(payload):
            return None
        looked_up = time.perf_counter()
        stored = await self.cache.get(cache_key(self._config.model.api, payload))
        if stored is None:
            self.metrics.cache_misses.inc()
            return None
        self.metrics.cache_hits.inc()
        return self._from_cache(payload, stored, looked_up)

    async def remember(self, payload: dict[str, Any], completion: Completion) -> None:
        """`completion` into the result cache under `payload`, when the cache takes it."""
        if self.cache is not None and self.may_cache(payload):
            await self.cache.put(cache_key(self._config.model.api, payload), stored_answer(completion))

    def completion_from(self, body: dict[str, Any], payload: dict[str, Any], *, attempts: int, started_ms: int,
                        latency_ms: float, endpoint: str, sent: dict[str, Any] | None = None,
                        price_factor: float = 1.0) -> Completion:
        """The `Completion` of a 2xx `body` answering `payload` (`sent`: the body as the answering
        endpoint was asked, when a fleet endpoint names its own model): the output (checked as
        `model.api` and `model.embedding_dim` say), usage, cost (times `price_factor`, a provider's
        batch price) and timings. The one reader of an answer, for realtime calls and a provider's
        batch alike; an unusable answer is an `InferenceError` counting `attempts`."""
        api = self._config.model.api
        sent = sent if sent is not None else payload
        with _counted(attempts):
            answer = responses.answer(api, body, self._config.model.embedding_dim)
        usage = responses.usage(api, body, payload, answer.output)
        cost = pricing.cost_or_none(self._config.model.prices, usage.prompt_tokens, usage.completion_tokens)
        return Completion(
            output=answer.output, model=responses.model_name(body, sent), finish_reason=answer.finish_reason,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, latency_ms=latency_ms,
            attempts=attempts, endpoint=endpoint, started_ms=started_ms, completed_ms=now_ms(),
            cost=cost * price_factor if cost is not None else None, requested_model=str(sent["model"]))

    async def _answer(self, request: Request, payload: dict[str, Any], batch: _Batch) -> Completion:
        """The model's answer; with `model.response_format`, a valid one (`StructuredOutput.until_valid`
        asks again, above the retry layer, when an answer does not validate). Once a call: each
        answer validates or not on its own."""
        if self.structured is None:
            return await self._call(request, payload, batch)
        return await self.structured.until_valid(lambda: self._call(request, payload, batch),
                                                 on_invalid=self.metrics.invalid_answers.inc)

    async def _call(self, request: Request, payload: dict[str, Any], batch: _Batch) -> Completion:
        """The model's answer to one record: alone, or in a micro-batch when `model.batch` says so
        (the micro-batch is the batcher's own grouping, by `model.batch.max_size` and its wait)."""
        if self._batcher is not None:
            return await self._batcher.submit((request, payload), batch_group(payload))
        return await self._call_one(request, payload, batch)

    async def _call_entry(self, entry: Entry) -> Completion:
        with self._batch() as batch:  # a micro-batch's record sent alone: a batch of its own
            return await self._call_one(*entry, batch)

    async def _call_one(self, request: Request, payload: dict[str, Any], batch: _Batch) -> Completion:
        """One request's call and its answer read. Once a call: its budget charge and the rate
        limiter's correction are its own usage (a later call's admission depends on them), as is
        its latency (a distribution of calls); only the token counters wait for the batch."""
        budgeted = (input_tokens(payload), int(payload.get("max_tokens") or 0))
        estimated = budgeted[0] + budgeted[1]
        attempt = await self._attempts(payload, request.id, estimated, budgeted, batch)
        completion = self.completion_from(attempt.body, payload, attempts=attempt.attempts,
                                          started_ms=attempt.started_ms, latency_ms=attempt.latency_ms,
                                          endpoint=attempt.endpoint, sent=attempt.payload)
        self._settle(estimated, responses.Usage(completion.prompt_tokens, completion.completion_tokens), budgeted,
                     batch)
        self.metrics.latency_ms.update(int(attempt.latency_ms))
        return completion

    async def _call_batch(self, entries: list[Entry]) -> list[Completion | BaseException]:
        """One embeddings request for `entries` (same `batch_group`), retried as a batch; one
        completion per entry, in order, with its share of the batch's usage and cost."""
        payloads = [payload for _, payload in entries]
        estimates = [input_tokens(payload) for payload in payloads]
        estimated = sum(estimates)
        body = batch_payload(payloads)
        label = f"{entries[0][0].id} (+{len(entries) - 1} in batch)"
        with self._batch() as batch:
            attempt = await self._attempts(body, label, estimated, (estimated, 0), batch)
            with _counted(attempt.attempts):
                vectors = responses.batch_vectors(attempt.body, len(entries), self._config.model.embedding_dim)
            total = responses.batch_prompt_tokens(attempt.body, estimated)
            self._settle(estimated, responses.Usage(total, 0), (estimated, 0), batch)
        model = responses.model_name(attempt.body, attempt.payload)
        completed_ms = now_ms()
        out: list[Completion | BaseException] = []
        for vector, share in zip(vectors, share_usage(total, estimates), strict=True):
            self.metrics.latency_ms.update(int(attempt.latency_ms))
            out.append(Completion(
                output=vector, model=model, finish_reason=None, prompt_tokens=share, completion_tokens=0,
                latency_ms=attempt.latency_ms, attempts=attempt.attempts, endpoint=attempt.endpoint,
                started_ms=attempt.started_ms, completed_ms=completed_ms,
                cost=pricing.cost_or_none(self._config.model.prices, share, 0),
                requested_model=str(attempt.payload["model"])))
        return out

    def _settle(self, estimated: int, usage: responses.Usage, budgeted: tuple[int, int], batch: _Batch) -> None:
        """Corrects the rate limiter's and the budget's charge from the estimate to the usage
        reported (once a call: a later call's admission depends on it; neither when the plan has
        none), and adds the tokens to the batch's counters."""
        if batch.plan.paced:
            self.rate_limiter.settle(estimated, usage.total)
        if batch.plan.budgeted:
            self.budget.settle(budgeted, (usage.prompt_tokens, usage.completion_tokens))
        batch.prompt += usage.prompt_tokens
        batch.completion += usage.completion_tokens

    # ------------------------------------------------------------------ the attempts of one request

    async def _attempts(self, payload: dict[str, Any], label: str, estimated: int,
                        budgeted: tuple[int, int], batch: _Batch) -> Attempt:
        """One request body through the spend budget, then `RetryPolicy` over attempts that each
        wait for a concurrency slot and rate-limit tokens before they are sent. Once a call: the
        record deadline starts at this request's own first dispatch, and the retries are its own."""
        deadline = Deadline(self._config.async_.record_deadline_s)
        attempts = _Attempts(self.url, payload)
        if batch.plan.budgeted:
            await self.budget.acquire(*budgeted)

        async def attempt(number: int) -> dict[str, Any]:
            return await self._attempt(payload, label, number, estimated, deadline, attempts, batch)

        try:
            body = await self.retry.run(attempt, deadline)
        except InferenceError as err:
            err.attempts = attempts.count
            raise
        return attempts.answered(body)

    async def _attempt(self, payload: dict[str, Any], label: str, number: int, estimated: int,
                       deadline: Deadline, attempts: _Attempts, batch: _Batch) -> dict[str, Any]:
        """One attempt, the only one there is: a slot on the endpoint `Fleet` chooses (waiting while
        none may take it), rate-limit tokens (job-wide, then the endpoint's), the deadline started
        (at the first), the POST. Its `Outcome` (`udfs/inference/statuses.py`) and the answer's
        Retry-After go to `Fleet.release`, which feeds that endpoint's AIMD, pause and circuit; an
        endpoint that failed is avoided by this request's next attempt while another may take it.
        The error raised to `RetryPolicy` carries no Retry-After: the endpoint's pause is the one
        wait for it, so in a fleet the retry may go to another endpoint at once. Without a rate limit
        (`_Plan.paced`) there are no tokens to wait for; the headers are the batch's. All of this
        is once an attempt: the slot, the route and the tokens follow each answer."""
        endpoint = await self.fleet.acquire(attempts.tried, number)
        route = self.routes[endpoint.index]
        outcome, latency_s, retry_after_s = Outcome.NEUTRAL, None, None
        try:
            if batch.plan.paced:
                await self.rate_limiter.acquire(estimated)
                await route.rate_limiter.acquire(estimated)
            deadline.start()
            if attempts.count:
                self.metrics.retries.inc()
            sent_payload = route.payload(payload)
            sent = attempts.sending()
            try:
                reply = await route.transport.post(sent_payload, label, number,
                                                   batch.headers(endpoint.index, route.transport))
            except InferenceError as err:  # no usable answer: a timeout, a connection or TLS failure
                outcome = of_error(err)
                raise
            retry_after_s = reply.retry_after_s
            if reply.refusal is not None:
                outcome = of_error(reply.refusal)
                raise reply.refusal
            assert reply.body is not None
            outcome, latency_s = Outcome.SUCCESS, time.perf_counter() - sent
            attempts.endpoint, attempts.payload = route.transport.url, sent_payload
            return reply.body
        finally:
            if outcome is Outcome.OVERLOAD:
                self.metrics.rate_limited.inc()
            if outcome.retryable:  # this request's next attempt goes elsewhere if it can
                attempts.tried.append(endpoint.index)
            self.fleet.release(endpoint, outcome, latency_s=latency_s, retry_after_s=retry_after_s)
            self._fleet_limit(self.fleet)


@dataclass(frozen=True)
class Route:
    """One endpoint of a fleet as the client sends to it: its config, transport and rate limits."""

    endpoint: EndpointConfig
    transport: Transport
    rate_limiter: RateLimiter

    def payload(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The request body for this endpoint: its `model`, when it names one."""
        if self.endpoint.model is None or payload.get("model") == self.endpoint.model:
            return payload
        return {**payload, "model": self.endpoint.model}
