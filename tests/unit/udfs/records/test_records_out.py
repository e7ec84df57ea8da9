"""Output and dead-letter records: what a consumer of the two topics sees."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from udfs.errors import BadInput, ResultTooLarge, RetryableError
from udfs.records import Completion, Request, SourceRef, dead_letter, forwarded_headers
from udfs.records.encode import result_row

SOURCE = SourceRef("requests", 1, 42, 1_700_000_000_000)


def test_result_row_keeps_key_and_carries_accounting() -> None:
    request = Request(id="r1", key=b"\x00key", source=SOURCE, prompt="hi")
    completion = Completion(output="hello", model="m", finish_reason="stop", prompt_tokens=3,
                            completion_tokens=5, latency_ms=12.34, attempts=2, endpoint="http://x/v1/chat/completions",
                            started_ms=1, completed_ms=2, cost=0.5)
    row = result_row(request, completion, "results")
    assert row.key == b"\x00key"
    assert row.topic == "results"
    body = json.loads(row.value)
    assert body["id"] == "r1"
    assert body["output"] == "hello"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert body["attempts"] == 2
    assert body["latency_ms"] == 12.3
    assert body["timestamps"] == {"produced": 1_700_000_000_000, "started": 1, "completed": 2}
    assert body["source"] == {"topic": "requests", "partition": 1, "offset": 42, "timestamp": 1_700_000_000_000}


def test_an_oversized_result_becomes_a_result_too_large_dead_letter() -> None:
    request = Request(id="big", key=b"k" * 10, source=SOURCE, prompt="write a novel", raw=b'{"id": "big"}')
    completion = Completion(output="x" * 5000, model="m", finish_reason="length", prompt_tokens=3,
                            completion_tokens=5000, latency_ms=1.0, attempts=2, endpoint="e", started_ms=1,
                            completed_ms=2)
    assert result_row(request, completion, "results", max_bytes=6000).topic == "results"
    try:
        result_row(request, completion, "results", max_bytes=5000)
        raise AssertionError("an oversized result must not become a sink row")
    except ResultTooLarge as err:
        row = dead_letter.for_error(err, key=request.key, value=request.raw, source=SOURCE, record_id="big",
                                    job="j", topic="dlq")
    body = json.loads(row.value)
    assert (row.topic, row.key) == ("dlq", b"k" * 10)
    assert body["reason"] == "result_too_large" and body["attempts"] == 2
    assert "limits.max_result_bytes (5000)" in body["error"]
    assert body["original"]["value"] == '{"id": "big"}'


def test_bad_input_dead_letter_keeps_original_bytes() -> None:
    raw = b"\xff\xfe not utf-8"
    row = dead_letter.for_error(BadInput("invalid_utf8", "value is not UTF-8 at byte 0"), key=b"k",
                                    value=raw, source=SOURCE, record_id=None, job="j", topic="dlq")
    body = json.loads(row.value)
    assert (row.key, row.topic) == (b"k", "dlq")
    assert body["reason"] == "invalid_utf8"
    assert body["original"]["encoding"] == "base64"
    assert base64.b64decode(body["original"]["value"]) == raw
    assert body["source"]["offset"] == 42
    assert body["attempts"] == 0


def test_inference_dead_letter_has_attempts_and_status() -> None:
    err = RetryableError("HTTP 503 from server", status=503, attempts=6)
    row = dead_letter.for_error(err, key=None, value=b'{"id":"r"}', source=SOURCE, record_id="r",
                                          job="j", topic="dlq")
    body = json.loads(row.value)
    assert body["reason"] == "inference_retries_exhausted"
    assert body["attempts"] == 6
    assert body["last_status"] == 503
    assert body["id"] == "r"
    assert body["original"] == {"size": 10, "truncated": False, "encoding": "utf-8", "value": '{"id":"r"}'}


def test_huge_original_is_cut_with_its_hash() -> None:
    raw = b"x" * (dead_letter.ORIGINAL_LIMIT_BYTES + 10)
    body = json.loads(dead_letter.dead_letter_value(reason="record_too_large", error="big", source=SOURCE,
                                                    original=raw, record_id=None, job="j"))
    assert body["original"]["truncated"] is True
    assert body["original"]["size"] == len(raw)
    assert len(body["original"]["value"]) == dead_letter.ORIGINAL_LIMIT_BYTES
    assert len(body["original"]["sha256"]) == 64


# ---------------------------------------------------------------------- headers

PAIRS = (("traceparent", b"00-abc-def-01"), ("tenant", b"acme"), ("tenant", b"globex"), ("blank", None))


@pytest.mark.parametrize(("forward", "expected"), [
    ("all", [("traceparent", b"00-abc-def-01"), ("tenant", b"globex"), ("blank", None)]),
    ("none", []),
    (["tenant", "traceparent"], [("traceparent", b"00-abc-def-01"), ("tenant", b"globex")]),
    (["Traceparent"], []),
])
def test_forwarded_headers_keep_order_and_the_last_value_of_a_repeated_name(
        forward: Any, expected: list[tuple[str, bytes | None]]) -> None:
    assert list(forwarded_headers(PAIRS, forward).items()) == expected


def test_no_headers_forward_nothing() -> None:
    assert forwarded_headers(None, "all") == {} and forwarded_headers((), ["a"]) == {}


def test_a_result_carries_the_forwarded_headers_and_they_count_towards_its_size() -> None:
    request = Request(id="r1", key=b"k", source=SOURCE, prompt="hi")
    completion = Completion(output="hello", model="m", finish_reason="stop", prompt_tokens=1, completion_tokens=1,
                            latency_ms=1.0, attempts=1, endpoint="e", started_ms=1, completed_ms=2)
    headers = {"traceparent": b"t" * 55}
    row = result_row(request, completion, "results", headers=headers)
    assert row.headers == headers
    assert result_row(request, completion, "results").headers is None
    size = len(row.value) + len(b"k") + len("traceparent") + 55
    assert result_row(request, completion, "results", max_bytes=size, headers=headers).headers == headers
    with pytest.raises(ResultTooLarge):
        result_row(request, completion, "results", max_bytes=size - 1, headers=headers)


def test_a_dead_letter_adds_its_reason_header_after_the_forwarded_ones_without_overwriting() -> None:
    err = BadInput("invalid_json", "nope")
    row = dead_letter.for_error(err, key=None, value=b"{", source=SOURCE, record_id=None, job="j", topic="dlq",
                                headers={"traceparent": b"t"})
    assert row.headers is not None
    assert list(row.headers.items()) == [("traceparent", b"t"), (dead_letter.REASON_HEADER, b"invalid_json")]
    mine = dead_letter.for_error(err, key=None, value=b"{", source=SOURCE, record_id=None, job="j", topic="dlq",
                                 headers={"llmstream-reason": b"user value"})
    assert mine.headers == {"llmstream-reason": b"user value"}
    assert json.loads(mine.value)["reason"] == "invalid_json"
    bare = dead_letter.for_error(err, key=None, value=b"{", source=SOURCE, record_id=None, job="j", topic="dlq")
    assert bare.headers == {"llmstream-reason": b"invalid_json"}
