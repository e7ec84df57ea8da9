"""Bench results made by hand, for the tests of what the bench reports: `finished_run`."""

from __future__ import annotations

from typing import Any

from jobs.dev.bench.scenarios import SCENARIOS


def finished_run(scenario: str, approach: str, rate: float, *, cpu: float | None = None, pct: float | None = None,
         checkpoints: dict[str, float] | None = None, records: int = 10_000, parallelism: int | None = 1) -> Any:
    """A finished bench run of `records` records answering `rate` a second at steady state
    (`parallelism` None: an approach without llmstream settings)."""
    from jobs.dev.bench.harness import RunResult
    from jobs.dev.bench.measure import DeliveryTally, Latencies

    none = Latencies()
    return RunResult(scenario=scenario, scenario_name=scenario, approach=approach,
                     limit_per_s=SCENARIOS[scenario].limit_per_s,
                     records_in=records, elapsed_s=60.0, stopped_by="finished", exit_code=0,
                     outcome=DeliveryTally(records, records, 0, 0, 0, 0, 0), throughput_steady=rate,
                     steady_window_s=20.0, throughput_overall=rate, pct_of_limit=pct, e2e_ms=none,
                     pickup_ms=none, commit_lag_ms=none, utilization=None, rss_peak_mb={}, rss_breakdown_mb={},
                     rss_drift_mb=None, rss_series=[], server={},
                     settings=None if parallelism is None else {"parallelism": parallelism},
                     load_avg=(0.0, 0.0, 0.0), log_file="", cpu_ms_per_record=cpu,
                     checkpoints=None if checkpoints is None else {"duration_ms": checkpoints})
