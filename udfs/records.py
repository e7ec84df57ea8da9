"""The values that travel between stages: where a record came from, the request made of it,
the model's answer, and the dead letter written when there is no answer.

They are frozen dataclasses pickled between Python operators; only `SinkRow`s (key, value,
topic) cross to the JVM, to the exactly-once Kafka sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


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
    # Structured output (udfs/structured.py): the answer parsed and validated, and how many
    # invalid answers came before it. `structured` tells a valid `null` from no schema.
    output_json: Any = None
    structured: bool = False
    invalid_answers: int = 0


class SinkRow(NamedTuple):
    """One Kafka record for the exactly-once sink: the topic decides output or dead letter."""

    key: bytes | None
    value: bytes
    topic: str
