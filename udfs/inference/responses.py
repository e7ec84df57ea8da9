"""Reading a model server's 2xx answer: pure functions from its parsed JSON body to what a
record gets (output, finish reason, token usage), for each `model.api` and for a batch of
embeddings.

An answer that is not of the expected shape is a `PermanentError` (status 200) naming what
was missing; one vector per token where `api: embeddings` needs one pooled vector per input
is an `UnsupportedResponse`. The caller sets `attempts` on what these raise. Token counts
come from the body's `usage`; a server that omits them gets an estimate (`udfs/inference/prompts.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from udfs.errors import PermanentError, UnsupportedResponse
from udfs.inference.prompts import estimate_tokens, input_tokens

MAX_DETAIL_CHARS = 300


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


def answer(api: str, body: dict[str, Any]) -> Answer:
    """The first choice's text (chat: `message.content`, completions: `text`) and finish reason,
    or the first embedding."""
    try:
        if api == "embeddings":
            return Answer(pooled(body["data"][0]["embedding"]), None)
        choice = body["choices"][0]
        output = choice["message"]["content"] if api == "chat" else choice["text"]
        return Answer(output, choice.get("finish_reason"))
    except (KeyError, IndexError, TypeError) as err:
        raise PermanentError(f"unexpected {api} response shape ({type(err).__name__}: {err})"[:MAX_DETAIL_CHARS],
                             status=200) from None


def usage(api: str, body: dict[str, Any], payload: dict[str, Any], output: Any) -> Usage:
    """The body's `usage`; a count it lacks is estimated from the request (`payload`) or the output."""
    reported = body.get("usage")
    if not isinstance(reported, dict):
        reported = {}
    prompt_tokens = reported.get("prompt_tokens")
    if not isinstance(prompt_tokens, int):
        prompt_tokens = input_tokens(payload)
    completion_tokens = reported.get("completion_tokens")
    if not isinstance(completion_tokens, int):
        completion_tokens = 0 if api == "embeddings" else estimate_tokens(output if isinstance(output, str) else "")
    return Usage(prompt_tokens, completion_tokens)


def model_name(body: dict[str, Any], payload: dict[str, Any]) -> str:
    """The model that answered, as the server names it, else the one asked for."""
    return str(body.get("model") or payload["model"])


def batch_vectors(body: dict[str, Any], count: int) -> list[Any]:
    """The `count` vectors of a batch response, in input order (by each item's `index`)."""
    data = body.get("data")
    if not isinstance(data, list) or len(data) != count:
        got = len(data) if isinstance(data, list) else type(data).__name__
        raise PermanentError(f"unexpected embeddings response: {got} items for a batch of {count} inputs", status=200)
    try:
        if all(isinstance(item.get("index"), int) for item in data):
            data = sorted(data, key=lambda item: item["index"])
        vectors = [item["embedding"] for item in data]
    except (AttributeError, KeyError, TypeError) as err:
        raise PermanentError(f"unexpected embeddings response shape ({type(err).__name__}: {err})"[:MAX_DETAIL_CHARS],
                             status=200) from None
    return [pooled(vector) for vector in vectors]


def batch_prompt_tokens(body: dict[str, Any], estimated: int) -> int:
    """The prompt tokens a batch response reports in all, else `estimated`."""
    reported = body.get("usage")
    total = reported.get("prompt_tokens") if isinstance(reported, dict) else None
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        return estimated
    return total


def pooled(vector: Any) -> Any:
    """`vector`, unless it is one vector per token (llama.cpp's server with a model that has no
    pooling): not an embedding of the input, so an `UnsupportedResponse` that says so."""
    if vector and isinstance(vector, list) and isinstance(vector[0], list):
        raise UnsupportedResponse(
            f"the server returned {len(vector)} vectors (one per token) for one input, not one "
            "pooled embedding; use an embedding model or server that pools (e.g. mean pooling)", status=200)
    return vector
