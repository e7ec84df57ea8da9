"""The scaling verdict (`jobs/observe/verdict.py`) on synthetic status figures."""

from __future__ import annotations

from typing import Any

from jobs.observe.verdict import (
    INPUT_BOUND,
    MODEL_BOUND,
    PIPELINE_BOUND,
    UNKNOWN,
    scaling_verdict,
)


def fig(*, at: float = 100.0, lag: int = 0, out_per_s: float = 100.0, admitted: int = 10, capacity: int = 64,
        limit: int | None = None, rate_limited: int = 0, requests: int = 1000, p50: int = 100,
        endpoints: dict[str, dict[str, Any]] | None = None, state: str = "RUNNING", processed: int = 1000,
        job_id: str = "j1") -> dict[str, Any]:
    """Figures as `jobs.observe.figures.figures` makes them, the fields the verdict reads."""
    return {
        "at": at,
        "job": {"id": job_id, "state": state},
        "input": {"lag_records": lag},
        "records": {"processed": processed, "out_per_s": out_per_s},
        "calls": {"admitted": admitted, "capacity": capacity, "in_flight": admitted,
                  "concurrency_limit": capacity if limit is None else limit,
                  "rate_limited": rate_limited, "requests": requests, "latency_p50_ms": p50},
        "endpoints": endpoints or {},
    }


def test_no_lag_is_input_bound() -> None:
    v = scaling_verdict(fig(lag=50, at=110), fig(lag=40), subtasks=2)
    assert v.verdict == INPUT_BOUND and v.more_subtasks_help is False
    assert "input is the limit" in v.summary()


def test_lag_growing_with_calls_below_the_limit_is_pipeline_bound() -> None:
    v = scaling_verdict(fig(at=110, lag=30_000, admitted=20, out_per_s=400),
                        fig(at=100, lag=25_000, admitted=22), subtasks=2)
    assert v.verdict == PIPELINE_BOUND and v.more_subtasks_help is True
    assert v.lag_growing is True and v.lag_change_per_s == 500.0
    assert v.per_subtask_per_s == 200.0
    assert v.summary() == "more subtasks would help: yes, about 200/s each"
    assert any("below the limit of 64" in e for e in v.evidence)


def test_full_stage_without_model_strain_is_pipeline_bound() -> None:
    v = scaling_verdict(fig(at=110, lag=30_000, admitted=64), fig(lag=30_000, admitted=64), subtasks=1)
    assert v.verdict == PIPELINE_BOUND
    assert any("stage is full" in e for e in v.evidence)


def test_at_the_aimd_limit_is_model_bound() -> None:
    v = scaling_verdict(fig(lag=30_000, admitted=20, limit=20), subtasks=2)
    assert v.verdict == MODEL_BOUND and v.more_subtasks_help is False
    assert "AIMD limit 20" in v.evidence[0]
    assert v.summary() == ("more subtasks would help: no: the model is the limit — calls at the AIMD limit its "
                           "429/503 answers set; add model replicas (or raise its rate limit)")


def test_429s_between_two_figures_are_model_bound() -> None:
    v = scaling_verdict(fig(at=115, lag=30_000, admitted=10, rate_limited=50, requests=1500),
                        fig(at=100, lag=30_000, admitted=10, rate_limited=0, requests=1000), subtasks=1)
    assert v.verdict == MODEL_BOUND
    assert v.evidence[0] == "50 429s in the last 15 s (10% of calls)"


def test_old_429s_alone_do_not_make_a_verdict_model_bound() -> None:
    v = scaling_verdict(fig(at=110, lag=30_000, rate_limited=500), fig(lag=28_000, rate_limited=500), subtasks=1)
    assert v.verdict == PIPELINE_BOUND


def test_latency_rising_with_load_is_model_bound() -> None:
    v = scaling_verdict(fig(at=110, lag=30_000, admitted=40, p50=300), fig(lag=28_000, admitted=20, p50=100),
                        subtasks=1)
    assert v.verdict == MODEL_BOUND
    assert "latency p50 rose from 100 to 300 ms" in v.evidence[0]


def test_the_one_endpoint_of_a_fleet_at_its_limit_is_named() -> None:
    endpoints = {"gpu-a": {"in_flight": 32, "limit": 32, "circuit": "closed", "rate_limited": 3}}
    before = {"gpu-a": {"in_flight": 30, "limit": 32, "circuit": "closed", "rate_limited": 0}}
    v = scaling_verdict(fig(at=110, lag=9_000, endpoints=endpoints), fig(lag=9_000, endpoints=before), subtasks=2)
    assert v.verdict == MODEL_BOUND and v.endpoints_at_limit == ("gpu-a",)
    assert v.summary() == ("more subtasks would help: no: the model is the limit — endpoint gpu-a at its limit; "
                           "add replicas there")


