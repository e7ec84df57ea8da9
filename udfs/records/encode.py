"""Stage 3: the output record for a request the model answered: the input's key, a JSON value
(or Avro in the Confluent wire format with `output.format: avro`, `udfs/records/avro.py`), and the
input's headers as `kafka.forward_headers` lets through (`records.forwarded_headers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from udfs.errors import ResultTooLarge
from udfs.records import Completion, Request, SinkHeaders, SinkRow, fastjson
from udfs.records.result import RESULT_FIELDS, ResultField, result_record

if TYPE_CHECKING:
    from udfs.records.avro import AvroCodec


CONTRACT_FIELDS: tuple[ResultField, ...] = (
    tuple(f for f in RESULT_FIELDS if f.only in (None, "text"))
    + tuple(f for f in RESULT_FIELDS if f.only == "structured"))
"""The result fields of the record contract: `output` holds any answer, an embedding too (JSON needs
no field per type, so `embedding` is a typed format's), and the structured-output fields come
last, as the contract added them; a result has them only when its answer is structured."""


def result_value(request: Request, completion: Completion) -> bytes:
    """The output record's JSON value (see README, "Record contract")."""
    return fastjson.dumps(result_record(request, completion, CONTRACT_FIELDS))


def headers_size(headers: SinkHeaders | None) -> int:
    """Bytes of header names and values, as they count towards a Kafka record's size."""
    return sum(len(name.encode("utf-8")) + len(value or b"") for name, value in (headers or {}).items())


def result_row(request: Request, completion: Completion, topic: str, max_bytes: int | None = None,
               headers: SinkHeaders | None = None, codec: AvroCodec | None = None) -> SinkRow:
    """The sink row for a result: the input's key, kept as it was, and `headers` (the forwarded
    input headers). `codec`: the worker's Avro codec, which writes the value when `output.format: avro`.

    Raises `ResultTooLarge` when key + value + headers exceed `max_bytes` (`limits.max_result_bytes`):
    the caller dead-letters the record rather than let the sink fail on it.
    """
    value = codec.result_value(request, completion) if codec is not None and codec.encodes \
        else result_value(request, completion)
    size = len(value) + len(request.key or b"") + headers_size(headers)
    if max_bytes is not None and size > max_bytes:
        raise ResultTooLarge(f"the output record would be {size} bytes, over limits.max_result_bytes ({max_bytes})",
                             attempts=completion.attempts)
    return SinkRow(request.key, value, topic, headers or None)
