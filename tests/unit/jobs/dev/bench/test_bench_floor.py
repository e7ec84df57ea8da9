"""The vectorized lane's floor with the model call (`vectorized-floor`), its targets and the
transport probe: what runs where, what is judged against what, and the floor's function on its
own against the simulator (no Flink)."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from jobs.dev.bench.harness import ALL_APPROACHES, APPROACHES, is_flink
from jobs.dev.bench.scenarios import SCENARIOS, VECTORIZED, VECTORIZED_FLOOR
from jobs.dev.bench.vectorized_floor import (
    STATS_PREFIX,
    batch_stats,
    insert_sql,
    make_function,
)
from tests.support.bench_runs import finished_run as _run


def test_the_floor_runs_beside_the_lane_in_d_and_e_by_default_and_wherever_named() -> None:
    assert VECTORIZED_FLOOR in APPROACHES and VECTORIZED_FLOOR in ALL_APPROACHES and is_flink(VECTORIZED_FLOOR)
    default = list(APPROACHES)
    assert VECTORIZED_FLOOR in SCENARIOS["d"].approaches(default, named=False)
    assert SCENARIOS["e"].approaches(default, named=False) == [
        "llmstream-unbatched", "llmstream", VECTORIZED, VECTORIZED_FLOOR, "ml-predict"]
    for key in ("a", "b", "c"):
        assert VECTORIZED_FLOOR not in SCENARIOS[key].approaches(default, named=False), key
    # Named, it runs where it is asked (the smoke run names every approach in (a)).
    assert SCENARIOS["a"].approaches([VECTORIZED_FLOOR]) == [VECTORIZED_FLOOR]


def test_the_floors_statement_is_the_lanes_with_a_bounded_source() -> None:
    sql = insert_sql(bounded=True, with_headers=True)
    assert "INSERT INTO kafka_results" in sql and "FROM kafka_requests /*+ OPTIONS('scan.bounded.mode'='latest-offset') */" in sql
    assert "vectorized_floor(k, v, `topic`, `partition`, `offset`, ts, CAST(`headers` AS MAP<STRING NOT NULL, BYTES>))" in sql
    assert sql.rstrip().endswith("WHERE r.emit")
    assert "OPTIONS" not in insert_sql(bounded=False, with_headers=False)


def test_the_floors_batch_line_is_read_back_from_its_log() -> None:
    log = "noise\n" + STATS_PREFIX + '{"batches": 3, "mean_rows": 950.0, "gap_ms_p50": 81.5}\nmore\n'
    assert batch_stats(log) == {"batches": 3, "mean_rows": 950.0, "gap_ms_p50": 81.5}
    assert batch_stats("nothing here") is None


def test_the_floors_targets_are_ratios_within_one_run() -> None:
    from jobs.dev.bench.report import floor_targets

    results = [
        _run("d", "semaphore-gather", 2000.0, cpu=0.30),
        _run("d", VECTORIZED, 2400.0, cpu=0.26),
        _run("d", VECTORIZED_FLOOR, 3000.0, cpu=0.20),
        _run("e", VECTORIZED, 9000.0, cpu=0.15),
        _run("e", VECTORIZED_FLOOR, 10_000.0, cpu=0.12),
    ]
    found = {(t.scenario, t.text.split(" (")[0]): t for t in floor_targets(results)}
    cpu = found["d", "llmstream-vectorized CPU a record <= 1.3x vectorized-floor's"]
    assert cpu.verdict == "met" and cpu.detail == "0.260 vs 0.200 ms = 1.30x"
    rate = found["d", "llmstream-vectorized >= 0.8x vectorized-floor's throughput and >= 1.0x semaphore-gather"]
    assert rate.verdict == "met" and rate.detail == "2,400 vs 3,000/s = 0.80x; 1.20x semaphore-gather (the floor 1.50x)"
    assert found["e", "llmstream-vectorized >= 0.8x vectorized-floor's embeddings/s"].verdict == "met"
    per_subtask = found["e", "llmstream-vectorized >= 10,000 embeddings/s a subtask where the floor reaches 12,500"]
    assert per_subtask.verdict == "reported" and per_subtask.detail.endswith("under 12,500: not judged")
    results[-1] = _run("e", VECTORIZED_FLOOR, 13_000.0, cpu=0.12)
    found = {(t.scenario, t.text.split(" (")[0]): t for t in floor_targets(results)}
    assert found["e", "llmstream-vectorized >= 10,000 embeddings/s a subtask where the floor reaches 12,500"].verdict \
        == "NOT met"
    assert all(t.verdict == "not measured" for t in floor_targets(results[:1]))


def _batch(n: int, bad: int | None = None) -> tuple[pd.Series, ...]:
    values = [b'{"id": "r%08d", "prompt": "p%d"}' % (i, i) for i in range(n)]
    if bad is not None:
        values[bad] = b"not json"
    stamp = pd.Timestamp(1_700_000_000_123, unit="ms", tz="UTC")
    return (pd.Series([b"k"] * n, dtype=object), pd.Series(values, dtype=object), pd.Series(["in"] * n),
            pd.Series([0] * n), pd.Series(range(n)), pd.Series([stamp] * n), pd.Series([None] * n, dtype=object))


@pytest.mark.parametrize("api", ["chat", "embeddings"])
def test_the_floors_function_answers_each_row_once_in_order(api: str, sim: Any) -> None:
    import orjson

    function = make_function(sim.url, api, 16, 8 if api == "embeddings" else 1, 10.0, "out", "dlq")._func
    function.open(None)
    try:
        first = function.eval(*_batch(20, bad=3))
        second = function.eval(*_batch(5))
    finally:
        function.close()
    assert list(first.columns) == ["k", "v", "topic", "headers", "emit"] and first["emit"].all()
    assert list(first["topic"]) == ["out"] * 3 + ["dlq"] + ["out"] * 16
    bodies = [orjson.loads(v) for v in first["v"]]
    assert [b["id"] for b in bodies] == [None if i == 3 else f"r{i:08d}" for i in range(20)]
    assert bodies[0]["timestamps"]["produced"] == 1_700_000_000_123 and bodies[0]["output"]
    assert len(second) == 5 and function._gaps_ms and len(function._inside_ms) == 2


def test_the_transport_report_sets_each_client_against_aiohttp_in_the_same_round() -> None:
    from jobs.dev.bench.transport import transport_markdown

    runs = [{"client": "aiohttp", "concurrency": 64, "round": 1, "cpu_us_per_call": 200.0, "rate": 2000.0,
             "errors": 0, "version": "3"},
            {"client": "pycurl", "concurrency": 64, "round": 1, "cpu_us_per_call": 50.0, "rate": 4000.0,
             "errors": 0, "version": "7"},
            {"client": "rnet", "concurrency": 64, "round": 1, "error": "rnet is not installed"}]
    text = transport_markdown(runs, {"generated": "now", "rounds": 1, "seconds": 5.0, "cpus": 2,
                                     "load_before": 0.5, "simulator": ["--latency", "0"]})
    assert "| pycurl | 7 | 64 | 50 | 4,000 | 0.25 | 0 |" in text
    assert "| rnet | – | 64 | – | – | – | rnet is not installed |" in text


def test_the_transport_probe_measures_aiohttp_against_the_simulator(sim: Any) -> None:
    from jobs.dev.bench.transport import WARM_UP_S, measure

    found = measure("aiohttp", sim.url, 0.3, 4)
    assert WARM_UP_S > 0 and found["calls"] > 0 and found["errors"] == 0 and found["cpu_us_per_call"] > 0


def test_the_bench_flags_leave_the_approaches_to_each_scenario_unless_named() -> None:
    import argparse

    from jobs.dev.bench.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).approaches is None  # the default list, the floor in (d) and (e) only
    assert parser.parse_args(["--approaches", "vectorized-floor"]).approaches == [VECTORIZED_FLOOR]
    args = parser.parse_args(["--transport-probe", "--transport-clients", "aiohttp,pycurl"])
    assert args.transport_probe and args.transport_clients == ["aiohttp", "pycurl"]
    assert args.transport_concurrency == "64,256" and args.transport_rounds == 2
