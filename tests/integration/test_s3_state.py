"""State on S3 (s3proxy, a real S3-compatible server): the state seam's S3 store, and `llmstream run`
with ``checkpointing.directory: s3://…`` stopped midway and resumed, observed, guarded against a
second run, and a bad endpoint refused in one line before any JVM starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests

from jobs.clients import kafka_admin
from jobs.dev import simulator
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.local_kafka import LocalBroker
from jobs.dev.object_store import DEFAULT_BUCKET, ObjectStore
from jobs.runtime.ports import free_port
from jobs.state.snapshots import LocalRun as RunRecord
from jobs.state.snapshots import StateDir
from jobs.state.storage import S3Settings, S3Store, StoreError
from tests.conftest import SHELL_ENV
from tests.support.committed import CommittedReader, check_exactly_once, final_tally
from tests.support.job_setup import SIM_ARGS, make_job, unique_records
from tests.support.runs import LocalRun

pytestmark = [pytest.mark.integration]

STATE_ON = os.environ.get("LLMSTREAM_S3_TEST_STATE", "s3")
"""``local`` runs the run scenario with a local state directory instead: the baseline of the
checkpoint durations docs/operations.md ("State on object storage") compares."""


def _store(object_store: ObjectStore, prefix: str) -> S3Store:
    return S3Store(f"s3://{DEFAULT_BUCKET}/{prefix}", S3Settings.from_flink(
        {**object_store.flink_settings(), "s3.access-key": object_store.config.identity,
         "s3.secret-key": object_store.config.credential}))


def test_the_s3_store_lists_reads_writes_and_deletes(object_store: ObjectStore) -> None:
    store = _store(object_store, f"seam-{uuid.uuid4().hex[:8]}")
    store.check(create=True)
    assert store.read("job.json") is None and not store.exists("checkpoints")
    store.write("checkpoints/j/chk-1/_metadata", b"m1")
    store.write("checkpoints/j/shared/x", b"x")
    store.write("job.json", b"{}")
    assert store.read("checkpoints/j/chk-1/_metadata") == b"m1"
    assert sorted(f.key for f in store.list("checkpoints/")) == ["checkpoints/j/chk-1/_metadata", "checkpoints/j/shared/x"]
    assert store.exists("checkpoints") and store.exists("job.json")
    store.delete("checkpoints/")
    assert list(store.list("checkpoints/")) == [] and store.read("job.json") == b"{}"
    wrong = S3Store(store.uri, S3Settings(endpoint=object_store.endpoint, path_style=True,
                                          access_key="llmstream-dev", secret_key="not-the-secret-4f2a"))
    with pytest.raises(StoreError) as err:
        wrong.check(create=False)
    assert "not-the-secret-4f2a" not in str(err.value) and "\n" not in str(err.value)


def _s3_job(tmp_path: Path, broker: LocalBroker, object_store: ObjectStore, endpoint: str, name: str,
            **sections: Any) -> tuple[Any, dict[str, str]]:
    """A job whose state is in the store (its ``flink:`` keys Flink's own), and the environment of
    its commands: the store's key pair through the AWS standard chain."""
    directory = f"s3://{DEFAULT_BUCKET}/{name}-{uuid.uuid4().hex[:8]}" if STATE_ON == "s3" else str(tmp_path / "state")
    setup = make_job(tmp_path, broker.bootstrap_servers, endpoint, name=name,
                     checkpointing={"directory": directory}, flink=object_store.flink_settings(), **sections)
    return setup, object_store.credentials_env()


def _checkpoint_summary(log: str) -> dict[str, Any]:
    """The end-to-end checkpoint durations of the run whose output is `log`, from its REST API."""
    line = next(x for x in log.splitlines() if "web UI and REST API at " in x)
    rest = line.split("web UI and REST API at ")[1].split(";")[0].strip()
    job = next(j for j in requests.get(f"{rest}/jobs", timeout=5).json()["jobs"] if j["status"] == "RUNNING")
    stats = requests.get(f"{rest}/jobs/{job['id']}/checkpoints", timeout=5).json()
    return {"completed": stats["counts"]["completed"], **stats["summary"]["end_to_end_duration"]}


def _llmstream(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True,
                          env={**SHELL_ENV, **env}, timeout=timeout, check=False)


def test_a_run_on_s3_stops_resumes_and_refuses_a_second_run(
        kafka_broker: LocalBroker, object_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM midway stops with a savepoint in the bucket; a second run while the first is live is
    refused by its lease; `status` reads the run record from the bucket; the rerun resumes from the
    savepoint there, and every id is in the output once."""
    sim = simulator.spawn(SIM_ARGS)
    try:
        setup, env = _s3_job(tmp_path, kafka_broker, object_store, sim.url, "s3-state")
        for name, value in env.items():  # this process reads the run record too
            monkeypatch.setenv(name, value)
        records = unique_records(2500, "s3")
        ids = [k.decode() for k, _ in records]
        kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
        reader = CommittedReader(setup.bootstrap, [setup.output_topic, setup.dead_letter_topic])
        reader.start()
        first = LocalRun(setup.path, tmp_path / "first.log", env=env)
        # 100 ids committed: several checkpoints on S3 (a loaded machine may run at a few records a second)
        assert reader.wait_for(100, 600, check=lambda: first.process.poll() is None), first.output()[-3000:]

        second = _llmstream("run", "--config", str(setup.path), env=env)
        assert second.returncode != 0 and "another llmstream run" in second.stderr, second.stderr[-2000:]
        assert "Traceback" not in second.stderr

        status = _llmstream("status", "--config", str(setup.path), "--json", "--no-topic", env=env)
        assert status.returncode == 0, status.stderr[-2000:]
        assert json.loads(status.stdout)["job"]["state"] == "RUNNING"

        summary = _checkpoint_summary(first.output())
        print(f"\ncheckpoints with state on {STATE_ON}: {json.dumps(summary)}")
        first.process.send_signal(signal.SIGTERM)  # as `kill PID` does (to the group it would stop the JVM too)
        assert first.wait(timeout=240) == 0, first.output()[-3000:]
        stopped = first.output()
        assert f"resumes from savepoint {setup.config.checkpointing.directory}" in stopped.replace("file:", ""), \
            stopped[-3000:]
        assert reader.unique_ids() < len(ids), "the run finished before it was stopped"
        record = RunRecord.load(StateDir.for_job(setup.config))
        assert record is not None and record.ended_at is not None  # the run record, read from where it lives

        last = LocalRun(setup.path, tmp_path / "last.log", "--until-end", env=env)
        assert last.wait(timeout=600) == 0, last.output()[-3000:]
        assert "resuming from savepoint" in last.output(), last.output()[-3000:]
        reader.stop()
    finally:
        sim.stop()
    result = final_tally(setup, ids)
    check_exactly_once(result)
    assert result.dead == 0, result.dead_reasons


def test_a_cluster_job_on_s3_backfills_and_stops_with_a_savepoint_there(
        kafka_broker: LocalBroker, object_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`llmstream submit --until-end` to a standalone cluster whose S3 settings are its own
    (`llmstream cluster start --setting`) and whose daemons have the credentials in their environment."""
    for name, value in object_store.credentials_env().items():
        monkeypatch.setenv(name, value)
    cluster = LocalCluster(ClusterConfig.ephemeral(tmp_path / "flink", settings=object_store.flink_settings()))
    cluster.start(taskmanagers=1, timeout=180)
    sim = simulator.spawn(SIM_ARGS)
    try:
        setup, env = _s3_job(tmp_path, kafka_broker, object_store, sim.url, "s3-cluster")
        records = unique_records(300, "s3c")
        kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
        done = _llmstream("submit", "--config", str(setup.path), "--jobmanager", cluster.address, "--until-end",
                          env=env, timeout=400)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert f"stopped with savepoint {setup.config.checkpointing.directory}/savepoints/" in done.stdout, done.stdout
    finally:
        sim.stop()
        cluster.stop()
    check_exactly_once(final_tally(setup, [k.decode() for k, _ in records]))


def test_an_unreachable_store_is_one_line_naming_the_setting(kafka_broker: LocalBroker, object_store: ObjectStore,
                                                           tmp_path: Path) -> None:
    port = free_port()
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, "http://127.0.0.1:9/v1", name="s3-unreachable",
                     checkpointing={"directory": f"s3://{DEFAULT_BUCKET}/nowhere"},
                     flink={"s3.endpoint": f"http://127.0.0.1:{port}", "s3.path.style.access": "true",
                            "s3.access-key": "${env:S3_KEY}", "s3.secret-key": "${env:S3_SECRET}"})
    started = time.monotonic()
    done = _llmstream("run", "--config", str(setup.path),
                      env={"S3_KEY": "llmstream-dev", "S3_SECRET": "canary-secret-91c3"})
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1].startswith(f"llmstream: config error: checkpointing.directory: s3://{DEFAULT_BUCKET}/nowhere cannot be reached "
                                f"at s3.endpoint http://127.0.0.1:{port}: "), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "canary-secret-91c3" not in done.stderr + done.stdout
    assert time.monotonic() - started < 60
