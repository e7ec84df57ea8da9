"""OpenAI-compatible model-server SIMULATOR for llmstream benchmarks and tests.

This is NOT a language model. Every answer is synthetic and deterministic: completion
text is "Simulated answer to: <first 40 characters of the prompt>" padded with filler
words, embeddings are derived from a hash of the input, and token counts are
approximations (ceil(len(text) / 4), at least 1). Responses carry
``system_fingerprint: "llmstream-simulator"`` and ``/stats`` and ``/v1/models`` carry
``"simulator": true`` so that nobody mistakes its numbers for a real model's.

It exists to put a controllable, cheap, realistic-looking HTTP endpoint in front of the
llmstream Flink job: configurable latency, a concurrency limit, OpenAI-style rate
limits and runtime-switchable fault injection. HTTP is aiohttp's low-level ``web.Server``
(keep-alive, pipelining, chunked request bodies, ``Expect: 100-continue``); every request
runs in its own handler task, cancelled when its client leaves.

Transport: aiohttp.web rather than a hand-written server
--------------------------------------------------------
Until issue 11 the simulator carried its own HTTP/1.1 server (an ``asyncio.Protocol``). It
needed less CPU per request, but one core of aiohttp.web still serves several times the job's
own ceiling with an instant model (bench scenario d), so the simulator stays off the critical
path and one HTTP stack less is ours to keep correct; the hand-written server was deleted.
What it costs: on two shared cores the server's extra CPU comes out of its clients' share.
The measurement, its command and the figures are in docs/performance.md ("The simulator's
HTTP server").

Endpoints
---------
``POST /v1/chat/completions``  body ``{"model", "messages": [{"role", "content"}], "max_tokens"?, "n"?}``
``POST /v1/completions``       body ``{"model", "prompt": str | list[str], "max_tokens"?, "n"?}``
``POST /v1/embeddings``        body ``{"model", "input": str | list[str], "dimensions"?, "encoding_format"?}``
``GET  /v1/models``, ``GET /v1/models/{id}``  (any model name in a request is accepted and echoed)
``GET  /health``               200 ``{"status": "ok"}``
``GET  /stats``                counters, see ``SimulatorServer.stats``; ``POST /stats/reset`` zeroes them
``GET|POST /admin/faults``     read / replace the fault scenario (keys below)
``GET|POST /admin/config``     read / update latency and limits (keys below)
``/v1/files``, ``/v1/batches``, ``/v1/messages/batches``, ``/admin/batches``
                               OpenAI's Batch API and Anthropic's Message Batches (``batches``, docs/models.md)

Errors use the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: unknown path
404, bad JSON or missing ``messages``/``prompt``/``input`` 400, wrong or missing API key 401
(only ``/v1/*`` is protected; health, stats and admin are not, so bind to loopback).

``POST /admin/faults`` body (the body REPLACES the whole fault scenario; omitted keys
go back to their defaults, so ``{}`` clears every fault)::

    error_rate       fraction of inference requests answered with error_status   (0)
    error_status     HTTP status of injected errors                              (500)
    rate_limit_rate  fraction answered 429 with Retry-After: retry_after_s       (0)
    retry_after_s    Retry-After seconds of injected 429s                        (1)
    hang_rate        fraction never answered; the connection is held open until
                     the client leaves or hang_max_s (config) passes              (0)
    reset_rate       fraction whose connection is aborted (TCP RST), no response  (0)
    down_for_s       go down now for that many seconds: stop listening (clients get
                     connection refused) and abort every open connection; the
                     admin request itself is answered first. A body with only
                     this key keeps the current scenario                         (0)
    until_s          the rates above revert to zero after that many seconds     (none)
    hostile          hostile answers instead of the usual ones, each kind in turn: a
                     kind, "a,b" or a list; "all" is every kind of an answer
                     (``hostile.py``; what llmstream makes of each: docs/operations.md,
                     "Bad input from every side")                               (none)
    hostile_rate     the share of requests that pass the faults above (a draw of
                     their own) answered with a hostile kind; tls-cert-change: of
                     the TLS handshakes                                          (1)

For example "429 to 30% of calls for 60 s" is ``{"rate_limit_rate": 0.3, "until_s": 60}``.
The rates are drawn from one uniform sample per request, so their sum must be <= 1.
Faults apply to the three inference endpoints only and are decided after the request
is validated (a bad request is always a 400), before rate limits and admission.

``POST /admin/config`` body (partial update; the same names as the command-line flags,
with ``-`` or ``_``)::

    latency            "0" | "instant" | "fixed:MS" | "lognormal:MEDIAN_MS:P99_MS"
    per_token_ms       extra latency per completion token
    per_input_ms       extra latency per input of an embeddings request
    max_input_tokens   embeddings inputs over this many tokens answer 400, 0 = no limit
    invalid_json_rate  share of schema-shaped answers made invalid on purpose (below)
    concurrency        requests processed at once, 0 = unlimited
    reject_over_limit  over the limit answer 429 at once instead of queueing
    retry_after_s      Retry-After seconds of those 429s
    rpm, tpm           requests / tokens per minute (token buckets), 0 = unlimited
    embedding_dim, default_max_tokens, max_output_tokens, hang_max_s, seed

A chat or completions request with ``response_format`` (``json_schema`` or ``json_object``)
is answered with JSON built from the schema (``schema_answers``); ``invalid_json_rate`` of
those answers are deliberately invalid, and ``/stats`` counts ``structured_answers`` and
``invalid_answers`` (checked with ``jsonschema``, so the count is what was really sent).

Latency is the time a request holds a concurrency slot: a sample of the latency model
plus ``per_token_ms`` times the completion tokens (``per_input_ms`` times the inputs of an
embeddings request), slept with the event loop (never
blocking it). Lognormal uses ``mu = ln(median)``, ``sigma = ln(p99 / median) / 2.3263``.
Rate limits count one request and ``prompt_tokens + max_tokens * choices`` tokens per
admitted request, and answer 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*``
headers (also sent on successful responses while a limit is set).

HTTPS: ``--tls-cert PEM --tls-key PEM`` serve TLS (the URLs become ``https://``);
``--tls-client-ca PEM`` also requires a client certificate signed by that CA. A request that
came without one is answered 400 ``client_certificate_required`` ("No required SSL certificate
was sent", as nginx's ``ssl_verify_client on`` answers); a certificate from another CA fails
the handshake, and since asyncio's TLS server closes a failed handshake without sending the
TLS alert, a client sees that as a reset connection. ``SimulatorConfig.required_headers``
(Python only) names headers every inference request must carry, else 401 naming the header.

Run it with ``llmstream model-server`` or ``python -m jobs.dev.simulator --help``. From
Python: ``serve`` (inside a running event loop), ``start_in_thread`` (a daemon thread,
for tests) or ``spawn`` (a subprocess).

Modules
-------
``config``     ``SimulatorConfig``, ``FaultSettings``, ``parse_latency``: every setting, checked at construction
``endpoints``  the request shapes accepted and the synthetic bodies returned (no HTTP)
``server``     ``SimulatorServer`` and ``serve``: HTTP, routing, faults, rate limits, concurrency, ``/stats``
``hostile``    the hostile answers (``--hostile KIND``): a broken or malicious server, kind by kind
``launch``     ``start_in_thread`` / ``ThreadedSimulator``, ``spawn`` / ``SpawnedSimulator`` and
               ``spawn_fleet`` / ``SpawnedFleet``
``fleet``      ``SimulatorFleet`` and ``serve_fleet``: several endpoints in one process (``--fleet 16,8,4``)
               and a control port that kills, revives, faults and reconfigures each
``batches``    ``BatchApis``: the provider batch APIs, OpenAI (``batch_openai``) and Anthropic
               (``batch_anthropic``) on one engine (``batch_engine``), their settings (``batch_config``)
``cli``        ``llmstream model-server``: ``add_arguments``, ``config_from_args``, ``run``, ``main``
"""

