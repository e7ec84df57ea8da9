"""What the simulator answers: the OpenAI request shapes it accepts and the synthetic bodies it returns.

Nothing here knows about HTTP, limits or faults; ``server`` decides whether a request is
answered and when.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

from jobs.dev.simulator.config import (
    MAX_CHOICES,
    MAX_EMBEDDING_DIM,
    MAX_OUTPUT_TOKENS_CAP,
    SIMULATOR_FINGERPRINT,
    SimulatorConfig,
)
from jobs.dev.simulator.schema_answers import answer as schema_answer
from jobs.dev.simulator.schema_answers import requested_schema, schema_in_prompt

_WORDS = (
    "the", "stream", "of", "tokens", "flows", "through", "a", "simulated", "model", "and",
    "returns", "plausible", "filler", "text", "for", "benchmarks", "with", "stable", "length",
    "so", "that", "latency", "and", "throughput", "can", "be", "measured", "without", "gpus",
)
_FILLER = " ".join(_WORDS * (MAX_OUTPUT_TOKENS_CAP * 4 // len(" ".join(_WORDS)) + 2))
_FILLER_OFFSETS = [i + 1 for i, ch in enumerate(_FILLER[:200]) if ch == " "][: len(_WORDS)]


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


class BadRequest(Exception):
    """The request is invalid: answered 400 with ``param`` naming the offending field."""

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
    raise BadRequest("message content must be a string or an array of content parts", "messages")


def _positive_int(payload: dict[str, Any], key: str, maximum: int | None = None) -> int | None:
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (maximum and value > maximum):
        limit = f" and <= {maximum}" if maximum else ""
        raise BadRequest(f"'{key}' must be an integer >= 1{limit}, got {value!r}", key)
    return value


def _prompt_text(prompt: Any, param: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return " ".join(map(str, prompt))
    raise BadRequest(f"'{param}' must be a string, an array of strings or token arrays", param)


def _prompt_list(value: Any, param: str) -> list[tuple[str, int]]:
    """Normalise a ``prompt``/``input`` to (text, tokens) pairs; token arrays count their length."""
    if value is None:
        raise BadRequest(f"'{param}' is required", param)
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
    raise BadRequest(f"'{param}' must be a non-empty string or array", param)


def _model_name(payload: dict[str, Any], default: str) -> str:
    model = payload.get("model", default)
    if model is None:
        return default
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    return model


class Call:
    """One inference request, parsed: what the gate charges and what the answer needs.

    The constructor validates the payload (``BadRequest`` answers 400) and sets ``model``,
    ``prompt_tokens`` and ``token_cost`` (what the token-per-minute limit charges); ``respond``
    builds the body once the gate let the request through, and sets ``completion_tokens``.
    Each request gets its own instance, so nothing is shared between requests in flight.
    """

    __slots__ = ("completion_tokens", "model", "prompt_tokens", "token_cost")

    model: str
    prompt_tokens: int
    token_cost: int
    completion_tokens: int

    def __init__(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        raise NotImplementedError

    def respond(self, next_id: Callable[[str], str]) -> dict[str, Any]:
        """The 200 body; ``next_id(prefix)`` numbers it."""
        raise NotImplementedError

    def extra_latency_s(self, config: SimulatorConfig) -> float:
        """Latency on top of the latency model that depends on the request's size."""
        return 0.0


