"""Structured output: answers that match a JSON Schema, or a dead letter that says why not.

`model.response_format` holds a JSON Schema, inline or as a file path; the config loader reads
and checks it (`udfs/config/json_schema.py`) (a bad schema is a `ConfigError` naming the key, before
the job starts), and the config then carries the schema itself, so a cluster's workers never
need the file. The schema reaches the model in one of three ways (`model.response_format_mode`):

- ``native``: OpenAI's ``response_format: {"type": "json_schema", "json_schema": {...}}``,
  which OpenAI, vLLM, llama.cpp's own ``llama-server`` and Ollama constrain decoding with;
- ``json_object``: ``response_format: {"type": "json_object", "schema": {...}}``, the older
  form llama-cpp-python's server accepts (measured: it answers ``json_schema`` with HTTP 500);
- ``prompt``: an instruction with the schema, added to the system prompt (chat) or in front
  of the prompt (completions), for servers that ignore or reject ``response_format``.

Either way every answer is parsed and validated with `jsonschema` (never trusted because the
server was asked nicely). A valid answer becomes the record's ``output_json``.

Where the invalid-answer retry lives, and why there: in `StructuredOutput.until_valid`, one
level above `RetryPolicy` (udfs/inference/retry.py) and below the result cache. An invalid answer is
an HTTP 200 from a healthy server, so it is not a transport failure: backing off would only
waste time, spending `retry.max_attempts` on it would leave a later 503 no retries, and a
429 storm must not eat the invalid-answer allowance either. So each round is one whole
`RetryPolicy.run` (its own attempts and its own `async.record_deadline_s`), and this loop
only counts answers that came back and did not validate, up to `model.max_invalid_retries`.
It sits below the cache so an invalid answer is never stored, and a retry never gets the
same stored answer back. When the allowance is spent the record is dead-lettered as
`invalid_model_output` with the last answer and the validator's message: a record's
outcome, never a failure of the job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import jsonschema
from jsonschema.exceptions import best_match

from udfs.config.json_schema import load_schema
from udfs.errors import InferenceError, InvalidModelOutput

if TYPE_CHECKING:
    from udfs.config import ModelConfig
    from udfs.records import Completion

MAX_MESSAGE_CHARS = 300
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n(?P<body>.*?)\n?```$", re.DOTALL)
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")

PROMPT_SCHEMA_MARKER = "It must be valid against this JSON Schema:\n"
"""Precedes the schema in the instruction; the simulator finds the schema by it."""
PROMPT_INSTRUCTION = (
    "Answer with one JSON value and nothing else (no prose, no code fence). " + PROMPT_SCHEMA_MARKER + "{schema}"
)
"""The instruction of `response_format_mode: prompt`; `{schema}` is the schema as compact JSON."""


def schema_name(schema: dict[str, Any]) -> str:
    """The `json_schema.name` OpenAI requires (`[A-Za-z0-9_-]{1,64}`): the schema's title, else `output`."""
    title = schema.get("title")
    name = _NAME_CHARS.sub("_", title).strip("_")[:64] if isinstance(title, str) else ""
    return name or "output"


def response_format_field(schema: dict[str, Any], mode: str = "native") -> dict[str, Any]:
    """The `response_format` request field: OpenAI's `json_schema` form (`native`), or the older
    `{"type": "json_object", "schema": ...}` form (`json_object`)."""
    if mode == "json_object":
        return {"type": "json_object", "schema": schema}
    return {"type": "json_schema", "json_schema": {"name": schema_name(schema), "schema": schema}}


def prompt_instruction(schema: dict[str, Any]) -> str:
    """The instruction of `prompt` mode, with the schema as compact JSON."""
    return PROMPT_INSTRUCTION.format(schema=json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def extract_json_text(output: str) -> str:
    """The JSON text of an answer: stripped, without a Markdown code fence around it (models
    asked by prompt often add one; nothing else is forgiven)."""
    text = output.strip()
    fenced = _FENCE.match(text)
    return fenced.group("body").strip() if fenced else text


@dataclass(frozen=True)
class Invalid:
    """Why an answer was rejected: the validator's (or parser's) message."""

    message: str


class StructuredOutput:
    """The schema of one job: how requests ask for it and how answers are checked against it."""

    def __init__(self, schema: dict[str, Any], *, mode: str = "native", max_invalid_retries: int = 2) -> None:
        self.schema = schema
        self.mode = mode
        self.max_invalid_retries = max_invalid_retries
        self._validator = jsonschema.validators.validator_for(schema)(schema)

    @classmethod
    def from_config(cls, model: ModelConfig) -> StructuredOutput | None:
        """The model's structured output, or `None` when `model.response_format` is unset."""
        if model.response_format is None:
            return None
        schema = load_schema(model.response_format, "model.response_format")
        return cls(schema, mode=model.response_format_mode, max_invalid_retries=model.max_invalid_retries)

    def check(self, output: Any) -> Any:
        """The answer's parsed JSON when it is valid against the schema, else an `Invalid`."""
        if not isinstance(output, str):
            return Invalid(f"expected a text answer, got {type(output).__name__}")
        try:
            value = json.loads(extract_json_text(output))
        except ValueError as err:
            return Invalid(f"not JSON: {err}"[:MAX_MESSAGE_CHARS])
        error = best_match(self._validator.iter_errors(value))
        if error is None:
            return value
        where = error.json_path if error.absolute_path else "$"
        return Invalid(f"at {where}: {error.message}"[:MAX_MESSAGE_CHARS])

    async def until_valid(self, answer: Callable[[], Awaitable[Completion]],
                          on_invalid: Callable[[], None] | None = None) -> Completion:
        """Calls `answer()` (one whole HTTP-retried call) until its output validates, at most
        `1 + max_invalid_retries` times. Returns the valid completion with `output_json` set;
        its `attempts`, token counts, cost and latency cover every round, since the invalid
        answers were paid for too. Raises `InvalidModelOutput` with the last answer and the
        validator's message when none validated. An `InferenceError` from a later round passes
        through with the earlier rounds' attempts added. `on_invalid` is called once per answer
        that did not validate (the `invalid_answers` metric)."""
        rounds: list[Completion] = []
        for _ in range(self.max_invalid_retries + 1):
            try:
                completion = await answer()
            except InferenceError as err:
                err.attempts += sum(r.attempts for r in rounds)
                raise
            rounds.append(completion)
            checked = self.check(completion.output)
            if not isinstance(checked, Invalid):
                return _over_rounds(rounds, checked)
            if on_invalid is not None:
                on_invalid()
            message = checked.message
        raise InvalidModelOutput(
            f"{len(rounds)} answer(s), none valid against model.response_format; last: {message}",
            last_output=rounds[-1].output, attempts=sum(r.attempts for r in rounds), status=200)


def _over_rounds(rounds: list[Completion], value: Any) -> Completion:
    """The last (valid) completion, its usage, cost, attempts and latency summed over `rounds`."""
    first, last = rounds[0], rounds[-1]
    costs = [r.cost for r in rounds if r.cost is not None]
    return replace(
        last, output_json=value, structured=True, invalid_answers=len(rounds) - 1,
        attempts=sum(r.attempts for r in rounds),
        prompt_tokens=sum(r.prompt_tokens for r in rounds),
        completion_tokens=sum(r.completion_tokens for r in rounds),
        cost=sum(costs) if costs else last.cost,
        started_ms=first.started_ms,
        latency_ms=last.latency_ms + max(0, last.started_ms - first.started_ms))
