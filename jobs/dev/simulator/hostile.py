"""Hostile answers: the simulator as a broken, or malicious, model server (``--hostile KIND``).

A model server, or a proxy in front of it, can answer anything: more than any answer needs, a
body without end, headers a byte at a time, bytes that are not UTF-8, JSON of the wrong shape,
a ``Retry-After`` of thirty years, a redirect, a reset in the middle of a body, another TLS
certificate. Each kind (named and described in ``config.KINDS``) is one such answer, given
instead of the simulator's usual one (after the request was validated, the fault scenario and
the rate limits passed). What llmstream's client makes of each is documented in
docs/operations.md ("Bad input from every side") and asserted by ``tests/unit/udfs/inference/test_hostile.py``,
which drives the real client against every kind.

Every hostile answer that has room for text quotes the request's headers, the API key among
them, as a proxy that reflects its request would: the worst case for an error detail or a log
line that quotes what a server said.

The kinds of an answer (``ANSWER_KINDS``) are given per request, in turn when several are set;
``tls-cert-change`` acts on the TLS handshake instead (``HANDSHAKE_KINDS``). ``hostile_rate``
(``FaultSettings``) is the share of requests (of handshakes, for ``tls-cert-change``) that get
a hostile answer. A kind that has no meaning for the request's API (an embedding's dimension
asked of a chat request) gives the usual answer. Nothing here knows about routing or limits;
``server`` decides when an answer is hostile and hands it to ``answer``.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any
from urllib.parse import quote

from aiohttp import web

from jobs.dev.simulator.config import ANSWER_KINDS, HANDSHAKE_KINDS, KINDS, parse_kinds
from jobs.dev.simulator.endpoints import Call, Chat, Embeddings

__all__ = ["ANSWER_KINDS", "HANDSHAKE_KINDS", "KINDS", "answer", "echo", "parse_kinds"]

TRICKLE_INTERVAL_S = 0.05
FLOOD_CHUNK_BYTES = 65_536
_FILLER = b"x" * FLOOD_CHUNK_BYTES
_WRITE_BUFFER_BYTES = 262_144
"""A raw writer pauses while this much waits unsent: a client that stops reading stops the flood."""
_DEEP = 100_000


def echo(request: web.BaseRequest) -> str:
    """The request's headers as one line, secrets and all: what a reflecting proxy would quote."""
    return "; ".join(f"{name}: {value}" for name, value in request.headers.items())


