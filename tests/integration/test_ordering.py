"""A CDC stream through the job: per-key order and tombstones on a real standalone cluster, a real
broker and the simulator with lognormal latency (issue 22, "Done when").

Each key has `VERSIONS` versions (an id `<key>-v<n>`); some keys end with a tombstone (deleted),
some have one in the middle (deleted, then written again). A key's versions are produced one after
another, so with `async.capacity` 16 several versions of a key are in flight at once and finish in
any order. A downstream read_committed consumer then checks, per key:

- `ordering: per_key`, with a TaskManager SIGKILL mid-run: the versions arrive strictly increasing,
  the last one is the newest, and each tombstone (a null value, not an empty one) arrives exactly
  where it was in the input;
- `ordering: none`, no fault: the same check finds keys out of order, so it can fail.

`KEYS` x `VERSIONS` is the issue's 200 x 10 (2,000 records; the helper that wrote it measured with
120 x 10 on a machine at load 15-20, where the restart after the kill took most of the run). One job
run per mode.

Run: ``pytest tests/integration/test_ordering.py``. 200 x 10 on a quiet machine: both tests 228 s
with the broker and cluster start (the kill at 499 of 2,000, 58 s from it to the end). Before, at load
15-20 with 120 keys: 295 s (per_key, the restart after the kill most of it) and 97 s (none), plus ~80 s to start
the session's broker and cluster when no other test has.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.local_cluster import LocalCluster
from tests.support.cluster import not_failed, wait_for_checkpoints
from tests.support.committed import CommittedReader
from tests.support.job_setup import JobSetup, SpawnSimulator, make_job
from tests.support.waiting import METRICS_SETTLE_S
from udfs.config import to_dict

pytestmark = [pytest.mark.integration, pytest.mark.fault]

KEYS = 200
VERSIONS = 10
DELETED_AT_END = range(0, KEYS, 10)
"""Keys whose last record is a tombstone."""
DELETED_IN_MIDDLE = range(5, KEYS, 10)
"""Keys with a tombstone in place of version 4 (deleted, then written again)."""
CAPACITY = 16
LATENCY = "lognormal:40:600"
"""Median 40 ms, p99 600 ms: a later version often overtakes an earlier one."""

Event = tuple[str, int | None]
"""What one output record says of its key: ("v", version) for a result, ("tombstone", None)."""


def cdc_records() -> tuple[list[tuple[bytes, bytes | None]], dict[str, list[Event]]]:
    """The input (key-major: a key's versions back to back) and, per key, what its output must be."""
    records: list[tuple[bytes, bytes | None]] = []
    expected: dict[str, list[Event]] = {}
    for k in range(KEYS):
        key = f"doc-{k:04d}"
        events: list[Event] = []
        for version in range(VERSIONS):
            tombstone = (k in DELETED_AT_END and version == VERSIONS - 1) or (k in DELETED_IN_MIDDLE and version == 4)
            if tombstone:
                records.append((key.encode(), None))
                events.append(("tombstone", None))
            else:
                body = {"id": f"{key}-v{version}", "prompt": f"Summarise version {version} of {key}.",
                        "params": {"max_tokens": 8}}
                records.append((key.encode(), json.dumps(body).encode()))
                events.append(("v", version))
        expected[key] = events
    return records, expected


def output_by_key(setup: JobSetup) -> tuple[dict[str, list[Event]], int]:
    """Every committed output record, per key in the order a consumer reads them (a key's records
    share a partition); and how many values were empty byte strings instead of null."""
    got: dict[str, list[Event]] = defaultdict(list)
    empty = 0
    for record in kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, timeout_s=60):
        key = record.key.decode()
        if record.value is None:
            got[key].append(("tombstone", None))
            continue
        if record.value == b"":
            empty += 1
        version = int(json.loads(record.value)["id"].rsplit("-v", 1)[1])
        got[key].append(("v", version))
    return got, empty


def out_of_order(got: dict[str, list[Event]], expected: dict[str, list[Event]]) -> list[str]:
    """Keys whose output differs from their input order (versions not strictly increasing, the
    last not the newest, or a tombstone elsewhere than it was)."""
    return sorted(k for k in expected if got.get(k) != expected[k])


