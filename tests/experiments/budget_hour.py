"""A spend budget at a tenth of the demand with the default one-hour window (issue 21), by hand:
too long for a test (it waits for the UTC hour to roll over), so run it where a broker and a
model server answer:

    python -m tests.experiments.budget_hour BOOTSTRAP MODEL_URL RECORDS OUT_DIR

`llmstream run` (a mini cluster) with `budget.max_tokens_per_hour` a tenth of the records'
estimated tokens, windows of an hour (they roll on the UTC hour). Every second it notes whether
the admission gate is closed (the pause file in the run's own TMPDIR) and the checkpoints the
REST API lists. Once the hour has rolled over, the job has resumed on its own (the gate opened)
and paused again, it presses Ctrl-C (a stop with a savepoint during a pause), then runs the job
without the budget with `--until-end`, and counts: every id exactly once? `summary.json` in
OUT_DIR: the pauses, checkpoints completed and failed with p50/p99/max (all, and those taken
during pauses), the stop, the tally. Results: docs/cost.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import requests
import yaml

from jobs.clients import kafka_admin
from tests.support.committed import check_exactly_once, final_tally
from tests.support.job_setup import estimated_tokens, make_job, unique_records

REPO = Path(__file__).resolve().parents[2]


class Watch(threading.Thread):
    """Every second: is a gate closed, and which checkpoints has the job completed or failed."""

    def __init__(self, rest: str, gates: Path) -> None:
        super().__init__(daemon=True)
        self.rest, self.gates = rest, gates
        self.closed: list[tuple[float, bool]] = []
        self.checkpoints: dict[int, tuple[str, float, int | None]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            self.closed.append((time.time(), any(self.gates.glob("llmstream-gate/*/*.closed"))))
            try:
                jobs = requests.get(f"{self.rest}/jobs/overview", timeout=5).json()["jobs"]
                for job in (j for j in jobs if j["state"] == "RUNNING"):
                    history = requests.get(f"{self.rest}/jobs/{job['jid']}/checkpoints", timeout=5).json()
                    for c in history.get("history", []):
                        self.checkpoints[c["id"]] = (c["status"], c["trigger_timestamp"] / 1000,
                                                     c.get("end_to_end_duration"))
            except (requests.RequestException, KeyError, ValueError):
                pass  # the job is starting or has ended

    def pauses(self) -> list[tuple[float, float]]:
        spans, since = [], None
        for at, closed in self.closed:
            if closed and since is None:
                since = at
            elif not closed and since is not None:
                spans.append((since, at))
                since = None
        if since is not None:
            spans.append((since, self.closed[-1][0]))
        return spans


def start_watched(config_path: Path, log: IO[str], log_path: Path, gates: Path,
                  cwd: Path = REPO) -> tuple[subprocess.Popen[bytes], Watch]:
    """`llmstream run` of `config_path` in its own session (so Ctrl-C is `os.killpg`), with its gate
    files under `gates` (its TMPDIR), and a `Watch` on it once its REST API is up."""
    run = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", "--config", str(config_path),
                            "--progress-every", "30", "--stop-timeout", "300"],
                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(cwd),
                           env={**os.environ, "TMPDIR": str(gates)}, start_new_session=True)
    rest = None
    while rest is None:
        if run.poll() is not None:
            raise SystemExit("llmstream run ended:\n" + log_path.read_text()[-3000:])
        match = re.search(r"REST API at (http://\S+?);", log_path.read_text())
        rest = match.group(1) if match else None
        time.sleep(1)
    watch = Watch(rest, gates)
    watch.start()
    return run, watch


def _percentile(values: list[int], q: float) -> int | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def main() -> None:
    bootstrap, model_url, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    records = unique_records(n, "hour")
    need = estimated_tokens(make_job(out, bootstrap, model_url, name="hour-probe").config, records)
    setup = make_job(out, bootstrap, model_url, name="hour", budget={"max_tokens_per_hour": need / 10},
                     checkpointing={"interval_ms": 5000})
    kafka_admin.produce(bootstrap, setup.input_topic, records)
    gates = out / "tmp"
    gates.mkdir(exist_ok=True)
    log_path = out / "run.log"
    with open(log_path, "w") as log:
        started = time.time()
        run, watch = start_watched(setup.path, log, log_path, gates)
        roll = (int(started // 3600) + 1) * 3600
        print(f"{need} estimated tokens, budget {need / 10:.0f} an hour; the window rolls at "
              f"{time.strftime('%H:%M:%S', time.gmtime(roll))} UTC", flush=True)
        while not (time.time() > roll and len([p for p in watch.pauses() if p[0] > roll]) >= 1
                   and any(p[1] > roll for p in watch.pauses() if p[0] < roll)):
            if run.poll() is not None:
                raise SystemExit("llmstream run ended:\n" + log_path.read_text()[-3000:])
            time.sleep(2)
        time.sleep(15)  # a few checkpoints into the second pause
        stop_at = time.time()
        os.killpg(run.pid, signal.SIGINT)
        code = run.wait(timeout=600)
        stop_s = time.time() - stop_at
        watch.halt.set()
    stopped = log_path.read_text()
    data = yaml.safe_load(setup.path.read_text())
    data["budget"]["max_tokens_per_hour"] = None
    plain = setup.path.with_name("hour-without-budget.yaml")
    plain.write_text(yaml.safe_dump(data, sort_keys=False))
    rest_run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "--config", str(plain), "--until-end"],
                              capture_output=True, text=True, cwd=str(REPO), timeout=1800, check=False)
    (out / "without-budget.log").write_text(rest_run.stdout + rest_run.stderr)
    result = final_tally(setup, [k.decode() for k, _ in records])
    pauses = watch.pauses()
    completed = [(at, d) for status, at, d in watch.checkpoints.values() if status == "COMPLETED" and d is not None]
    durations = sorted(d for _, d in completed)
    during = sorted(d for at, d in completed if any(a <= at <= b for a, b in pauses))
    summary = {
        "records": n, "estimated_tokens": need, "budget_per_hour": need / 10,
        "pauses": [(time.strftime("%H:%M:%S", time.gmtime(a)), round(b - a, 1)) for a, b in pauses],
        "checkpoints_completed": len(completed),
        "checkpoints_failed": sum(1 for status, _, _ in watch.checkpoints.values() if status == "FAILED"),
        "p50_ms": _percentile(durations, 0.5), "p99_ms": _percentile(durations, 0.99),
        "max_ms": durations[-1] if durations else None,
        "during_pauses": len(during), "during_pauses_p99_ms": _percentile(during, 0.99),
        "during_pauses_max_ms": during[-1] if during else None,
        "stop_exit": code, "stop_s": round(stop_s, 1), "stopped_with_savepoint": "resumes from savepoint" in stopped,
        "without_budget_exit": rest_run.returncode, "left_behind_said": "left behind" in rest_run.stdout,
        "tally": str(result),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2), flush=True)
    check_exactly_once(result)
    print("every id exactly once", flush=True)


if __name__ == "__main__":
    main()
