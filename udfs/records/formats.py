"""Record formats: the seam between Kafka's bytes and llmstream's values.

A format turns an input value into a `Request` (`decode`) and a result record, the dict
`udfs/records/result.py` builds, into an output value (`encode`). `input.format` and
`output.format` name one each in `FORMATS`; a worker makes one object per named format (so
`avro` in and out share one registry client) and opens its output format before the first
result (`JobFormats`). The stage never asks which format it has: it hands records to the object.

Adding a format: a module with a class that satisfies `FormatClass` (and its objects
`RecordFormat`), its name in `FORMATS` (`udfs/records/format_names.py`), and its section in docs/formats.md. The config accepts the
name from `FORMATS` alone; a format that needs settings of its own adds them to `udfs/config`
as well (`avro` needs `schema_registry`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from udfs.records.format_names import FORMATS

if TYPE_CHECKING:
    from udfs.config import JobConfig, LimitsConfig
    from udfs.records import Request, SourceRef
    from udfs.records.result import ResultField

class RecordFormat(Protocol):
    """One format's objects, on a worker. `fields`: the result fields it writes, in order. `decode`
    raises `BadInput` with a reason for a value that cannot be a request (the stage dead-letters
    it); a null value never reaches it. `open`: start-up work before the first `encode`, done
    only for the output format (it may raise: the worker does not start). `close`: lets go of
    what the object holds (connections)."""

    fields: tuple[ResultField, ...]

    def read(self, value: bytes, limits: LimitsConfig) -> dict[str, Any]:
        """The value as the record it holds, whatever its fields (`BadInput` if it holds none): what
        a user's preprocess gets (`udfs/lanes/user_functions.py`); `decode` is `read` and the
        format's own rules for a request."""

    def decode(self, key: bytes | None, value: bytes, source: SourceRef, limits: LimitsConfig) -> Request: ...

    def encode(self, record: dict[str, Any]) -> bytes: ...

    def open(self) -> None: ...

    def close(self) -> None: ...


class FormatClass(Protocol):
    """A format's class: its objects are made from the job config, and `preflight` checks at launch,
    before Flink starts, what the format needs outside the job (`output`: it is the output format),
    raising `ConfigError` naming the setting."""

    def __call__(self, config: JobConfig) -> RecordFormat: ...

    def preflight(self, config: JobConfig, *, output: bool, timeout_s: float) -> None: ...


def format_class(name: str) -> FormatClass:
    """The class of format `name` (a key of `FORMATS`, which the config has checked)."""
    module, _, attribute = FORMATS[name].partition(":")
    return cast(FormatClass, getattr(importlib.import_module(module), attribute))


@dataclass(frozen=True)
class JobFormats:
    """A worker's input and output formats: one object per format name, the output one opened."""

    input: RecordFormat
    output: RecordFormat

    @classmethod
    def open(cls, config: JobConfig) -> JobFormats:
        made = {name: format_class(name)(config) for name in dict.fromkeys((config.input.format, config.output.format))}
        formats = cls(made[config.input.format], made[config.output.format])
        try:
            formats.output.open()
        except BaseException:
            formats.close()
            raise
        return formats

    def close(self) -> None:
        self.input.close()
        if self.output is not self.input:
            self.output.close()


def preflight(config: JobConfig, *, timeout_s: float) -> None:
    """Each format of the job checks what it needs outside the job (`FormatClass.preflight`)."""
    for name in dict.fromkeys((config.input.format, config.output.format)):
        format_class(name).preflight(config, output=name == config.output.format, timeout_s=timeout_s)


def result_fields(config: JobConfig) -> tuple[ResultField, ...]:
    """The fields of this job's results: the declared ones for its kind of answer, then its
    `output.carry_fields`. Fixed at start, whatever each answer turns out to be."""
    from udfs.records.result import RESULT_FIELDS, carried_field

    kinds: set[str] = {"embeddings" if config.model.api == "embeddings" else "text"}
    if config.model.response_format is not None:
        kinds.add("structured")
    if config.lane == "provider-batch":
        kinds.add("batch")
    declared = tuple(f for f in RESULT_FIELDS if f.only is None or f.only in kinds)
    return declared + tuple(carried_field(name) for name in config.output.carry_fields or [])
