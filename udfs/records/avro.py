"""Avro in the Confluent wire format, for `input.format: avro` and `output.format: avro`.

Input: a value is a magic byte 0, a 4-byte big-endian schema id and the Avro binary record
written with that schema (the writer's schema, fetched from the registry by id and kept,
`udfs/records/registry.py`). The record's id is `input.id_field` (a top-level field) or the Kafka key
as UTF-8; `model.prompt_template` is filled from its top-level fields; `output.carry_fields`
are copied into the result. Anything that cannot be read raises `BadInput` with reason
`schema_error` (no magic byte, an id the registry does not have, bytes that do not match the
schema) or `registry_unavailable` (the registry did not answer within
`schema_registry.unavailable_timeout_s`), so the stage dead-letters the record with its
original bytes and the job goes on.

Decoding is here, in Python, rather than in Flink's `avro-confluent` format, because that
format can only fail the job or drop the record (`ignore-parse-errors`) on a bad one: a
dead letter with a reason and the original bytes needs the bytes to reach this stage.
What it costs per record is in docs/formats.md.

Output: the result record (`udfs/records/result.py`) under a schema derived from its declared
fields for the job config (`result_schema`), registered at start under `output.subject`
(default `<output_topic>-value`); every field the config can add or take away (the answer's
kind, structured output, carried fields) is optional with a null default, so a config change
keeps the subject BACKWARD compatible.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import fastavro
import fastavro.validation

from udfs.errors import BadInput, ConfigError
from udfs.records import Request, SourceRef
from udfs.records.formats import result_fields
from udfs.records.registry import (
    RegistryClient,
    RegistryError,
    RegistryRefused,
    RegistryUnavailable,
    SchemaNotFound,
    SchemaRejected,
)
from udfs.records.result import ABSENT, ResultField

if TYPE_CHECKING:
    from udfs.config import JobConfig, LimitsConfig

MAGIC = 0
HEADER_BYTES = 5
NAMESPACE = "llmstream"
CARRIED_TYPE = ["null", "boolean", "int", "long", "double", "string", "bytes"]
"""A carried field's type: its value keeps its primitive type; a nested or logical value (a
record, array, map, date, decimal) is carried as its JSON text. The writer's schema is only known
per record, the output schema is fixed at start: so a union, not the input field's own type."""


def carried(value: Any) -> Any:
    """A decoded field's value as `CARRIED_TYPE` holds it (primitives as they are, else JSON text)."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, int):
        return value if -2**63 <= value < 2**63 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return json.dumps(value, default=str, ensure_ascii=False)


def _text(value: Any) -> Any:
    """`text`: a string (or null) as it is, another value as its JSON text."""
    return value if isinstance(value, str) or value is None else json.dumps(value, ensure_ascii=False)


def _json_text(value: Any) -> str:
    """`json`: the value's JSON text, a string's too (a structured answer may be a JSON string)."""
    return json.dumps(value, ensure_ascii=False)


AVRO_TYPES: dict[str, Any] = {"string": "string", "int": "int", "long": "long", "double": "double",
                              "boolean": "boolean", "floats": {"type": "array", "items": "float"},
                              "text": "string", "json": "string", "carried": CARRIED_TYPE}
"""The Avro type of each type of `udfs/records/result.py` (a `record` is derived from its fields)."""
CONVERSIONS: dict[str, Callable[[Any], Any]] = {"text": _text, "json": _json_text, "carried": carried}
"""How a value of these types becomes what its Avro type holds (the others are written as they are)."""


def avro_field(field: ResultField) -> dict[str, Any]:
    """A result field as an Avro record field: a nested record is named after its field (`Usage`),
    a nullable field is a union with null first and a null default."""
    if field.type == "record":
        avro_type: Any = {"type": "record", "name": field.name.capitalize(),
                          "fields": [avro_field(f) for f in field.fields]}
    else:
        avro_type = AVRO_TYPES[field.type]
    if field.nullable and not (isinstance(avro_type, list) and avro_type[0] == "null"):
        avro_type = ["null", avro_type]
    out: dict[str, Any] = {"name": field.name}
    if field.doc is not None:
        out["doc"] = field.doc
    out["type"] = avro_type
    if field.nullable:
        out["default"] = None
    return out


def result_schema(config: JobConfig) -> dict[str, Any]:
    """The output record's Avro schema for this config, derived from its result fields
    (`udfs/records/result.py`; see the module docstring on evolution). `output_json` is the
    validated answer as JSON text: a typed schema is not derived from the JSON Schema. With
    `output.postprocess`, the user's function decides the record: `output.schema` is its schema."""
    if config.output.postprocess is not None and config.output.schema is not None:
        return dict(config.output.schema)  # type: ignore[arg-type]  # loaded as a mapping
    return {"type": "record", "name": "Result", "namespace": NAMESPACE,
            "doc": "An llmstream result (docs/formats.md)", "fields": [avro_field(f) for f in result_fields(config)]}


