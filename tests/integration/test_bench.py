"""`llmstream bench --smoke`: the benchmark works end to end (not how fast anything is).

The smoke run starts its own broker and simulator, runs every approach (the two baselines,
both llmstream lanes, Flink's SQL ML_PREDICT, the vectorized lane's floor with the model call
and, asked for by name, the same SQL job without a model: the floors) on 100 records of
scenario (a) and writes the report to
a temp dir. These tests assert what a reader of the report relies on: every approach answered
every record, none twice, nothing lost (for the Flink jobs: through exactly-once Kafka
sinks, read with read_committed), and the report files exist with one table row per approach
and the simulator's ceiling probe in its notes.
Speed is never asserted. The bench starts as `python -m jobs.cli` from this checkout, so it
runs this checkout's code whatever `llmstream` script the venv has.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.dev.bench.harness import ALL_APPROACHES
from jobs.dev.bench.scenarios import SMOKE_RECORDS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("bench-smoke")
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "bench", "--smoke", "--out", str(out),
         "--approaches", ",".join(ALL_APPROACHES)],
        cwd=REPO, capture_output=True, text=True, timeout=1800, check=False,
    )
    return proc, out


def _failure(proc: subprocess.CompletedProcess[str]) -> str:
    """The end of the bench's output, led by the log tail of each run that answered nothing.

    The report table at the end says which approach failed; the harness prints that run's log
    tail earlier, where the end of the output alone would cut it off.
    """
    out = proc.stdout
    tails = [out[out.rfind("\n", 0, m.start()) + 1:m.start() + 2500]
             for m in re.finditer(" results; last lines of ", out)]
    return "\n".join(tails) + "\n[...]\n" + out[-3000:] + proc.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.slow
def test_smoke_bench_answers_every_record_once_in_every_approach(
        smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = smoke
    assert proc.returncode == 0, _failure(proc)
    data = json.loads((out / "latest.json").read_text())
    runs = {r["approach"]: r for r in data["results"]}
    assert set(runs) == set(ALL_APPROACHES)
    for approach, run in runs.items():
        result = run["outcome"]
        assert result["expected"] == SMOKE_RECORDS, approach
        assert result["seen"] == SMOKE_RECORDS, (approach, result, run["log_file"])
        assert result["duplicates"] == 0, (approach, result)
        assert result["lost"] == 0 and result["missing"] == 0, (approach, result)
        assert run["throughput_steady"] and run["throughput_steady"] > 0, approach
        assert run["rss_peak_mb"]["approach"] > 0, approach
    # ML_PREDICT's answers carry the fields the measurement needs (ISO-8601 in its JSON).
    assert runs["ml-predict"]["pickup_ms"]["p50"] is not None, runs["ml-predict"]["log_file"]


@pytest.mark.integration
@pytest.mark.slow
def test_smoke_bench_writes_the_report(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = smoke
    assert proc.returncode == 0, _failure(proc)
    table = (out / "latest.md").read_text()
    for approach in ALL_APPROACHES:
        assert f"| (a) fixed 50 ms | {approach} |" in table
    # The simulator's own ceiling beside (a)'s target: what bare aiohttp gets from it here.
    assert "- (a) ceiling probe: bare aiohttp, 128 concurrent" in table, table[-2000:]
    png = (out / "latest.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert f"bench: {len(ALL_APPROACHES)} runs" in proc.stdout
