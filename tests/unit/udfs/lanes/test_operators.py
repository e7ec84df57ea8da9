"""Nothing raises out of the Flink function (`udfs.lanes.keyed.InferenceStage`).

An exception out of `process_element` or `on_timer` fails the task and restarts the job, which
then meets the same record again: one bad record would stop the stream for good. Every way a
record can fail must therefore end as a dead letter with a reason, and leave the keyed state.
These tests drive the stage on a fake PyFlink runtime (tests/support/fake_flink.py) with a fake
model client: no JVM, no network.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import pickle
import threading
from typing import Any

import pytest
from pyflink.common import Row

from tests.support.fake_flink import Harness, KeyedState, record
from udfs.config import JobConfig, config_from_dict
from udfs.errors import (
    BadInput,
    ContextTooLong,
    DeadlineExceeded,
    InferenceError,
    PermanentError,
    ResponseTooLarge,
    RetryableError,
)
from udfs.lanes import record_path
from udfs.lanes.keyed import epoch_ms
from udfs.records import Completion, PendingRecord, Request

TS = 1_700_000_000_000


def offline_config(**kafka: Any) -> JobConfig:
    """A config whose endpoint nothing listens on: any real call would fail, so a result proves the fake."""
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t", **kafka},
        "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "fake", "max_tokens": 8},
        "async": {"capacity": 4, "request_timeout_s": 5.0, "record_deadline_s": 20.0},
        "retry": {"max_attempts": 1},
    })


def answer(request: Request) -> Completion:
    return Completion(output=f"answer to {request.id}", model="fake", finish_reason="stop", prompt_tokens=3,
                      completion_tokens=2, latency_ms=1.0, attempts=1, endpoint="fake", started_ms=TS,
                      completed_ms=TS + 1)


def stage(harnesses: list[Harness], complete: Any = None, state: KeyedState | None = None,
          config: JobConfig | None = None) -> Harness:
    """A stage whose model client is `complete` (default: answers every request)."""
    h = Harness(config or offline_config(), state)
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
    (ResponseTooLarge("answer passed model.max_response_bytes", status=200, attempts=4), "response_too_large"),
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
    real_decode = record_path.decode

    def decode(key: bytes | None, raw: bytes | None, *args: Any) -> Request:
        if raw == record(1):
            raise AttributeError("a decoder bug")
        return real_decode(key, raw, *args)

    monkeypatch.setattr(record_path, "decode", decode)
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
    state = KeyedState({0: {"in:0:5": PendingRecord(b"k", record(5), "in", 0, 5, TS)}})

    def decode(*args: Any) -> Request:
        raise RuntimeError("decoder bug after an upgrade")

    monkeypatch.setattr(record_path, "decode", decode)
    h = stage(harnesses, state=state)
    h.tick(0)
    [dead] = dead_letters(h)
    assert dead["reason"] == "internal_error" and dead["source"]["offset"] == 5
    assert h.state.snapshot() == {}


def test_an_encoder_bug_is_a_dead_letter(harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    def result_row(*args: Any) -> Any:
        raise TypeError("cannot encode")

    monkeypatch.setattr(record_path, "result_row", result_row)
    h = stage(harnesses)
    h.element(1, record(3), offset=3)
    h.end_of_input()
    [dead] = dead_letters(h)
    assert dead["reason"] == "internal_error" and "TypeError" in dead["error"] and dead["id"] == "id-3"
    assert h.state.snapshot() == {}


def test_a_call_that_raises_past_its_own_guard_is_a_dead_letter_with_the_stored_record(
        harnesses: list[Harness]) -> None:
    """The runner's last line of defence: `RecordPath.call` should never raise, and if it does, the record
    still gets its dead letter from what the state kept."""
    h = stage(harnesses)

    async def broken_call(request: Request, stored: PendingRecord) -> Any:
        raise MemoryError("out of luck")

    h.function._path.call = broken_call  # type: ignore[method-assign]
    h.element(2, record(4), offset=4, key=b"key-4")
    h.end_of_input()
    [dead] = dead_letters(h)
    assert dead["reason"] == "internal_error" and dead["id"] == "id-4"
    assert dead["source"]["offset"] == 4 and dead["original"]["value"] == record(4).decode()
    assert h.state.snapshot() == {}


def test_state_that_cannot_be_read_on_restore_is_a_dead_letter_not_a_crash(harnesses: list[Harness]) -> None:
    class UnreadableState(KeyedState):
        def items(self) -> Any:
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


# ---------------------------------------------------------------------- headers

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
INPUT_HEADERS = {"traceparent": TRACEPARENT, "tenant": b"acme", "empty": None}


async def refusing(request: Request) -> Completion:
    raise PermanentError("HTTP 400", status=400)


async def never_answering(request: Request) -> Completion:
    """A call still out when the test takes its checkpoint."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("forward", "carried"), [
    ("all", INPUT_HEADERS),
    ("none", {}),
    (["traceparent", "not-sent"], {"traceparent": TRACEPARENT}),
])
def test_results_and_dead_letters_carry_the_headers_forward_headers_lets_through(
        harnesses: list[Harness], forward: Any, carried: dict[str, bytes | None]) -> None:
    config = offline_config(forward_headers=forward)
    answered, refused = stage(harnesses, config=config), stage(harnesses, refusing, config=config)
    for h in (answered, refused):
        h.element(0, record(1), offset=1, headers=dict(INPUT_HEADERS))
        h.element(0, b"{not json", offset=2, headers=dict(INPUT_HEADERS))
        h.end_of_input()
    assert answered.headers("out") == [carried or None]
    reason = {"llmstream-reason": b"invalid_json"}
    assert answered.headers("dlq") == [{**carried, **reason}]
    by_reason = {b["reason"]: headers for b, headers in zip(refused.bodies("dlq"), refused.headers("dlq"), strict=True)}
    assert by_reason == {"invalid_json": {**carried, **reason},
                         "inference_rejected": {**carried, "llmstream-reason": b"inference_rejected"}}


