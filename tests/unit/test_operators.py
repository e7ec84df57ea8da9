"""Nothing raises out of the Flink function (`udfs.operators.InferenceStage`).

An exception out of `process_element` or `on_timer` fails the task and restarts the job, which
then meets the same record again: one bad record would stop the stream for good. Every way a
record can fail must therefore end as a dead letter with a reason, and leave the keyed state.
These tests drive the stage on a fake PyFlink runtime (tests/unit/fake_flink.py) with a fake
model client: no JVM, no network.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
from pyflink.common import Row

from tests.unit.fake_flink import Harness, KeyedState, record
from udfs import operators
from udfs.config import JobConfig, config_from_dict
from udfs.errors import (
    BadInput,
    ContextTooLong,
    DeadlineExceeded,
    InferenceError,
    PermanentError,
    RetryableError,
)
from udfs.operators import epoch_ms
from udfs.records import Completion, Request

TS = 1_700_000_000_000


def offline_config() -> JobConfig:
    """A config whose endpoint nothing listens on: any real call would fail, so a result proves the fake."""
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "fake", "max_tokens": 8},
        "async": {"capacity": 4, "request_timeout_s": 5.0, "record_deadline_s": 20.0},
        "retry": {"max_attempts": 1},
    })


def answer(request: Request) -> Completion:
    return Completion(output=f"answer to {request.id}", model="fake", finish_reason="stop", prompt_tokens=3,
                      completion_tokens=2, latency_ms=1.0, attempts=1, endpoint="fake", started_ms=TS,
                      completed_ms=TS + 1)


def stage(harnesses: list[Harness], complete: Any = None, state: KeyedState | None = None) -> Harness:
    """A stage whose model client is `complete` (default: answers every request)."""
    h = Harness(offline_config(), state)
    harnesses.append(h)

    async def answering(request: Request) -> Completion:
        return answer(request)

    h.function._client.complete = complete or answering  # type: ignore[method-assign]
    return h


def dead_letters(h: Harness) -> list[dict[str, Any]]:
    return h.bodies("dlq")


def test_an_answered_record_is_an_output_row_and_leaves_state(harnesses: list[Harness]) -> None:
    h = stage(harnesses)
    h.element(0, record(1), offset=1)
    h.end_of_input()
    [body] = h.bodies("out")
    assert body["id"] == "id-1" and body["output"] == "answer to id-1"
    assert dead_letters(h) == [] and h.state.snapshot() == {}


@pytest.mark.parametrize(("error", "reason"), [
    (RetryableError("HTTP 503", status=503, attempts=4), "inference_retries_exhausted"),
    (PermanentError("HTTP 400", status=400), "inference_rejected"),
    (DeadlineExceeded("record deadline 20 s passed", attempts=2), "inference_deadline_exceeded"),
    (ContextTooLong("4096 tokens over 2048"), "context_too_long"),
    (BadInput("template_field_missing", "no field 'text'"), "template_field_missing"),
    (ZeroDivisionError("a bug"), "internal_error"),
    (KeyError("missing"), "internal_error"),
])
def test_every_failure_of_a_call_is_a_dead_letter_with_its_reason(
        harnesses: list[Harness], error: Exception, reason: str) -> None:
    async def failing(request: Request) -> Completion:
        raise error

    h = stage(harnesses, failing)
    h.element(3, record(7), offset=7, key=b"key-7")
    h.end_of_input()
    [body] = dead_letters(h)
    assert body["reason"] == reason
    assert body["id"] == "id-7" and body["source"]["offset"] == 7
    assert body["original"]["value"] == record(7).decode()
    if isinstance(error, InferenceError):
        assert body["attempts"] == error.attempts
    if reason == "internal_error":
        assert type(error).__name__ in body["error"]
    assert h.bodies("out") == [] and h.state.snapshot() == {}
    assert h.function._metrics.dead_letters_by_reason[reason].value == 1


def test_a_row_that_cannot_be_read_is_a_dead_letter(harnesses: list[Harness]) -> None:
    h = stage(harnesses)
    h._at(0)
    h.out.extend(h.function.process_element(Row(b"k", b"{}"), h.ctx))  # type: ignore[arg-type]
    [body] = dead_letters(h)
    assert body["reason"] == "internal_error" and "IndexError" in body["error"]
    assert body["source"]["topic"] == "unknown"
    assert h.state.snapshot() == {}


def test_a_decoder_bug_is_a_dead_letter_and_the_next_record_still_flows(
        harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    real_decode = operators.decode

    def decode(key: bytes | None, raw: bytes | None, *args: Any) -> Request:
        if raw == record(1):
            raise AttributeError("a decoder bug")
        return real_decode(key, raw, *args)

    monkeypatch.setattr(operators, "decode", decode)
    h = stage(harnesses)
    h.element(0, record(1), offset=1)
    h.element(0, record(2), offset=2)
    h.end_of_input()
    [dead] = dead_letters(h)
    assert dead["reason"] == "internal_error" and "AttributeError" in dead["error"]
    assert dead["id"] == "id-1" and dead["source"]["offset"] == 1
    assert [b["id"] for b in h.bodies("out")] == ["id-2"]
    assert h.state.snapshot() == {}


def test_a_restored_record_the_decoder_now_fails_on_leaves_state_as_a_dead_letter(
        harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    """A record stored before a restore and failing on decode after it (e.g. new limits)."""
    state = KeyedState({0: {"0:5": (b"k", record(5), "in", 0, 5, TS)}})

    def decode(*args: Any) -> Request:
        raise RuntimeError("decoder bug after an upgrade")

    monkeypatch.setattr(operators, "decode", decode)
    h = stage(harnesses, state=state)
    h.tick(0)
    [dead] = dead_letters(h)
    assert dead["reason"] == "internal_error" and dead["source"]["offset"] == 5
    assert h.state.snapshot() == {}


def test_an_encoder_bug_is_a_dead_letter(harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    def result_row(*args: Any) -> Any:
        raise TypeError("cannot encode")

    monkeypatch.setattr(operators, "result_row", result_row)
    h = stage(harnesses)
    h.element(1, record(3), offset=3)
    h.end_of_input()
    [dead] = dead_letters(h)
    assert dead["reason"] == "internal_error" and "TypeError" in dead["error"] and dead["id"] == "id-3"
    assert h.state.snapshot() == {}


def test_a_call_that_raises_past_its_own_guard_is_a_dead_letter_with_the_stored_record(
        harnesses: list[Harness]) -> None:
    """The runner's last line of defence: `_call` should never raise, and if it does, the record
    still gets its dead letter from what the state kept."""
    h = stage(harnesses)

    async def broken_call(request: Request) -> Any:
        raise MemoryError("out of luck")

    h.function._call = broken_call  # type: ignore[method-assign]
    h.element(2, record(4), offset=4, key=b"key-4")
    h.end_of_input()
    [dead] = dead_letters(h)
    assert dead["reason"] == "internal_error" and dead["id"] == "id-4"
    assert dead["source"]["offset"] == 4 and dead["original"]["value"] == record(4).decode()
    assert h.state.snapshot() == {}


def test_state_that_cannot_be_read_on_restore_is_a_dead_letter_not_a_crash(harnesses: list[Harness]) -> None:
    class UnreadableState(KeyedState):
        def values(self) -> Any:
            raise OSError("state backend unreachable")

    h = stage(harnesses, state=UnreadableState())
    h.tick(0)
    [dead] = dead_letters(h)
    assert dead["reason"] == "internal_error" and "OSError" in dead["error"]


def test_bad_input_is_a_dead_letter_with_its_own_reason_not_an_internal_error(harnesses: list[Harness]) -> None:
    h = stage(harnesses)
    h.element(0, json.dumps({"id": "x"}).encode(), offset=9)
    [dead] = dead_letters(h)
    assert dead["reason"] not in ("internal_error", "inference_failed")
    assert h.metric("bad_input") == 1 and h.state.snapshot() == {}


@pytest.mark.parametrize(("ts", "ms"), [
    (None, None),
    (TS, TS),
    (datetime.datetime.fromtimestamp(TS / 1000, tz=datetime.UTC), TS),
])
def test_kafka_timestamps_become_epoch_ms(ts: Any, ms: int | None) -> None:
    assert epoch_ms(ts) == ms


def test_an_instant_becomes_epoch_ms() -> None:
    class Instant:
        def to_epoch_milli(self) -> int:
            return TS

    assert epoch_ms(Instant()) == TS
