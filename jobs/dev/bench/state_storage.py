"""Checkpoint and savepoint durations with the state directory on S3 against the local disk.

    python -m jobs.dev.bench.state_storage [--scenarios a,d] [--lanes keyed,vectorized]
        [--stores local,s3] [--records N] [--checkpoint-interval-ms MS] [--savepoints 2] [--json FILE]

For each scenario x lane x store: fresh topics, the scenario's records preloaded (bench (a): 20,000
records at a fixed 50 ms; (d): 30,000 at an instant model; `--records` overrides), and the job as the
bench runs it (`llmstream run --until-end` on the generated config, `jobs/dev/bench/harness.py`), its
state directory a local one or ``s3://llmstream/…`` on s3proxy (`jobs/dev/object_store.py`) on this
machine. While it runs, every completed checkpoint's end-to-end duration is read from the mini
cluster's REST API (`/jobs/:id/checkpoints`, whose history keeps only the last few: it is read every
second and collected here), and `--savepoints` savepoints are triggered through the same API
(``POST /jobs/:id/savepoints`` into the state directory) at even fractions of the records visible,
each timed by Flink (its end-to-end duration) and by the wall clock from trigger to completion.

**Why a module of its own, not a `llmstream bench` option:** the bench compares approaches with the
state where each keeps it; this holds the approach fixed and varies only where the state lives, with
its own axes (store, lane) and its own figures (savepoints, which the bench never takes). It reuses
the bench's scenarios, generated config, process handling and checkpoint sampler, so a run here is
the bench's llmstream run with one setting moved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.bench.harness import (
    REPO_ROOT,
    ApproachProcess,
    LlmstreamSettings,
    Topics,
    llmstream_config,
)
from jobs.dev.bench.measure import CheckpointSampler, Observer, percentile
from jobs.dev.bench.scenarios import SCENARIOS, Scenario
from jobs.dev.bench.workload import InputProducer
from jobs.dev.object_store import DEFAULT_BUCKET, ObjectStore, ObjectStoreConfig
from jobs.dev.simulator import spawn as spawn_simulator
from jobs.runtime.ports import free_port

__all__ = ["StorageRun", "main", "measure"]

SAVEPOINT_TIMEOUT_S = 300.0


@dataclass
class StorageRun:
    """One scenario x lane x store: its checkpoints' and savepoints' durations (ms)."""

    scenario: str
    lane: str
    store: str
    records: int
    seen: int = 0
    seconds: float = 0.0
    exit_code: int | None = None
    checkpoints: list[float] = field(default_factory=list)
    savepoints: list[dict[str, Any]] = field(default_factory=list)
    failed_checkpoints: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """Why the triggered checkpoints that failed did (the rest were refused at the trigger: see
    `CheckpointSampler`)."""
    state_bytes_p50: float | None = None

    def row(self) -> str:
        ckpt = (f"{len(self.checkpoints)} | {percentile(self.checkpoints, 50):,.0f} | {percentile(self.checkpoints, 99):,.0f}"
                if self.checkpoints else "0 | – | –")
        saves = ", ".join(f"{s['flink_ms']:,.0f}" if s.get("flink_ms") is not None else str(s.get("error", "?"))
                          for s in self.savepoints) or "–"
        return (f"| ({self.scenario}) {self.lane} | {self.store} | {self.seen:,}/{self.records:,} in {self.seconds:.0f} s "
                f"| {ckpt} | {saves} |")


class CheckpointHistory(CheckpointSampler):
    """`CheckpointSampler` that also keeps every completed checkpoint and savepoint it sees in the
    REST API's short history, by id, and can trigger a savepoint on the job it found."""

    def __init__(self, root_pid: int) -> None:
        super().__init__(root_pid, interval_s=1.0)
        self.entries: dict[int, dict[str, Any]] = {}

    def take(self, data: Any) -> None:
        super().take(data)
        if isinstance(data, dict):
            for entry in data.get("history") or []:
                if entry.get("status") == "COMPLETED":
                    self.entries[int(entry["id"])] = entry

    @property
    def job(self) -> tuple[str, str] | None:
        return (self._base, self._job) if self._base is not None and self._job is not None else None

    def checkpoint_durations(self) -> list[float]:
        return [float(e["end_to_end_duration"]) for _, e in sorted(self.entries.items())
                if not e.get("is_savepoint")]

    def state_sizes(self) -> list[float]:
        return [float(e.get("state_size") or e.get("checkpointed_size") or 0) for e in self.entries.values()
                if not e.get("is_savepoint")]

    def savepoint(self, directory: str) -> dict[str, Any]:
        """Triggers a savepoint into ``directory`` and waits for it: Flink's end-to-end duration
        (from its checkpoint history) and the wall-clock time from trigger to completion."""
        found = self.job
        if found is None:
            return {"error": "no job found"}
        base, job = found
        started = time.monotonic()
        answer = requests.post(f"{base}/jobs/{job}/savepoints", json={"target-directory": directory, "cancel-job": False},
                               timeout=10).json()
        request = answer.get("request-id")
        if request is None:
            return {"error": str(answer)[:200]}
        deadline = started + SAVEPOINT_TIMEOUT_S
        while time.monotonic() < deadline:
            status = requests.get(f"{base}/jobs/{job}/savepoints/{request}", timeout=10).json()
            if (status.get("status") or {}).get("id") == "COMPLETED":
                wall_ms = (time.monotonic() - started) * 1000
                operation = status.get("operation") or {}
                if "failure-cause" in operation:
                    return {"error": str(operation["failure-cause"].get("class", "failed")), "wall_ms": wall_ms}
                location = str(operation.get("location"))
                return {"flink_ms": self._flink_duration(base, job, location), "wall_ms": round(wall_ms),
                        "location": location}
            time.sleep(0.2)
        return {"error": f"not completed in {SAVEPOINT_TIMEOUT_S:g} s"}


    def _flink_duration(self, base: str, job: str, location: str, wait_s: float = 20.0) -> float | None:
        """The savepoint's end-to-end duration in Flink's checkpoint statistics, which the REST API
        caches for a few seconds (``rest.cache.checkpoint-statistics-timeout``): asked until it shows."""
        deadline = time.monotonic() + wait_s
        while True:
            with contextlib.suppress(requests.RequestException, ValueError):
                self.take(requests.get(f"{base}/jobs/{job}/checkpoints", timeout=10).json())
            for entry in self.entries.values():
                path = str(entry.get("external_path") or "").removesuffix("/_metadata")
                if entry.get("is_savepoint") and path and (path == location or location.endswith(path.split("://")[-1])):
                    return float(entry["end_to_end_duration"])
            if time.monotonic() > deadline:
                return None
            time.sleep(1.0)


