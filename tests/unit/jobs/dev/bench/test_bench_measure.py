"""The benchmark's pure parts: scenario limits from Little's law, the steady-state window,
answer timestamps, the ML_PREDICT job's SQL and the children's paths."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import pytest

from jobs.dev.bench.harness import (
    ALL_APPROACHES,
    APPROACHES,
    FLOORS,
    REPO_ROOT,
    _llmstream_command,
    child_environment,
)
from jobs.dev.bench.measure import (
    CheckpointSampler,
    epoch_ms,
    percentile,
    steady_window,
)
from jobs.dev.bench.ml_predict import MlPredictJob
from jobs.dev.bench.report import _checkpoints
from jobs.dev.bench.scenarios import SCENARIOS
from tests.support.bench_runs import finished_run as _run


def test_limits_follow_littles_law() -> None:
    assert SCENARIOS["a"].limit_per_s == pytest.approx(64 / 0.050)
    sigma = math.log(2000 / 200) / 2.3263478740408408
    assert SCENARIOS["b"].mean_latency_ms == pytest.approx(200 * math.exp(sigma**2 / 2))
    assert SCENARIOS["b"].limit_per_s == pytest.approx(196, abs=1)
    assert SCENARIOS["d"].limit_per_s is None


def test_steady_window_leaves_out_start_up_and_drain() -> None:
    # 10 s of start-up with nothing, then 100 completions per second for 10 s.
    completions = [10_000 + i * 10 for i in range(1000)]
    window = steady_window(completions)
    assert window is not None
    assert window.rate == pytest.approx(100, rel=0.02)
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([], 99) is None


def test_answer_timestamps_are_epoch_ms_from_numbers_or_iso_strings() -> None:
    # llmstream and the baselines write epoch ms; Flink's JSON format writes TIMESTAMP_LTZ as ISO-8601.
    assert epoch_ms(1_764_596_700_123) == 1_764_596_700_123
    assert epoch_ms("2025-12-01T13:45:00.123Z") == pytest.approx(1_764_596_700_123)
    assert epoch_ms("2025-12-01T14:45:00.123+01:00") == pytest.approx(1_764_596_700_123)
    # No zone is no instant; junk, booleans and missing values are no timestamps.
    assert epoch_ms("2025-12-01T13:45:00.123") is None
    assert epoch_ms("soon") is None and epoch_ms(True) is None and epoch_ms(None) is None


def test_ml_predict_job_is_the_recipes_sql() -> None:
    job = MlPredictJob("127.0.0.1:9092", "in-'x", "out", "grp", "http://127.0.0.1:8000/v1/")
    source, picked, model, sink = job.statements()
    assert "'scan.startup.mode' = 'group-offsets'" in source and "'scan.bounded.mode' = 'latest-offset'" in source
    assert "'topic' = 'in-''x'" in source  # quoted, so a topic name cannot end the literal
    assert "CURRENT_TIMESTAMP AS started" in picked
    assert "'endpoint' = 'http://127.0.0.1:8000/v1/chat/completions'" in model and "OUTPUT (output STRING)" in model
    assert "'sink.delivery-guarantee' = 'exactly-once'" in sink and "'sink.transactional-id-prefix' = 'grp'" in sink
    insert = job.insert()
    assert "ML_PREDICT(TABLE picked, MODEL m, DESCRIPTOR(prompt), MAP['async', 'true', " in insert
    assert "'max-concurrent-operations', '64'" in insert and "'output-mode', 'ALLOW_UNORDERED'" in insert
    unbounded = MlPredictJob("b", "i", "o", "g", "http://h/v1", api="embeddings", bounded=False)
    assert "scan.bounded.mode" not in unbounded.source()
    assert "/v1/embeddings'" in unbounded.model() and "OUTPUT (output ARRAY<FLOAT>)" in unbounded.model()
    assert "output ARRAY<FLOAT>" in unbounded.sink()


def test_the_floors_are_the_same_job_without_a_model() -> None:
    # Same source, view and exactly-once sink as ML_PREDICT's job; no model, no ML_PREDICT.
    with_model = MlPredictJob("127.0.0.1:9092", "in", "out", "grp", "http://h/v1")
    floor = MlPredictJob("127.0.0.1:9092", "in", "out", "grp", "http://h/v1", kind="flink-floor")
    assert floor.statements() == [with_model.source(), with_model.picked(), with_model.sink()]
    assert "ML_PREDICT" not in floor.insert() and "MODEL" not in floor.insert()
    assert floor.insert().startswith("INSERT INTO sink SELECT id, prompt, 'flink-floor', ")
    python = MlPredictJob("127.0.0.1:9092", "in", "out", "grp", "http://h/v1", kind="pyflink-floor")
    assert python.statements() == floor.statements()
    assert python.insert().startswith("INSERT INTO sink SELECT id, echo(prompt), 'pyflink-floor', ")
    embeddings = MlPredictJob("b", "i", "o", "g", "http://h/v1", api="embeddings", kind="flink-floor")
    assert "ARRAY[CAST(CHAR_LENGTH(prompt) AS FLOAT)]" in embeddings.insert()  # the sink's ARRAY<FLOAT>
    # They run where ML_PREDICT does, and only when asked for by name.
    assert SCENARIOS["e"].approaches(["llmstream", "flink-floor"]) == ["llmstream-unbatched", "llmstream", "flink-floor"]
    assert not set(FLOORS) & set(APPROACHES) and set(FLOORS) <= set(ALL_APPROACHES)


def test_bench_children_run_this_checkouts_code() -> None:
    # The repository root, not jobs/: the children's working directory and PYTHONPATH head.
    assert (REPO_ROOT / "jobs" / "dev" / "bench" / "harness.py").is_file()
    assert (REPO_ROOT / "pom-free" / "fetch.py").is_file()
    env = child_environment({"PYTHONPATH": "/elsewhere", "LLMSTREAM_HOME": "/other/checkout"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]
    assert env["LLMSTREAM_HOME"] == str(REPO_ROOT)
    # llmstream as a module of this checkout, never an installed script of another.
    assert _llmstream_command() == [sys.executable, "-m", "jobs.cli"]


def test_ml_predict_runs_in_every_scenario_it_applies_to() -> None:
    requested = ["semaphore-gather", "llmstream", "ml-predict"]
    assert SCENARIOS["d"].approaches(requested) == requested
    # Embeddings: the baselines send chat requests; ML_PREDICT has an embeddings task.
    assert SCENARIOS["e"].approaches(requested) == ["llmstream-unbatched", "llmstream", "ml-predict"]
    assert SCENARIOS["e"].approaches(["ml-predict"]) == ["ml-predict"]


def test_the_bench_says_why_each_checkpoint_failed() -> None:
    """A failed checkpoint's reason is in Flink's history for as long as it is among the latest ten,
    so every sample's are kept; a trigger refused before any task was asked is only counted."""
    sampler = CheckpointSampler(root_pid=0)
    expired = {"id": 3, "status": "FAILED", "failure_message": "Checkpoint expired before completing."}
    sampler.take({"counts": {"completed": 2, "failed": 1}, "history": [expired]})
    sampler.take({"counts": {"completed": 14, "failed": 2},  # id 3 has left the history since
                  "summary": {"end_to_end_duration": {"p50": 200, "max": 900}},
                  "history": [{"id": 16, "status": "COMPLETED", "end_to_end_duration": 210}]})
    summary = sampler.summary()
    assert summary is not None
    assert summary["failures"] == {"Checkpoint expired before completing.": 1}
    assert summary["failed_untriggered"] == 1
    assert _checkpoints(summary) == ("14, 0.20 / 0.90 (2 failed: 1× Checkpoint expired before completing.; "
                                     "1× refused at trigger, not counted by Flink)")