async def answer(kind: str, request: web.BaseRequest, call: Call, body: dict[str, Any], *,
                 size_bytes: int, hang_max_s: float) -> web.StreamResponse | None:
    """The hostile answer of ``kind`` to ``request`` (whose usual answer is ``body``); None when the
    connection is to be reset now, the answer unfinished (the caller resets it)."""
    headers = {"Server": "llmstream-simulator", "Content-Type": "application/json"}
    said = echo(request)
    if kind in _SHAPES:
        return web.Response(status=200, body=json.dumps(_SHAPES[kind](call, copy.deepcopy(body), said)).encode(),
                            headers=headers)
    if kind.startswith("retry-after-"):
        error = {"error": {"message": f"Rate limit reached (hostile simulator); request was {said}",
                           "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
        return web.Response(status=429, body=json.dumps(error).encode(),
                            headers={**headers, "Retry-After": _RETRY_AFTER[kind]})
    if kind == "redirect":
        location = f"http://{request.host}/moved{request.path}?request={quote(said)}"
        return web.Response(status=307, headers={**headers, "Location": location},
                            body=json.dumps({"error": {"message": f"moved; request was {said}"}}).encode())
    if kind == "invalid-utf8":
        raw = json.dumps(_with_text(call, body, "__BAD__")).encode()
        return web.Response(status=200, body=raw.replace(b"__BAD__", b"\xff\xfe broken \xc3 " + said.encode()),
                            headers=headers)
    if kind == "not-json":
        page = f"<html><body><h1>502 Bad Gateway</h1><p>{said}</p></body></html>".encode()
        return web.Response(status=200, body=page, headers={**headers, "Content-Type": "text/html"})
    if kind == "bad-charset":
        return web.Response(status=500, body=f"upstream failed; request was {said}".encode(),
                            headers={**headers, "Content-Type": "text/plain; charset=base64"})
    if kind == "deep-json-error":
        return web.Response(status=500, body=b"[" * _DEEP + said.encode() + b"]" * _DEEP, headers=headers)
    if kind == "huge-body":
        return await _huge(request, call, headers, size_bytes)
    if kind == "endless-body":
        await _endless(request, call, headers, hang_max_s)
        return None
    if kind == "reset-mid-body":
        raw = json.dumps(_with_text(call, body, said)).encode()
        response = web.StreamResponse(status=200, headers=headers)
        response.content_length = len(raw)
        await response.prepare(request)
        await response.write(raw[:len(raw) // 2])
        return None
    if kind in ("trickle-headers", "header-flood"):
        await _raw_head(request, kind, said, hang_max_s)
        return None
    if kind == "trickle-body":
        await _trickle_body(request, call, body, headers, hang_max_s)
        return None
    raise AssertionError(f"hostile kind {kind!r} has no answer")


# ------------------------------------------------------------------ valid JSON, wrong answer


def _with_text(call: Call, body: dict[str, Any], text: str) -> dict[str, Any]:
    """``body`` with its answer's text (embeddings: its first vector) replaced by ``text``."""
    body = copy.deepcopy(body)
    if isinstance(call, Embeddings):
        body["data"][0]["embedding"] = text
    elif isinstance(call, Chat):
        body["choices"][0]["message"] = {**body["choices"][0]["message"], "content": text}
    else:
        body["choices"][0]["text"] = text
    return body


def _no_choices(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    body.pop("data" if isinstance(call, Embeddings) else "choices")
    return body


def _empty_choices(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    body["data" if isinstance(call, Embeddings) else "choices"] = []
    return body


def _null_content(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    body = _with_text(call, body, "")
    if isinstance(call, Embeddings):
        body["data"][0]["embedding"] = None
    elif isinstance(call, Chat):
        body["choices"][0]["message"].update(content=None, refusal=f"I will not answer that ({said})")
    else:
        body["choices"][0]["text"] = None
    return body


def _number_content(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    body = _with_text(call, body, "")
    if isinstance(call, Embeddings):
        body["data"][0]["embedding"] = 42
    elif isinstance(call, Chat):
        body["choices"][0]["message"]["content"] = 42
    else:
        body["choices"][0]["text"] = 42
    return body


def _wrong_dimension(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    if isinstance(call, Embeddings) and isinstance(body["data"][-1]["embedding"], list):
        body["data"][-1]["embedding"].append(0.0)
    return body


def _missing_index(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    if isinstance(call, Embeddings):
        del body["data"][-1]["index"]
    return body


def _repeated_index(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    if isinstance(call, Embeddings):
        data = body["data"]
        if len(data) == 1:
            data.append(copy.deepcopy(data[0]))
        else:
            data[-1]["index"] = data[0]["index"]
    return body


def _index_out_of_range(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    if isinstance(call, Embeddings):
        body["data"][-1]["index"] = len(body["data"])
    return body


def _absurd_usage(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    body["usage"] = {"prompt_tokens": 2**63 - 1, "completion_tokens": -1, "total_tokens": 2**63 - 2}
    return body


def _error_in_200(call: Call, body: dict[str, Any], said: str) -> dict[str, Any]:
    return {"error": {"message": f"The upstream model failed (hostile simulator); request was {said}",
                      "type": "server_error", "param": None, "code": "upstream_error"}}


_SHAPES = {
    "no-choices": _no_choices,
    "empty-choices": _empty_choices,
    "null-content": _null_content,
    "number-content": _number_content,
    "wrong-dimension": _wrong_dimension,
    "missing-index": _missing_index,
    "repeated-index": _repeated_index,
    "index-out-of-range": _index_out_of_range,
    "absurd-usage": _absurd_usage,
    "error-in-200": _error_in_200,
}

_RETRY_AFTER = {
    "retry-after-zero": "0",
    "retry-after-negative": "-30",
    "retry-after-huge": "1000000000",
    "retry-after-past-date": "Thu, 01 Jan 1970 00:00:00 GMT",
}


# ------------------------------------------------------------------ size and time


def _text_head(call: Call) -> tuple[bytes, bytes]:
    """The start and the end of an answer whose text is to be filled in between."""
    if isinstance(call, Embeddings):
        return b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":"', b'"}]}'
    slot = b'"message":{"role":"assistant","content":"' if isinstance(call, Chat) else b'"text":"'
    return b'{"object":"hostile","choices":[{"index":0,"finish_reason":"length",' + slot, b'"}}]}'


async def _huge(request: web.BaseRequest, call: Call, headers: dict[str, str], size: int) -> web.StreamResponse:
    head, tail = _text_head(call)
    response = web.StreamResponse(status=200, headers=headers)
    response.content_length = size
    await response.prepare(request)
    await response.write(head)
    left = size - len(head) - len(tail)
    while left > 0:
        chunk = _FILLER[:min(left, FLOOD_CHUNK_BYTES)]
        await response.write(chunk)
        left -= len(chunk)
    await response.write(tail)
    return response


async def _endless(request: web.BaseRequest, call: Call, headers: dict[str, str], hang_max_s: float) -> None:
    head, _ = _text_head(call)
    response = web.StreamResponse(status=200, headers=headers)
    response.enable_chunked_encoding()
    await response.prepare(request)
    await response.write(head)
    ends = asyncio.get_running_loop().time() + hang_max_s
    while asyncio.get_running_loop().time() < ends:
        await response.write(_FILLER)


async def _trickle_body(request: web.BaseRequest, call: Call, body: dict[str, Any], headers: dict[str, str],
                        hang_max_s: float) -> None:
    raw = json.dumps(body).encode()
    response = web.StreamResponse(status=200, headers=headers)
    response.content_length = len(raw)
    await response.prepare(request)
    ends = asyncio.get_running_loop().time() + hang_max_s
    for i in range(len(raw) - 1):  # never the last byte: the answer is never complete
        if asyncio.get_running_loop().time() >= ends:
            return
        await response.write(raw[i:i + 1])
        await asyncio.sleep(TRICKLE_INTERVAL_S)
    await asyncio.sleep(max(0.0, ends - asyncio.get_running_loop().time()))


async def _raw_head(request: web.BaseRequest, kind: str, said: str, hang_max_s: float) -> None:
    """Write the answer's head past aiohttp's writer: one header a byte at a time
    (``trickle-headers``), or header lines without end (``header-flood``)."""
    transport = request.transport
    assert isinstance(transport, asyncio.Transport)
    transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    loop = asyncio.get_running_loop()
    ends = loop.time() + hang_max_s
    line = f"X-Request: {said}".encode("utf-8", "replace")
    count = 0
    while loop.time() < ends and not transport.is_closing():
        if kind == "trickle-headers":
            transport.write(line[count % len(line):count % len(line) + 1])
            await asyncio.sleep(TRICKLE_INTERVAL_S)
        else:
            while transport.get_write_buffer_size() > _WRITE_BUFFER_BYTES and not transport.is_closing():
                await asyncio.sleep(0.01)
            transport.write(f"X-Flood-{count}: ".encode() + line[len("X-Request: "):] + b"\r\n")
            await asyncio.sleep(0)
        count += 1
