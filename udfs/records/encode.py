"""Stage 3: the output record for a request the model answered: the input's key, the result record
(`udfs/records/result.py`) written by the job's output format (`udfs/records/formats.py`: JSON, the
record contract, by default; Avro, docs/formats.md), and the input's headers as
`kafka.forward_headers` lets through (`records.forwarded_headers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from udfs.errors import ResultTooLarge
from udfs.records import Completion, Request, SinkHeaders, SinkRow
from udfs.records.json_format import JSON
from udfs.records.result import result_record

if TYPE_CHECKING:
    from udfs.records.formats import RecordFormat


def result_value(request: Request, completion: Completion, fmt: RecordFormat = JSON) -> bytes:
    """The output record's value: the result record of `fmt`'s fields, written by `fmt`."""
    return fmt.encode(result_record(request, completion, fmt.fields))


def headers_size(headers: SinkHeaders | None) -> int:
    """Bytes of header names and values, as they count towards a Kafka record's size."""
    return sum(len(name.encode("utf-8")) + len(value or b"") for name, value in (headers or {}).items())


def result_row(request: Request, completion: Completion, topic: str, max_bytes: int | None = None,
               headers: SinkHeaders | None = None, fmt: RecordFormat = JSON) -> SinkRow:
    """The sink row for a result: the input's key, kept as it was, the value in `fmt` (the job's
    output format) and `headers` (the forwarded input headers).

    Raises `ResultTooLarge` when key + value + headers exceed `max_bytes` (`limits.max_result_bytes`):
    the caller dead-letters the record rather than let the sink fail on it.
    """
    return sized_row(request.key, result_value(request, completion, fmt), topic, max_bytes, headers,
                     completion.attempts)


def sized_row(key: bytes | None, value: bytes | None, topic: str, max_bytes: int | None,
              headers: SinkHeaders | None, attempts: int = 0) -> SinkRow:
    """The sink row of an outgoing value (a result, a postprocess's record, a record passed
    through); `ResultTooLarge` when key + value + headers exceed `max_bytes`."""
    size = len(value or b"") + len(key or b"") + headers_size(headers)
    if max_bytes is not None and size > max_bytes:
        raise ResultTooLarge(f"the output record would be {size} bytes, over limits.max_result_bytes ({max_bytes})",
                             attempts=attempts)
    return SinkRow(key, value, topic, headers or None)