def test_the_reason_header_follows_the_forwarded_ones_and_never_overwrites_a_users(
        harnesses: list[Harness]) -> None:
    h = stage(harnesses)
    h.element(0, b"[1]", offset=1, headers={"a": b"1", "b": b"2"})
    h.element(0, b"[2]", offset=2, headers={"llmstream-reason": b"the user's own", "a": b"1"})
    first, second = h.headers("dlq")
    assert first is not None and list(first.items()) == [("a", b"1"), ("b", b"2"), ("llmstream-reason", b"not_an_object")]
    assert second == {"llmstream-reason": b"the user's own", "a": b"1"}
    assert [b["reason"] for b in h.bodies("dlq")] == ["not_an_object", "not_an_object"]


@pytest.mark.parametrize("headers", [None, {}])
def test_a_record_without_headers_gets_none_and_its_dead_letter_only_the_reason(
        harnesses: list[Harness], headers: dict[str, bytes] | None) -> None:
    """The connector hands over an empty map for a record without headers; a NULL map (a row
    built elsewhere) must work as well."""
    h = stage(harnesses)
    h._at(0)
    for offset, value in ((1, record(1)), (2, b"{}")):
        row = Row(b"k", value, "in", 0, offset, TS, headers)
        h.out.extend(h.function.process_element(row, h.ctx))  # type: ignore[arg-type]
    h.end_of_input()
    assert h.headers("out") == [None]
    assert h.headers("dlq") == [{"llmstream-reason": b"missing_field"}]


def test_headers_survive_a_restore_with_the_record(harnesses: list[Harness]) -> None:
    first = stage(harnesses, never_answering)
    first.element(0, record(1), offset=1, headers={"traceparent": TRACEPARENT})
    checkpoint = first.state.snapshot()
    first.close()
    second = stage(harnesses, state=KeyedState(checkpoint))
    second.tick(0)
    second.end_of_input()
    assert second.headers("out") == [{"traceparent": TRACEPARENT}]


def test_source_topic_says_which_input_topic_each_record_came_from(harnesses: list[Harness]) -> None:
    """Two input topics: the same partition and offset in the same bucket are two records, two
    state entries, two answers."""
    h = stage(harnesses, never_answering)
    h.element(0, record(1), offset=5, topic="orders")
    h.element(0, record(2), offset=5, topic="refunds")
    h.element(0, b"[]", offset=6, topic="refunds")
    assert set(h.state.snapshot()[0]) == {"orders:0:5", "refunds:0:5"}
    checkpoint = h.state.snapshot()
    h.close()
    second = stage(harnesses, state=KeyedState(checkpoint))
    second.tick(0)
    second.end_of_input()
    assert sorted((b["id"], b["source"]["topic"]) for b in second.bodies("out")) == [
        ("id-1", "orders"), ("id-2", "refunds")]
    assert [b["source"]["topic"] for b in h.bodies("dlq")] == ["refunds"]


