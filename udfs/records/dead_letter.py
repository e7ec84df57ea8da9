"""Dead letters: what is written, instead of a result, for a record that gets none.

A dead letter says why (a stable `reason` code and a human `error`), where the record came
from (topic/partition/offset), how hard we tried (`attempts`, `last_status`) and carries
the original bytes, so nothing is lost. The original is UTF-8 text where it is, base64
where not, and cut at `ORIGINAL_LIMIT_BYTES` (with its full size and sha256) so a 10 MB
bad record cannot make the dead-letter write itself fail.

It carries the input's headers as `kafka.forward_headers` lets through, plus
`llmstream-reason` (the reason code) unless a forwarded header already has that name: a
user's header is never overwritten, the reason is in the value either way.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from udfs.clock import now_ms
from udfs.errors import InvalidModelOutput, RecordError
from udfs.records import SinkHeaders, SinkRow, SourceRef

ORIGINAL_LIMIT_BYTES = 256 * 1024
REASON_HEADER = "llmstream-reason"
"""The header that carries a dead letter's reason code, for consumers that route on headers."""


def _original(value: bytes | None) -> dict[str, Any]:
    if value is None:
        return {"encoding": None, "value": None, "size": 0}
    kept = value[:ORIGINAL_LIMIT_BYTES]
    out: dict[str, Any] = {"size": len(value), "truncated": len(kept) < len(value)}
    try:
        out.update(encoding="utf-8", value=kept.decode("utf-8"))
    except UnicodeDecodeError:
        out.update(encoding="base64", value=base64.b64encode(kept).decode("ascii"))
    if out["truncated"]:
        out["sha256"] = hashlib.sha256(value).hexdigest()
    return out


def dead_letter_value(
    *,
    reason: str,
    error: str,
    source: SourceRef,
    original: bytes | None,
    record_id: str | None,
    job: str,
    attempts: int = 0,
    last_status: int | None = None,
    last_output: Any = None,
) -> bytes:
    """The dead-letter record's JSON value (see README, "Record contract"). `last_output`: the
    model's last answer, for `invalid_model_output` (the key is absent otherwise)."""
    body = {
        "reason": reason,
        "error": error,
        "id": record_id,
        "attempts": attempts,
        "last_status": last_status,
        "source": source.as_json(),
        "original": _original(original),
        "dead_lettered_at": now_ms(),
        "job": job,
    }
    if last_output is not None:
        cut = isinstance(last_output, str) and len(last_output) > ORIGINAL_LIMIT_BYTES
        body["last_output"] = last_output[:ORIGINAL_LIMIT_BYTES] if cut else last_output
    try:
        return json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (an id read from a "\ud800" escape): written escaped, as it came
        return json.dumps(body).encode("ascii")


def for_error(
    err: RecordError, *, key: bytes | None, value: bytes | None, source: SourceRef,
    record_id: str | None, job: str, topic: str, headers: SinkHeaders | None = None,
) -> SinkRow:
    """The dead-letter row for a record that got no result: bad input never reached the model
    (0 attempts); an inference error carries its attempts and the last HTTP status, and an
    invalid answer (`invalid_model_output`) the answer itself, beside the validator's message.
    `headers`: the forwarded input headers; `REASON_HEADER` is added after them unless one of
    them has its name."""
    last_output = err.last_output if isinstance(err, InvalidModelOutput) else None
    payload = dead_letter_value(reason=err.reason, error=err.detail, source=source, original=value,
                                record_id=record_id, job=job, attempts=err.attempts, last_status=err.status,
                                last_output=last_output)
    out = dict(headers or {})
    out.setdefault(REASON_HEADER, err.reason.encode("utf-8"))
    return SinkRow(key, payload, topic, out)