def test_flink_options_on_the_command_line_reach_the_job_config(tmp_path) -> None:
    import argparse

    from jobs.dev.bench.harness import BenchContext, Topics, llmstream_config
    from jobs.dev.bench.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--flink", "python.metric.enabled=false", "--flink", "pipeline.name = x=y"])
    assert args.flink == [("python.metric.enabled", "false"), ("pipeline.name", "x=y")]
    with pytest.raises(SystemExit):
        parser.parse_args(["--flink", "no-equals-sign"])
    ctx = BenchContext(broker=None, workdir=tmp_path, overrides={"flink": dict(args.flink)})  # type: ignore[arg-type]
    settings = ctx.settings_for(SCENARIOS["d"])
    assert "python.metric.enabled=false" in settings.describe()
    data = llmstream_config(Topics.fresh(SCENARIOS["d"], "llmstream"), "127.0.0.1:9", "http://127.0.0.1:1/v1",
                            settings, SCENARIOS["d"], tmp_path)
    assert data["flink"]["python.metric.enabled"] == "false" and data["flink"]["pipeline.name"] == "x=y"


def test_a_fixed_latency_scenario_reports_what_bare_aiohttp_gets_from_its_simulator() -> None:
    """(a)'s 90% target reads differently once the simulator alone serves bare aiohttp at 94% of
    its limit: the bench probes that ceiling where a short probe can say it (fixed latency, chat,
    one endpoint) and quotes it beside the target and in the notes."""
    from jobs.dev.bench.report import markdown, targets

    assert SCENARIOS["a"].ceiling_probe_concurrency == 128  # twice the server's 64 slots
    assert SCENARIOS["c"].ceiling_probe_concurrency == 32
    for key in ("b", "d", "e", "h"):  # heavy tail, no limit, embeddings, a fleet
        assert SCENARIOS[key].ceiling_probe_concurrency is None, key

    run = _run("a", "llmstream", 1000.0, pct=78.125, records=20_000, parallelism=None)
    probes = {"ceiling_a": {"requests": 12_000, "seconds": 10.0, "rate": 1200.0, "concurrency": 128}}
    (target_a,) = [t for t in targets([run], probes) if t.scenario == "a" and t.text.startswith("llmstream >=")]
    assert target_a.met is False
    assert target_a.detail == "1,000/s = 78% of 1,280/s (same simulator, bare aiohttp 1,200/s = 94% of the limit)"
    assert next(t for t in targets([run]) if t.scenario == "a").detail == "1,000/s = 78% of 1,280/s"
    assert next(t for t in targets([run]) if "one lane or the other" in t.text).verdict == "not measured"
    machine = {"cpus": 2, "memory_gb": 1.0, "load_avg_at_end": [0.0, 0.0, 0.0]}
    text = markdown([run], {"generated": "now", "command": "llmstream bench", "machine": machine, "load_before": 0.0},
                    probes)
    assert "(a) ceiling probe: bare aiohttp, 128 concurrent" in text and "1,200 requests/s" in text
    assert "94% of the limit" in text