# ---------------------------------------------------------------------- the pending record in state


def test_the_state_holds_named_pending_records_under_topic_partition_offset(harnesses: list[Harness]) -> None:
    h = stage(harnesses, never_answering)
    h.element(2, record(3), offset=3, key=b"key-3", partition=1, headers={"tenant": b"acme"})
    [(handle, stored)] = h.state.snapshot()[2].items()
    assert handle == "in:1:3"
    assert stored == PendingRecord(b"key-3", record(3), "in", 1, 3, TS, (("tenant", b"acme"),))


def test_a_state_of_six_tuples_written_before_pending_records_still_resumes(harnesses: list[Harness]) -> None:
    """A savepoint taken by the llmstream before `PendingRecord` holds `partition:offset` ->
    (key, value, topic, partition, offset, timestamp_ms), pickled."""
    legacy = pickle.loads(pickle.dumps((b"key-5", record(5), "in", 0, 5, TS)))
    h = stage(harnesses, state=KeyedState({1: {"0:5": legacy}, 2: {"0:6": (None, b"[]", "in", 0, 6, None)}}))
    h.tick(1)
    h.tick(2)
    h.end_of_input()
    [body] = h.bodies("out")
    assert body["id"] == "id-5" and body["source"] == {"topic": "in", "partition": 0, "offset": 5, "timestamp": TS}
    assert [(b["reason"], b["source"]["offset"]) for b in dead_letters(h)] == [("not_an_object", 6)]
    assert h.headers("out") == [None]
    assert h.state.snapshot() == {} and h.metric("reissued") == 1


def test_a_state_entry_that_is_no_pending_record_is_a_dead_letter_and_leaves_state(harnesses: list[Harness]) -> None:
    h = stage(harnesses, state=KeyedState({0: {"0:1": ("not", "a", "record")}, 1: {"in:0:2": record(2)}}))
    h.tick(0)
    h.tick(1)
    assert [b["reason"] for b in dead_letters(h)] == ["internal_error", "internal_error"]
    assert h.state.snapshot() == {}


def test_a_pending_record_pickled_before_a_field_was_added_takes_its_default() -> None:
    """`headers` stands for any field a later llmstream adds: older pickles lack it."""
    current = PendingRecord(b"k", b"v", "in", 0, 1, TS, (("a", b"1"),))
    old_state = {k: v for k, v in vars(current).items() if k != "headers"}
    older = PendingRecord.__new__(PendingRecord)
    older.__setstate__(old_state)
    assert pickle.loads(pickle.dumps(older)) == PendingRecord(b"k", b"v", "in", 0, 1, TS)
    assert pickle.loads(pickle.dumps(current)) == current


def test_the_stage_counts_what_it_holds_until_each_outcome_leaves(harnesses: list[Harness]) -> None:
    """`held` (what a backfill's drain waits for) counts every record in state: calls in flight,
    also after a restore, and none once their outcomes have left."""
    first = stage(harnesses, never_answering)
    first.element(0, record(1), offset=1)
    first.element(1, record(2), offset=2)
    first.element(1, b"[]", offset=3)  # bad input: a dead letter at once, never held
    holding = first.function._metrics.holding
    assert holding.count == 2 and holding.oldest_s() >= 0
    checkpoint = first.state.snapshot()
    first.close()
    release = threading.Event()

    async def held_back(request: Request) -> Completion:
        while not release.is_set():
            await asyncio.sleep(0.01)
        return answer(request)

    second = stage(harnesses, held_back, state=KeyedState(checkpoint))
    assert second.function._metrics.holding.count == 0  # nothing adopted yet
    second.tick(0)
    second.tick(1)
    assert second.function._metrics.holding.count == 2  # restored, called again
    release.set()
    second.end_of_input()
    assert second.function._metrics.holding.count == 0 and len(second.bodies("out")) == 2
    assert second.function._metrics.snapshot()["held"] == 0