def output_subject(config: JobConfig) -> str:
    return config.output.subject or f"{config.kafka.output_topic}-value"


def wire(schema_id: int, payload: bytes) -> bytes:
    """`payload` (Avro binary) framed in the Confluent wire format."""
    return bytes([MAGIC]) + schema_id.to_bytes(4, "big") + payload


def wire_schema_id(value: bytes) -> int | None:
    """The schema id a Confluent wire-format value names, or None if it is not framed that way."""
    if len(value) < HEADER_BYTES or value[0] != MAGIC:
        return None
    return int.from_bytes(value[1:HEADER_BYTES], "big")


class AvroFormat:
    """Avro in the Confluent wire format, for `input.format: avro` and `output.format: avro`: the
    registry client and the parsed schemas of one worker (one object for both ends). `open`
    registers the output schema; `encode` writes a result record under it."""

    def __init__(self, config: JobConfig, registry: RegistryClient | None = None) -> None:
        assert config.schema_registry is not None  # JobConfig.validate: avro needs a registry
        self._config = config
        self._registry = registry if registry is not None else RegistryClient(config.schema_registry)
        self._parsed: dict[int, Any] = {}
        self._output_schema: Any = None
        self.output_id: int | None = None
        # A postprocess's dict is the user's record, checked against its schema before it is written;
        # a result record is llmstream's, whose fields `encode` converts or fills with null.
        self._user_records = config.output.postprocess is not None
        self.fields = () if self._user_records else result_fields(config)
        self._prepare = tuple((f.name, CONVERSIONS.get(f.type)) for f in self.fields
                              if f.nullable or f.type in CONVERSIONS)

    @classmethod
    def preflight(cls, config: JobConfig, *, output: bool, timeout_s: float) -> None:
        """The Schema Registry answers (and takes the credentials), and as the output format, the
        result schema can be registered under its subject: an incompatible config change is named
        here, not in a worker's `open` that would restart the job over and over."""
        assert config.schema_registry is not None
        client = RegistryClient(dataclasses.replace(config.schema_registry, unavailable_timeout_s=timeout_s))
        try:
            client.ping()
            if output:
                cls(config, client).open()
        except RegistryRefused as err:
            raise ConfigError("schema_registry.username", str(err)) from None
        except SchemaRejected as err:
            raise ConfigError("output.format", f"the Avro result schema cannot be registered under subject "
                                               f"{output_subject(config)!r}: {err}") from None
        except RegistryError as err:
            raise ConfigError("schema_registry.url", str(err)) from None
        finally:
            client.close()

    def close(self) -> None:
        self._registry.close()

    # ------------------------------------------------------------------ output
    def open(self) -> None:
        """Registers the output schema under its subject and keeps its id (start-up; raises
        `RegistryError`). A subject this creates is set to BACKWARD compatibility, which Confluent's
        registry has by default and Apicurio's has not, so a later config's schema is checked
        against this one."""
        schema = result_schema(self._config)
        subject = output_subject(self._config)
        new = not self._registry.subject_exists(subject)
        self.output_id = self._registry.register(subject, schema)
        if new:
            self._registry.set_compatibility(subject, "BACKWARD")
        self._output_schema = fastavro.parse_schema(schema)

    def encode(self, record: dict[str, Any]) -> bytes:
        """A result record of `fields` in the wire format, under the registered output schema (a
        field the record leaves out is null)."""
        if self.output_id is None:
            self.open()
        assert self.output_id is not None
        if self._user_records:
            try:
                fastavro.validation.validate(record, self._output_schema, raise_errors=True)
            except fastavro.validation.ValidationError as err:
                raise ValueError(f"a record output.schema does not accept: {err}"[:500]) from None
        body = dict(record)
        for name, convert in self._prepare:
            value = body.get(name, ABSENT)
            body[name] = None if value is ABSENT else convert(value) if convert is not None else value
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self._output_schema, body)
        return wire(self.output_id, out.getvalue())

    # ------------------------------------------------------------------ input
    def writer_schema(self, schema_id: int) -> Any:
        """The parsed writer schema of `schema_id`; `BadInput` if it cannot be had."""
        parsed = self._parsed.get(schema_id)
        if parsed is not None:
            return parsed
        try:
            kind, schema = self._registry.schema(schema_id)
        except (RegistryUnavailable, RegistryRefused) as err:
            raise BadInput("registry_unavailable", str(err)) from None
        except SchemaNotFound:
            raise BadInput("schema_error", f"unknown schema id {schema_id} (the registry has none)") from None
        except RegistryError as err:
            raise BadInput("schema_error", str(err)) from None
        if kind != "AVRO":
            raise BadInput("schema_error", f"schema id {schema_id} is {kind}, not Avro")
        try:
            parsed = fastavro.parse_schema(schema)
        except Exception as err:  # noqa: BLE001 - fastavro raises several types for a bad schema
            raise BadInput("schema_error", f"schema id {schema_id} is not a valid Avro schema: {err}"[:300]) from None
        registry = self._config.schema_registry
        if registry is not None and len(self._parsed) >= registry.cache_size:
            self._parsed.pop(next(iter(self._parsed)))  # the oldest: ids are few, a bound is what matters
        self._parsed[schema_id] = parsed
        return parsed

    def read(self, value: bytes, limits: LimitsConfig) -> dict[str, Any]:
        """One wire-format value as the record its writer's schema reads (`BadInput` if it is not one)."""
        if len(value) > limits.max_record_bytes:
            raise BadInput("record_too_large", f"value has {len(value)} bytes, limit {limits.max_record_bytes}")
        schema_id = wire_schema_id(value)
        if schema_id is None:
            raise BadInput("schema_error", "not the Confluent wire format (no magic byte 0 and schema id)")
        schema = self.writer_schema(schema_id)
        buffer = io.BytesIO(value)
        buffer.seek(HEADER_BYTES)
        try:
            record = fastavro.schemaless_reader(buffer, schema, None)
        except Exception as err:  # noqa: BLE001 - truncated or garbled bytes fail in many ways
            raise BadInput("schema_error", f"value does not match schema id {schema_id}: "
                                           f"{type(err).__name__}: {err}"[:300]) from None
        if buffer.tell() != len(value):
            raise BadInput("schema_error", f"{len(value) - buffer.tell()} bytes left after the record of "
                                           f"schema id {schema_id}")
        if not isinstance(record, dict):
            raise BadInput("schema_error", f"schema id {schema_id} is not a record schema")
        return record

    def decode(self, key: bytes | None, value: bytes, source: SourceRef, limits: LimitsConfig) -> Request:
        """One wire-format record as a `Request` (prompt from the template, fields for it and the carry)."""
        record = self.read(value, limits)
        return Request(id=self._id(key, record, limits), key=key, source=source, fields=record, raw=value)

    def _id(self, key: bytes | None, record: dict[str, Any], limits: LimitsConfig) -> str:
        field = self._config.input.id_field
        if field is None:
            if key is None:
                raise BadInput("missing_field", "the record has no Kafka key to be its id (or set input.id_field)")
            try:
                found: Any = key.decode("utf-8")
            except UnicodeDecodeError:
                raise BadInput("invalid_utf8", "the Kafka key (the record's id) is not UTF-8") from None
        else:
            found = record.get(field)
            if isinstance(found, bool) or not isinstance(found, (str, int)):
                raise BadInput("missing_field" if found is None else "wrong_type",
                               f"input.id_field {field!r} must be a string or an integer, got {type(found).__name__}")
            found = str(found)
        if not found.strip():
            raise BadInput("empty_id", "the record's id is empty")
        if len(found) > limits.max_id_chars:
            raise BadInput("id_too_long", f"the id has {len(found)} characters, limit {limits.max_id_chars}")
        return str(found)


if TYPE_CHECKING:  # mypy holds the class to the format protocols (udfs/records/formats.py)
    from udfs.records.formats import FormatClass

    _AS_FORMAT: FormatClass = AvroFormat