def test_one_saturated_endpoint_while_the_others_have_room_is_not_model_bound() -> None:
    endpoints = {"gpu-a": {"in_flight": 32, "limit": 32, "circuit": "closed"},
                 "gpu-b": {"in_flight": 2, "limit": 32, "circuit": "closed"}}
    v = scaling_verdict(fig(at=110, lag=9_000, endpoints=endpoints), fig(lag=8_000, endpoints=endpoints), subtasks=1)
    assert v.verdict == PIPELINE_BOUND
    assert v.endpoints_at_limit == ("gpu-a",) and "the other endpoints have room" in v.evidence


def test_an_open_circuit_on_every_endpoint_is_model_bound() -> None:
    endpoints = {"gpu-a": {"in_flight": 0, "limit": 8, "circuit": "open"}}
    v = scaling_verdict(fig(lag=9_000, admitted=0, endpoints=endpoints), subtasks=1)
    assert v.verdict == MODEL_BOUND and "circuit open" in v.evidence[0]


def test_idle_when_fewer_subtasks_would_hold_the_calls() -> None:
    v = scaling_verdict(fig(lag=0, admitted=5, capacity=256), subtasks=4)
    assert v.verdict == INPUT_BOUND and v.idle
    assert scaling_verdict(fig(lag=0, admitted=5, capacity=64), subtasks=1).idle is False
    assert scaling_verdict(fig(lag=0, admitted=150, capacity=256), subtasks=4).idle is False


def test_unknown_when_not_running_or_not_started() -> None:
    assert scaling_verdict(fig(state="RESTARTING"), subtasks=1).verdict == UNKNOWN
    assert scaling_verdict(fig(processed=0), subtasks=1).summary() == (
        "more subtasks would help: unknown (nothing processed yet)")


def test_figures_of_another_job_or_too_close_give_no_trend() -> None:
    assert scaling_verdict(fig(at=110, lag=30_000), fig(lag=0, job_id="j0"), subtasks=1).lag_change_per_s is None
    assert scaling_verdict(fig(at=102, lag=30_000), fig(lag=0), subtasks=1).lag_growing is None


def test_a_restart_between_figures_is_no_429_burst() -> None:
    v = scaling_verdict(fig(at=110, lag=30_000, rate_limited=0, requests=10),
                        fig(lag=30_000, rate_limited=400, requests=5000), subtasks=1)
    assert v.verdict == PIPELINE_BOUND


def test_to_dict_is_json_ready() -> None:
    import json

    data = scaling_verdict(fig(lag=30_000, limit=20, admitted=20), subtasks=1).to_dict()
    assert json.loads(json.dumps(data))["verdict"] == MODEL_BOUND
    assert data["summary"].startswith("more subtasks would help: no")


def test_the_provider_batch_lane_is_paced_by_the_provider() -> None:
    current = fig(lag=5_000)
    current["batch_lane"] = {"batches_open": 3}
    v = scaling_verdict(current, subtasks=1)
    assert v.verdict == MODEL_BOUND and "3 open" in v.evidence[0]
    assert "batch API sets the pace" in v.summary()


def sub(index: int, *, processed: int, admitted: int, limit: int, rate_limited: int = 0,
        out_per_s: float = 50.0) -> dict[str, Any]:
    return {"index": index, "records": {"processed": processed, "out_per_s": out_per_s},
            "calls": {"admitted": admitted, "capacity": 16, "concurrency_limit": limit,
                      "rate_limited": rate_limited, "requests": processed, "latency_p50_ms": 100},
            "endpoints": {}}


def test_each_subtask_is_judged_on_its_own_calls_and_its_share_of_the_lag() -> None:
    from jobs.observe.verdict import subtask_summary, subtask_verdicts

    now = fig(at=110, lag=20_000, admitted=24, capacity=32)
    now["subtasks"] = [sub(0, processed=3000, admitted=8, limit=8, rate_limited=30),
                       sub(1, processed=1000, admitted=16, limit=16)]
    before = fig(at=100, lag=19_000, admitted=24, capacity=32)
    before["subtasks"] = [sub(0, processed=2500, admitted=8, limit=8, rate_limited=10),
                          sub(1, processed=800, admitted=16, limit=16)]
    verdicts = subtask_verdicts(now, before)
    assert [v["subtask"] for v in verdicts] == [0, 1]
    first, second = verdicts
    assert first["verdict"] == MODEL_BOUND and any("20 429s" in e for e in first["evidence"])
    assert first["share"] == 0.75 and first["lag_records"] == 15_000   # 3/4 of the records, 3/4 of the lag
    assert second["verdict"] == PIPELINE_BOUND and second["lag_records"] == 5_000
    assert second["lag_change_per_s"] == 25.0                          # (5,000 - 4,750) / 10 s
    assert subtask_summary(verdicts) == "0 model-bound, 1 pipeline-bound"
    same = [dict(second, subtask=0), second]
    assert subtask_summary(same) is None


def test_one_subtask_has_no_verdict_of_its_own() -> None:
    from jobs.observe.verdict import subtask_verdicts

    one = fig(lag=100)
    one["subtasks"] = []
    assert subtask_verdicts(one) == []
    assert subtask_verdicts(fig(lag=100)) == []
