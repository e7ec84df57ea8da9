"""`llmstream bench --smoke`: the benchmark works end to end (not how fast anything is).

The smoke run starts its own broker and simulator, runs all three approaches on 100 records
of scenario (a) and writes the report to a temp dir. These tests assert what a reader of
the report relies on: every approach answered every record, none twice, nothing lost, and
the report files exist with one table row per approach. Speed is never asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.bench.harness import APPROACHES
from jobs.bench.measure import percentile, steady_window
from jobs.bench.scenarios import SCENARIOS, SMOKE_RECORDS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("bench-smoke")
    script = Path(sys.executable).with_name("llmstream")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "jobs.cli"]
    # `--` keeps `llmstream`'s own parser from reading the bench flags (see jobs/cli.py).
    proc = subprocess.run(
        [*command, "bench", "--", "--smoke", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    return proc, out


@pytest.mark.integration
@pytest.mark.slow
def test_smoke_bench_answers_every_record_once_in_every_approach(
        smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "latest.json").read_text())
    runs = {r["approach"]: r for r in data["results"]}
    assert set(runs) == set(APPROACHES)
    for approach, run in runs.items():
        result = run["outcome"]
        assert result["expected"] == SMOKE_RECORDS, approach
        assert result["seen"] == SMOKE_RECORDS, (approach, result, run["log_file"])
        assert result["duplicates"] == 0, (approach, result)
        assert result["lost"] == 0 and result["missing"] == 0, (approach, result)
        assert run["throughput_steady"] and run["throughput_steady"] > 0, approach
        assert run["rss_peak_mb"]["approach"] > 0, approach


@pytest.mark.integration
@pytest.mark.slow
def test_smoke_bench_writes_the_report(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "latest.md").read_text()
    for approach in APPROACHES:
        assert f"| (a) fixed 50 ms | {approach} |" in table
    png = (out / "latest.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert "bench: 3 runs" in proc.stdout


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
