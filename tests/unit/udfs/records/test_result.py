"""The result record declared once (udfs/records/result.py): the JSON result keeps the record
contract's bytes, the Avro schema is derived from the declarations, and carried fields may not take
a declared name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.configs import minimal_config
from udfs.config import JobConfig
from udfs.errors import ConfigError
from udfs.records import Completion, Request, SourceRef
from udfs.records.avro import result_schema
from udfs.records.encode import result_value
from udfs.records.result import RESULT_FIELDS, ResultField

SOURCE = SourceRef("in", 2, 9, 1_700_000_000_000)


job = minimal_config


def avro_job(carry_fields: list[str] | None = None, **model: Any) -> JobConfig:
    return job(model={"endpoint": "http://127.0.0.1:9/v1", "model": "m", **model}, input={"format": "avro"},
               output={"format": "avro", "carry_fields": carry_fields}, schema_registry={"url": "http://127.0.0.1:9"})


def completion(**changes: Any) -> Completion:
    values: dict[str, Any] = {"output": "an answer", "model": "m", "finish_reason": "stop", "prompt_tokens": 3,
                              "completion_tokens": 4, "latency_ms": 5.55, "attempts": 1, "endpoint": "e",
                              "started_ms": 10, "completed_ms": 20}
    return Completion(**{**values, **changes})


def test_the_json_result_keeps_the_record_contracts_bytes() -> None:
    """The contract's order: the answer after the id, the structured-output fields last."""
    request = Request(id="r-1", key=b"k", source=SOURCE, prompt="p")
    structured = completion(output='{"a": 1}', output_json={"a": 1}, structured=True, invalid_answers=1, cost=0.5)
    assert json.loads(result_value(request, structured)) == {
        "id": "r-1", "output": '{"a": 1}', "model": "m", "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, "latency_ms": 5.5, "attempts": 1,
        "endpoint": "e", "cost": 0.5, "cached": False, "timestamps": {"produced": 1_700_000_000_000, "started": 10,
                                                                     "completed": 20},
        "source": {"topic": "in", "partition": 2, "offset": 9, "timestamp": 1_700_000_000_000},
        "output_json": {"a": 1}, "invalid_answers": 1}
    assert list(json.loads(result_value(request, structured))) == [
        "id", "output", "model", "finish_reason", "usage", "latency_ms", "attempts", "endpoint", "cost", "cached",
        "timestamps", "source", "output_json", "invalid_answers"]
    embedding = json.loads(result_value(request, completion(output=[0.5, -1.0])))
    assert embedding["output"] == [0.5, -1.0] and "embedding" not in embedding and "output_json" not in embedding


def test_the_avro_schema_is_derived_from_the_declared_fields() -> None:
    """The schema a deployed job registered: deriving it must give the same, or its id changes."""
    schema = result_schema(avro_job(["doc_id"], response_format={"type": "object"}))
    nullable = {"default": None}
    assert schema == {"type": "record", "name": "Result", "namespace": "llmstream",
                      "doc": "An llmstream result (docs/formats.md)", "fields": [
        {"name": "id", "type": "string"},
        {"name": "output", "type": ["null", "string"], **nullable},
        {"name": "output_json", "type": ["null", "string"], **nullable},
        {"name": "invalid_answers", "type": ["null", "int"], **nullable},
        {"name": "model", "type": "string"},
        {"name": "finish_reason", "type": ["null", "string"], **nullable},
        {"name": "usage", "type": {"type": "record", "name": "Usage", "fields": [
            {"name": "prompt_tokens", "type": "long"}, {"name": "completion_tokens", "type": "long"},
            {"name": "total_tokens", "type": "long"}]}},
        {"name": "latency_ms", "type": "double"},
        {"name": "attempts", "type": "int"},
        {"name": "endpoint", "type": "string"},
        {"name": "cost", "type": ["null", "double"], **nullable},
        {"name": "cached", "type": "boolean"},
        {"name": "timestamps", "doc": "epoch milliseconds", "type": {"type": "record", "name": "Timestamps", "fields": [
            {"name": "produced", "type": ["null", "long"], **nullable}, {"name": "started", "type": "long"},
            {"name": "completed", "type": "long"}]}},
        {"name": "source", "type": {"type": "record", "name": "Source", "fields": [
            {"name": "topic", "type": "string"}, {"name": "partition", "type": "int"},
            {"name": "offset", "type": "long"}, {"name": "timestamp", "type": ["null", "long"], **nullable}]}},
        {"name": "doc_id", "type": ["null", "boolean", "int", "long", "double", "string", "bytes"], **nullable},
    ]}
    embeddings = result_schema(avro_job(api="embeddings"))
    assert embeddings["fields"][1] == {"name": "embedding", "type": ["null", {"type": "array", "items": "float"}],
                                       "default": None}


def test_a_carried_field_may_not_take_a_declared_name() -> None:
    declared = [f.name for f in RESULT_FIELDS]
    with pytest.raises(ConfigError) as info:
        avro_job(["cached"])
    assert info.value.problem == f"'cached' is a field of the result itself ({', '.join(declared)})"
    assert isinstance(RESULT_FIELDS[0], ResultField) and "embedding" in declared