def start(cluster: LocalCluster, tmp_path: Path, bootstrap: str, endpoint: str, *, ordering: str,
          name: str) -> tuple[JobSetup, CommittedReader, str, int]:
    setup = make_job(tmp_path, bootstrap, endpoint, name=name, async_={"capacity": CAPACITY},
                     input={"tombstones": "forward"})
    config = dataclasses.replace(setup.config, ordering=ordering)  # type: ignore[arg-type]
    setup.path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    setup = JobSetup(config, setup.path)
    records, _ = cdc_records()
    kafka_admin.produce(bootstrap, setup.input_topic, records)
    reader = CommittedReader(bootstrap, [setup.output_topic, setup.dead_letter_topic])
    reader.start()
    job_id = cluster.submit(setup.path)
    cluster.wait_for_job_state(job_id, "RUNNING", timeout=180)
    return setup, reader, job_id, len(records)


def finish(cluster: LocalCluster, reader: CommittedReader, job_id: str, total: int, timeout: float = 420) -> None:
    done = reader.wait_for(total, timeout, unique=False, check=not_failed(cluster, job_id))
    wait_for_checkpoints(cluster, job_id, 3)  # a late duplicate would show
    reader.stop()
    assert done, f"only {reader.count()} of {total} records arrived within {timeout} s"


def test_per_key_order_and_tombstones_survive_a_taskmanager_kill(
        cluster: LocalCluster, spawn_simulator: SpawnSimulator, tmp_path: Path,
        kafka_broker: local_kafka.LocalBroker) -> None:
    sim = spawn_simulator(["--latency", LATENCY, "--seed", "7"])
    setup, reader, job_id, total = start(cluster, tmp_path, kafka_broker.bootstrap_servers, sim.url,
                                         ordering="per_key", name="cdc-per-key")
    assert reader.wait_for(total // 5, 240, unique=False), f"{reader.count()} of {total} before the kill"
    assert reader.count() < total, "the stream finished before the kill"
    committed_at_kill = reader.count()
    killed_at = time.monotonic()
    cluster.replace_taskmanager(job_id)
    finish(cluster, reader, job_id, total)
    cluster.reap_orphans(grace_s=2)
    restarts = cluster.num_restarts(job_id, settle_s=METRICS_SETTLE_S)
    print(f"per_key: {committed_at_kill} of {total} committed at the kill, "
          f"{time.monotonic() - killed_at:.1f} s from the kill to the end, {restarts} restart(s)")

    assert restarts >= 1
    got, empty = output_by_key(setup)
    _, expected = cdc_records()
    assert empty == 0, "a tombstone was written as an empty value, not a null one"
    assert kafka_admin.consume_committed(setup.bootstrap, setup.dead_letter_topic, timeout_s=30) == []
    wrong = out_of_order(got, expected)
    assert wrong == [], {k: got.get(k) for k in wrong[:5]}
    for k in DELETED_AT_END:
        assert got[f"doc-{k:04d}"][-1] == ("tombstone", None)


def test_without_per_key_order_the_same_stream_is_reordered(
        cluster: LocalCluster, spawn_simulator: SpawnSimulator, tmp_path: Path,
        kafka_broker: local_kafka.LocalBroker) -> None:
    """The check above can fail: in completion order the versions of a key cross."""
    sim = spawn_simulator(["--latency", LATENCY, "--seed", "7"])
    setup, reader, job_id, total = start(cluster, tmp_path, kafka_broker.bootstrap_servers, sim.url,
                                         ordering="none", name="cdc-none")
    finish(cluster, reader, job_id, total)
    got, _ = output_by_key(setup)
    _, expected = cdc_records()
    assert sum(len(v) for v in got.values()) == total
    wrong = out_of_order(got, expected)
    print(f"none: {len(wrong)} of {KEYS} keys out of order")
    assert len(wrong) >= KEYS // 4, f"only {len(wrong)} keys reordered without per_key: the check may not bind"
