"""ML_PREDICT's limits, measured rather than claimed: what a malformed input record, HTTP 500
answers and a model call that outlives ML_PREDICT's `timeout` do to the job.

    python -m jobs.dev.bench.ml_predict_limits [--cases malformed,http-500,timeout] [--records 300]

Each case gets a fresh broker topic set, a simulator with the case's faults and the bench's
`ml-predict` job (`jobs/dev/bench/ml_predict.py`, bounded at the latest offset) for at most
`--max-seconds`. Printed per case, one JSON line: answers visible to a read_committed
consumer (distinct ids, duplicates), the job's restarts (`numRestarts`) and the root
exception of its latest failure from the mini cluster's REST API, the simulator's counts,
and how the process ended. The in-flight cap is measured by the bench itself (scenario a:
the simulator's `max_in_flight`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import requests

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.bench.harness import ApproachProcess, Topics
from jobs.dev.bench.measure import Observer
from jobs.dev.bench.scenarios import SCENARIOS
from jobs.dev.bench.workload import InputProducer
from jobs.dev.simulator import spawn as spawn_simulator
from jobs.runtime import jars

CASES: dict[str, dict[str, Any]] = {
    # One record that is not JSON, in the middle of the input (the model is fine).
    "malformed": {"simulator": ["--latency", "fixed:5"], "timeout": "3 min"},
    # The model answers 5% of calls with HTTP 500 (the OpenAI SDK retries 5xx).
    "http-500": {"simulator": ["--latency", "fixed:5", "--error-rate", "0.05", "--error-status", "500"],
                 "timeout": "3 min"},
    # 1% of calls hang for up to 60 s; ML_PREDICT's per-row timeout is 5 s.
    "timeout": {"simulator": ["--latency", "fixed:5", "--hang-rate", "0.01", "--hang-max-s", "60"],
                "timeout": "5 s"},
}


def _rest(pid: int) -> tuple[str, str] | None:
    """(base URL, job id) of the mini cluster under `pid`, once it runs a job."""
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process(pid).children(recursive=True):
            if proc.name() != "java":
                continue
            for conn in proc.net_connections(kind="tcp"):
                if conn.status != psutil.CONN_LISTEN:
                    continue
                base = f"http://127.0.0.1:{conn.laddr.port}"
                with contextlib.suppress(requests.RequestException, ValueError, AttributeError, KeyError):
                    jobs = requests.get(f"{base}/jobs/overview", timeout=0.5).json().get("jobs") or []
                    if jobs:
                        return base, str(jobs[0]["jid"])
    return None


def _job_state(rest: tuple[str, str]) -> dict[str, Any]:
    base, jid = rest
    state: dict[str, Any] = {}
    with contextlib.suppress(requests.RequestException, ValueError):
        state["status"] = requests.get(f"{base}/jobs/{jid}", timeout=1).json().get("state")
        metrics = requests.get(f"{base}/jobs/{jid}/metrics?get=numRestarts", timeout=1).json()
        state["restarts"] = next((int(float(m["value"])) for m in metrics if m.get("id") == "numRestarts"), None)
        history = ((requests.get(f"{base}/jobs/{jid}/exceptions?maxExceptions=1", timeout=1).json()
                    .get("exceptionHistory") or {}).get("entries") or [])
        if history:
            trace = str(history[0].get("stacktrace", ""))
            causes = [line for line in trace.splitlines() if line and not line.startswith(("\tat ", "\t..."))]
            state["failure"] = " | ".join(causes[:1] + causes[-2:])[:600]
    return state


def _first_output(bootstrap: str, topic: str) -> str | None:
    """The first committed answer as written, to show what the job's JSON looks like."""
    from kafka import KafkaConsumer, TopicPartition  # type: ignore[import-untyped]

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                             enable_auto_commit=False, consumer_timeout_ms=3000)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        for message in consumer:
            return bytes(message.value).decode(errors="replace")[:400]
    finally:
        consumer.close()
    return None


def run_case(name: str, broker: local_kafka.LocalBroker, workdir: Path, records: int, max_seconds: float
             ) -> dict[str, Any]:
    case = CASES[name]
    bootstrap = broker.bootstrap_servers
    simulator = spawn_simulator([*case["simulator"], "--concurrency", "64", "--seed", "7", "--stats-interval-s", "0",
                                 "--log-level", "WARNING"])
    topics = Topics.fresh(SCENARIOS["a"], f"limits-{name}")
    kafka_admin.create_topics(bootstrap, [topics.input, topics.output, topics.dead_letter], partitions=1)
    producer = InputProducer(bootstrap, topics.input)
    if name == "malformed":
        producer.send(records // 2)
        producer._producer.send(topics.input, key=b"bad", value=b"{this is not json", partition=0)
        producer.send(records - records // 2)
        producer.settle()
    else:
        producer.preload(records)
    observer = Observer(bootstrap, topics.output, topics.dead_letter)
    observer.start()
    command = [sys.executable, "-m", "jobs.dev.bench.ml_predict", "--bootstrap", bootstrap, "--input", topics.input,
               "--output", topics.output, "--group", topics.group, "--endpoint", simulator.url, "--bounded",
               "--timeout", case["timeout"]]
    log_file = workdir / f"{name}.log"
    proc = ApproachProcess(command, log_file, {"FLINK_LOG_DIR": str(workdir / f"{name}-flink-log")})
    started = time.monotonic()
    rest: tuple[str, str] | None = None
    state: dict[str, Any] = {}
    sample: str | None = None
    ended = "not started"
    try:
        while proc.running() and time.monotonic() - started < max_seconds:
            rest = rest or _rest(proc.pid)
            if rest is not None:
                state = _job_state(rest) or state
            time.sleep(2)
        ended = "exited" if not proc.running() else f"stopped after {max_seconds:g} s"
        proc.stop()
        time.sleep(3)
    finally:
        proc.stop(5)
        proc.reap_group()
        observer.stop()
        observer.join(10)
        producer.close()
    first, counts = observer.snapshot()
    stats = simulator.stats()
    simulator.stop()
    with contextlib.suppress(Exception):
        sample = next(iter(first))
    return {"case": name, "records": records, "answered": len(first),
            "duplicates": sum(1 for n in counts.values() if n > 1), "ended": ended,
            "exit_code": proc.process.returncode, "seconds": round(time.monotonic() - started, 1),
            "job": state, "simulator": {k: stats.get(k) for k in ("served", "errors", "max_in_flight")},
            "sample_id": sample, "first_output": _first_output(bootstrap, topics.output), "log": str(log_file)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.ml_predict_limits",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--max-seconds", type=float, default=240)
    args = parser.parse_args(argv)
    jars.ensure("broker")
    jars.ensure("connector")
    jars.ensure("ml-predict")
    workdir = Path(tempfile.mkdtemp(prefix="ml-predict-limits-"))
    broker = local_kafka.LocalBroker(local_kafka.BrokerConfig.ephemeral(workdir / "kafka"))
    broker.start(timeout=120)
    try:
        for name in args.cases.split(","):
            print(json.dumps(run_case(name, broker, workdir, args.records, args.max_seconds)), flush=True)
    finally:
        broker.stop()
    print(f"ml-predict-limits: logs in {workdir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
