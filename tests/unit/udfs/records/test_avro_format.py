"""Avro in the Confluent wire format (udfs/records/avro.py) with fastavro alone: the registry is a
dict of schemas behind the calls of `RegistryClient` the format makes (the real Apicurio is in
tests/integration/test_avro.py)."""

from __future__ import annotations

import io
import json
from typing import Any

import fastavro
import pytest

from tests.support.schema_store import SchemaStore
from udfs.config import JobConfig, config_from_dict
from udfs.errors import BadInput, ConfigError
from udfs.inference.prompts import fill_template
from udfs.records import Completion, SourceRef
from udfs.records.avro import AvroFormat, carried, result_schema, wire, wire_schema_id
from udfs.records.decode import decode
from udfs.records.encode import result_row, result_value

SOURCE = SourceRef("docs", 0, 7, 1_700_000_000_000)
DOC_V1 = {"type": "record", "name": "Doc", "namespace": "cdc", "fields": [
    {"name": "doc_id", "type": "long"}, {"name": "title", "type": "string"}, {"name": "body", "type": "string"}]}
DOC_V2 = {**DOC_V1, "fields": [*DOC_V1["fields"], {"name": "lang", "type": ["null", "string"], "default": None},
                                {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []}]}


def config(**sections: dict[str, Any]) -> JobConfig:
    data: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "docs", "output_topic": "summaries",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "sim",
                  "prompt_template": "Summarise {title}: {body}"},
        "input": {"format": "avro"}, "output": {"format": "avro", "carry_fields": ["doc_id", "lang", "tags"]},
        "schema_registry": {"url": "http://127.0.0.1:9/apis/ccompat/v7"},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return config_from_dict(data)


def avro_format(cfg: JobConfig | None = None, store: SchemaStore | None = None) -> tuple[AvroFormat, SchemaStore]:
    store = store or SchemaStore({1: DOC_V1, 2: DOC_V2})
    return AvroFormat(cfg or config(), store), store  # type: ignore[arg-type]


