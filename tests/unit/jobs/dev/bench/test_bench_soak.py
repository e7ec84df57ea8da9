"""The soak's schedule and arithmetic (`jobs/dev/bench/soak.py`), without services: the faults land
one at a time inside the window, every kind comes up in a long soak, the slopes are least squares
per TaskManager process, and the report says when ids were lost."""

from __future__ import annotations

import itertools

import pytest

from jobs.dev.bench.soak import (
    FAULT_SECONDS,
    KINDS,
    RECOVERY_SECONDS,
    SETTLE_S,
    WARMUP_S,
    Sample,
    SoakResult,
    chaos_schedule,
    fault_kinds,
    fault_traffic,
    segment_slopes,
    slope_per_hour,
)


@pytest.mark.parametrize("seed", [1, 2, 3, 42])
def test_faults_land_one_at_a_time_inside_the_window(seed: int) -> None:
    events = chaos_schedule(30, seed)
    assert events, "a 30-minute soak has faults"
    assert all(WARMUP_S <= e.at_s < 30 * 60 - SETTLE_S for e in events)
    for before, after in itertools.pairwise(events):
        assert after.at_s >= before.at_s + FAULT_SECONDS[before.kind] + RECOVERY_SECONDS[before.kind]
    assert {e.kind for e in events} == set(KINDS), "30 minutes hold a round of every kind"
    assert all((e.endpoint is None) == (e.kind in ("TaskManager SIGKILL", "broker restart")) for e in events)
    assert chaos_schedule(30, seed) == events, "a seed gives the same schedule"


def test_a_soak_draws_only_the_faults_asked_for() -> None:
    kinds = fault_kinds("endpoint-kill,endpoint-500,endpoint-429,broker-restart")
    events = chaos_schedule(30, 1, kinds_allowed=kinds)
    assert events and "TaskManager SIGKILL" not in {e.kind for e in events}
    assert {e.kind for e in events} == set(kinds)
    assert chaos_schedule(30, 1, kinds_allowed=fault_kinds("none")) == []
    assert fault_kinds("all") == KINDS
    with pytest.raises(ValueError, match="tm-kill"):
        fault_kinds("endpoint-kill,tm-kill")


def test_a_soak_too_short_for_faults_has_none() -> None:
    assert chaos_schedule((WARMUP_S + SETTLE_S) / 60, 1) == []


def test_slope_is_least_squares_per_hour() -> None:
    assert slope_per_hour([(t, 100 + t / 60) for t in range(0, 600, 10)]) == pytest.approx(60.0)
    assert slope_per_hour([(t, 5.0) for t in range(0, 600, 10)]) == pytest.approx(0.0)
    assert slope_per_hour([(0, 1.0), (10, 2.0)]) is None, "too few points to say"


def test_slopes_are_per_taskmanager_after_its_warmup() -> None:
    first = [Sample(t, 11, 500 + (1000 if t < WARMUP_S else t / 3600 * 20), 1.0) for t in range(0, 1200, 10)]
    second = [Sample(t, 22, 800.0, 2.0) for t in range(1200, 2400, 10)]
    rows = segment_slopes(first + second, lambda s: s.taskmanager_rss_mb)
    assert [r["pid"] for r in rows] == [11, 22]
    assert rows[0]["slope_per_h"] == pytest.approx(20.0, abs=0.1), "the warm-up's jump is left out"
    assert rows[1]["slope_per_h"] == pytest.approx(0.0)
    assert rows[0]["later_slope_per_h"] == pytest.approx(20.0, abs=0.1), "a steady rise: both halves alike"
    assert rows[1]["minutes"] == pytest.approx((2390 - 1200 - WARMUP_S) / 60, abs=0.1)


