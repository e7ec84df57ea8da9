"""The record contract: what becomes a request, and the reason code for what does not."""

from __future__ import annotations

import json

import pytest

from udfs.config import LimitsConfig
from udfs.errors import BadInput
from udfs.records import SourceRef
from udfs.records.decode import decode, record_id

SOURCE = SourceRef("in", 0, 7, 1_700_000_000_000)
LIMITS = LimitsConfig(max_record_bytes=10_000, max_prompt_chars=1_000, max_id_chars=64)


def _decode(value: bytes | None, key: bytes | None = b"k"):
    return decode(key, value, SOURCE, LIMITS)


def _reason(value: bytes | None) -> str:
    with pytest.raises(BadInput) as info:
        _decode(value)
    return info.value.reason


def test_prompt_record() -> None:
    raw = json.dumps({"id": "a1", "prompt": "Why is the sky blue?", "topic": "physics",
                      "params": {"max_tokens": 20, "temperature": 0.1}}).encode()
    request = _decode(raw)
    assert request.id == "a1"
    assert request.key == b"k"
    assert request.prompt == "Why is the sky blue?"
    assert request.messages is None
    assert request.params == {"max_tokens": 20, "temperature": 0.1}
    assert request.fields["topic"] == "physics"
    assert request.source == SOURCE
    assert request.raw == raw


def test_messages_record() -> None:
    raw = json.dumps({"id": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}]}).encode()
    request = _decode(raw, key=None)
    assert request.key is None
    assert request.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "null_value"),
        (b"\xff\xfe\x00binary", "invalid_utf8"),
        (b'{"id": "a", "prompt": "x\x00y"}', "invalid_json"),
        (b'{"id": "a", "prompt": "trunc', "invalid_json"),
        (b"", "invalid_json"),
        (b'{"id": "a", "prompt": "p", "n": NaN}', "invalid_json"),
        (b"[" * 100_00 + b"]" * 100_00, "record_too_large"),
        (b"[" * 4_000 + b"]" * 4_000, "invalid_json"),
        (b'{"id": "a", "prompt": "p", "n": ' + b"9" * 5_000 + b"}", "invalid_json"),
        (b'["id", "prompt"]', "not_an_object"),
        (b'"just a string"', "not_an_object"),
        (b"null", "not_an_object"),
        (b'{"prompt": "p"}', "missing_field"),
        (b'{"id": "a"}', "missing_field"),
        (b'{"id": 12, "prompt": "p"}', "wrong_type"),
        (b'{"id": "a", "prompt": ["p"]}', "wrong_type"),
        (b'{"id": "", "prompt": "p"}', "empty_id"),
        (b'{"id": "a", "prompt": "   "}', "empty_prompt"),
        (json.dumps({"id": "a", "prompt": "x" * 1_001}).encode(), "prompt_too_large"),
        (json.dumps({"id": "i" * 65, "prompt": "p"}).encode(), "id_too_long"),
        (b'{"id": "a", "prompt": "p", "messages": []}', "ambiguous_input"),
        (b'{"id": "a", "messages": []}', "invalid_messages"),
        (b'{"id": "a", "messages": [{"role": "wizard", "content": "x"}]}', "invalid_messages"),
        (b'{"id": "a", "messages": [{"role": "user", "content": 5}]}', "invalid_messages"),
        (b'{"id": "a", "messages": [{"role": "user", "content": ""}]}', "empty_prompt"),
        (b'{"id": "a", "prompt": "p", "params": "hot"}', "invalid_params"),
        (b'{"id": "a", "prompt": "p", "params": {"max_tokens": "9"}}', "invalid_params"),
        (b'{"id": "a", "prompt": "p", "params": {"max_tokens": 0}}', "invalid_params"),
        (b'{"id": "a", "prompt": "p", "params": {"api_key": "x"}}', "invalid_params"),
    ],
)
def test_bad_records_have_reasons(value: bytes | None, reason: str) -> None:
    assert _reason(value) == reason


def test_record_id_is_best_effort() -> None:
    assert record_id(b'{"id": "x", "prompt": 3}') == "x"
    assert record_id(b"not json") is None
    assert record_id(None) is None
    assert record_id(b'{"id": 5}') is None
