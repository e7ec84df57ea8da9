"""JSON on the record's path (the model call's request and response, the output record) with
orjson when it is installed, and the standard library's `json` otherwise.

Why: with an instant model the client's JSON work (request body, response body, output record)
is a sizeable share of the Python CPU of a call, and orjson does it in a fraction of that
(docs/performance.md, "The client's JSON", has the profile, its command and the figures). It differs from `json` where it must
not change what llmstream reads: it refuses NaN and Infinity, integers beyond 64 bits and more
than 1,024 levels of nesting, so `loads` falls back to `json` whenever orjson refuses, and `dumps`
whenever it cannot write a value (a big integer, a key that is not a string). What llmstream
writes changes in form only: compact separators (`{"a":1}`, not `{"a": 1}`), floats in orjson's
shortest form (`0.00001`, not `1e-05`), and NaN or Infinity (a broken model's embedding) as
`null` instead of `json`'s `NaN`, which no strict JSON reader accepts.

Input records are still parsed by `json` (`udfs/records/json_format.py`): its dead-letter reasons quote
`json`'s messages.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

orjson: ModuleType | None
try:
    import orjson
except ImportError:  # pragma: no cover - orjson is in install_requires; a bare environment still works
    orjson = None


def loads(data: bytes | str) -> Any:
    """`json.loads(data)`, faster when orjson can read it."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # NaN, Infinity, deep nesting, or not JSON at all: `json` decides and says why
    return json.loads(data)


def dumps(obj: Any) -> bytes:
    """`json.dumps(obj, ensure_ascii=False).encode()` with compact separators, faster when orjson
    can write it."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except (TypeError, orjson.JSONEncodeError):
            pass  # a big integer, NaN, a key that is not a string: `json` writes it as before
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

