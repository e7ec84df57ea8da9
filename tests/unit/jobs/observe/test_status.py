"""`llmstream status` without a JVM: figures from fake REST answers, the screen, the run line."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, ClassVar

from rich.console import Console

from jobs.clients.flink_rest import FlinkRest
from jobs.observe.figures import JobMetrics, Observer, figures, find_job
from jobs.observe.status import line, render
from jobs.state.snapshots import LocalRun, StateDir
from udfs.config import load_config, with_overrides

JOB = "a" * 32
SOURCE_V, INFERENCE_V = "v-source", "v-inference"
METRICS: dict[str, dict[str, list[dict[str, Any]]]] = {
    SOURCE_V: {"values": [
        {"id": "Source__kafka_requests[1].numRecordsOut", "sum": 1200.0},
        {"id": "Source__kafka_requests[1].numRecordsOutPerSecond", "sum": 40.0},
        {"id": "Source__kafka_requests[1].pendingRecords", "sum": 800.0},
        {"id": "Source__kafka_requests[1].KafkaSourceReader.topic.llm-requests.partition.0.currentOffset", "sum": 499.0},
        {"id": "Source__kafka_requests[1].KafkaSourceReader.topic.llm-requests.partition.1.currentOffset", "sum": -1.0},
    ]},
    INFERENCE_V: {"values": [
        {"id": "inference.numRecordsOut", "sum": 1100.0},
        {"id": "inference.numRecordsOutPerSecond", "sum": 38.5},
        {"id": "inference.llmstream.records_in", "sum": 1150.0},
        {"id": "inference.llmstream.dead_lettered", "sum": 3.0},
        {"id": "inference.llmstream.requests", "sum": 1120.0},
        {"id": "inference.llmstream.retries", "sum": 20.0},
        {"id": "inference.llmstream.rate_limited", "sum": 7.0},
        {"id": "inference.llmstream.in_flight", "sum": 12.0},
        {"id": "inference.llmstream.admitted", "sum": 14.0},
        {"id": "inference.llmstream.concurrency_limit", "sum": 16.0},
        {"id": "inference.llmstream.latency_count", "sum": 1097.0},
        {"id": "inference.llmstream.latency_sum_ms", "sum": 219400.0},
        {"id": "inference.llmstream.latency_p50_ms", "sum": 300.0, "max": 180.0},
        {"id": "inference.llmstream.latency_p99_ms", "sum": 1500.0, "max": 900.0},
        {"id": "inference.llmstream.prompt_tokens", "sum": 60000.0},
        {"id": "inference.llmstream.completion_tokens", "sum": 120000.0},
        {"id": "inference.llmstream.reason.invalid_json.dead_letters", "sum": 2.0},
        {"id": "inference.llmstream.reason.inference_rejected.dead_letters", "sum": 1.0},
        {"id": "inference.llmstream.latency_ms", "sum": "DistributionResult{...}"},
        # a model fleet: two endpoints over two subtasks (counts summed, circuit and latency the worst)
        {"id": "inference.llmstream.endpoint.gpu-a.in_flight", "sum": 10.0, "max": 6.0},
        {"id": "inference.llmstream.endpoint.gpu-a.limit", "sum": 16.0, "max": 8.0},
        {"id": "inference.llmstream.endpoint.gpu-a.circuit", "sum": 0.0, "max": 0.0},
        {"id": "inference.llmstream.endpoint.gpu-a.requests", "sum": 900.0},
        {"id": "inference.llmstream.endpoint.gpu-a.rate_limited", "sum": 7.0},
        {"id": "inference.llmstream.endpoint.gpu-a.failures", "sum": 0.0},
        {"id": "inference.llmstream.endpoint.gpu-a.latency_p50_ms", "sum": 300.0, "max": 170.0},
        {"id": "inference.llmstream.endpoint.gpu-a.latency_p99_ms", "sum": 1500.0, "max": 880.0},
        {"id": "inference.llmstream.endpoint.127_0_0_1_8001.in_flight", "sum": 0.0, "max": 0.0},
        {"id": "inference.llmstream.endpoint.127_0_0_1_8001.limit", "sum": 8.0, "max": 4.0},
        {"id": "inference.llmstream.endpoint.127_0_0_1_8001.circuit", "sum": 2.0, "max": 2.0},
        {"id": "inference.llmstream.endpoint.127_0_0_1_8001.requests", "sum": 220.0},
        {"id": "inference.llmstream.endpoint.127_0_0_1_8001.failures", "sum": 12.0},
    ]},
}
NOW_MS = 1_800_000_000_000
SUBTASKS: dict[int, dict[str, float]] = {
    # Subtask 0 at its AIMD limit with 429s, subtask 1 with room: the job's 14 admitted, 7 429s split.
    0: {"inference.numRecordsOut": 700.0, "inference.numRecordsOutPerSecond": 23.5, "inference.llmstream.records_in": 730.0,
        "inference.llmstream.admitted": 8.0, "inference.llmstream.concurrency_limit": 8.0,
        "inference.llmstream.rate_limited": 7.0, "inference.llmstream.requests": 720.0,
        "inference.llmstream.latency_p50_ms": 180.0, "inference.llmstream.endpoint.gpu-a.in_flight": 6.0,
        "inference.llmstream.endpoint.gpu-a.limit": 8.0},
    1: {"inference.numRecordsOut": 400.0, "inference.numRecordsOutPerSecond": 15.0, "inference.llmstream.records_in": 420.0,
        "inference.llmstream.admitted": 6.0, "inference.llmstream.concurrency_limit": 8.0,
        "inference.llmstream.rate_limited": 0.0, "inference.llmstream.requests": 400.0,
        "inference.llmstream.latency_p50_ms": 120.0, "inference.llmstream.endpoint.gpu-a.in_flight": 4.0,
        "inference.llmstream.endpoint.gpu-a.limit": 8.0, "numBytesOut": 5.0},
}


class FakeRest(FlinkRest):
    """Answers the REST paths `JobMetrics` asks for, from canned JSON."""

    def __init__(self, taskmanagers: int = 1) -> None:
        super().__init__("http://fake:8081")
        self.paths: list[str] = []
        self.taskmanagers = taskmanagers

    def rest(self, path: str, *, method: str = "GET", body: Any = None, timeout: float = 10.0) -> Any:
        self.paths.append(path)
        if path == "/jobs/overview":
            return {"jobs": [{"jid": "old", "name": "llmstream-inference", "state": "CANCELED", "start-time": 1},
                             {"jid": JOB, "name": "llmstream-inference", "state": "RUNNING", "start-time": 2}]}
        if path == f"/jobs/{JOB}":
            return {"jid": JOB, "name": "llmstream-inference", "state": "RUNNING", "start-time": NOW_MS - 60_000,
                    "end-time": -1, "now": NOW_MS,
                    "vertices": [{"id": SOURCE_V, "name": "Source: kafka_requests[1] -> Calc[2]", "parallelism": 1},
                                 {"id": "v-ticks", "name": "Source: inference_ticks[4]", "parallelism": 1},
                                 {"id": INFERENCE_V, "name": "inference -> kafka_results[9]: Writer",
                                  "parallelism": 2}]}
        if path.startswith(f"/jobs/{JOB}/metrics"):
            return [{"id": "numRestarts", "value": "1"}]
        if path == "/taskmanagers":
            return {"taskmanagers": [{"id": f"tm-{i}"} for i in range(self.taskmanagers)]}
        if path == f"/jobs/{JOB}/checkpoints":
            return {"counts": {"completed": 12, "failed": 0},
                    "latest": {"completed": {"latest_ack_timestamp": NOW_MS - 3_000, "end_to_end_duration": 240,
                                             "checkpointed_size": 20480}}}
        for index, values in SUBTASKS.items():
            base = f"/jobs/{JOB}/vertices/{INFERENCE_V}/subtasks/{index}/metrics"
            if path == base:
                return [{"id": name} for name in values]
            if path.startswith(base + "?get="):
                asked = path.split("?get=", 1)[1].split(",")
                return [{"id": name, "value": str(value)} for name, value in values.items() if name in asked]
        if re.search(r"/subtasks/\d+/metrics", path):
            return []  # a subtask of another vertex: no metrics of its own here
        for vertex, answer in METRICS.items():
            base = f"/jobs/{JOB}/vertices/{vertex}/subtasks/metrics"
            if path == base:
                return [{"id": m["id"]} for m in answer["values"]]
            if path.startswith(base + "?get="):
                return answer["values"]
        raise AssertionError(f"unexpected REST call {path}")


def config(**sections: Any) -> Any:
    return with_overrides(load_config(), async_={"capacity": 16}, **sections)


def test_figures_from_the_rest_api() -> None:
    rest = FakeRest()
    raw = JobMetrics(rest, find_job(rest, "llmstream-inference") or "").collect()
    fig = figures(config(model={"prices": {"prompt_per_1k": 0.5, "completion_per_1k": 1.0}}), raw,
                  lag={"committed": 100, "end": 2100, "partitions": {"llm-requests:0": [0, 1500], "llm-requests:1": [100, 600]}})
    assert fig["job"] == {"id": JOB, "name": "llmstream-inference", "state": "RUNNING", "uptime_s": 60.0,
                          "restarts": 1, "taskmanagers": 1, "lane": "keyed"}
    # Per partition: end - (last emitted + 1), or - the group's offset before the first emitted record:
    # (1500 - 500) + (600 - 100); not pendingRecords (800), which counts from the fetch position.
    assert fig["input"]["lag_records"] == 1500 and fig["input"]["drain_s"] == 37.5   # at 40 records/s
    assert fig["input"]["group_lag"] == 2000     # the group's commits lag; the figures do not use them
    assert fig["records"] == {"in": 1200, "in_per_s": 40.0, "processed": 1150, "results": 1097, "dead_letters": 3,
                              "out_per_s": 38.5, "emitted": 1100, "dropped": None}
    calls = fig["calls"]
    assert calls["capacity"] == 32 and calls["admitted"] == 14 and calls["concurrency_limit"] == 16
    assert calls["latency_p50_ms"] == 180 and calls["latency_p99_ms"] == 900   # the slowest subtask's
    assert calls["latency_mean_ms"] == 200.0 and calls["retries"] == 20 and calls["rate_limited"] == 7
    assert fig["dead_letters"] == {"by_reason": {"invalid_json": 2, "inference_rejected": 1}, "source": "metrics"}
    assert fig["checkpoint"] == {"completed": 12, "failed": 0, "age_s": 3.0, "duration_ms": 240, "size_bytes": 20480}
    # 180,000 tokens over the 60 s uptime: 180,000 a minute; (30 + 120) a minute = 9,000 an hour
    assert fig["cost"]["tokens_per_min"] == 180000.0
    assert fig["cost"]["cost_per_hour"] == 9000.0


def test_a_job_without_a_taskmanager_is_said_so_plainly() -> None:
    """A job RESTARTING with no TaskManager registered looks like any restart; status says why it
    cannot run, in the progress line and on the screen."""
    fig = figures(config(), JobMetrics(FakeRest(taskmanagers=0), JOB).collect())
    assert fig["job"]["taskmanagers"] == 0
    assert "no TaskManager is registered: the job cannot run until one starts" in line(fig)
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(fig))
    assert "no TaskManager is registered" in out.getvalue()


def test_lag_without_partition_offsets_is_the_sources_pending_records() -> None:
    fig = figures(config(), JobMetrics(FakeRest(), JOB).collect(), lag={"committed": 0, "end": 5000})
    assert fig["input"]["lag_records"] == 800 and fig["input"]["drain_s"] == 20.0


def test_rates_from_the_previous_refresh() -> None:
    raw = JobMetrics(FakeRest(), JOB).collect()
    first = figures(config(), raw)
    previous = dict(first, at=first["at"] - 10, records=dict(first["records"], **{"in": 1000, "emitted": 950}))
    second = figures(config(), raw, previous=previous)
    assert 19 <= second["records"]["in_per_s"] <= 20.1 and 14 <= second["records"]["out_per_s"] <= 15.1


def test_token_rates_from_the_previous_refresh() -> None:
    rest = FakeRest()
    raw = JobMetrics(rest, JOB).collect()
    first = figures(config(), raw)
    previous = dict(first, at=first["at"] - 30, cost=dict(first["cost"], prompt_tokens=59000, completion_tokens=118000))
    second = figures(config(), raw, previous=previous)
    assert 5900 <= second["cost"]["tokens_per_min"] <= 6000   # 3,000 tokens in ~30 s
    assert second["cost"]["cost_per_hour"] is None               # no model.prices


def test_screen_and_line_show_every_figure() -> None:
    fig = figures(config(), JobMetrics(FakeRest(), JOB).collect(), lag={"committed": 100, "end": 2000},
                  dead_letters={"invalid_json": 2, "inference_rejected": 1})
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(fig))
    text = out.getvalue()
    for expected in ("RUNNING", "input lag", "800 records", "20 s", "40/s", "14 / 32 capacity", "AIMD limit",
                     "180 / 900 ms", "1,120 / 20 / 7", "3 s ago", "240 ms / 20.0 KB", "invalid_json",
                     "inference_rejected", "tokens / min", "restarts 1", "keyed lane"):
        assert expected in text, expected
    compact = line(fig)
    assert compact.startswith("RUNNING") and "in 1,200 (40/s)" in compact and "lag 800 (~20 s)" in compact
    assert "calls 14/32 limit 16" in compact and "p50/p99 180/900 ms" in compact and "committed" not in compact


def test_nothing_processed_yet_says_starting() -> None:
    fig = figures(config(), None, lag={"committed": 0, "end": 185})
    assert line(fig).split()[:2] == ["UNKNOWN", "starting"] and "lag 185" in line(fig)
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render(fig))
    assert "starting" in out.getvalue()


def test_a_local_run_is_found_through_its_state_directory(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    run = LocalRun.starting(config(metrics={"prometheus_port": 9999}), JOB, 12345)
    run.record(state)
    loaded = LocalRun.load(state)
    assert loaded is not None and loaded.rest_url == "http://127.0.0.1:12345"
    assert loaded.prometheus_url == "http://127.0.0.1:9999/metrics" and loaded.ended_at is None


def test_an_ended_run_shows_its_last_figures_with_current_dead_letters(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    last = figures(config(), JobMetrics(FakeRest(), JOB).collect())
    run = LocalRun.starting(config(), JOB, 1)
    run.last = json.loads(json.dumps(last))
    run.ended(state)
    tally = type("Tally", (), {"read": lambda self: {"invalid_json": 5}})()
    fig = Observer(config(), None, job_id=JOB, dead_letters=tally, local_run=LocalRun.load(state)).collect()  # type: ignore[arg-type]
    assert fig["job"]["state"] == "ENDED" and fig["job"]["id"] == JOB and not fig["live"]
    assert fig["calls"]["requests"] == 1120 and fig["records"]["in_per_s"] == 0.0
    assert fig["dead_letters"] == {"by_reason": {"invalid_json": 5}, "source": "topic"}
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(fig))
    assert "ENDED" in out.getvalue() and "figures as last seen" in out.getvalue()


def test_a_fleets_endpoints_in_figures_and_on_the_screen() -> None:
    fig = figures(config(), JobMetrics(FakeRest(), JOB).collect())
    assert fig["endpoints"] == {
        "127_0_0_1_8001": {"in_flight": 0, "limit": 8, "circuit": "open", "requests": 220, "failures": 12},
        "gpu-a": {"in_flight": 10, "limit": 16, "circuit": "closed", "requests": 900, "rate_limited": 7,
                  "failures": 0, "latency_p50_ms": 170, "latency_p99_ms": 880}}
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(fig))
    text = out.getvalue()
    assert "Endpoints" in text
    row = next(r for r in text.splitlines() if "gpu-a" in r)
    assert "closed" in row and "10 / 16" in row and "900" in row and "170 / 880" in row
    assert "open" in next(r for r in text.splitlines() if "127_0_0_1_8001" in r)


class VectorizedRest(FakeRest):
    """The vectorized lane: one chained vertex, its function's figures under the planner's name."""

    VALUES: ClassVar[list[dict[str, Any]]] = [
        {"id": "Source__kafka_requests[1].numRecordsOut", "sum": 1200.0},
        {"id": "PythonCalc[3].numRecordsOut", "sum": 1190.0},
        {"id": "PythonCalc[3].llmstream.records_in", "sum": 1190.0},
        {"id": "PythonCalc[3].llmstream.requests", "sum": 1180.0},
        {"id": "PythonCalc[3].llmstream.admitted", "sum": 64.0},
        {"id": "PythonCalc[3].llmstream.reason.invalid_json.dead_letters", "sum": 2.0},
        {"id": "Calc[4].numRecordsOut", "sum": 1190.0},
    ]

    def rest(self, path: str, *, method: str = "GET", body: Any = None, timeout: float = 10.0) -> Any:
        base = f"/jobs/{JOB}/vertices/{SOURCE_V}/subtasks/metrics"
        if path == f"/jobs/{JOB}":
            answer = super().rest(path)
            answer["vertices"] = [{"id": SOURCE_V, "parallelism": 2, "name": "Source: kafka_requests[1] -> Calc[2] -> "
                                   "PythonCalc[3] -> Calc[4] -> kafka_results[5]: Writer -> kafka_results[5]: Committer"}]
            return answer
        if path == base:
            return [{"id": m["id"]} for m in self.VALUES]
        if path.startswith(base + "?get="):
            return self.VALUES
        return super().rest(path)


def test_the_vectorized_lanes_figures_read_as_the_keyed_stages() -> None:
    raw = JobMetrics(VectorizedRest(), JOB).collect()
    fig = figures(config(stage="auto", model={"api": "embeddings"}), raw)
    assert fig["job"]["lane"] == "vectorized"  # what `stage: auto` chose
    assert fig["records"]["in"] == 1200 and fig["records"]["processed"] == 1190 and fig["records"]["emitted"] == 1190
    assert fig["calls"]["capacity"] == 32 and fig["calls"]["admitted"] == 64
    assert fig["dead_letters"]["by_reason"] == {"invalid_json": 2}


class BatchLaneRest(FakeRest):
    """A provider-batch job (`model.mode: batch`): the stage's batch gauges beside its usual figures."""

    BATCH: ClassVar[list[dict[str, Any]]] = [
        {"id": "inference.llmstream.batch_records_waiting", "sum": 37.0},
        {"id": "inference.llmstream.batches_open", "sum": 3.0},
        {"id": "inference.llmstream.batch_oldest_age_s", "sum": 9100.0, "max": 7300.0},
        {"id": "inference.llmstream.batch_requests", "sum": 12000.0},
    ]

    def rest(self, path: str, *, method: str = "GET", body: Any = None, timeout: float = 10.0) -> Any:
        base = f"/jobs/{JOB}/vertices/{INFERENCE_V}/subtasks/metrics"
        if path == base:
            return [{"id": m["id"]} for m in METRICS[INFERENCE_V]["values"] + self.BATCH]
        if path.startswith(base + "?get="):
            return METRICS[INFERENCE_V]["values"] + self.BATCH
        return super().rest(path)


