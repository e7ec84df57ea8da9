"""Stage 1: turn a raw Kafka record into a `Request`, or explain why it cannot be one.

A null value (a tombstone) is never a request; any other value is read by the job's input format
(`udfs/records/formats.py`: JSON, the record contract, by default; Avro in the Confluent wire
format, docs/formats.md). Whatever the format, a value that cannot be a request raises `BadInput`
with a stable reason code, never anything past the stage: the caller dead-letters it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from udfs.errors import BadInput
from udfs.records import Request, SourceRef
from udfs.records.json_format import JSON

if TYPE_CHECKING:
    from udfs.config import LimitsConfig
    from udfs.records.formats import RecordFormat


def record_id(value: bytes | None) -> str | None:
    """Best-effort id of a record that failed to decode, so a dead letter can name it."""
    if not value:
        return None
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return None
    found = parsed.get("id") if isinstance(parsed, dict) else None
    return found if isinstance(found, str) and len(found) <= 512 else None


def decode(key: bytes | None, value: bytes | None, source: SourceRef, limits: LimitsConfig,
           fmt: RecordFormat = JSON) -> Request:
    """One record as a `Request`, read by `fmt` (the job's input format); raises `BadInput` if it
    cannot be one."""
    if value is None:
        raise BadInput("null_value", "record value is null (a tombstone?)")
    return fmt.decode(key, value, source, limits)
