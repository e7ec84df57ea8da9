"""Generated records (Hypothesis) through the keyed inference stage: decode, the call, encode.

Each record goes through `InferenceStage` on the fake PyFlink runtime (tests/support/fake_flink.py)
against the simulator over loopback HTTP, as in tests/unit/udfs/lanes/test_keyed.py, with small
`limits.*` so sizes at and over each limit are cheap. The property, for every input: nothing raises out of the
Flink function, the record leaves keyed state, and it ends as exactly one output record (its key
and forwarded headers, under `limits.max_result_bytes`) or one dead letter whose reason is in the
documented list (docs/record-contract.md) and is not `internal_error` (a bug), with the original
value, its coordinates and the `llmstream-reason` header. Where the generator knows what is wrong
with a record (one defect applied to a valid one) the reason must be that defect's.

Inputs: JSON (the record contract) as arbitrary bytes, arbitrary JSON, and valid records with one
defect; Avro in the Confluent wire format with a registry stand-in (`SchemaStore`), framed, cut,
padded, unframed and of unknown ids; a user's `model.preprocess` returning generated values and an
`output.postprocess` returning generated dicts. Example counts: the `ci` and `fuzz` Hypothesis
profiles (tests/conftest.py, docs/testing.md). Each case a run found is kept as an `@example`.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import math
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pyflink.common import Row

from jobs.dev.simulator import ThreadedSimulator
from tests.support.fake_flink import Harness
from tests.support.reasons import documented_reasons
from tests.support.schema_store import SchemaStore
from udfs.config import JobConfig, config_from_dict
from udfs.lanes.keyed import FLUSH_AT
from udfs.records import forwarded_headers
from udfs.records.avro import wire
from udfs.records.dead_letter import REASON_HEADER
from udfs.records.encode import headers_size
from udfs.records.json_format import MESSAGE_ROLES, PARAM_TYPES

REASONS = documented_reasons()
LIMITS = {"max_record_bytes": 16_384, "max_prompt_chars": 600, "max_id_chars": 40, "max_result_bytes": 2_500}


def _config(endpoint: str, **sections: dict[str, Any]) -> JobConfig:
    data: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": endpoint, "model": "sim", "max_tokens": 8},
        "async": {"capacity": 4, "request_timeout_s": 5.0, "record_deadline_s": 10.0},
        "retry": {"max_attempts": 2, "initial_backoff_s": 0.001, "max_backoff_s": 0.005},
        "limits": LIMITS,
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return config_from_dict(data)


# ---------------------------------------------------------------------- one record through the stage

OFFSETS = itertools.count()


def _through(h: Harness, value: bytes | None, key: bytes | None, headers: dict[str, bytes | None]) -> tuple[int, list[Row]]:
    """`value` as one input record of the stage, its bucket flushed: its offset and the rows it left.
    A raise out of the Flink function fails the test here; so does a record left in keyed state."""
    offset = next(OFFSETS)
    bucket = offset % 3
    before = len(h.out)
    h.element(bucket, value, offset=offset, key=key, headers=headers)
    h.fire(bucket, FLUSH_AT)  # the end-of-input timer of this bucket: waits for its calls
    assert h.state.snapshot() == {}, "the record was left in keyed state"
    return offset, h.out[before:]


def _one(h: Harness, config: JobConfig, value: bytes | None, key: bytes | None,
         headers: dict[str, bytes | None]) -> tuple[str, Any]:
    """The one outcome of a record: ("out", value bytes) or ("dlq", the dead letter's body)."""
    offset, rows = _through(h, value, key, headers)
    assert len(rows) == 1, f"{len(rows)} rows for one record: {rows}"
    row_key, row_value, topic, row_headers = rows[0]
    assert row_key == key, "the output's key is the input's"
    forwarded = forwarded_headers(list(headers.items()), config.kafka.forward_headers)
    if topic == config.kafka.dead_letter_topic:
        body = json.loads(row_value)
        reason = body["reason"]
        assert reason in REASONS, f"undocumented reason {reason!r}: {body['error']}"
        assert reason != "internal_error", f"a bug: {body['error']}"
        assert body["source"]["offset"] == offset and body["source"]["topic"] == "in"
        original = body["original"]
        if value is None:
            assert original["value"] is None
        else:
            kept = original["value"].encode() if original["encoding"] == "utf-8" else base64.b64decode(original["value"])
            assert kept == value and original["size"] == len(value) and not original["truncated"]
        assert row_headers == {REASON_HEADER: reason.encode(), **forwarded}
        if reason == "result_too_large":
            size, limit = map(int, re.findall(r"would be (\d+) bytes, over limits.max_result_bytes \((\d+)\)",
                                              body["error"])[0])
            assert size > limit
        return "dlq", body
    assert topic == config.kafka.output_topic, topic
    assert (row_headers or {}) == forwarded
    if row_value is not None:  # a forwarded tombstone's headers are not held to the limit (not yet: docs/testing.md)
        assert len(row_value) + len(key or b"") + headers_size(row_headers) <= config.limits.max_result_bytes
    return "out", row_value


# ---------------------------------------------------------------------- keys, headers

keys = st.one_of(st.none(), st.binary(max_size=24), st.text(max_size=12).map(str.encode))
header_values = st.one_of(st.none(), st.binary(max_size=40), st.binary(min_size=2_000, max_size=2_600))
headers = st.dictionaries(st.one_of(st.text(max_size=12), st.sampled_from([REASON_HEADER, "traceparent"])),
                          header_values, max_size=4)

# ---------------------------------------------------------------------- JSON: the record contract

text = st.text(st.characters(codec="utf-8"), max_size=30)
nonblank = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30).filter(str.strip)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         text)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                 st.dictionaries(text, inner, max_size=3)),
                           max_leaves=8)
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(sorted(MESSAGE_ROLES)), "content": text}),
                          min_size=1, max_size=3).filter(lambda ms: any(m["content"].strip() for m in ms))