def test_the_batch_lanes_figures_and_its_table_with_a_stale_batch() -> None:
    lane = config(model={"endpoint": "http://127.0.0.1:1", "model": "m", "mode": "batch", "provider": "openai"},
                  provider_batch={"stale_after_s": 3600, "price_factor": 0.5})
    fig = figures(lane, JobMetrics(BatchLaneRest(), JOB).collect())
    assert fig["batch_lane"] == {"provider": "openai", "records_waiting": 37, "batches_open": 3,
                                 "oldest_age_s": 7300, "requests_submitted": 12000, "stale_after_s": 3600,
                                 "saving": 0.5}
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(fig))
    text = out.getvalue()

    def row(label: str) -> str:
        return next(r for r in text.splitlines() if label in r).strip(" │")

    assert "Batch lane (openai)" in text
    assert row("records waiting to be batched").split()[-1] == "37"
    assert row("batches at the provider").split()[-1] == "3"
    assert row("oldest batch").split()[-3:] == ["2.0", "h", "STALE"]
    assert row("requests submitted").split()[-1] == "12,000"
    assert row("saving on list price").split()[-1] == "50%"


def test_a_job_outside_the_batch_lane_has_no_batch_table() -> None:
    fig = figures(config(), JobMetrics(FakeRest(), JOB).collect())
    assert "batch_lane" not in fig
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(fig))
    assert "Batch lane" not in out.getvalue()


