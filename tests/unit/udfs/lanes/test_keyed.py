"""The keyed lane's Flink function (`udfs.lanes.keyed.InferenceStage`) without a JVM: fake keyed
state, timers and runtime context (tests/support/fake_flink.py), and as model either the simulator
over loopback HTTP or a fake client that answers, fails or never returns as a test needs.

What a user sees of the lane: every record answered once and out of state, capacity, emission by
timer, drain, restore and re-issue, headers, the pending record in state (older forms included),
per-key order and tombstones, and records parked behind a closed gate.

Nothing raises out of the function: an exception out of `process_element` or `on_timer` fails the
task and restarts the job, which then meets the same record again, so one bad record would stop
the stream for good. Every way a record can fail, a bug included, must therefore end as a dead
letter with a reason and leave the keyed state.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from pyflink.common import Row

from jobs.dev.simulator import ThreadedSimulator
from tests.support.fake_flink import Harness, KeyedState, record
from tests.support.waiting import wait_until
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
from udfs.lanes.keyed import EMIT_PERIOD_MS, FLUSH_AT, epoch_ms
from udfs.records import Completion, PendingRecord, Request

TS = 1_700_000_000_000
NOWHERE = "http://127.0.0.1:9/v1"
"""An endpoint nothing listens on: any real call would fail, so a result proves the fake client."""


def job_config(endpoint: str = NOWHERE, capacity: int = 8, kafka: dict[str, Any] | None = None,
               **sections: Any) -> JobConfig:
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t", **(kafka or {})},
        "model": {"endpoint": endpoint, "model": "sim", "max_tokens": 8},
        "async": {"capacity": capacity, "request_timeout_s": 5.0, "record_deadline_s": 20.0},
        "retry": {"max_attempts": 3, "initial_backoff_s": 0.001, "max_backoff_s": 0.005},
        **sections,
    })


def feed(h: Harness, ids: range, buckets: int = 4) -> None:
    for i in ids:
        h.element(i % buckets, record(i), offset=i)


def answer(request: Request) -> Completion:
    return Completion(output=f"answer to {request.id}", model="fake", finish_reason="stop", prompt_tokens=3,
                      completion_tokens=2, latency_ms=1.0, attempts=1, endpoint="fake", started_ms=TS,
                      completed_ms=TS + 1)


def harness(harnesses: list[Harness], config: JobConfig, state: KeyedState | None = None,
            **options: Any) -> Harness:
    """A stage on the fake runtime (`options`: `Harness`'s), closed when the test ends."""
    h = Harness(config, state, **options)
    harnesses.append(h)
    return h


def stage(harnesses: list[Harness], complete: Any = None, state: KeyedState | None = None,
          config: JobConfig | None = None) -> Harness:
    """A stage whose model client is `complete` (default: answers every request)."""
    h = harness(harnesses, config or job_config(), state)

    async def answering(request: Request) -> Completion:
        return answer(request)

    h.function._client.complete = complete or answering  # type: ignore[method-assign]
    return h


def dead_letters(h: Harness) -> list[dict[str, Any]]:
    return h.bodies("dlq")


# ---------------------------------------------------------------------- answers, capacity, emission


def test_every_record_is_answered_once_and_leaves_state(sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    h = harness(harnesses, job_config(sim.url))
    feed(h, range(40))
    h.end_of_input()
    ids = Counter(b["id"] for b in h.bodies("out"))
    assert ids == Counter({f"id-{i}": 1 for i in range(40)})
    assert all(bytes(r[0]) == b"k" for r in h.out)
    assert h.bodies("dlq") == [] and h.state.snapshot() == {}
    assert h.metric("records_in") == 40 and h.metric("reissued") == 0


def test_without_flink_metrics_the_stage_runs_and_keeps_its_figures(sim: ThreadedSimulator,
                                                                     harnesses: list[Harness]) -> None:
    # `flink: {python.metric.enabled: false}` makes PyFlink's get_metrics_group() return None;
    # the stage once failed in `open` on it, and the job restarted forever.
    h = harness(harnesses, job_config(sim.url), metrics=False)
    feed(h, range(10))
    h.end_of_input()
    assert sorted(b["id"] for b in h.bodies("out")) == sorted(f"id-{i}" for i in range(10))
    assert h.metric("records_in") == 10


def test_capacity_bounds_calls_in_flight(make_sim: Callable[..., ThreadedSimulator],
                                         harnesses: list[Harness]) -> None:
    sim = make_sim(latency="fixed:150")
    h = harness(harnesses, job_config(sim.url, capacity=3))
    feed(h, range(12))
    h.end_of_input()
    stats = sim.stats()
    assert len(h.bodies("out")) == 12
    assert stats["max_in_flight"] == 3, stats


def test_results_are_emitted_by_the_processing_time_timer_when_no_input_comes(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    # An answer slower than the element's own work: an instant one can be back (and emitted by
    # the element itself, leaving no timer) when a busy machine pauses this thread for a moment.
    sim = make_sim(latency="fixed:500")
    h = harness(harnesses, job_config(sim.url))
    h.element(1, record(1), offset=1)
    assert len(h.timers.processing) == 1
    (_, at), = h.timers.processing
    assert at - int(time.time() * 1000) <= EMIT_PERIOD_MS

    def emitted_or_idle() -> bool:
        if h.out:
            return True
        h.fire_due_processing_timers()
        return not h.timers.processing  # nothing left in flight: no timer is kept armed

    wait_until(emitted_or_idle, 30, interval=0.01, message="the output of id-1 (or no timer left armed)")
    assert [b["id"] for b in h.bodies("out")] == ["id-1"]
    assert h.state.snapshot() == {}


# ---------------------------------------------------------------------- every failure is a dead letter


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
    h.out.extend(h.function.process_element(Row(b"k", b"{}"), h.ctx))
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


def test_bad_input_is_dead_lettered_at_once_with_its_own_reason_and_never_stored(harnesses: list[Harness]) -> None:
    h = stage(harnesses)
    h.element(0, b"{not json", offset=7)
    h.element(0, None, offset=8, key=None)  # a null value with no key to delete
    h.element(0, json.dumps({"id": "x"}).encode(), offset=9)
    reasons = [(b["reason"], b["source"]["offset"]) for b in dead_letters(h)]
    assert reasons == [("invalid_json", 7), ("null_value", 8), ("missing_field", 9)]
    assert h.state.snapshot() == {}
    assert h.metric("bad_input") == 3


def test_model_failure_is_dead_lettered_with_attempts(sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    sim.admin({"error_rate": 1.0, "error_status": 400})
    h = harness(harnesses, job_config(sim.url))
    h.element(0, record(1), offset=1)
    h.end_of_input()
    [body] = h.bodies("dlq")
    assert (body["reason"], body["attempts"], body["last_status"]) == ("inference_rejected", 1, 400)


def test_an_oversized_result_is_a_dead_letter_not_a_sink_failure(sim: ThreadedSimulator,
                                                                 harnesses: list[Harness]) -> None:
    """A result over limits.max_result_bytes would fail the Kafka sink and restart the job."""
    h = harness(harnesses, job_config(sim.url, limits={"max_result_bytes": 300}))
    h.element(0, record(1), offset=1)
    h.end_of_input()
    assert h.bodies("out") == []
    (body,) = h.bodies("dlq")
    assert body["reason"] == "result_too_large" and body["id"] == "id-1"
    assert "limits.max_result_bytes (300)" in body["error"]
    assert h.state.snapshot() == {}


# ---------------------------------------------------------------------- Kafka timestamps


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


# ---------------------------------------------------------------------- restore and re-issue


def test_a_snapshot_holds_exactly_what_is_not_emitted_and_a_restore_issues_it_again(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    sim = make_sim(latency="fixed:400")
    config = job_config(sim.url, capacity=16)
    first = harness(harnesses, config)
    feed(first, range(20))  # 16 admitted at once, the last 4 waited for slots
    checkpoint = first.state.snapshot()
    emitted = {b["id"] for b in first.bodies("out")}
    stored = {json.loads(v.value)["id"] for bucket in checkpoint.values() for v in bucket.values()}
    assert stored and not stored & emitted
    assert stored | emitted == {f"id-{i}" for i in range(20)}
    # Every call of the first instance has reached the server before it is counted afresh: on a
    # loaded machine a call started before the failure could otherwise arrive after reset_stats.
    wait_until(lambda: sim.stats()["requests_total"] >= 20, 60, interval=0.02,
               message=lambda: f"all 20 calls at the server ({sim.stats()['requests_total']} arrived)")
    first.close()  # the failure: calls in flight are abandoned

    sim.reset_stats()
    second = harness(harnesses, config, KeyedState(copy.deepcopy(checkpoint)))
    for bucket in checkpoint:  # restored processing-time timers fire
        second.fire(bucket, 0)
    second.end_of_input()
    again = Counter(b["id"] for b in second.bodies("out"))
    assert again == Counter({i: 1 for i in stored})
    assert second.metric("reissued") == len(stored)
    assert sim.stats()["requests_total"] == len(stored)
    assert second.state.snapshot() == {}


def test_a_restored_bucket_is_issued_again_on_its_first_element_too(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    sim = make_sim(latency="fixed:300")
    config = job_config(sim.url, capacity=8)
    first = harness(harnesses, config)
    feed(first, range(4), buckets=1)
    checkpoint = first.state.snapshot()
    first.close()
    second = harness(harnesses, config, KeyedState(copy.deepcopy(checkpoint)))
    second.element(0, record(100), offset=100)
    second.end_of_input()
    ids = Counter(b["id"] for b in second.bodies("out"))
    stored = {json.loads(v.value)["id"] for v in checkpoint[0].values()}
    assert ids == Counter({i: 1 for i in [*stored, "id-100"]})


def test_after_a_drain_a_restored_job_arms_the_flush_timer_again(sim: ThreadedSimulator,
                                                                 harnesses: list[Harness]) -> None:
    config = job_config(sim.url)
    first = harness(harnesses, config)
    feed(first, range(8))
    first.end_of_input()  # drain: the flush timers fired and are gone
    assert first.timers.event == set()
    drained = first.state.snapshot()
    assert drained == {}
    first.close()

    second = harness(harnesses, config, KeyedState(drained))
    feed(second, range(8, 16))
    assert {at for _, at in second.timers.event} == {FLUSH_AT}
    second.end_of_input()
    assert Counter(b["id"] for b in second.bodies("out")) == Counter({f"id-{i}": 1 for i in range(8, 16)})


def test_ticks_alone_restart_a_restored_state_when_no_input_comes(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    """A restored job whose input is consumed gets no elements and (measured) no restored
    processing-time timers: the ticks must be enough to issue the pending requests again."""
    sim = make_sim(latency="fixed:300")
    config = job_config(sim.url, capacity=8)
    first = harness(harnesses, config)
    feed(first, range(8))
    checkpoint = first.state.snapshot()
    first.close()
    stored = {json.loads(v.value)["id"] for bucket in checkpoint.values() for v in bucket.values()}
    assert stored

    second = harness(harnesses, config, KeyedState(copy.deepcopy(checkpoint)))

    def drained() -> bool:
        if not second.state.snapshot():
            return True
        for bucket in range(4):
            second.tick(bucket)
        return False

    wait_until(drained, 30, interval=0.05,
               message=lambda: f"the reissued records to leave the state ({second.state.snapshot()} left)")
    assert Counter(b["id"] for b in second.bodies("out")) == Counter({i: 1 for i in stored})
    assert second.metric("records_in") == 0 and second.metric("reissued") == len(stored)


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
    config = job_config(kafka={"forward_headers": forward})
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
        h.out.extend(h.function.process_element(row, h.ctx))
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


# ---------------------------------------------------------------------- per-key order and tombstones


def versioned(key: str, version: int) -> bytes:
    return json.dumps({"id": f"{key}-v{version}", "prompt": f"{key} version {version}"}).encode()


def slow_first_versions(h: Harness, slow: set[str], delay_s: float = 0.3) -> None:
    """The model client answers the ids in `slow` after `delay_s`, every other at once: later
    versions of a key tend to finish before earlier ones."""
    real = h.function._client.complete

    async def complete(request: Any) -> Any:
        if request.id in slow:
            await asyncio.sleep(delay_s)
        return await real(request)

    h.function._client.complete = complete  # type: ignore[method-assign]


def gated(h: Harness, held: set[str]) -> threading.Event:
    """The model client answers the ids in `held` only once the returned event is set: the test
    decides which calls finish first, whatever the machine's speed."""
    gate = threading.Event()
    real = h.function._client.complete

    async def complete(request: Any) -> Any:
        while request.id in held and not gate.is_set():
            await asyncio.sleep(0.005)
        return await real(request)

    h.function._client.complete = complete  # type: ignore[method-assign]
    return gate


def only_gated_calls_left(h: Harness, n: int) -> None:
    wait_until(lambda: h.function._runner.in_flight == n, 30, interval=0.01,
               message=lambda: f"{n} calls left in flight ({h.function._runner.in_flight})")


def emitted(h: Harness) -> list[tuple[bytes | None, str, str | None]]:
    """(key, topic, id) of each row in emission order; the id is None for a null value."""
    return [(None if r[0] is None else bytes(r[0]), r[2], None if r[1] is None else json.loads(bytes(r[1]))["id"])
            for r in h.out]


def per_key_ids(h: Harness, topic: str | None = None) -> dict[bytes | None, list[str | None]]:
    out: dict[bytes | None, list[str | None]] = {}
    for key, t, rid in emitted(h):
        if topic is None or t == topic:
            out.setdefault(key, []).append(rid)
    return out


def test_per_key_results_leave_in_input_order_though_later_versions_finish_first(
        sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    keys = ["a", "b", "c"]
    for ordering, expect_order in [("per_key", True), ("none", False)]:
        h = harness(harnesses, job_config(sim.url, capacity=16, ordering=ordering))
        gate = gated(h, {f"{k}-v0" for k in keys})
        offset = 0
        for version in range(4):
            for k in keys:
                h.element(0, versioned(k, version), offset=offset, key=k.encode())
                offset += 1
        only_gated_calls_left(h, len(keys))  # every later version has finished before its v0
        gate.set()
        h.end_of_input()
        got = per_key_ids(h)
        in_order = all(got[k.encode()] == [f"{k}-v{v}" for v in range(4)] for k in keys)
        assert in_order is expect_order, (ordering, got)
        assert sum(len(v) for v in got.values()) == 12
        assert h.state.snapshot() == {}


def test_per_key_other_keys_are_not_held_back_by_a_slow_one(sim: ThreadedSimulator,
                                                            harnesses: list[Harness]) -> None:
    h = harness(harnesses, job_config(sim.url, capacity=8, ordering="per_key"))
    gate = gated(h, {"hot-v0"})
    h.element(0, versioned("hot", 0), offset=0, key=b"hot")
    h.element(0, versioned("hot", 1), offset=1, key=b"hot")
    h.element(0, versioned("cold", 0), offset=2, key=b"cold")
    only_gated_calls_left(h, 1)
    h.tick(0)
    assert [i for _, _, i in emitted(h)] == ["cold-v0"], "the cold key leaves, the hot key's v1 waits for its v0"
    assert h.function._order is not None and h.function._order.held == 1
    assert h.function._runner.has_slot(), "a held outcome takes no call slot"
    gate.set()
    h.end_of_input()
    assert per_key_ids(h)[b"hot"] == ["hot-v0", "hot-v1"]


def test_per_key_dead_letters_and_tombstones_wait_for_their_key(sim: ThreadedSimulator,
                                                                harnesses: list[Harness]) -> None:
    """A bad record and a tombstone are settled without a call, but under per_key they leave after
    the earlier record of their key, and wait in state (a checkpoint then holds them)."""
    h = harness(harnesses, job_config(sim.url, capacity=8, ordering="per_key",
                                      input={"tombstones": "forward"}))
    gate = gated(h, {"a-v0"})
    h.element(0, versioned("a", 0), offset=0, key=b"a")
    h.element(0, b"{not json", offset=1, key=b"a")
    h.element(0, None, offset=2, key=b"a")
    h.element(0, b"{not json", offset=3, key=b"b")  # nothing of b is out: at once
    assert emitted(h) == [(b"b", "dlq", None)]
    assert set(h.state.snapshot()[0]) == {"in:0:0", "in:0:1", "in:0:2"}
    gate.set()
    h.end_of_input()
    assert [(k, t) for k, t, _ in emitted(h)] == [(b"b", "dlq"), (b"a", "out"), (b"a", "dlq"), (b"a", "out")]
    tombstone = h.out[-1]
    assert tombstone[1] is None and bytes(tombstone[0]) == b"a"
    assert h.state.snapshot() == {}


def test_tombstones_forward_skip_or_dead_letter(sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    outcomes = {}
    for mode in ("forward", "skip", "dead-letter"):
        h = harness(harnesses, job_config(sim.url, input={"tombstones": mode}))
        h.element(0, None, offset=1, key=b"doc-1", headers={"trace": b"t1"})
        h.element(0, None, offset=2, key=None)  # nothing to delete: never forwarded
        h.end_of_input()
        outcomes[mode] = [(r[0], r[1] is None, r[2], r[3]) for r in h.out]
        assert h.state.snapshot() == {}
    assert outcomes["forward"][0] == (b"doc-1", True, "out", {"trace": b"t1"})
    assert [(t, n) for _, n, t, _ in outcomes["forward"][1:]] == [("dlq", False)]
    assert [t for _, _, t, _ in outcomes["skip"]] == []
    assert [t for _, _, t, _ in outcomes["dead-letter"]] == ["dlq", "dlq"]


def test_per_key_restore_reissues_pending_records_and_emits_them_in_offset_order(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    sim = make_sim(latency="fixed:300")
    config = job_config(sim.url, capacity=16, ordering="per_key")
    first = harness(harnesses, config)
    for version in range(3):
        for k in ("a", "b"):
            first.element(0, versioned(k, version), offset=version * 2 + (k == "b"), key=k.encode())
    checkpoint = first.state.snapshot()
    done_before = per_key_ids(first)
    first.close()
    assert checkpoint, "the 300 ms calls are still out at the snapshot"

    second = harness(harnesses, config, KeyedState(copy.deepcopy(checkpoint)))
    slow_first_versions(second, {"a-v0", "a-v1", "b-v0"}, delay_s=0.4)  # restored heads finish last
    for version in range(3, 5):
        for k in ("a", "b"):
            second.element(0, versioned(k, version), offset=version * 2 + (k == "b"), key=k.encode())
    second.end_of_input()
    after = per_key_ids(second)
    for k in ("a", "b"):
        whole = done_before.get(k.encode(), []) + after[k.encode()]
        assert whole == [f"{k}-v{v}" for v in range(5)], (k, done_before, after)
    assert second.metric("reissued") == sum(len(v) for v in checkpoint.values())


def drain_gated(h: Harness, n: int, pause_file: Any, timeout_s: float = 60) -> None:
    """Timers and ticks until `n` records are answered and the pause file is gone: what a gated
    stage does while its gate holds the input back."""
    def answered() -> bool:
        h.fire_due_processing_timers()
        h.tick(0)
        return len(h.bodies("out")) >= n

    wait_until(answered, timeout_s, 0.05, f"{n} records answered")
    wait_until(lambda: (h.fire_due_processing_timers(), not pause_file.exists())[-1], 30, 0.05,
               "the pause file removed")


def test_a_paused_budget_parks_records_closes_the_gate_and_resumes_by_itself(
        sim: ThreadedSimulator, harnesses: list[Harness], tmp_path: Any) -> None:
    """With a gate in front, a paused spend budget never holds the bundle: records that find no
    slot are parked (they are in state already), the pause file tells the gate to stop the input,
    and each new window starts the next call; the file goes when the budget is no longer paused."""
    h = harness(harnesses, job_config(sim.url, capacity=2, budget={"max_tokens_per_hour": 1, "window_s": 10}),
                gate_dir=str(tmp_path))
    now = [1_000_009.9]  # 0.1 s before a window ends: a waiting call looks again every 0.1 s
    h.function._client.budget._clock = lambda: now[0]  # windows roll only when the test says so
    pause_file = tmp_path / "0.closed"
    feed(h, range(6), buckets=1)  # returns though the budget admits one call per window
    assert pause_file.exists()
    assert len(h.function._parked) >= 3, "records beyond the waiting calls are parked"
    assert len(h.state.snapshot()[0]) + len(h.bodies("out")) == 6
    def answered(n: int) -> bool:
        h.fire_due_processing_timers()
        h.tick(0)
        return len(h.bodies("out")) >= n

    for window in range(1, 7):
        now[0] += 10
        wanted = min(6, window + 1)
        wait_until(lambda: answered(wanted), 30, 0.05, f"call {wanted} after the window rolled over")  # noqa: B023
    wait_until(lambda: (h.fire_due_processing_timers(), not pause_file.exists())[-1], 30, 0.05,
               "the pause file removed")
    assert Counter(b["id"] for b in h.bodies("out")) == Counter({f"id-{i}": 1 for i in range(6)})
    assert h.state.snapshot() == {}
    assert not h.function._parked


def test_a_stop_with_a_savepoint_opens_a_paused_gate_and_the_stage_parks_what_comes(
        sim: ThreadedSimulator, harnesses: list[Harness], tmp_path: Any) -> None:
    """A savepoint's barrier is aligned: it waits behind the input a closed gate holds back. Once
    `llmstream run` marks the stop (`jobs.graph.gate_operator.open_for_stop`), a paused stage opens its gate
    and parks what arrives (it is in state, so the savepoint holds it), starting nothing."""
    from jobs.graph import gate_operator as gate

    h = harness(harnesses, job_config(sim.url, capacity=2, budget={"max_tokens_per_hour": 1, "window_s": 10}),
                gate_dir=str(tmp_path))
    h.function._client.budget._clock = lambda: 1_000_005.0  # mid-window, and it never rolls over
    pause_file = tmp_path / "0.closed"
    feed(h, range(6), buckets=1)
    assert pause_file.exists()
    parked = len(h.function._parked)
    gate.open_for_stop(str(tmp_path))
    wait_until(lambda: (h.fire_due_processing_timers(), not pause_file.exists())[-1], 30, 0.05,
               "the gate opened for the stop")
    feed(h, range(6, 9), buckets=1)  # returns at once: parked, not started
    assert len(h.function._parked) == parked + 3 and not pause_file.exists()
    assert len(h.state.snapshot()[0]) + len(h.bodies("out")) == 9
    gate.forget(str(tmp_path))  # after the job
    assert not (tmp_path / "stopping").exists()


def test_a_fleet_with_every_circuit_open_parks_records_and_closes_the_gate(
        sim: ThreadedSimulator, harnesses: list[Harness], tmp_path: Any) -> None:
    """Every endpoint of a fleet failing: its circuit opens, the calls wait for a probe, and the
    stage parks what finds no slot and closes the gate instead of waiting in the bundle (a
    cooldown can last `max_cooldown_s`); when the endpoint answers again, every record is
    answered once, none dead-lettered, and the pause file is gone."""
    sim.admin({"error_rate": 1.0, "error_status": 500})
    h = harness(harnesses, job_config(sim.url, capacity=2,
                                      model={"endpoint": None, "model": "sim", "max_tokens": 8,
                                             "endpoints": [{"url": sim.url, "name": "only"}],
                                             "circuit": {"failures": 1, "cooldown_s": 0.2, "max_cooldown_s": 0.4}},
                                      retry={"max_attempts": 1000, "initial_backoff_s": 0.001, "max_backoff_s": 0.005}),
                gate_dir=str(tmp_path))
    pause_file = tmp_path / "0.closed"
    feed(h, range(6), buckets=1)  # returns: what finds no slot is parked
    assert pause_file.exists()
    assert h.function._parked, "records beyond the waiting calls are parked"
    sim.admin({})
    drain_gated(h, 6, pause_file)  # every record answered once the endpoint is back
    assert Counter(b["id"] for b in h.bodies("out")) == Counter({f"id-{i}": 1 for i in range(6)})
    assert h.bodies("dlq") == [] and h.state.snapshot() == {} and not h.function._parked


def test_a_binding_rate_limit_parks_records_and_closes_the_gate(
        sim: ThreadedSimulator, harnesses: list[Harness], tmp_path: Any) -> None:
    """At 120 requests a minute (2 a second) with 6 slots, 4 calls queue at the rate limit for 2 s:
    over `PAUSE_AFTER_S`, so what finds no slot is parked and the gate closed instead of waiting
    in the bundle; the limit then lets every record through once, at its pace."""
    h = harness(harnesses, job_config(sim.url, capacity=6, rate_limit={"requests_per_minute": 120}),
                gate_dir=str(tmp_path))
    pause_file = tmp_path / "0.closed"
    started = time.monotonic()
    feed(h, range(10), buckets=1)  # returns: what finds no slot is parked
    assert pause_file.exists()
    assert h.function._parked, "records beyond the queued calls are parked"
    drain_gated(h, 10, pause_file)
    assert time.monotonic() - started >= 3.5, "10 calls at 2 a second, 2 of them at once: ~4 s at least"
    assert Counter(b["id"] for b in h.bodies("out")) == Counter({f"id-{i}": 1 for i in range(10)})
    assert h.bodies("dlq") == [] and h.state.snapshot() == {} and not h.function._parked


def test_a_retry_after_from_the_one_server_parks_records_and_closes_the_gate(
        sim: ThreadedSimulator, harnesses: list[Harness], tmp_path: Any) -> None:
    """The server answers 429 with Retry-After: 3 to every call for a while: every call waits 3 s,
    so the stage parks what finds no slot and closes the gate; once the 429s end, every record
    is answered once, none dead-lettered."""
    sim.admin({"rate_limit_rate": 1.0, "retry_after_s": 3, "until_s": 2})
    h = harness(harnesses, job_config(sim.url, capacity=2, retry={"max_attempts": 50}), gate_dir=str(tmp_path))
    pause_file = tmp_path / "0.closed"
    feed(h, range(6), buckets=1)
    wait_until(lambda: (h.tick(0), pause_file.exists())[-1], 30, 0.05, "the gate closed by the Retry-After")
    assert h.function._parked, "records beyond the waiting calls are parked"
    drain_gated(h, 6, pause_file)
    assert Counter(b["id"] for b in h.bodies("out")) == Counter({f"id-{i}": 1 for i in range(6)})
    assert h.bodies("dlq") == [] and h.state.snapshot() == {} and not h.function._parked


def test_without_a_gate_a_paused_budget_still_waits_in_the_bundle(
        sim: ThreadedSimulator, harnesses: list[Harness], tmp_path: Any) -> None:
    """No gate (no `gate_dir`): the stage keeps its old backpressure, waiting for a slot."""
    h = harness(harnesses, job_config(sim.url, capacity=1, budget={"max_tokens_per_hour": 1, "window_s": 1}))
    feed(h, range(3), buckets=1)
    assert not h.function._parked and not list(tmp_path.iterdir())
    assert len(h.bodies("out")) >= 1