def test_the_report_says_when_ids_were_lost() -> None:
    clean = SoakResult(30, 60, 1, produced=100, answered=98, dead_lettered=2, drained_s=3.0)
    assert clean.exactly_once and "**every id exactly once**" in clean.markdown()
    lossy = SoakResult(30, 60, 1, produced=100, answered=97, dead_lettered=2, lost=1, drained_s=900.0)
    assert not lossy.exactly_once and "**NOT exactly once**" in lossy.markdown() and "1 lost" in lossy.markdown()
    doubled = SoakResult(30, 60, 1, produced=100, answered=100, duplicates=1, drained_s=3.0)
    assert "**NOT exactly once**" in doubled.markdown()
    failed = SoakResult(30, 60, 1, produced=100, answered=100, error="TimeoutError: 3 ids unseen")
    assert not failed.exactly_once and "TimeoutError" in failed.markdown()
    stopped = SoakResult(3, 60, 1, produced=648, answered=568, lost=80, error="interrupted 11 s into the soak")
    assert "**not finished**" in stopped.markdown() and "80 not seen yet" in stopped.markdown()


def test_the_report_tells_refused_triggers_from_failed_checkpoints() -> None:
    result = SoakResult(30, 60, 1, produced=10, answered=10, checkpoints={
        "completed": 300, "failed": 4, "failures": {"Checkpoint expired before completing.": 1},
        "failed_untriggered": 3, "seen": 300, "p50_ms": 150, "p99_ms": 900, "max_ms": 1200})
    text = result.markdown()
    assert "1× Checkpoint expired before completing.; 3× refused at trigger, not counted by Flink" in text
    assert "150 / 900 / 1200 ms" in text


def test_a_fault_s_traffic_share_quiet_and_rejoin_times() -> None:
    """Endpoint 1 of two, killed at 10 s for 10 s: it takes 50 requests a second until 11 s, then
    only a probe at 15 s; after the fault its answers grow again from 21 s."""
    traffic = []
    requests, answers = [0, 0], [0, 0]
    for tenth in range(0, 300, 5):
        at = tenth / 10
        step = 0.5
        requests[0] += int(50 * step)
        answers[0] += int(50 * step)
        if at <= 11 or at >= 21:
            requests[1] += int(50 * step)
            if at < 10 or at >= 21:
                answers[1] += int(50 * step)
        elif at == 15:
            requests[1] += 1
        traffic.append((at, list(requests), list(answers)))
    seen = fault_traffic(traffic, 10.0, 20.0, 1)
    assert seen["quiet_after_s"] == 1.0  # its last requests are counted by 11 s: then only the probe
    assert seen["requests_share"] == round(1 / 401, 4)  # 12..20 s: the probe against endpoint 0's 400
    assert seen["answers_share"] == 0.0
    assert seen["answering_after_s"] == 1.0
    assert seen["answers_per_s"] == 50.0  # endpoint 0's, alone
    assert fault_traffic(traffic, 25.0, 28.0, 0)["quiet_after_s"] is None  # never quiet
    assert fault_traffic([], 10.0, 20.0, 1) == {"requests_share": None, "answers_share": None, "answers_per_s": None,
                                                 "quiet_after_s": None, "answering_after_s": None}


def test_the_report_gives_each_endpoint_fault_its_traffic() -> None:
    result = SoakResult(minutes=10, rate_per_s=150, seed=1, faults=["endpoint killed", "broker restart"])
    result.events = [
        {"at_s": 100.0, "kind": "endpoint killed", "endpoint": 0, "duration_s": 30.0, "lasted_s": 30.2,
         "requests_share": 0.0, "answers_share": 0.0, "answers_per_s": 95.5, "quiet_after_s": 0.5,
         "answering_after_s": 4.0},
        {"at_s": 200.0, "kind": "broker restart", "endpoint": None, "duration_s": 15.0, "lasted_s": 27.0}]
    text = result.markdown()
    assert "| 100 | endpoint killed | 0 | 30 | 0.0% | 0.0% | 95.5 (100) | 0.5 | 4 |" in text, text
    assert "| 200 | broker restart |  | 27 | – | – | – | – | – |" in text, text