from jobs.dev.simulator.cli import (
    FINAL_STATS_PREFIX,
    LISTENING_PREFIX,
    add_arguments,
    build_parser,
    config_from_args,
    main,
    run,
)
from jobs.dev.simulator.config import (
    DEFAULT_MODEL,
    SIMULATOR_FINGERPRINT,
    FaultSettings,
    LatencyModel,
    SimulatorConfig,
    parse_latency,
)
from jobs.dev.simulator.endpoints import (
    approx_tokens,
    completion_text,
    embedding_vector,
)
from jobs.dev.simulator.fleet import FLEET_PREFIX, SimulatorFleet, serve_fleet
from jobs.dev.simulator.launch import (
    SpawnedFleet,
    SpawnedSimulator,
    ThreadedSimulator,
    spawn,
    spawn_fleet,
    start_in_thread,
)
from jobs.dev.simulator.server import SimulatorServer, format_reset, serve

__all__ = [
    "DEFAULT_MODEL",
    "FINAL_STATS_PREFIX",
    "FLEET_PREFIX",
    "LISTENING_PREFIX",
    "SIMULATOR_FINGERPRINT",
    "FaultSettings",
    "LatencyModel",
    "SimulatorConfig",
    "SimulatorFleet",
    "SimulatorServer",
    "SpawnedFleet",
    "SpawnedSimulator",
    "ThreadedSimulator",
    "add_arguments",
    "approx_tokens",
    "build_parser",
    "completion_text",
    "config_from_args",
    "embedding_vector",
    "format_reset",
    "main",
    "parse_latency",
    "run",
    "serve",
    "serve_fleet",
    "spawn",
    "spawn_fleet",
    "start_in_thread",
]
