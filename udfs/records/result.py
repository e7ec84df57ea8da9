"""The result record: its fields declared once (`RESULT_FIELDS`), and the one function that builds
it as a dict (`result_record`), which each output format serialises (`udfs/records/formats.py`).

A field is declared with its name, its type and how its value is got from the request and the
model's answer. The JSON format writes the dict as it is (the record contract,
docs/record-contract.md); the Avro format derives its schema from the same declarations
(`udfs/records/avro.py`); `output.carry_fields` may not reuse a declared name (`udfs/config`). So a
field added here reaches every format, and no format keeps a field list of its own.

Types are a small vocabulary a typed format maps to its own: the primitives `string`, `int`,
`long`, `double` and `boolean`; `floats` (a list of numbers, an embedding); `text` (a string, or
another value the model gave as its JSON text); `json` (any JSON value: a typed format writes its
JSON text); `carried` (a top-level value of the input record, whatever its type); and `record`
(a nested record of `fields`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from udfs.records import Completion, Request

Getter = Callable[[Request, Completion], Any]
Only = Literal["text", "embeddings", "structured", "batch"]
"""The results a field belongs to: a text answer (`model.api` chat or completions), an embedding,
a structured answer (`model.response_format`), or a job with a provider-batch lane (`model.mode:
batch`); a field without `only` is in every result."""


class _Absent:
    """The value of a field this result leaves out (`ABSENT`)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()
"""What a getter returns for a field this result does not have (a structured-output field of an
answer that is not structured): the dict has no key for it."""


@dataclass(frozen=True)
class ResultField:
    """One field of the result record. `type`: a name of the vocabulary above. `value`: its value
    for a request and its answer (none for a `record`, whose value is made of its `fields`).
    `nullable`: it may be null (a typed format makes it optional, with a null default).
    `doc`: a note a typed schema carries."""

    name: str
    type: str
    value: Getter | None = None
    nullable: bool = False
    only: Only | None = None
    doc: str | None = None
    fields: tuple[ResultField, ...] = ()


def _answer(request: Request, completion: Completion) -> Any:
    return completion.output


def _structured(attribute: str) -> Getter:
    def value(request: Request, completion: Completion) -> Any:
        return getattr(completion, attribute) if completion.structured else ABSENT
    return value


RESULT_FIELDS: tuple[ResultField, ...] = (
    ResultField("id", "string", lambda r, c: r.id),
    ResultField("output", "text", _answer, nullable=True, only="text"),
    ResultField("embedding", "floats", _answer, nullable=True, only="embeddings"),
    ResultField("output_json", "json", _structured("output_json"), nullable=True, only="structured"),
    ResultField("invalid_answers", "int", _structured("invalid_answers"), nullable=True, only="structured"),
    ResultField("model", "string", lambda r, c: c.model),
    ResultField("finish_reason", "string", lambda r, c: c.finish_reason, nullable=True),
    ResultField("usage", "record", fields=(
        ResultField("prompt_tokens", "long", lambda r, c: c.prompt_tokens),
        ResultField("completion_tokens", "long", lambda r, c: c.completion_tokens),
        ResultField("total_tokens", "long", lambda r, c: c.prompt_tokens + c.completion_tokens))),
    ResultField("latency_ms", "double", lambda r, c: round(c.latency_ms, 1)),
    ResultField("attempts", "int", lambda r, c: c.attempts),
    ResultField("endpoint", "string", lambda r, c: c.endpoint),
    ResultField("cost", "double", lambda r, c: c.cost, nullable=True),
    ResultField("cached", "boolean", lambda r, c: c.cached),
    ResultField("timestamps", "record", doc="epoch milliseconds", fields=(
        ResultField("produced", "long", lambda r, c: r.source.timestamp_ms, nullable=True),
        ResultField("started", "long", lambda r, c: c.started_ms),
        ResultField("completed", "long", lambda r, c: c.completed_ms))),
    ResultField("source", "record", fields=(
        ResultField("topic", "string", lambda r, c: r.source.topic),
        ResultField("partition", "int", lambda r, c: r.source.partition),
        ResultField("offset", "long", lambda r, c: r.source.offset),
        ResultField("timestamp", "long", lambda r, c: r.source.timestamp_ms, nullable=True))),
    ResultField("lane", "string", lambda r, c: c.lane if c.lane is not None else ABSENT, nullable=True, only="batch",
                doc="batch: a provider's batch answered; realtime: a call of its own (lane: provider-batch)"),
)
"""Every field a result can have, in the order of a typed schema (the Avro result schema)."""


def carried_field(name: str) -> ResultField:
    """A field of `output.carry_fields`: the input record's top-level field of that name (null if
    the record has none)."""
    return ResultField(name, "carried", lambda r, c: r.fields.get(name), nullable=True)


def result_record(request: Request, completion: Completion, fields: Iterable[ResultField]) -> dict[str, Any]:
    """The result of `request` answered by `completion` as a dict of `fields`, in their order; a
    field whose value is `ABSENT` has no key."""
    out: dict[str, Any] = {}
    for f in fields:
        if f.value is None:
            out[f.name] = result_record(request, completion, f.fields)
            continue
        value = f.value(request, completion)
        if value is not ABSENT:
            out[f.name] = value
    return out