def test_the_vectorized_lanes_targets_are_judged_within_one_run() -> None:
    """Issue 41's targets, each a ratio of two approaches of the same run (or a probe of it), and
    the heavy tail's row a figure, not a verdict."""
    from jobs.dev.bench.report import targets
    from jobs.dev.bench.scenarios import VECTORIZED

    fast = {"p50": 300.0, "p99": 800.0, "max": 900.0}
    results = [
        _run("d", "semaphore-gather", 2000.0, cpu=0.30),
        _run("d", "ml-predict", 1000.0, cpu=1.4),
        _run("d", VECTORIZED, 4500.0, cpu=0.20, checkpoints=fast),
        _run("e", VECTORIZED, 8000.0, checkpoints={"p50": 400.0, "p99": 1500.0, "max": 1600.0}),
        _run("a", "llmstream", 900.0),
        _run("a", VECTORIZED, 1150.0, checkpoints=fast),
        _run("b", "llmstream", 199.0, pct=101.0),
        _run("b", VECTORIZED, 120.0, pct=61.0, checkpoints={"p50": 2100.0, "p99": 4000.0, "max": 4200.0}),
    ]
    probes = {"ceiling_a": {"requests": 12_000, "seconds": 10.0, "rate": 1200.0, "concurrency": 128}}
    found = {(t.scenario, t.text): t for t in targets(results, probes) if "vectorized" in t.text
             or "one lane or the other" in t.text}
    speed = found["d", "llmstream-vectorized >= 2x semaphore-gather and >= 3x ML_PREDICT (same run)"]
    assert speed.verdict == "met" and speed.detail == "4,500/s: 2.25x semaphore-gather, 4.50x ML_PREDICT"
    cpu = found["d", "llmstream-vectorized CPU a record <= 0.6x semaphore-gather's"]
    assert cpu.verdict == "NOT met" and cpu.detail == "0.20 vs 0.30 ms = 0.67x"
    assert found["e", "llmstream-vectorized >= 10,000 embedded records/s per subtask"].verdict == "NOT met"
    either = found["a", ">= 90% of bare aiohttp against the same simulator, in one lane or the other"]
    assert either.verdict == "met" and either.detail == "llmstream 75%, llmstream-vectorized 96% of bare aiohttp's 1,200/s"
    tail = found["b", "llmstream-vectorized under the heavy tail: how far it falls"]
    assert tail.verdict == "reported"
    assert tail.detail == "120/s = 61% of the limit (the keyed stage 101%); checkpoints p50 2.10 s, max 4.20 s"
    assert found["a", "llmstream-vectorized checkpoints p99 <= 1 s"].verdict == "met"
    assert found["e", "llmstream-vectorized checkpoints p99 <= 1 s"].verdict == "NOT met"
    # Without the lane's runs nothing is judged.
    missing = [t for t in targets(results[:2]) if "vectorized" in t.text]
    assert missing and all(t.verdict == "not measured" for t in missing)


@pytest.mark.parametrize("api", ["chat", "embeddings"])
def test_the_lane_probe_runs_the_vectorized_function_without_flink(api: str, sim: Any) -> None:
    """`probes lane`: whole batches through the lane's function, each row answered (it raises if
    one is not), counted in records with the probe's own CPU a record; the report quotes both."""
    from jobs.dev.bench.probes import lane_ceiling
    from jobs.dev.bench.report import markdown

    found = lane_ceiling(sim.url, 0.2, 256, batch_size=40, api=api)  # capacity >= the embeddings batch of 128
    assert found["requests"] >= 40 and found["requests"] % 40 == 0
    assert found["rate"] > 0 and found["cpu_us_per_record"] > 0
    machine = {"cpus": 2, "memory_gb": 1.0, "load_avg_at_end": [0.0, 0.0, 0.0]}
    text = markdown([_run("d", "llmstream", 1000.0)],
                    {"generated": "now", "command": "llmstream bench", "machine": machine, "load_before": 0.0},
                    {"lane_d": found})
    assert found["batch_size"] == 40
    assert "(d) probe: the vectorized lane's function over batches of 40 rows, without Flink" in text
    assert f"{found['cpu_us_per_record']:g} µs CPU a record" in text
