"""The values that travel between stages: where a record came from, the record kept while its
call is out, the request made of it, the model's answer, the headers an outgoing record
carries, and the row written for a result or a dead letter.

`PendingRecord` is what the inference stage keeps in keyed state (pickled); only `SinkRow`s
(key, value, topic, headers) cross to the JVM, to the exactly-once Kafka sink.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast

HeaderPairs = tuple[tuple[str, bytes | None], ...]
"""Kafka record headers as (name, value) pairs, in the order given; a value may be null."""
SinkHeaders = dict[str, bytes | None]
"""Headers as the Kafka table connector writes them: a map, so one value per name."""
ForwardHeaders = Literal["all", "none"] | list[str]
"""`kafka.forward_headers`: which input headers an outgoing record carries."""


@dataclass(frozen=True)
class SourceRef:
    """The input record's coordinates: enough to find it again in Kafka."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "offset": self.offset,
                "timestamp": self.timestamp_ms}


class KeptInState:
    """A dataclass Flink state holds pickled (`Types.PICKLED_BYTE_ARRAY`): unpickling what was
    written before a field was added gives that field its default, so such a savepoint restores."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling: a field added after the state was written takes its default."""
        for f in dataclasses.fields(cast(Any, self)):  # a dataclass that inherits this
            if f.name not in state and f.default is not dataclasses.MISSING:
                state[f.name] = f.default
        self.__dict__.update(state)


@dataclass(frozen=True)
class PendingRecord(KeptInState):
    """One input record as the inference stage keeps it in keyed state (pickled) from the moment
    its call starts until its result or dead letter is emitted: all it needs to start the call
    again after a restore, and to write a dead letter with the original bytes.

    `handle` is its name in that state, unique across input topics. Restoring accepts what an
    older llmstream stored too (`restored`).
    """

    key: bytes | None
    value: bytes | None
    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None = None
    headers: HeaderPairs | None = None

    @property
    def source(self) -> SourceRef:
        return SourceRef(self.topic, self.partition, self.offset, self.timestamp_ms)

    @property
    def handle(self) -> str:
        """`topic:partition:offset` (Kafka topic names cannot contain `:`)."""
        return f"{self.topic}:{self.partition}:{self.offset}"

    @classmethod
    def restored(cls, stored: Any) -> PendingRecord:
        """A value read back from state: a `PendingRecord`, or the positional 6-tuple
        (key, value, topic, partition, offset, timestamp_ms) that llmstream stored before it had
        this type (under the handle `partition:offset`; its record has no headers)."""
        if isinstance(stored, cls):
            return stored
        if isinstance(stored, tuple) and len(stored) == 6:
            key, value, topic, partition, offset, timestamp_ms = stored
            return cls(key, value, topic, partition, offset, timestamp_ms)
        raise TypeError(f"not a pending record: {type(stored).__name__}")


def forwarded_headers(headers: Iterable[tuple[str, bytes | None]] | None, forward: ForwardHeaders) -> SinkHeaders:
    """The input headers an outgoing record carries under `kafka.forward_headers`: all, none, or
    those whose name is in the list (names compared exactly, as Kafka does). The order given is
    kept; a name given more than once keeps its last value, because the sink writes headers from
    a map. (The Kafka table connector reads and writes headers through a Java `HashMap`, so on
    the wire neither the input's order nor its repeated names survive: measured.)"""
    if headers is None or forward == "none":
        return {}
    wanted = None if forward == "all" else frozenset(forward)
    out: SinkHeaders = {}
    for name, value in headers:
        if wanted is None or name in wanted:
            out.pop(name, None)  # the last value of a repeated name, at its last position
            out[name] = value
    return out


@dataclass(frozen=True)
class Request:
    """A validated inference request.

    Exactly one of `prompt` and `messages` is set. `fields` is the whole decoded record, so
    the prompt template can use any of its top-level fields. `params` are per-record
    overrides of the model settings (model, max_tokens, temperature, ...). `raw` is the
    original value, kept so a dead letter can carry it if inference fails for good.
    """

    id: str
    key: bytes | None
    source: SourceRef
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)
    raw: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Completion:
    """The model's answer and what it cost: the body of an output record."""

    output: Any
    model: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    attempts: int
    endpoint: str
    started_ms: int
    completed_ms: int
    cost: float | None = None
    cached: bool = False
    # Structured output (udfs/inference/structured.py): the answer parsed and validated, and how many
    # invalid answers came before it. `structured` tells a valid `null` from no schema.
    output_json: Any = None
    structured: bool = False
    invalid_answers: int = 0
    # The model name the answering endpoint was asked for (a fleet endpoint or the fallback may
    # name another than model.model): the result cache stores the answer under it.
    requested_model: str | None = None
    # Which lane answered, in a job with a provider-batch lane (`lane: provider-batch`, docs/cost.md): a
    # provider's batch (`batch`) or a call of its own (`realtime`); None in a job without one.
    lane: str | None = None


class SinkRow(NamedTuple):
    """One Kafka record for the exactly-once sink: the topic decides output or dead letter.
    `value` is None only for a forwarded tombstone (`input.tombstones: forward`), which the
    sink writes as a null value. `headers`: None or empty for none; a header with a null value
    is not written (the connector skips it)."""

    key: bytes | None
    value: bytes | None
    topic: str
    headers: SinkHeaders | None = None