def _config(scenario: Scenario, lane: str, store: str, topics: Topics, broker: local_kafka.LocalBroker,
            endpoint: str, object_store: ObjectStore | None, workdir: Path, interval_ms: int) -> tuple[Path, str]:
    """The bench's generated config for this run, its state directory moved to ``store``."""
    settings = LlmstreamSettings.recommended(scenario)
    settings = LlmstreamSettings(**{**asdict(settings), "checkpoint_interval_ms": interval_ms})
    data = llmstream_config(topics, broker.bootstrap_servers, endpoint, settings, scenario, workdir / "state",
                            vectorized=lane == "vectorized")
    if store == "s3":
        assert object_store is not None
        data["checkpointing"]["directory"] = f"s3://{DEFAULT_BUCKET}/bench-{topics.group}"
        data["flink"] = {**(data.get("flink") or {}), **object_store.flink_settings()}
    path = workdir / f"{topics.group}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, str(data["checkpointing"]["directory"]).rstrip("/") + "/savepoints"


def measure(scenario: Scenario, lane: str, store: str, records: int, broker: local_kafka.LocalBroker,
            endpoint: str, object_store: ObjectStore | None, workdir: Path, *, interval_ms: int,
            savepoints: int, say: Any = print) -> StorageRun:
    """One run; see the module docstring."""
    label = f"[{scenario.key}/{lane}/{store}]"
    topics = Topics.fresh(scenario, f"{lane}-{store}")
    kafka_admin.create_topics(broker.bootstrap_servers, [topics.input, topics.output, topics.dead_letter], partitions=1)
    producer = InputProducer(broker.bootstrap_servers, topics.input, keys=scenario.keys)
    producer.preload(records)
    producer.close()
    config, savepoints_dir = _config(scenario, lane, store, topics, broker, endpoint, object_store, workdir, interval_ms)
    env = object_store.credentials_env() if object_store is not None and store == "s3" else {}
    result = StorageRun(scenario.key, lane, store, records)
    observer = Observer(broker.bootstrap_servers, topics.output, topics.dead_letter)
    observer.start()
    proc = ApproachProcess([sys.executable, "-m", "jobs.cli", "run", "--config", str(config), "--until-end",
                            "--progress-every", "10"], workdir / f"{topics.group}.log", env)
    history = CheckpointHistory(proc.pid)
    history.start()
    say(f"{label} {records:,} records, state in {savepoints_dir.rsplit('/savepoints', 1)[0]}")
    started = time.monotonic()
    marks = [records * (i + 1) // (savepoints + 1) for i in range(savepoints)]
    try:
        while proc.running():
            if marks and observer.seen >= marks[0]:
                marks.pop(0)
                taken = history.savepoint(savepoints_dir)
                say(f"{label} savepoint at {observer.seen:,} visible: {taken}")
                result.savepoints.append(taken)
            if time.monotonic() - started > 1800:
                say(f"{label} still running after 30 min: stopping it")
                break
            time.sleep(0.5)
        result.seconds = time.monotonic() - started
    finally:
        proc.stop()
        proc.reap_group()
        history.stop()
        history.join(10)
        time.sleep(2)
        observer.stop()
        observer.join(10)
    result.exit_code = proc.process.returncode
    result.seen = observer.seen
    result.checkpoints = history.checkpoint_durations()
    result.failed_checkpoints = int(((history.latest or {}).get("counts") or {}).get("failed") or 0)
    result.failures = dict(Counter(history.failed.values()))
    result.state_bytes_p50 = percentile(history.state_sizes(), 50)
    if result.exit_code != 0:
        say(f"{label} exit code {result.exit_code}; last lines:\n{proc.tail()}")
    with contextlib.suppress(Exception):
        kafka_admin.delete_topics(broker.bootstrap_servers, [topics.input, topics.output, topics.dead_letter])
    say(f"{label} {result.row()}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.state_storage", description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="a,d", help="bench scenarios (default a,d)")
    parser.add_argument("--lanes", default="keyed,vectorized")
    parser.add_argument("--stores", default="local,s3")
    parser.add_argument("--records", type=int, default=None, help="records a run (default: the scenario's)")
    parser.add_argument("--checkpoint-interval-ms", type=int, default=2000)
    parser.add_argument("--savepoints", type=int, default=2, help="savepoints triggered a run (default 2)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = parser.parse_args(argv)
    workdir = args.workdir or REPO_ROOT / "var" / "bench" / f"state-storage-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True, exist_ok=True)
    stores = args.stores.split(",")
    broker = local_kafka.LocalBroker(local_kafka.BrokerConfig.ephemeral(workdir / "kafka"))
    store = ObjectStore(ObjectStoreConfig(port=free_port(), data_dir=workdir / "object-store")) if "s3" in stores else None
    results: list[StorageRun] = []
    try:
        broker.start(timeout=120)
        if store is not None:
            store.config.data_dir.mkdir(parents=True, exist_ok=True)
            store.start()
        for key in args.scenarios.split(","):
            scenario = SCENARIOS[key]
            simulator = spawn_simulator(scenario.simulator_args())
            try:
                for lane in args.lanes.split(","):
                    for where in stores:
                        results.append(measure(scenario, lane, where, args.records or scenario.records, broker,
                                               simulator.url, store, workdir, interval_ms=args.checkpoint_interval_ms,
                                               savepoints=args.savepoints))
            finally:
                simulator.stop()
    finally:
        if store is not None:
            store.stop()
        broker.stop()
    print("\n| run | state | records | checkpoints | p50 ms | p99 ms | savepoints (Flink, ms) |")
    print("|---|---|---|---|---|---|---|")
    for run in results:
        print(run.row())
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0 if all(r.exit_code == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