valid_params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 16), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1),
    "seed": st.integers(0, 2**31), "stop": st.one_of(text, st.lists(text, max_size=2)),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2)})
extra_fields = st.dictionaries(text.filter(lambda k: k not in ("id", "prompt", "messages", "params")), json_values,
                               max_size=3)


@st.composite
def valid_records(draw: st.DrawFn) -> dict[str, Any]:
    record: dict[str, Any] = {"id": draw(nonblank)}
    if draw(st.booleans()):
        record["prompt"] = draw(nonblank)
    else:
        record["messages"] = draw(valid_messages)
    if draw(st.booleans()):
        record["params"] = draw(valid_params)
    record.update(draw(extra_fields))
    return record


def _dumps(record: Any, ascii_only: bool) -> bytes:
    return json.dumps(record, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def _padded(record: dict[str, Any], size: int, ascii_only: bool) -> bytes:
    """`record` with a filler field that makes its value exactly `size` bytes."""
    base = _dumps({**record, "zz_pad": ""}, ascii_only)
    return _dumps({**record, "zz_pad": "p" * max(0, size - len(base))}, ascii_only)


def _utf8_or(value: bytes, reason: str) -> tuple[bytes, str]:
    """`reason`, unless the change (in the middle of a character) left `value` no UTF-8."""
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return value, "invalid_utf8"
    return value, reason


BLANK = st.text(" \t\n\r", max_size=4)
FINITE = st.floats(allow_nan=False, allow_infinity=False)  # JSON has no NaN or Infinity (invalid_json)
WRONG_TYPES = st.one_of(st.none(), st.booleans(), st.integers(), FINITE, st.lists(text, max_size=2),
                        st.dictionaries(text, text, max_size=2))
BAD_MESSAGES = st.one_of(
    WRONG_TYPES.filter(lambda v: not isinstance(v, list) or not v), st.just([]),
    st.lists(st.one_of(text, st.integers(), st.none()), min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": text.filter(lambda r: r not in MESSAGE_ROLES), "content": nonblank}),
             min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(sorted(MESSAGE_ROLES)), "content": WRONG_TYPES}),
             min_size=1, max_size=2))
