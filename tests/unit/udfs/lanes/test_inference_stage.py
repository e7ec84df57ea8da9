"""The inference stage (`udfs.lanes.keyed.InferenceStage`) without a JVM: fake keyed state, timers
and runtime context (tests/support/fake_flink.py), the simulator over loopback HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from jobs.dev.simulator import ThreadedSimulator
from tests.support.fake_flink import Harness, KeyedState, record
from tests.support.waiting import wait_until
from udfs.config import JobConfig, config_from_dict
from udfs.lanes.keyed import EMIT_PERIOD_MS, FLUSH_AT


def job_config(endpoint: str, capacity: int = 8, **sections: dict[str, Any]) -> JobConfig:
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": endpoint, "model": "sim", "max_tokens": 8},
        "async": {"capacity": capacity, "request_timeout_s": 5.0, "record_deadline_s": 20.0},
        "retry": {"max_attempts": 3, "initial_backoff_s": 0.001, "max_backoff_s": 0.005},
        **sections,
    })


def feed(h: Harness, ids: range, buckets: int = 4) -> None:
    for i in ids:
        h.element(i % buckets, record(i), offset=i)


def test_every_record_is_answered_once_and_leaves_state(sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    h = Harness(job_config(sim.url))
    harnesses.append(h)
    feed(h, range(40))
    h.end_of_input()
    ids = Counter(b["id"] for b in h.bodies("out"))
    assert ids == Counter({f"id-{i}": 1 for i in range(40)})
    assert all(bytes(r[0]) == b"k" for r in h.out)
    assert h.state.snapshot() == {}
    assert h.metric("records_in") == 40 and h.metric("reissued") == 0


def test_without_flink_metrics_the_stage_runs_and_keeps_its_figures(sim: ThreadedSimulator,
                                                                     harnesses: list[Harness]) -> None:
    # `flink: {python.metric.enabled: false}` makes PyFlink's get_metrics_group() return None;
    # the stage once failed in `open` on it, and the job restarted forever.
    h = Harness(job_config(sim.url), metrics=False)
    harnesses.append(h)
    feed(h, range(10))
    h.end_of_input()
    assert sorted(b["id"] for b in h.bodies("out")) == sorted(f"id-{i}" for i in range(10))
    assert h.metric("records_in") == 10


def test_capacity_bounds_calls_in_flight(make_sim: Callable[..., ThreadedSimulator],
                                         harnesses: list[Harness]) -> None:
    sim = make_sim(latency="fixed:150")
    h = Harness(job_config(sim.url, capacity=3))
    harnesses.append(h)
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
    h = Harness(job_config(sim.url))
    harnesses.append(h)
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


def test_an_oversized_result_is_a_dead_letter_not_a_sink_failure(sim: ThreadedSimulator,
                                                                 harnesses: list[Harness]) -> None:
    """A result over limits.max_result_bytes would fail the Kafka sink and restart the job."""
    h = Harness(job_config(sim.url, limits={"max_result_bytes": 300}))
    harnesses.append(h)
    h.element(0, record(1), offset=1)
    h.end_of_input()
    assert h.bodies("out") == []
    (body,) = h.bodies("dlq")
    assert body["reason"] == "result_too_large" and body["id"] == "id-1"
    assert "limits.max_result_bytes (300)" in body["error"]
    assert h.state.snapshot() == {}


def test_bad_input_is_dead_lettered_at_once_and_never_stored(sim: ThreadedSimulator,
                                                              harnesses: list[Harness]) -> None:
    h = Harness(job_config(sim.url))
    harnesses.append(h)
    h.element(0, b"{not json", offset=7)
    h.element(0, None, offset=8, key=None)  # a null value with no key to delete
    reasons = [(b["reason"], b["source"]["offset"]) for b in h.bodies("dlq")]
    assert reasons == [("invalid_json", 7), ("null_value", 8)]
    assert h.state.snapshot() == {}
    assert h.metric("bad_input") == 2


def test_an_unexpected_exception_becomes_an_internal_error_dead_letter(
        sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    h = Harness(job_config(sim.url))
    harnesses.append(h)

    async def broken(request: Any) -> Any:
        raise ZeroDivisionError("a bug")

    h.function._client.complete = broken  # type: ignore[method-assign]
    h.element(2, record(5), offset=5)
    h.end_of_input()
    [body] = h.bodies("dlq")
    assert body["reason"] == "internal_error" and "ZeroDivisionError" in body["error"]
    assert body["id"] == "id-5" and body["original"]["value"] == record(5).decode()
    assert h.state.snapshot() == {}


def test_model_failure_is_dead_lettered_with_attempts(sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    sim.admin({"error_rate": 1.0, "error_status": 400})
    h = Harness(job_config(sim.url))
    harnesses.append(h)
    h.element(0, record(1), offset=1)
    h.end_of_input()
    [body] = h.bodies("dlq")
    assert (body["reason"], body["attempts"], body["last_status"]) == ("inference_rejected", 1, 400)


def test_a_snapshot_holds_exactly_what_is_not_emitted_and_a_restore_issues_it_again(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    sim = make_sim(latency="fixed:400")
    config = job_config(sim.url, capacity=16)
    first = Harness(config)
    harnesses.append(first)
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
    second = Harness(config, KeyedState(copy.deepcopy(checkpoint)))
    harnesses.append(second)
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
    first = Harness(config)
    harnesses.append(first)
    feed(first, range(4), buckets=1)
    checkpoint = first.state.snapshot()
    first.close()
    second = Harness(config, KeyedState(copy.deepcopy(checkpoint)))
    harnesses.append(second)
    second.element(0, record(100), offset=100)
    second.end_of_input()
    ids = Counter(b["id"] for b in second.bodies("out"))
    stored = {json.loads(v.value)["id"] for v in checkpoint[0].values()}
    assert ids == Counter({i: 1 for i in [*stored, "id-100"]})


def test_after_a_drain_a_restored_job_arms_the_flush_timer_again(sim: ThreadedSimulator,
                                                                 harnesses: list[Harness]) -> None:
    config = job_config(sim.url)
    first = Harness(config)
    harnesses.append(first)
    feed(first, range(8))
    first.end_of_input()  # drain: the flush timers fired and are gone
    assert first.timers.event == set()
    drained = first.state.snapshot()
    assert drained == {}
    first.close()

    second = Harness(config, KeyedState(drained))
    harnesses.append(second)
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
    first = Harness(config)
    harnesses.append(first)
    feed(first, range(8))
    checkpoint = first.state.snapshot()
    first.close()
    stored = {json.loads(v.value)["id"] for bucket in checkpoint.values() for v in bucket.values()}
    assert stored

    second = Harness(config, KeyedState(copy.deepcopy(checkpoint)))
    harnesses.append(second)

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
        h = Harness(job_config(sim.url, capacity=16, ordering=ordering))  # type: ignore[arg-type]
        harnesses.append(h)
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
    h = Harness(job_config(sim.url, capacity=8, ordering="per_key"))  # type: ignore[arg-type]
    harnesses.append(h)
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
    h = Harness(job_config(sim.url, capacity=8, ordering="per_key",  # type: ignore[arg-type]
                           input={"tombstones": "forward"}))
    harnesses.append(h)
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
        h = Harness(job_config(sim.url, input={"tombstones": mode}))
        harnesses.append(h)
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
    config = job_config(sim.url, capacity=16, ordering="per_key")  # type: ignore[arg-type]
    first = Harness(config)
    harnesses.append(first)
    for version in range(3):
        for k in ("a", "b"):
            first.element(0, versioned(k, version), offset=version * 2 + (k == "b"), key=k.encode())
    checkpoint = first.state.snapshot()
    done_before = per_key_ids(first)
    first.close()
    assert checkpoint, "the 300 ms calls are still out at the snapshot"

    second = Harness(config, KeyedState(copy.deepcopy(checkpoint)))
    harnesses.append(second)
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
    h = Harness(job_config(sim.url, capacity=2, budget={"max_tokens_per_hour": 1, "window_s": 10}),
                gate_dir=str(tmp_path))
    harnesses.append(h)
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

    h = Harness(job_config(sim.url, capacity=2, budget={"max_tokens_per_hour": 1, "window_s": 10}),
                gate_dir=str(tmp_path))
    harnesses.append(h)
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
    h = Harness(job_config(sim.url, capacity=2,
                           model={"endpoint": None, "model": "sim", "max_tokens": 8,
                                  "endpoints": [{"url": sim.url, "name": "only"}],
                                  "circuit": {"failures": 1, "cooldown_s": 0.2, "max_cooldown_s": 0.4}},
                           retry={"max_attempts": 1000, "initial_backoff_s": 0.001, "max_backoff_s": 0.005}),
                gate_dir=str(tmp_path))
    harnesses.append(h)
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
    h = Harness(job_config(sim.url, capacity=6, rate_limit={"requests_per_minute": 120}), gate_dir=str(tmp_path))
    harnesses.append(h)
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
    h = Harness(job_config(sim.url, capacity=2, retry={"max_attempts": 50}), gate_dir=str(tmp_path))
    harnesses.append(h)
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
    h = Harness(job_config(sim.url, capacity=1, budget={"max_tokens_per_hour": 1, "window_s": 1}))
    harnesses.append(h)
    feed(h, range(3), buckets=1)
    assert not h.function._parked and not list(tmp_path.iterdir())
    assert len(h.bodies("out")) >= 1
