"""HTTP helpers of the simulator's batch APIs: bodies read with a size limit of their own (the
providers' 200 and 256 MB are above the server's 32 MiB for inference bodies), JSON answers, and
list pages with cursors."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson
from aiohttp import web

_HEADERS = {"Server": "llmstream-simulator"}

MIB_BODY = 1024 * 1024
"""The limit on a JSON body other than a Message Batch: a batch creation, an admin call."""

dumps = orjson.dumps
"""Compact JSON as bytes: the batch files are large, and orjson writes them several times faster."""
loads = orjson.loads

T = TypeVar("T")


class HttpError(Exception):
    """An answer other than 200: ``status``, a message, and the provider's error ``kind``/``code``/``param``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param


def not_found(message: str) -> HttpError:
    return HttpError(404, message, "not_found_error")


def json_response(status: int, data: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=dumps(data), content_type="application/json",
                        headers={**_HEADERS, **(headers or {})})


def bytes_response(body: bytes, content_type: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=200, body=body, content_type=content_type, headers={**_HEADERS, **(headers or {})})


async def continue_100(request: web.BaseRequest) -> None:
    """Answer ``Expect: 100-continue`` (curl sends it before a large upload) before reading the body."""
    if request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0


async def read_limited(request: web.BaseRequest, limit: int, what: str) -> bytes:
    """The whole body, refused with 413 past ``limit`` bytes."""
    await continue_100(request)
    if request.content_length is not None and request.content_length > limit:
        raise HttpError(413, f"{what} is {request.content_length} bytes, over the limit of {limit}",
                        "request_too_large", "request_too_large")
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"{what} is over the limit of {limit} bytes", "request_too_large",
                            "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: web.BaseRequest, limit: int, what: str = "The request body") -> dict[str, Any]:
    body = await read_limited(request, limit, what)
    try:
        payload = loads(body) if body.strip() else None
    except ValueError as exc:
        raise HttpError(400, f"Request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise HttpError(400, "Request body must be a JSON object")
    return payload


def query_int(request: web.BaseRequest, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise HttpError(400, f"{name} must be an integer from {low} to {high}, got {raw!r}", param=name)
    return value


def page(items: Sequence[T], key: Callable[[T], str], limit: int, after: str | None = None,
         before: str | None = None) -> tuple[list[T], bool]:
    """``limit`` of ``items`` (already in list order) after the one whose key is ``after``, or the
    ``limit`` just before ``before``; and whether more follow in that direction."""
    keys = [key(item) for item in items]
    if after is not None:
        if after not in keys:
            raise not_found(f"No object with id {after!r} to list after")
        start = keys.index(after) + 1
        chosen = list(items[start:start + limit])
        return chosen, start + limit < len(items)
    if before is not None:
        if before not in keys:
            raise not_found(f"No object with id {before!r} to list before")
        end = keys.index(before)
        start = max(0, end - limit)
        return list(items[start:end]), start > 0
    return list(items[:limit]), limit < len(items)


def rfc3339(unix: float | None) -> str | None:
    """Anthropic's timestamps: RFC 3339 in UTC with microseconds."""
    if unix is None:
        return None
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).isoformat().replace("+00:00", "Z")