class _Generation(Call):
    """Chat and text completions: the same options and the same OpenAI-shaped body.

    With a ``response_format`` schema the answer is schema-shaped (``schema_answers``); the
    server sets ``spoil`` to make it deliberately invalid, and ``respond`` leaves in
    ``schema_answers`` how many of its answers (choices) did and did not validate."""

    __slots__ = ("n", "out_tokens", "schema", "schema_answers", "spoil")

    def _options(self, config: SimulatorConfig, payload: dict[str, Any], texts: list[str]) -> None:
        if payload.get("stream"):
            raise BadRequest("stream=true is not supported by the simulator", "stream")
        try:
            self.schema = requested_schema(payload) or schema_in_prompt(texts)
        except ValueError as err:
            raise BadRequest(str(err), "response_format") from None
        self.spoil = False
        self.schema_answers = (0, 0)
        self.model = _model_name(payload, config.models[0])
        requested = _positive_int(payload, "max_completion_tokens") or _positive_int(payload, "max_tokens")
        self.out_tokens = min(requested or config.default_max_tokens, config.max_output_tokens)
        self.n = _positive_int(payload, "n", MAX_CHOICES) or 1

    def _answer(self, prompt: str) -> str:
        """Filler text, or a schema-shaped answer (counted in ``schema_answers`` per choice)."""
        if self.schema is None:
            return completion_text(prompt, self.out_tokens)
        text, valid = schema_answer(self.schema, prompt, self.spoil)
        ok, bad = self.schema_answers
        self.schema_answers = (ok + self.n, bad) if valid else (ok, bad + self.n)
        return text

    def _body(self, next_id: Callable[[str], str], id_prefix: str, kind: str, choices: list[dict[str, Any]],
              completion_tokens: int) -> dict[str, Any]:
        self.completion_tokens = completion_tokens
        prompt_tokens = self.prompt_tokens
        return {
            "id": next_id(id_prefix),
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


class Chat(_Generation):
    __slots__ = ("prompt",)

    def __init__(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty array", "messages")
        chars = 0
        echo: str | None = None
        last = ""
        texts = []
        for message in messages:
            if not isinstance(message, dict):
                raise BadRequest("each message must be an object with 'role' and 'content'", "messages")
            last = _content_text(message.get("content"))
            texts.append(last)
            chars += len(last)
            if message.get("role") == "user":
                echo = last
        self._options(config, payload, texts)
        self.prompt = echo if echo is not None else last
        self.prompt_tokens = max(1, (chars + 3) // 4)
        self.token_cost = self.prompt_tokens + self.out_tokens * self.n

    def respond(self, next_id: Callable[[str], str]) -> dict[str, Any]:
        n = self.n
        text = self._answer(self.prompt)
        message = {"role": "assistant", "content": text}
        choices = [{"index": i, "message": message, "logprobs": None, "finish_reason": "stop"} for i in range(n)]
        return self._body(next_id, "chatcmpl", "chat.completion", choices, approx_tokens(text) * n)


class Completions(_Generation):
    __slots__ = ("prompts",)

    def __init__(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        self.prompts = prompts = _prompt_list(payload.get("prompt"), "prompt")
        self._options(config, payload, [text for text, _ in prompts])
        self.prompt_tokens = sum(tokens for _, tokens in prompts)
        self.token_cost = self.prompt_tokens + self.out_tokens * self.n * len(prompts)

    def respond(self, next_id: Callable[[str], str]) -> dict[str, Any]:
        n = self.n
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for text, _ in self.prompts:
            answer = self._answer(text)
            completion_tokens += approx_tokens(answer) * n
            for _ in range(n):
                choices.append({"text": answer, "index": len(choices), "logprobs": None, "finish_reason": "stop"})
        return self._body(next_id, "cmpl", "text_completion", choices, completion_tokens)


class Embeddings(Call):
    __slots__ = ("dim", "encoding", "inputs")

    def __init__(self, config: SimulatorConfig, payload: dict[str, Any]) -> None:
        self.inputs = inputs = _prompt_list(payload.get("input"), "input")
        self.model = _model_name(payload, config.models[0])
        self.dim = _positive_int(payload, "dimensions", MAX_EMBEDDING_DIM) or config.embedding_dim
        self.encoding = payload.get("encoding_format") or "float"
        if self.encoding not in ("float", "base64"):
            raise BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        limit = config.max_input_tokens
        for index, (_, tokens) in enumerate(inputs):
            if limit and tokens > limit:
                raise BadRequest(f"input {index} is {tokens} tokens, over this model's maximum of {limit} "
                                 "(simulator --max-input-tokens)", "input")
        self.prompt_tokens = self.token_cost = sum(tokens for _, tokens in inputs)
        self.completion_tokens = 0

    def extra_latency_s(self, config: SimulatorConfig) -> float:
        """``per_input_ms`` per input: a batch costs the server more than one input, less than one
        request per input."""
        return config.per_input_ms * len(self.inputs) / 1000.0

    def respond(self, next_id: Callable[[str], str]) -> dict[str, Any]:
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
