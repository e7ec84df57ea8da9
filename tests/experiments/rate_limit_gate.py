"""Checkpoints of a job held by its rate limit, by hand (issue 21 item 5; figures in
docs/architecture.md "The admission gate"):

    python -m tests.experiments.rate_limit_gate BOOTSTRAP MODEL_URL OUT_DIR [SECONDS]

against `llmstream kafka start` and `llmstream model-server --latency fixed:40`. 400 records wait
in the input; `llmstream run` with `rate_limit.requests_per_minute: 60` and capacity 64 (so 63
calls queue at the limit) runs for SECONDS (150), then Ctrl-C. Every second it notes whether the
admission gate is closed and the checkpoints the REST API lists; `summary.json` in OUT_DIR: how
many completed and failed, p50/p99/max, the share of the time the gate was closed, the stop.
Run it from a checkout of an older commit to compare (PYTHONPATH and the working directory there).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from jobs.clients import kafka_admin
from tests.experiments.budget_hour import _percentile, start_watched
from tests.support.job_setup import make_job, unique_records


def main() -> None:
    bootstrap, model_url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 150.0
    out.mkdir(parents=True, exist_ok=True)
    setup = make_job(out, bootstrap, model_url, name="rate-limited", rate_limit={"requests_per_minute": 60},
                     checkpointing={"interval_ms": 5000}, async_={"capacity": 64})
    kafka_admin.produce(bootstrap, setup.input_topic, unique_records(400, "rl"))
    gates = out / "tmp"
    gates.mkdir(exist_ok=True)
    log_path = out / "run.log"
    with open(log_path, "w") as log:
        run, watch = start_watched(setup.path, log, log_path, gates, cwd=Path.cwd())
        time.sleep(seconds)  # an experiment's fixed length, not a test's wait
        stop_at = time.time()
        os.killpg(run.pid, signal.SIGINT)
        code = run.wait(timeout=900)
        watch.halt.set()
    entries = list(watch.checkpoints.values())
    durations = sorted(d for status, _, d in entries if status == "COMPLETED" and d is not None)
    summary = {
        "completed": len(durations), "failed": sum(1 for status, _, _ in entries if status == "FAILED"),
        "p50_ms": _percentile(durations, 0.5), "p99_ms": _percentile(durations, 0.99),
        "max_ms": durations[-1] if durations else None,
        "gate_closed_share": round(sum(1 for _, closed in watch.closed if closed) / max(1, len(watch.closed)), 3),
        "stop_exit": code, "stop_s": round(time.time() - stop_at, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main()
