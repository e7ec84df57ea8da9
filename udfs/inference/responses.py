"""Reading a model server's 2xx answer: pure functions from its parsed JSON body to what a
record gets (output, finish reason, token usage), for each `model.api` and for a batch of
embeddings.

Nothing in a 2xx body is taken on trust (docs/operations.md, "Bad input from every side"): an
answer whose output is not where and what it must be (no `choices`, `choices: []`, a `content`
that is null or not text, a vector that is not a list of numbers, of another length than
`model.embedding_dim` or than its batch's others, a batch whose items' `index` are not each of
its inputs' once) is an `UnsupportedResponse` (status 200, reason `unsupported_response`) saying
what was wrong, never an output record with a wrong or missing output. Its detail names fields
and types, never quotes what the server wrote. The caller sets `attempts` on what these raise.
Token counts come from the body's `usage`; a count that is missing, not a whole number, negative
or over `MAX_REPORTED_TOKENS` is estimated instead (`udfs/inference/prompts.py`), so a server's
arithmetic cannot make a cost, a budget or a rate limit absurd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from udfs.errors import UnsupportedResponse
from udfs.inference.prompts import estimate_tokens, input_tokens

MAX_DETAIL_CHARS = 300
MAX_REPORTED_TOKENS = 100_000_000
"""More tokens than any one call uses (a model's context is at most a few million): a `usage`
count over it is not a count, and is estimated instead."""
MAX_MODEL_NAME_CHARS = 256
"""A longer `model` in an answer is not a model's name: the record names the model asked for."""


@dataclass(frozen=True)
class Answer:
    """The output of one answer: text for chat and completions, a vector for embeddings."""

    output: Any
    finish_reason: str | None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _unusable(detail: str) -> UnsupportedResponse:
    return UnsupportedResponse(detail[:MAX_DETAIL_CHARS], status=200)


def _kind(value: Any) -> str:
    """What a JSON value is, for a detail that must not quote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return f"a list of {len(value)}" if value else "an empty list"
    return "an object" if isinstance(value, dict) else type(value).__name__


def answer(api: str, body: dict[str, Any], dimensions: int | None = None) -> Answer:
    """The first choice's text (chat: `message.content`, completions: `text`) and finish reason
    (none unless a string), or the one embedding (checked as `batch_vectors` checks a batch's)."""
    if api == "embeddings":
        return Answer(batch_vectors(body, 1, dimensions)[0], None)
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise _unusable(f"the {api} answer's choices are {'missing' if choices is None else _kind(choices)}, "
                        "not a list of at least one choice")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise _unusable(f"the {api} answer's choices[0] is {_kind(choice)}, not an object")
    if api == "chat":
        message = choice.get("message")
        if not isinstance(message, dict):
            raise _unusable(f"the chat answer's choices[0].message is {_kind(message)}, not an object")
        owner, where, output = message, "choices[0].message.content", message.get("content")
    else:
        owner, where, output = choice, "choices[0].text", choice.get("text")
    if not isinstance(output, str):
        instead = [name for name in ("refusal", "tool_calls", "function_call") if owner.get(name)]
        raise _unusable(f"the {api} answer's {where} is {_kind(output)}, not text"
                        + (f" (the message has {' and '.join(instead)} instead)" if instead else ""))
    finish = choice.get("finish_reason")
    return Answer(output, finish if isinstance(finish, str) else None)


def usage(api: str, body: dict[str, Any], payload: dict[str, Any], output: Any) -> Usage:
    """The body's `usage`; a count it lacks is estimated from the request (`payload`) or the output."""
    reported = body.get("usage")
    if not isinstance(reported, dict):
        reported = {}
    prompt_tokens = _count(reported.get("prompt_tokens"))
    if prompt_tokens is None:
        prompt_tokens = input_tokens(payload)
    completion_tokens = _count(reported.get("completion_tokens"))
    if completion_tokens is None:
        completion_tokens = 0 if api == "embeddings" else estimate_tokens(output if isinstance(output, str) else "")
    return Usage(prompt_tokens, completion_tokens)


def _count(value: Any) -> int | None:
    """A token count as reported, if it is one: a whole number from 0 to `MAX_REPORTED_TOKENS`."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_REPORTED_TOKENS:
        return value
    return None


def model_name(body: dict[str, Any], payload: dict[str, Any]) -> str:
    """The model that answered, as the server names it (a string of at most `MAX_MODEL_NAME_CHARS`),
    else the one asked for."""
    named = body.get("model")
    if isinstance(named, str) and 0 < len(named) <= MAX_MODEL_NAME_CHARS:
        return named
    return str(payload["model"])


def batch_vectors(body: dict[str, Any], count: int, dimensions: int | None = None) -> list[Any]:
    """The `count` vectors of an embeddings answer, in input order: by each item's `index`, which
    must be each of 0 .. count - 1 once (items without any index at all are taken in order).
    Every vector is a non-empty list of numbers, `dimensions` long when that is given, else as
    long as the answer's others."""
    data = body.get("data")
    if not isinstance(data, list) or len(data) != count:
        got = f"{len(data)} items" if isinstance(data, list) else "data " + ("missing" if data is None else _kind(data))
        raise _unusable(f"the embeddings answer has {got} for {count} input{'s' if count != 1 else ''}")
    for position, item in enumerate(data):
        if not isinstance(item, dict):
            raise _unusable(f"the embeddings answer's item {position} is {_kind(item)}, not an object")
    indices = [item.get("index") for item in data]
    if any(index is not None for index in indices):
        data = _by_index(data, indices, count)
    vectors = [pooled(item.get("embedding"), position) for position, item in enumerate(data)]
    expected = dimensions if dimensions is not None else len(vectors[0]) if vectors else 0
    for position, vector in enumerate(vectors):
        if len(vector) != expected:
            against = f"model.embedding_dim is {dimensions}" if dimensions is not None else \
                f"the answer's first is {expected} long"
            raise _unusable(f"the embeddings answer's vector {position} has {len(vector)} numbers; {against}")
    return vectors


def _by_index(data: list[dict[str, Any]], indices: list[Any], count: int) -> list[dict[str, Any]]:
    """`data` in the order its `index` fields give, or `UnsupportedResponse` saying which item's
    index is missing, repeated or out of range: a vector is never given to another input."""
    ordered: list[dict[str, Any] | None] = [None] * count
    for position, (item, index) in enumerate(zip(data, indices, strict=True)):
        if not isinstance(index, int) or isinstance(index, bool):
            raise _unusable(f"the embeddings answer's item {position} has "
                            f"{'no index' if index is None else 'an index that is ' + _kind(index)}; the others have one")
        if not 0 <= index < count:
            raise _unusable(f"the embeddings answer's item {position} has index {index}, out of range for "
                            f"{count} input{'s' if count != 1 else ''}")
        if ordered[index] is not None:
            raise _unusable(f"the embeddings answer's item {position} repeats index {index}")
        ordered[index] = item
    return [item for item in ordered if item is not None]


def batch_prompt_tokens(body: dict[str, Any], estimated: int) -> int:
    """The prompt tokens a batch response reports in all (a count as `usage` takes one), else `estimated`."""
    reported = body.get("usage")
    total = _count(reported.get("prompt_tokens")) if isinstance(reported, dict) else None
    return estimated if total is None else total


def pooled(vector: Any, position: int = 0) -> list[Any]:
    """`vector`, if it is one embedding: a non-empty list of numbers. One vector per token
    (llama.cpp's server with a model that has no pooling) is not an embedding of the input,
    so an `UnsupportedResponse` that says so; anything else that is not a list of numbers too."""
    if vector and isinstance(vector, list) and isinstance(vector[0], list):
        raise UnsupportedResponse(
            f"the server returned {len(vector)} vectors (one per token) for one input, not one "
            "pooled embedding; use an embedding model or server that pools (e.g. mean pooling)", status=200)
    if not isinstance(vector, list) or not vector:
        raise _unusable(f"the embeddings answer's vector {position} is {_kind(vector)}, not a list of numbers")
    try:
        sum(vector)  # a C loop: raises on anything but numbers (JSON's parser already refused NaN and infinity)
    except TypeError:
        raise _unusable(f"the embeddings answer's vector {position} holds something other than numbers") from None
    return vector
