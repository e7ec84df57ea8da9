"""Stage 3: the output record for a request the model answered: the input's key, a JSON value
(or Avro in the Confluent wire format with `output.format: avro`, `udfs/records/avro.py`), and the
input's headers as `kafka.forward_headers` lets through (`records.forwarded_headers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from udfs.errors import ResultTooLarge
from udfs.records import Completion, Request, SinkHeaders, SinkRow, fastjson

if TYPE_CHECKING:
    from udfs.records.avro import AvroCodec


def result_value(request: Request, completion: Completion) -> bytes:
    """The output record's JSON value (see README, "Record contract")."""
    body = {
        "id": request.id,
        "output": completion.output,
        "model": completion.model,
        "finish_reason": completion.finish_reason,
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        },
        "latency_ms": round(completion.latency_ms, 1),
        "attempts": completion.attempts,
        "endpoint": completion.endpoint,
        "cost": completion.cost,
        "cached": completion.cached,
        "timestamps": {
            "produced": request.source.timestamp_ms,
            "started": completion.started_ms,
            "completed": completion.completed_ms,
        },
        "source": request.source.as_json(),
    }
    if completion.structured:  # model.response_format is set: the answer, parsed and validated
        body["output_json"] = completion.output_json
        body["invalid_answers"] = completion.invalid_answers
    return fastjson.dumps(body)


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