def test_each_inference_subtask_has_figures_and_a_verdict_of_its_own() -> None:
    """With more than one inference subtask, `subtasks` holds each one's own figures (from its own
    `/subtasks/<i>/metrics`), and `status --json`'s `scaling.subtasks` a verdict for each: here
    subtask 0 at its AIMD limit (model-bound), subtask 1 with room while records wait."""
    from jobs.observe.status import _collect

    rest = FakeRest()
    raw = JobMetrics(rest, JOB).collect()
    fig = figures(config(), raw, lag={"committed": 0, "end": 5000})
    assert [s["index"] for s in fig["subtasks"]] == [0, 1]
    first, second = fig["subtasks"]
    assert first["records"] == {"processed": 730, "emitted": 700, "out_per_s": 23.5}
    assert first["calls"]["admitted"] == 8 and first["calls"]["capacity"] == 16 and first["calls"]["rate_limited"] == 7
    assert second["endpoints"] == {"gpu-a": {"in_flight": 4, "limit": 8}}
    assert not any("numBytesOut" in path for path in rest.paths)  # only the metrics a verdict reads

    class Once:
        history: ClassVar[list[Any]] = []

        def __init__(self) -> None:
            self.config = config()

        def collect(self) -> dict[str, Any]:
            return figures(self.config, JobMetrics(FakeRest(), JOB).collect(), lag={"committed": 0, "end": 50_000})

    scaling = _collect(Once())["scaling"]  # type: ignore[arg-type]
    per = {v["subtask"]: v for v in scaling["subtasks"]}
    assert per[0]["verdict"] == "model-bound" and "AIMD limit 8" in per[0]["evidence"][0]
    assert per[1]["verdict"] == "pipeline-bound" and per[1]["more_subtasks_help"] is True
    assert per[0]["share"] + per[1]["share"] == 1.0
    json.dumps(scaling)
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render(_collect(Once())))  # type: ignore[arg-type]
    assert "per subtask: 0 model-bound, 1 pipeline-bound" in out.getvalue()


def test_one_inference_subtask_asks_for_no_subtask_metrics() -> None:
    class OneSubtask(FakeRest):
        def rest(self, path: str, *, method: str = "GET", body: Any = None, timeout: float = 10.0) -> Any:
            answer = super().rest(path, method=method, body=body, timeout=timeout)
            if path == f"/jobs/{JOB}":
                answer["vertices"][-1]["parallelism"] = 1
            return answer

    rest = OneSubtask()
    fig = figures(config(), JobMetrics(rest, JOB).collect())
    assert fig["subtasks"] == [] and not any("/subtasks/0/" in path for path in rest.paths)