def avro(schema_id: int, schema: Any, record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return wire(schema_id, out.getvalue())


def read(value: bytes, writer: Any, reader: Any = None) -> dict[str, Any]:
    assert value[0] == 0
    return fastavro.schemaless_reader(io.BytesIO(value[5:]), fastavro.parse_schema(writer),
                                      fastavro.parse_schema(reader) if reader else None)  # type: ignore[return-value]


def test_a_wire_format_record_becomes_a_request_whose_prompt_is_the_template_filled() -> None:
    c, _ = avro_format()
    cfg = config()
    value = avro(1, DOC_V1, {"doc_id": 42, "title": "Kafka", "body": "a log"})
    request = decode(b"doc-42", value, SOURCE, cfg.limits, c)
    assert request.id == "doc-42" and request.raw == value and request.key == b"doc-42"
    assert request.fields == {"doc_id": 42, "title": "Kafka", "body": "a log"}
    assert fill_template(request, cfg.model.prompt_template) == "Summarise Kafka: a log"


def test_the_id_comes_from_input_id_field_when_set_and_an_evolved_writer_schema_is_read_by_its_own_id() -> None:
    cfg = config(input={"id_field": "doc_id"})
    c, _ = avro_format(cfg)
    value = avro(2, DOC_V2, {"doc_id": 7, "title": "t", "body": "b", "lang": "en", "tags": ["x"]})
    request = decode(None, value, SOURCE, cfg.limits, c)
    assert request.id == "7" and request.fields["lang"] == "en" and request.fields["tags"] == ["x"]


@pytest.mark.parametrize(("value", "reason", "says"), [
    (b'{"id": "json, not avro"}', "schema_error", "magic byte"),
    (b"\x00\x00\x01", "schema_error", "magic byte"),
    (wire(99, b"\x02"), "schema_error", "unknown schema id 99"),
    (wire(1, b"\x54\x0aKafka"), "schema_error", "does not match schema id 1"),
    (wire(1, b"\x54\x02K\x02b\xff\xff"), "schema_error", "2 bytes left"),
])
def test_bytes_that_cannot_be_read_are_schema_errors(value: bytes, reason: str, says: str) -> None:
    c, _ = avro_format()
    with pytest.raises(BadInput) as info:
        decode(b"k", value, SOURCE, config().limits, c)
    assert info.value.reason == reason and says in info.value.detail


def test_a_registry_that_does_not_answer_is_registry_unavailable_and_a_cached_schema_needs_none() -> None:
    c, store = avro_format()
    cfg = config()
    decode(b"k", avro(1, DOC_V1, {"doc_id": 1, "title": "t", "body": "b"}), SOURCE, cfg.limits, c)
    store.down = True
    assert decode(b"k2", avro(1, DOC_V1, {"doc_id": 2, "title": "t", "body": "b"}), SOURCE, cfg.limits, c).id == "k2"
    with pytest.raises(BadInput) as info:
        decode(b"k3", avro(2, DOC_V2, {"doc_id": 3, "title": "t", "body": "b", "lang": None, "tags": []}),
               SOURCE, cfg.limits, c)
    assert info.value.reason == "registry_unavailable"


def test_wire_schema_id_reads_the_frame_and_only_the_frame() -> None:
    assert wire_schema_id(wire(70000, b"payload")) == 70000
    assert wire_schema_id(wire(1, b"")) == 1
    assert wire_schema_id(b"\x00\x00\x00\x01") is None, "four bytes are no frame"
    assert wire_schema_id(b'{"id": 1, "prompt": "json"}') is None


def test_a_missing_key_or_id_field_is_bad_input() -> None:
    value = avro(1, DOC_V1, {"doc_id": 1, "title": "t", "body": "b"})
    with pytest.raises(BadInput, match="Kafka key"):
        decode(None, value, SOURCE, config().limits, avro_format()[0])
    cfg = config(input={"id_field": "title"}, output={"carry_fields": ["doc_id"]})
    with pytest.raises(BadInput) as info:
        decode(b"k", avro(1, DOC_V1, {"doc_id": 1, "title": " ", "body": "b"}), SOURCE, cfg.limits, avro_format(cfg)[0])
    assert info.value.reason == "empty_id"


def _completion(output: Any = "a summary") -> Completion:
    return Completion(output=output, model="sim", finish_reason="stop", prompt_tokens=3, completion_tokens=4,
                      latency_ms=5.55, attempts=1, endpoint="http://x", started_ms=10, completed_ms=20, cost=0.25)


def test_the_result_is_written_under_the_registered_schema_with_the_carried_fields_typed() -> None:
    c, store = avro_format()
    cfg = config()
    c.open()
    schema_id = c.output_id
    assert store.subjects == {"summaries-value": [schema_id]}
    request = decode(b"doc-1", avro(2, DOC_V2, {"doc_id": 1, "title": "t", "body": "b", "lang": "de",
                                                "tags": ["a", "b"]}), SOURCE, cfg.limits, c)
    row = result_row(request, _completion(), "summaries", 10_000, None, c)
    assert row.key == b"doc-1" and wire_schema_id(row.value) == schema_id
    body = read(row.value, store.schemas[schema_id])
    assert body["id"] == "doc-1" and body["output"] == "a summary" and body["cost"] == 0.25
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert body["source"] == {"topic": "docs", "partition": 0, "offset": 7, "timestamp": 1_700_000_000_000}
    assert (body["doc_id"], body["lang"], body["tags"]) == (1, "de", '["a", "b"]')


def test_embeddings_are_an_array_of_floats() -> None:
    cfg = config(model={"api": "embeddings", "prompt_template": "{body}"})
    c, store = avro_format(cfg)
    request = decode(b"d", avro(1, DOC_V1, {"doc_id": 1, "title": "t", "body": "b"}), SOURCE, cfg.limits, c)
    body = read(result_value(request, _completion([0.5, -1.0]), c), store.schemas[c.output_id or 0])
    assert body["embedding"] == [0.5, -1.0] and "output" not in body


def test_a_config_that_adds_fields_keeps_the_output_schema_backward_compatible() -> None:
    """BACKWARD: a consumer with the new schema reads what the old one wrote."""
    old = result_schema(config(output={"carry_fields": ["doc_id"]}))
    new = result_schema(config(model={"response_format": {"type": "object"}},
                               output={"carry_fields": ["doc_id", "lang"]}))
    c, _store = avro_format(config(output={"carry_fields": ["doc_id"]}))
    request = decode(b"d", avro(1, DOC_V1, {"doc_id": 9, "title": "t", "body": "b"}), SOURCE, config().limits, c)
    body = read(result_value(request, _completion(), c), old, new)
    assert body["doc_id"] == 9 and body["lang"] is None and body["output_json"] is None
    assert {f["name"] for f in new["fields"]} - {f["name"] for f in old["fields"]} == {
        "lang", "output_json", "invalid_answers"}
    assert all(f.get("default", "absent") is None for f in new["fields"]
               if f["name"] in ("lang", "output_json", "invalid_answers"))


def test_carried_values_keep_primitive_types_and_others_become_json_text() -> None:
    assert [carried(v) for v in (None, True, 3, 2.5, "s", b"b")] == [None, True, 3, 2.5, "s", b"b"]
    assert carried({"a": [1]}) == '{"a": [1]}' and carried(float("nan")) == "nan"


@pytest.mark.parametrize(("sections", "key"), [
    ({"schema_registry": None}, "input.format"),
    ({"input": {"format": "json"}, "output": {"carry_fields": None}, "schema_registry": {"url": "http://r"}},
     None),
    ({"input": {"format": "json", "id_field": "x"}}, "input.id_field"),
    ({"output": {"carry_fields": ["model"]}}, "output.carry_fields"),
    ({"output": {"carry_fields": ["not-a-name"]}}, "output.carry_fields"),
    ({"schema_registry": {"url": "http://u:p@r"}}, "schema_registry.url"),
    ({"schema_registry": {"url": "http://r", "username": "u", "password": "literal"}}, "schema_registry.password"),
    ({"schema_registry": {"url": "http://r", "unavailable_timeout_s": 600}}, "schema_registry.unavailable_timeout_s"),
])
def test_config_rules(sections: dict[str, Any], key: str | None) -> None:
    data = json.loads(json.dumps({k: v for k, v in sections.items() if v is not None}))
    if key is None:
        config(**data)
        return
    if "schema_registry" in sections and sections["schema_registry"] is None:
        with pytest.raises(ConfigError) as info:
            config_from_dict({"kafka": config().kafka.__dict__, "model": {"endpoint": "http://m/v1", "model": "m"},
                              "input": {"format": "avro"}})
    else:
        with pytest.raises(ConfigError) as info:
            config(**data)
    assert info.value.key == key


LABEL = {"type": "record", "name": "Label", "namespace": "team", "fields": [
    {"name": "ticket_id", "type": "long"}, {"name": "label", "type": "string"},
    {"name": "confidence", "type": ["null", "double"], "default": None}]}


def test_with_a_postprocess_the_users_records_are_written_under_output_schema_and_checked() -> None:
    """`output.postprocess` decides the record: `output.schema` is registered instead of the result
    schema, and a dict it does not accept raises ValueError naming the field (the stage makes that
    a `user_function_error` dead letter, tests/unit/udfs/lanes/test_user_functions.py) instead of writing it."""
    c, store = avro_format(config(output={"carry_fields": None, "postprocess": "m:f", "schema": LABEL}))
    c.open()
    assert store.schemas[c.output_id] == LABEL and store.subjects == {"summaries-value": [c.output_id]}
    value = c.encode({"ticket_id": 7, "label": "billing", "confidence": 0.9})
    assert wire_schema_id(value) == c.output_id
    assert read(value, LABEL) == {"ticket_id": 7, "label": "billing", "confidence": 0.9}
    with pytest.raises(ValueError, match="ticket_id"):
        c.encode({"ticket_id": "seven", "label": "billing"})
    with pytest.raises(ValueError, match="label"):
        c.encode({"ticket_id": 7})
