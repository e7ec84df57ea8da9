"""Bench scenarios (j), (k), (l) (`jobs/dev/bench/scale_scenarios.py`) without a cluster: the jobs they
build, and their verdicts computed from given measurements. No timing here: the runs are the bench's."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from jobs.dev.bench import main as bench_main
from jobs.dev.bench import scale_scenarios as sc
from jobs.dev.bench.scale_scenarios import CurvePoint
from jobs.dev.bench.scaling import Ramp, job_config_data, parse_auto_line
from udfs.config import config_from_dict


def _point(p: int, rate: float, busy: float = 0.5) -> CurvePoint:
    return CurvePoint(p, rate, 0.5, 0.5, busy, 1.0)


def test_the_curve_is_judged_at_four_when_the_cpu_allows() -> None:
    points = [_point(1, 100), _point(2, 195), _point(4, 360), _point(8, 500, busy=0.97)]
    verdict = sc.curve_verdict(points)
    assert verdict["efficiency"] == {1: 1.0, 2: 0.975, 4: 0.9, 8: 0.625}
    assert verdict["met"] is True and verdict["judged_at"] == 4
    assert verdict["cpu_bound"] == [8]
    assert "CPU stops the curve at 8 subtasks (machine 97% busy, the job 0.5 cores of it" in verdict["detail"]


def test_a_point_the_cpu_stopped_is_not_held_against_the_job() -> None:
    points = [_point(1, 100), _point(2, 170), _point(4, 200, busy=0.95), _point(8, 210, busy=0.99)]
    verdict = sc.curve_verdict(points)
    assert verdict["judged_at"] == 2 and verdict["met"] is True  # 85% at 2; 4 had no CPU to spare
    assert "CPU stops the curve at 4" in verdict["detail"]
    slow = sc.curve_verdict([_point(1, 100), _point(2, 150), _point(4, 300)])
    assert slow["met"] is False and slow["judged_at"] == 4  # 75% at 4 with CPU to spare: not met
    none = sc.curve_verdict([_point(1, 100), _point(2, 150, busy=0.95)])
    assert none["met"] is None and "no point between 2 and 4" in none["detail"]


def test_time_to_the_new_limit_counts_from_the_join() -> None:
    # 80/s until t=100, then 100/s from t=100 to 130, then 160/s.
    samples = []
    count = 0
    for t in range(0, 200, 2):
        samples.append((float(t), count))
        count += 2 * (80 if t < 100 else 100 if t < 130 else 160)
    reached = sc.time_to_share(samples, since=100.0, limit_per_s=160.0, share=0.9)
    assert reached is not None and 130 < 100 + reached <= 142
    assert sc.time_to_share(samples[:60], since=100.0, limit_per_s=160.0, share=0.9) is None
    assert sc.doubling_verdict(reached, True)["met"] is True
    assert sc.doubling_verdict(reached, False)["met"] is False
    assert sc.doubling_verdict(130.0, True)["met"] is False
    assert sc.doubling_verdict(None, True)["met"] is False


def test_a_busy_time_policy_asks_for_subtasks_a_model_bound_job_cannot_use() -> None:
    # One subtask 100% busy at 40/s while 120/s arrive: 120 / (40 x 0.7) -> 5 subtasks.
    assert sc.busy_time_parallelism(1, 1000.0, 120.0, 40.0) == 5
    # Half busy, the input met: no more than now.
    assert sc.busy_time_parallelism(2, 500.0, 40.0, 40.0) == 2
    assert sc.busy_time_parallelism(1, 0.0, 120.0, 40.0) is None


def test_the_saturation_target_wants_no_scale_up_and_one_call_a_record() -> None:
    assert sc.saturation_verdict(0, 1.004)["met"] is True
    assert sc.saturation_verdict(1, 1.0)["met"] is False
    assert sc.saturation_verdict(0, 1.05)["met"] is False
    assert sc.saturation_verdict(0, None)["met"] is False


def test_the_auto_lines_parse_into_decisions() -> None:
    up = parse_auto_line("llmstream: 1 subtasks: more subtasks would help: yes, about 80/s each; -> 3 "
                         "(pipeline-bound, lag growing +90/s)")
    assert up is not None and (up.current, up.kind, up.target) == (1, "pipeline-bound", 3)
    hold = parse_auto_line("llmstream: 2 subtasks: more subtasks would help: no: the model is the limit — it answers "
                           "429s; add model replicas (or raise its rate limit); hold (model-bound: ...)")
    assert hold is not None and (hold.kind, hold.target) == ("model-bound", None)
    assert parse_auto_line("llmstream: scaling job (abc) by its verdict every 10 s") is None


def test_the_ramp_holds_its_end_rate() -> None:
    ramp = Ramp(producer=None, start=20, end=120, seconds=100, hold_s=50)  # type: ignore[arg-type]
    assert ramp.due(0) == 0
    assert ramp.due(100) == 20 * 100 + 100 * 100 // 2
    assert ramp.due(150) == ramp.due(100) + 120 * 50
    assert ramp.due(1000) == ramp.due(150)


@pytest.mark.parametrize("spec", [sc.curve_job(8, "http://127.0.0.1:1/v1"),
                                  sc.doubling_job(["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]),
                                  sc.saturation_job("http://127.0.0.1:3/v1")])
def test_each_scenario_builds_a_valid_job(spec: sc.JobSpec, tmp_path: Path) -> None:
    data = job_config_data(tmp_path, "127.0.0.1:9092", "t", model=spec.model, capacity=spec.capacity,
                           inference=spec.inference)
    config = config_from_dict(data)
    assert config.async_.capacity == spec.capacity
    assert config.parallelism.of("inference") == spec.inference
    assert config.kafka.input_topic == "t-in" and config.name == "llmstream-t"


def test_the_auto_scaled_rig_has_a_slot_for_every_subtask_its_jobs_may_run() -> None:
    """(k) and (l) share one cluster shape: with fewer slots than the subtasks a job is submitted
    at, or than `--max`, the adaptive scheduler would run it at fewer than the scenario says."""
    most = max(sc.doubling_job(["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]).inference,
               sc.saturation_job("http://127.0.0.1:3/v1").inference,
               int(sc.AUTO_FLAGS[sc.AUTO_FLAGS.index("--max") + 1]))
    assert sc.AUTO_RIG["taskmanager.numberOfTaskSlots"] == most == 4


def test_the_doubling_job_lists_both_endpoints_at_their_servers_slots(tmp_path: Path) -> None:
    spec = sc.doubling_job(["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"])
    config = config_from_dict(job_config_data(tmp_path, "127.0.0.1:9092", "t", model=spec.model,
                                              capacity=spec.capacity, inference=spec.inference))
    assert [e.max_concurrency for e in config.model.endpoints] == list(sc.FLEET_SLOTS)
    assert config.model.circuit.max_cooldown_s == 10.0
    # One subtask fills one endpoint (twice its slots, admission to emission), not the doubled fleet.
    assert config.async_.capacity == 2 * sc.FLEET_SLOTS[0] < 2 * sum(sc.FLEET_SLOTS)


def test_bench_takes_the_scaling_scenarios_by_letter() -> None:
    parser = argparse.ArgumentParser()
    bench_main.add_arguments(parser)
    assert parser.parse_args(["--scenarios", "j,k,l"]).scenarios == ["j", "k", "l"]
    assert parser.parse_args(["--scenarios", "a,j"]).scenarios == ["a", "j"]


def test_the_report_shows_each_scenario_with_its_verdict() -> None:
    points = [_point(1, 100), _point(2, 190)]
    text = sc.render([{"scenario": "j", "points": [vars(p) for p in points], "verdict": sc.curve_verdict(points)},
                      {"scenario": "l", "error": "RuntimeError: boom"}], "llmstream bench --scenarios j,l")
    assert "| 2 | 190.0 | 95% |" in text
    assert "## (l) model saturates, input grows" in text and "**not judged** — RuntimeError: boom" in text


def test_calls_a_record_count_the_results_completed_in_the_window() -> None:
    """Results are taken by their completion time, not by when their commit or a metric showed them."""
    bodies = [{"id": f"r{i}", "attempts": 2 if i == 3 else 1, "timestamps": {"completed": 1_000 + 100 * i}}
              for i in range(10)]
    bodies.append({"id": "late", "attempts": 1, "timestamps": {"completed": "1970-01-01T00:00:05Z"}})
    assert sc.completed_between(bodies, 1_000, 1_500) == (5, 6)   # r0..r4, r3 twice tried
    first = {"at": 10.0, "wall_ms": 1_000, "served": 100, "rejected": 4}
    last = {"at": 15.0, "wall_ms": 1_500, "served": 105, "rejected": 6}
    calls = sc.calls_in(first, last, bodies)
    assert calls["results"] == 5 and calls["calls_per_record"] == 1.0
    assert calls["sent_per_record"] == 1.4 and calls["attempts_per_record"] == 1.2 and calls["rejected_per_s"] == 0.4


def test_a_hold_that_quotes_an_earlier_scale_up_is_a_hold() -> None:
    hold = parse_auto_line("llmstream: 3 subtasks: more subtasks would help: yes, about 52/s each; hold (pipeline-bound, "
                           "but the last scale-up, 2 -> 3, added -2/s of the 79/s expected: the limit is past the job)")
    assert hold is not None and (hold.current, hold.kind, hold.target) == (3, "pipeline-bound", None)