BAD_PARAMS = st.one_of(
    WRONG_TYPES.filter(lambda v: v is not None and not isinstance(v, dict)),
    st.dictionaries(text.filter(lambda k: k not in PARAM_TYPES), json_values, min_size=1, max_size=2),
    st.fixed_dictionaries({"max_tokens": st.one_of(st.integers(max_value=0), st.booleans(), text, FINITE)}),
    st.fixed_dictionaries({"temperature": st.one_of(st.booleans(), text, st.none())}),
    st.fixed_dictionaries({"seed": st.one_of(FINITE, text, st.booleans())}))


@st.composite
def defective_records(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A valid record with one defect (or none), as bytes, and the reason that defect must get
    (None: the record is valid and must get an answer)."""
    record = draw(valid_records())
    ascii_only = draw(st.booleans())
    limits = LIMITS
    defect = draw(st.sampled_from([
        "none", "record_at_limit", "record_over_limit", "not_utf8", "nul", "truncated", "nan", "deep", "long_number",
        "surrogate", "not_object", "no_id", "no_prompt", "both", "id_type", "prompt_type", "id_blank",
        "prompt_blank", "messages_blank", "id_at_limit", "id_over_limit", "prompt_at_limit", "prompt_over_limit",
        "messages_over_limit", "messages_bad", "params_bad"]))
    has_prompt = "prompt" in record
    expected: str | None = None
    if defect == "record_at_limit":
        return _padded(record, limits["max_record_bytes"], ascii_only), None
    if defect == "record_over_limit":
        size = limits["max_record_bytes"] + draw(st.integers(1, 50))
        return _padded(record, size, ascii_only), "record_too_large"
    if defect == "not_utf8":
        value = _dumps(record, ascii_only)
        at = draw(st.integers(0, len(value)))
        return value[:at] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80"])) + value[at:], "invalid_utf8"
    if defect == "nul":
        value = _dumps(record, ascii_only)
        at = draw(st.integers(0, len(value)))
        return _utf8_or(value[:at] + b"\x00" + value[at:], "invalid_json")
    if defect == "truncated":
        value = _dumps(record, ascii_only)
        return _utf8_or(value[:draw(st.integers(0, len(value) - 1))], "invalid_json")
    if defect == "nan":
        return _dumps({**record, "zz": draw(st.sampled_from([math.nan, math.inf, -math.inf]))}, ascii_only), "invalid_json"
    if defect == "deep":
        depth = draw(st.integers(4_000, 7_000))  # past what json reads (about 1,000 to 3,000 here)
        return _dumps(record, ascii_only)[:-1] + b', "zz": ' + b"[" * depth + b"]" * depth + b"}", "invalid_json"
    if defect == "long_number":
        return _dumps(record, ascii_only)[:-1] + b', "zz": ' + b"7" * draw(st.integers(4_301, 6_000)) + b"}", "invalid_json"
    if defect == "surrogate":  # a lone surrogate escape (\ud800-\udfff): JSON syntax, but no Unicode text
        field = draw(st.sampled_from(["id", "prompt", "zz"]))
        lone = draw(st.sampled_from(["\ud800", "\udfff", "a\udc00b"]))
        record = {**record, field: lone} if field != "prompt" or has_prompt else {**record, "zz": lone}
        return json.dumps(record).encode(), "invalid_json"
    if defect == "not_object":
        return _dumps(draw(json_values.filter(lambda v: not isinstance(v, dict))), ascii_only), "not_an_object"
    if defect == "no_id":
        del record["id"]
        expected = "missing_field"
    elif defect == "no_prompt":
        record.pop("prompt", None)
        record.pop("messages", None)
        expected = "missing_field"
    elif defect == "both":
        record["prompt"], record["messages"] = draw(nonblank), draw(valid_messages)
        expected = "ambiguous_input"
    elif defect == "id_type":
        record["id"] = draw(WRONG_TYPES)
        expected = "wrong_type"
    elif defect == "prompt_type" and has_prompt:
        record["prompt"] = draw(WRONG_TYPES)
        expected = "wrong_type"
    elif defect == "id_blank":
        record["id"] = draw(BLANK)
        expected = "empty_id"
    elif defect == "prompt_blank" and has_prompt:
        record["prompt"] = draw(BLANK)
        expected = "empty_prompt"
    elif defect == "messages_blank":
        record.pop("prompt", None)
        record["messages"] = [{"role": m["role"], "content": draw(BLANK)} for m in draw(valid_messages)]
        expected = "empty_prompt"
    elif defect == "id_at_limit":
        record["id"] = "i" * limits["max_id_chars"]
    elif defect == "id_over_limit":
        record["id"] = "i" * (limits["max_id_chars"] + draw(st.integers(1, 30)))
        expected = "id_too_long"
    elif defect == "prompt_at_limit" and has_prompt:
        record["prompt"] = draw(st.text(st.characters(codec="utf-8", exclude_categories=["Z", "C"]),
                                        min_size=limits["max_prompt_chars"], max_size=limits["max_prompt_chars"]))
    elif defect == "prompt_over_limit" and has_prompt:
        record["prompt"] = "q" * (limits["max_prompt_chars"] + draw(st.integers(1, 30)))
        expected = "prompt_too_large"
    elif defect == "messages_over_limit":
        record.pop("prompt", None)
        record["messages"] = [{"role": "user", "content": "m" * (limits["max_prompt_chars"] // 2 + 1)}] * 2
        expected = "prompt_too_large"
    elif defect == "messages_bad":
        record.pop("prompt", None)
        record["messages"] = draw(BAD_MESSAGES)
        expected = "invalid_messages"
    elif defect == "params_bad":
        record["params"] = draw(BAD_PARAMS)
        expected = "invalid_params"
    return _dumps(record, ascii_only), expected


@pytest.fixture
def json_stage(sim: ThreadedSimulator, harnesses: list[Harness]) -> tuple[Harness, JobConfig]:
    """One stage for all of a test's examples: each record leaves it as it came (nothing kept)."""
    config = _config(sim.url)
    h = Harness(config)
    harnesses.append(h)
    return h, config


def test_a_record_with_one_defect_gets_that_defects_reason_and_a_valid_one_an_answer(
        json_stage: tuple[Harness, JobConfig]) -> None:
    h, config = json_stage

    # What earlier runs found:
    @example(case=(b'{"id": "\\ud800", "prompt": ""}', "invalid_json"), key=b"k", hdrs={})  # raised out of the stage
    @example(case=(b'{"id": "\\ud800", "prompt": "x"}', "invalid_json"), key=b"k", hdrs={})  # raised out of the stage
    @example(case=(b'{"id": "a", "prompt": "x", "n": "\\udfff"}', "invalid_json"), key=None, hdrs={})
    @example(case=(b'{"id": "a", "messages": [{"role": "user", "content": " "}]}', "empty_prompt"), key=b"k", hdrs={})
    @given(case=defective_records(), key=keys, hdrs=headers)
    def check(case: tuple[bytes, str | None], key: bytes | None, hdrs: dict[str, bytes | None]) -> None:
        value, expected = case
        topic, outcome = _one(h, config, value, key, hdrs)
        if expected is None:
            assert topic == "out" or outcome["reason"] == "result_too_large", outcome
        else:
            assert topic == "dlq" and outcome["reason"] == expected, (expected, outcome)

    check()


def test_any_value_ends_as_one_output_or_one_dead_letter(json_stage: tuple[Harness, JobConfig]) -> None:
    h, config = json_stage
    values = st.one_of(st.none(), st.binary(max_size=200), json_values.map(lambda v: _dumps(v, True)),
                       st.builds(lambda d, a: _dumps(d, a), st.dictionaries(
                           st.sampled_from(["id", "prompt", "messages", "params", "x"]), json_values, max_size=4),
                           st.booleans()))

    @given(value=values, key=keys, hdrs=headers)
    def check(value: bytes | None, key: bytes | None, hdrs: dict[str, bytes | None]) -> None:
        topic, outcome = _one(h, config, value, key, hdrs)
        if value is None:  # a tombstone: `input.tombstones: forward` deletes the key, a keyless one has none
            assert (topic, outcome) == ("out", None) if key is not None else outcome["reason"] == "null_value"

    check()


# ---------------------------------------------------------------------- Avro in the Confluent wire format

DOC = {"type": "record", "name": "Doc", "namespace": "cdc", "fields": [
    {"name": "doc_id", "type": "long"}, {"name": "title", "type": "string"}, {"name": "body", "type": "string"}]}
RICH = {"type": "record", "name": "Rich", "namespace": "cdc", "fields": [
    {"name": "title", "type": "string"}, {"name": "body", "type": ["null", "string"]},
    {"name": "n", "type": "long"}, {"name": "score", "type": "double"}, {"name": "flag", "type": "boolean"},
    {"name": "blob", "type": "bytes"}, {"name": "tags", "type": {"type": "array", "items": "string"}},
    {"name": "attrs", "type": {"type": "map", "values": "int"}},
    {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
    {"name": "inner", "type": {"type": "record", "name": "Inner", "fields": [{"name": "x", "type": "float"}]}}]}
UNTITLED = {"type": "record", "name": "Untitled", "fields": [{"name": "body", "type": "string"}]}
SCHEMAS = {1: DOC, 2: RICH, 3: UNTITLED}


def _avro_values(schema: Any) -> st.SearchStrategy[Any]:
    """Values of an Avro schema (the types `SCHEMAS` use)."""
    if isinstance(schema, list):
        return st.one_of([_avro_values(s) for s in schema])
    kind = schema if isinstance(schema, str) else schema["type"]
    simple: dict[str, st.SearchStrategy[Any]] = {
        "null": st.none(), "boolean": st.booleans(), "int": st.integers(-2**31, 2**31 - 1),
        "long": st.integers(-2**63, 2**63 - 1), "float": st.floats(width=32), "double": st.floats(),
        "string": text, "bytes": st.binary(max_size=20)}
    if kind in simple:
        return simple[kind]
    if kind == "array":
        return st.lists(_avro_values(schema["items"]), max_size=3)
    if kind == "map":
        return st.dictionaries(text, _avro_values(schema["values"]), max_size=3)
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    return st.fixed_dictionaries({f["name"]: _avro_values(f["type"]) for f in schema["fields"]})


def _avro_body(schema: Any, record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


@st.composite
def avro_values(draw: st.DrawFn) -> tuple[bytes, str | None, bool]:
    """A value on an Avro topic, the reason it must get (None: an answer), and whether it is framed
    as written (if not, any documented outcome will do)."""
    schema_id = draw(st.sampled_from(sorted(SCHEMAS)))
    body = _avro_body(SCHEMAS[schema_id], draw(_avro_values(SCHEMAS[schema_id])))
    damage = draw(st.sampled_from(["none", "none", "unknown_id", "extra_bytes", "cut", "unframed", "short",
                                   "json", "garbled"]))
    framed = wire(schema_id, body)
    expected = "template_field_missing" if schema_id == 3 else None
    if damage == "none":
        return framed, expected, True
    if damage == "unknown_id":
        return wire(draw(st.integers(4, 2**32 - 1)), body), "schema_error", True
    if damage == "extra_bytes":
        return framed + draw(st.binary(min_size=1, max_size=8)), "schema_error", True
    if damage == "cut":
        return framed[:draw(st.integers(5, len(framed) - 1))] if len(framed) > 5 else framed[:4], "schema_error", False
    if damage == "unframed":  # the Avro body without the 5-byte header; its first byte may still be 0
        return body, "schema_error", body[:1] != b"\x00"
    if damage == "short":
        return draw(st.binary(max_size=4)), "schema_error", True
    if damage == "json":
        return json.dumps({"id": "x", "prompt": draw(text)}).encode(), "schema_error", True
    at = draw(st.integers(5, max(5, len(framed) - 1)))
    return framed[:at] + draw(st.binary(min_size=1, max_size=2)) + framed[at + 1:], None, False


@pytest.fixture(params=["json", "avro"])
def avro_stage(request: pytest.FixtureRequest, sim: ThreadedSimulator, harnesses: list[Harness],
               monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Harness, JobConfig, SchemaStore]]:
    """A stage reading Avro through a `SchemaStore` (the format's registry client replaced), writing
    JSON or Avro."""
    store = SchemaStore(dict(SCHEMAS))
    monkeypatch.setattr("udfs.records.avro.RegistryClient", lambda settings: store)
    config = _config(sim.url, model={"prompt_template": "Summarise {title}: {body}"}, input={"format": "avro"},
                     output={"format": request.param}, schema_registry={"url": "http://127.0.0.1:9/apis/ccompat/v7"})
    h = Harness(config)
    harnesses.append(h)
    yield h, config, store


def _key_reason(key: bytes | None) -> str | None:
    """What is wrong with a Kafka key as the record's id (no `input.id_field`), if anything."""
    if key is None:
        return "missing_field"
    try:
        key_id = key.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    if not key_id.strip():
        return "empty_id"
    return "id_too_long" if len(key_id) > LIMITS["max_id_chars"] else None


def test_an_avro_value_ends_as_one_output_or_one_dead_letter_with_its_reason(
        avro_stage: tuple[Harness, JobConfig, SchemaStore]) -> None:
    h, config, store = avro_stage

    @given(case=avro_values(), key=keys, hdrs=headers)
    def check(case: tuple[bytes, str | None, bool], key: bytes | None, hdrs: dict[str, bytes | None]) -> None:
        value, expected, certain = case
        topic, outcome = _one(h, config, value, key, hdrs)
        if not certain:
            return
        if expected in (None, "template_field_missing"):  # read: then the id (the key) before the template
            expected = _key_reason(key) or expected
        if expected is None:
            assert topic == "out" or outcome["reason"] == "result_too_large", outcome
            if topic == "out" and config.output.format == "avro":
                assert outcome[:1] == b"\x00"
                (subject_ids,) = store.subjects.values()
                schema = fastavro.parse_schema(store.schemas[subject_ids[-1]])
                assert fastavro.schemaless_reader(io.BytesIO(outcome[5:]), schema, None)["id"] == key.decode()  # type: ignore[union-attr, call-overload, index]
        else:
            assert topic == "dlq" and outcome["reason"] == expected, (expected, outcome)

    check()


# ---------------------------------------------------------------------- a user's preprocess and postprocess

USER_MODULE = '''
ANSWER = [None]


def _give(record, result=None):
    answer = ANSWER[0]
    if isinstance(answer, BaseException):
        raise answer
    return answer


preprocess = _give
postprocess = _give
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    (tmp_path / "generated_user_code.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("generated_user_code", None)
    import generated_user_code  # type: ignore[import-not-found]

    yield generated_user_code
    sys.modules.pop("generated_user_code", None)


class Opaque:
    """Something a user function may return that no format can write."""


junk_answers = st.one_of(st.integers(), st.floats(), st.binary(max_size=8), st.booleans(),
                         st.sets(st.integers(), max_size=2), st.builds(Opaque), st.tuples(text),
                         st.builds(lambda m: ValueError(m), text), st.builds(lambda m: KeyError(m), text))
def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


nested = st.sampled_from([3, 300, 1_200]).map(_nested)  # past orjson's and then json's nesting limits


@st.composite
def preprocess_answers(draw: st.DrawFn) -> tuple[Any, str]:
    """What a preprocess returns, and what must come of it: "out", "dropped", "error" or "either"."""
    kind = draw(st.sampled_from(["none", "prompt", "messages", "dict", "junk", "blank", "long", "wrong_dict", "text",
                                 "deep_stop", "any_dict"]))
    if kind == "none":
        return None, "dropped"
    if kind == "prompt":
        return draw(nonblank), "out"
    if kind == "messages":
        return draw(valid_messages), "out"
    if kind == "dict":
        shaped: dict[str, Any] = {"prompt": draw(nonblank)} if draw(st.booleans()) else {"messages": draw(valid_messages)}
        if draw(st.booleans()):
            shaped["params"] = draw(valid_params)
        if draw(st.booleans()):
            shaped["id"] = draw(nonblank)
        return shaped, "out"
    if kind == "junk":
        return draw(junk_answers), "error"
    if kind == "blank":
        return draw(st.one_of(BLANK, st.builds(lambda b: {"prompt": b}, BLANK), st.just([]))), "error"
    if kind == "long":
        return "q" * (LIMITS["max_prompt_chars"] + 1), "error"
    if kind == "wrong_dict":
        return draw(st.one_of(st.fixed_dictionaries({"prompt": nonblank, "messages": valid_messages}),
                              st.fixed_dictionaries({"prompt": nonblank, "params": BAD_PARAMS}),
                              st.fixed_dictionaries({"prompt": nonblank, "id": WRONG_TYPES}),
                              st.fixed_dictionaries({"messages": BAD_MESSAGES}),
                              st.fixed_dictionaries({"prompt": nonblank, "temperature": st.floats()}))), "error"
    if kind == "deep_stop":
        return {"prompt": "x", "params": {"stop": draw(nested)}}, "either"
    if kind == "text":  # surrogates and all
        return draw(st.text(st.characters(codec=None), max_size=20)), "either"
    return draw(st.dictionaries(text, json_values, max_size=3)), "either"


def test_a_preprocess_answer_ends_as_a_call_a_skip_or_a_user_function_error(
        sim: ThreadedSimulator, harnesses: list[Harness], user_module: Any) -> None:
    config = _config(sim.url, model={"preprocess": "generated_user_code:preprocess"})
    h = Harness(config)
    harnesses.append(h)

    @given(answer=preprocess_answers(), record=st.one_of(valid_records(), st.dictionaries(text, json_values)),
           key=keys)
    def check(answer: tuple[Any, str], record: dict[str, Any], key: bytes | None) -> None:
        returned, expected = answer
        user_module.ANSWER[0] = returned
        dropped = h.metric("dropped")
        _, rows = _through(h, json.dumps(record).encode(), key, {})
        if expected == "dropped":
            assert rows == [] and h.metric("dropped") == dropped + 1
            return
        assert len(rows) == 1, rows
        topic = rows[0][2]
        body = json.loads(rows[0][1])
        if topic == "dlq":
            assert body["reason"] == "user_function_error", body
            assert body["error"].startswith("model.preprocess generated_user_code:preprocess ")
            assert expected in ("error", "either"), (returned, body)
        else:
            assert expected in ("out", "either"), (returned, body)
            if isinstance(returned, dict) and "id" in returned:
                assert body["id"] == returned["id"]

    check()


def test_a_postprocess_answer_is_written_or_a_user_function_error(
        sim: ThreadedSimulator, harnesses: list[Harness], user_module: Any) -> None:
    config = _config(sim.url, output={"postprocess": "generated_user_code:postprocess"})
    h = Harness(config)
    harnesses.append(h)
    record = json.dumps({"id": "r", "prompt": "hello"}).encode()

    answers = st.one_of(st.none().map(lambda n: (n, "dropped")),
                        st.dictionaries(text, json_values, max_size=4).map(lambda d: (d, "out")),
                        st.dictionaries(text, st.one_of(junk_answers, nested), min_size=1, max_size=2).map(
                            lambda d: (d, "either")),
                        st.one_of(junk_answers, st.lists(json_values, max_size=2)).map(lambda a: (a, "error")))

    @given(answer=answers)
    def check(answer: tuple[Any, str]) -> None:
        returned, expected = answer
        user_module.ANSWER[0] = returned
        dropped = h.metric("dropped")
        _, rows = _through(h, record, b"k", {})
        if expected == "dropped":
            assert rows == [] and h.metric("dropped") == dropped + 1
            return
        assert len(rows) == 1, rows
        written = json.loads(rows[0][1])
        if rows[0][2] == "dlq":
            assert written["reason"] in ("user_function_error", "result_too_large"), written
            assert written["reason"] == "result_too_large" or expected != "out", (returned, written)
            assert written["reason"] == "user_function_error" or len(rows[0][1]) > 0
        else:
            assert expected != "error", (returned, written)
            if expected == "out":
                assert written == returned

    check()
