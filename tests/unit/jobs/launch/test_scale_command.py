"""`llmstream scale` (`jobs/launch/scale.py`) against a fake REST API: which vertex each lane scales,
the adaptive-scheduler check, the requirements it declares, and the `--auto` policy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jobs.clients.flink_rest import FlinkRest
from jobs.launch import scale
from jobs.launch.scale import (
    Vertex,
    bucket_shares,
    decide,
    plan_changes,
    requirements_for,
)
from jobs.observe.verdict import INPUT_BOUND, MODEL_BOUND, PIPELINE_BOUND, Verdict
from tests.support.configs import minimal_config
from udfs.errors import ConfigError

SOURCE = Vertex("s1", "Source: kafka_requests -> Calc[2] -> TableToDataStream", 1, 128, "RUNNING")
TICKS = Vertex("t1", "Source: inference_ticks[4] -> Calc[5] -> ticks: TableToDataStream", 1, 128, "RUNNING")
INFERENCE = Vertex("i1", "inference -> DataStreamToTable -> kafka_results[9]: Writer -> kafka_results[9]: Committer",
                   1, 128, "RUNNING")
VECTORIZED = Vertex("v1", "Source: kafka_requests -> Calc[2] -> PythonCalc[3] -> kafka_results[5]: Writer", 1, 128,
                    "RUNNING")


class FakeRest(FlinkRest):
    """The REST calls `scale` makes, answered from a list of vertices; a PUT of the requirements makes
    the vertices run at their upper bounds at once."""

    def __init__(self, vertices: list[Vertex], scheduler: str = "Adaptive", slots: int = 4,
                 mode: str | None = None) -> None:
        super().__init__("http://fake:8081")
        self.vertices = {v.id: v for v in vertices}
        self.scheduler_type = scheduler
        self.mode = mode
        self.state = "RUNNING"
        self.slots = slots
        self.puts: list[dict[str, Any]] = []

    def rest(self, path: str, *, method: str = "GET", body: Any = None, timeout: float = 10.0) -> Any:
        if path == "/overview":
            return {"slots-total": self.slots}
        if path == "/jobmanager/config":
            return [{"key": "jobmanager.scheduler", "value": self.scheduler_type}] + (
                [{"key": "scheduler-mode", "value": self.mode}] if self.mode else [])
        if path.endswith("/resource-requirements") and method == "PUT":
            self.puts.append(json.loads(json.dumps(body)))
            for vertex_id, req in body.items():
                v = self.vertices[vertex_id]
                self.vertices[vertex_id] = Vertex(v.id, v.name, req["parallelism"]["upperBound"], v.max_parallelism,
                                                  "RUNNING")
            return None
        if path.endswith("/resource-requirements"):
            return {v.id: {"parallelism": {"lowerBound": 1, "upperBound": v.parallelism}} for v in self.vertices.values()}
        if path.startswith("/jobs/j1"):
            return {"state": self.state, "schedulerType": self.scheduler_type,
                    "vertices": [{"id": v.id, "name": v.name, "parallelism": v.parallelism,
                                  "maxParallelism": v.max_parallelism, "status": v.status}
                                 for v in self.vertices.values()]}
        raise AssertionError(f"unexpected {method} {path}")


def test_keyed_inference_scales_the_inference_vertex_with_its_chained_sink() -> None:
    [change] = plan_changes(minimal_config(), [SOURCE, TICKS, INFERENCE], inference=2)
    assert change.vertex == INFERENCE and change.to == 2
    assert "sink is chained" in change.note


def test_vectorized_inference_scales_the_source_vertex_and_says_so() -> None:
    config = minimal_config(lane="vectorized")
    [change] = plan_changes(config, [VECTORIZED], inference=3)
    assert change.vertex == VECTORIZED and "PythonCalc" in change.note
    with pytest.raises(ConfigError, match="one vertex"):
        plan_changes(config, [VECTORIZED], inference=3, source=2)


def test_beyond_max_parallelism_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--inference: 200 is above the vertex's max parallelism 128"):
        plan_changes(minimal_config(), [SOURCE, INFERENCE], inference=200)


def test_requirements_keep_the_other_vertices_as_they_run() -> None:
    changes = plan_changes(minimal_config(), [SOURCE, TICKS, INFERENCE], inference=2)
    assert requirements_for({"s1": (1, 1), "t1": (1, 1), "i1": (1, 1)}, [SOURCE, TICKS, INFERENCE], changes) == {
        "s1": (1, 1), "t1": (1, 1), "i1": (1, 2)}


def test_the_buckets_of_one_subtask_fall_evenly_on_two_and_unevenly_on_three_or_four() -> None:
    # bucket_keys(1) at the default max parallelism 128 are 0, 1, 2, 3 (jobs/graph/pipeline.py).
    assert bucket_shares([0, 1, 2, 3], 128, 2) == [0.5, 0.5]
    assert bucket_shares([0, 1, 2, 3], 128, 3) == [0.25, 0.25, 0.5]
    assert bucket_shares([0, 1, 2, 3], 128, 4) == [0.0, 0.5, 0.0, 0.5]


def test_the_warning_says_how_the_records_fall(monkeypatch: pytest.MonkeyPatch) -> None:
    from jobs.graph import pipeline

    monkeypatch.setattr(pipeline, "bucket_keys", lambda parallelism, max_p=None: [0, 1, 2, 3])
    config = minimal_config()
    warning = scale.bucket_warning(config, scale.Change(INFERENCE, 4))
    assert warning is not None and "unevenly (0%, 50%, 0%, 50%)" in warning
    assert "parallelism.inference: 4" in warning
    assert "unevenly (25%, 25%, 50%)" in (scale.bucket_warning(config, scale.Change(INFERENCE, 3)) or "")
    assert scale.bucket_warning(config, scale.Change(INFERENCE, 2)) is None


def test_apply_declares_and_waits(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale, "bucket_warning", lambda config, change: None)
    rest = FakeRest([SOURCE, TICKS, INFERENCE])
    result = scale.apply(rest, "j1", minimal_config(), inference=2, wait_s=5)
    assert rest.puts == [{"s1": {"parallelism": {"lowerBound": 1, "upperBound": 1}},
                          "t1": {"parallelism": {"lowerBound": 1, "upperBound": 1}},
                          "i1": {"parallelism": {"lowerBound": 1, "upperBound": 2}}}]
    assert result[INFERENCE.name] == 2
    assert "inference runs at 2 subtasks (was 1)" in capsys.readouterr().out


def test_apply_refuses_more_subtasks_than_slots() -> None:
    with pytest.raises(scale.ClusterError, match="5 subtasks need 5 slots, and the cluster .* has 4"):
        scale.apply(FakeRest([SOURCE, INFERENCE]), "j1", minimal_config(), inference=5, wait_s=1)


def test_a_job_that_fails_while_rescaling_ends_the_wait() -> None:
    rest = FakeRest([SOURCE, INFERENCE])
    rest.state = "FAILED"
    with pytest.raises(scale.ClusterError, match="is FAILED while rescaling"):
        scale.apply(rest, "j1", minimal_config(), inference=2, wait_s=30, say=False)


def test_a_cluster_without_the_adaptive_scheduler_names_upgrade() -> None:
    with pytest.raises(scale.NotAdaptive, match="llmstream upgrade") as raised:
        scale.check_adaptive(FakeRest([INFERENCE], scheduler="Default"), "j1")
    assert raised.value.exit_code == 2
    with pytest.raises(scale.NotAdaptive, match="reactive mode"):
        scale.check_adaptive(FakeRest([INFERENCE], mode="reactive"), "j1")
    scale.check_adaptive(FakeRest([INFERENCE]), "j1")


def verdict(kind: str, *, growing: bool | None = None, per: float | None = 100.0, growth: float | None = None,
            idle: bool = False) -> Verdict:
    return Verdict(kind, kind == PIPELINE_BOUND, 2, per_subtask_per_s=per, lag_growing=growing,
                   lag_change_per_s=growth, idle=idle)


def test_auto_scales_up_to_what_the_input_needs_when_pipeline_bound_and_lag_grows() -> None:
    up = decide(verdict(PIPELINE_BOUND, growing=True, growth=250.0), current=2, minimum=1, maximum=8,
                since_change_s=600, cooldown_s=120)
    assert up.target == 5  # (2 x 100 + 250) / 100 -> 5
    assert decide(verdict(PIPELINE_BOUND, growing=True, growth=250.0), current=2, minimum=1, maximum=3,
                  since_change_s=600, cooldown_s=120).target == 3


def test_auto_never_scales_up_a_model_bound_job() -> None:
    hold = decide(verdict(MODEL_BOUND, growing=True, growth=500.0), current=2, minimum=1, maximum=8,
                  since_change_s=600, cooldown_s=120)
    assert hold.target == 2 and "model-bound" in hold.reason


def test_auto_holds_without_lag_growth_and_within_the_cooldown() -> None:
    assert decide(verdict(PIPELINE_BOUND, growing=False), current=2, minimum=1, maximum=8, since_change_s=600,
                  cooldown_s=120).target == 2
    assert decide(verdict(PIPELINE_BOUND, growing=True, growth=500.0), current=2, minimum=1, maximum=8,
                  since_change_s=30, cooldown_s=120).target == 2


def test_auto_scales_down_one_when_idle_but_not_below_min() -> None:
    assert decide(verdict(INPUT_BOUND, idle=True), current=3, minimum=1, maximum=8, since_change_s=600,
                  cooldown_s=120).target == 2
    assert decide(verdict(INPUT_BOUND, idle=True), current=2, minimum=2, maximum=8, since_change_s=600,
                  cooldown_s=120).target == 2
    assert decide(verdict(INPUT_BOUND), current=1, minimum=2, maximum=8, since_change_s=0, cooldown_s=120).target == 2


def test_a_scale_up_that_added_no_output_blocks_the_next() -> None:
    """(k)'s second run: 2 -> 3 subtasks at 164/s, then 162/s at 3: the servers queued the calls the
    verdict could not see; a fourth subtask would add nothing either."""
    from jobs.launch.scale import ScaleUp, ineffective

    last = ScaleUp(before=2, after=3, rate_before=164.0)
    why = ineffective(last, 3, 162.0)
    assert why is not None and "2 -> 3, added -2/s of the 82/s expected" in why
    hold = decide(verdict(PIPELINE_BOUND, growing=True, growth=14.0), current=3, minimum=1, maximum=4,
                  since_change_s=600, cooldown_s=30, blocked=why)
    assert hold.target == 3 and hold.reason.startswith("pipeline-bound, but the last scale-up")
    # An effective one (1 -> 2 took 87/s to 168/s), another subtask count, or no scale-up: no block.
    assert ineffective(ScaleUp(1, 2, 87.0), 2, 168.0) is None
    assert ineffective(last, 4, 162.0) is None and ineffective(None, 3, 162.0) is None
    assert ineffective(last, 3, None) is None
    # Blocked only matters for a scale-up: an idle job still scales down.
    assert decide(verdict(INPUT_BOUND, idle=True), current=3, minimum=1, maximum=4, since_change_s=600,
                  cooldown_s=30, blocked=why).target == 2
