"""State on S3 (s3proxy, a real S3-compatible server): the state seam's S3 store; `llmstream run`
with ``checkpointing.directory: s3://…`` stopped midway and resumed, observed, guarded against a
second run and against another job's or another lane's config; a cluster job submitted, upgraded,
stopped and backfilled from savepoints in the bucket; and a bad S3 setting or an unreachable store
refused in one line naming it, before any JVM starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from jobs.clients import kafka_admin
from jobs.dev import simulator
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.local_kafka import LocalBroker
from jobs.dev.object_store import DEFAULT_BUCKET, ObjectStore
from jobs.runtime.ports import free_port
from jobs.state.location import checked_state_dir
from jobs.state.snapshots import LocalRun as RunRecord
from jobs.state.snapshots import StateDir
from jobs.state.storage import S3Settings, S3Store, StoreError
from tests.conftest import SHELL_ENV
from tests.support.cluster import not_failed
from tests.support.committed import CommittedReader, check_exactly_once, final_tally
from tests.support.job_setup import LONG_FAULT, SIM_ARGS, make_job, unique_records
from tests.support.runs import LocalRun
from udfs.errors import ConfigError

pytestmark = [pytest.mark.integration]

STATE_ON = os.environ.get("LLMSTREAM_S3_TEST_STATE", "s3")
"""``local`` runs the run scenario with a local state directory instead: the baseline of the
checkpoint durations docs/operations.md ("State on object storage") compares."""

BACKFILL_ON_S3 = os.environ.get("LLMSTREAM_LONG_FAULTS") == "1"
"""Whether the cluster scenario ends with `submit --until-end` from its stop's savepoint (a submission
more): in the full fault run (`make fault`), as the `LONG_FAULT` tests are; the test's docstring says
which `make test` tests prove its steps on S3."""


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


def _variant(config_path: Path, name: str, **changes: Any) -> Path:
    """The job's config with ``changes`` (``kafka`` keys merged, ``lane`` replaced), saved beside it:
    the same job name and state directory."""
    data = yaml.safe_load(config_path.read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            data[key] = {**(data.get(key) or {}), **value}
        else:
            if key == "lane":
                data.pop("stage", None)  # the lane's old name: a config gives one of the two
            data[key] = value
    path = config_path.with_name(f"{config_path.stem}-{name}.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _refused(done: subprocess.CompletedProcess[str], key: str, says: str) -> None:
    """A command refused by a setting: exit 2, one stderr line naming ``key`` and saying ``says``."""
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert lines[0].startswith(f"llmstream: config error: {key}: ") and says in lines[0], lines[0]


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
        assert reader.wait_for(100, 600, check=first.still_running), first.output()[-3000:]

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
        ended = _llmstream("status", "--config", str(setup.path), "--json", "--no-topic", env=env)
        assert ended.returncode == 0, ended.stderr[-2000:]
        assert json.loads(ended.stdout)["job"] | {"state": "ENDED", "id": record.job_id} \
            == json.loads(ended.stdout)["job"], ended.stdout[-2000:]

        # The state in the bucket belongs to this job and lane: another group or lane is refused
        # before any JVM starts, and the refusal changes nothing there.
        other_group = _variant(setup.path, "group", kafka={"group_id": f"{setup.config.kafka.group_id}-other"})
        _refused(_llmstream("run", "--config", str(other_group), env=env), "kafka.group_id",
                 "holds the state of a job with group_id")
        other_lane = _variant(setup.path, "vectorized", lane="vectorized")
        _refused(_llmstream("run", "--config", str(other_lane), env=env), "stage", "taken by the keyed lane")

        last = LocalRun(setup.path, tmp_path / "last.log", "--until-end", env=env)
        assert last.wait(timeout=600) == 0, last.output()[-3000:]
        assert "resuming from savepoint" in last.output(), last.output()[-3000:]
        reader.stop()
    finally:
        sim.stop()
    result = final_tally(setup, ids)
    check_exactly_once(result)
    assert result.dead == 0, result.dead_reasons


@pytest.fixture
def s3_cluster(object_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    """A standalone cluster of its own whose daemons have the store's S3 settings and, in their
    environment, its credentials (a cluster reads its file systems' settings when it starts)."""
    for name, value in object_store.credentials_env().items():
        monkeypatch.setenv(name, value)
    cluster = LocalCluster(ClusterConfig.ephemeral(tmp_path / "flink", settings=object_store.flink_settings()))
    cluster.start(taskmanagers=1, timeout=180)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_cluster_job_on_s3_upgrades_stops_and_backfills_from_savepoints_there(
        kafka_broker: LocalBroker, object_store: ObjectStore, s3_cluster: LocalCluster, tmp_path: Path) -> None:
    """On a standalone cluster whose S3 settings are its own (`llmstream cluster start --setting`) and
    whose daemons have the credentials in their environment: `llmstream submit`; `upgrade` to a larger
    capacity stops the job with a savepoint in the bucket and resubmits from it; an upgrade to another
    lane or group is refused while the job runs on; `status` finds the new job; once every id is in,
    `stop` puts a savepoint in the bucket. Every id once.

    Then, in the full fault run only (`BACKFILL_ON_S3`), `submit --until-end` resumes from that
    savepoint and finishes, a submission more: in `make test` its steps on S3 are proven apart, the
    submission from a savepoint in the bucket by the upgrade here, the newest savepoint found by
    listing the bucket by `test_a_run_on_s3_stops_resumes_and_refuses_a_second_run`'s rerun (the same
    launch plan, `jobs/launch/plan.py`), and a backfill ending with a draining savepoint on the cluster
    by tests/integration/test_cluster.py::test_submit_until_end_finishes_a_backfill."""
    cluster = s3_cluster
    sim = simulator.spawn(["--latency", "fixed:100", "--seed", "3"])
    reader: CommittedReader | None = None
    try:
        setup, env = _s3_job(tmp_path, kafka_broker, object_store, sim.url, "s3-cluster", async_={"capacity": 4})
        directory = setup.config.checkpointing.directory
        at = ("--jobmanager", cluster.address)
        records = unique_records(1200, "s3c")
        kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
        reader = CommittedReader(setup.bootstrap, [setup.output_topic, setup.dead_letter_topic])
        reader.start()
        submitted = _llmstream("submit", "--config", str(setup.path), *at, env=env)
        assert submitted.returncode == 0 and "no snapshot" in submitted.stdout, submitted.stdout + submitted.stderr[-3000:]
        first = str(cluster.live_jobs(setup.config.name)[0]["jid"])
        assert reader.wait_for(100, 600, check=not_failed(cluster, first)), cluster.failure(first)

        faster = _variant(setup.path, "faster", **{"async": {"capacity": 8}})
        upgraded = _llmstream("upgrade", "--config", str(faster), *at, env=env, timeout=400)
        assert upgraded.returncode == 0, upgraded.stdout[-2000:] + upgraded.stderr[-3000:]
        assert f"savepoint {directory}/savepoints/savepoint-" in upgraded.stdout, upgraded.stdout
        assert f"restored from {directory}/savepoints/savepoint-" in upgraded.stdout, upgraded.stdout
        second = str(cluster.live_jobs(setup.config.name)[0]["jid"])
        assert second != first
        cluster.wait_for_job_state(second, "RUNNING", timeout=180)

        for refused, key, says in ((_variant(faster, "vectorized", lane="vectorized"), "stage", "taken by the keyed lane"),
                                   (_variant(faster, "group", kafka={"group_id": "another-group"}), "kafka.group_id",
                                    "holds the state of a job with group_id")):
            _refused(_llmstream("upgrade", "--config", str(refused), *at, env=env), key, says)
        assert [str(j["jid"]) for j in cluster.live_jobs(setup.config.name)] == [second]
        assert cluster.job_status(second) == "RUNNING"

        status = _llmstream("status", "--config", str(faster), *at, "--json", "--no-topic", env=env)
        assert status.returncode == 0, status.stderr[-2000:]
        assert json.loads(status.stdout)["job"]["id"] == second, status.stdout[-2000:]

        assert reader.wait_for(len(records), 600, check=not_failed(cluster, second)), \
            cluster.failure(second)
        stopped = _llmstream("stop", "--config", str(faster), *at, env=env, timeout=300)
        assert stopped.returncode == 0 and f"savepoint {directory}/savepoints/" in stopped.stdout, \
            stopped.stdout + stopped.stderr[-3000:]
        if BACKFILL_ON_S3:
            done = _llmstream("submit", "--config", str(faster), *at, "--until-end", env=env, timeout=400)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
            assert "resuming from savepoint" in done.stdout, done.stdout
            assert f"stopped with savepoint {directory}/savepoints/" in done.stdout, done.stdout
    finally:
        if reader is not None:
            reader.stop()
        sim.stop()
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


BAD_SETTINGS = [
    pytest.param({"s3.endpoint": "ftp://127.0.0.1:{port}"}, {}, "flink.s3.endpoint",
                 "write http://HOST:PORT or https://", id="endpoint-of-another-scheme"),
    pytest.param({"s3.path.style.access": "yes"}, {}, "flink.s3.path.style.access", "write true",
                 id="path-style-not-a-boolean"),
    pytest.param({}, {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}, "checkpointing.directory",
                 "no S3 credentials found; set s3.access-key and s3.secret-key", id="no-credentials"),
    pytest.param({}, {"AWS_SECRET_ACCESS_KEY": "canary-secret-62b1"}, "checkpointing.directory",
                 "the store refused the credentials (SignatureDoesNotMatch", id="a-wrong-secret"),
    pytest.param({"bucket": "no-such-bucket"}, {}, "checkpointing.directory",
                 "the bucket 'no-such-bucket' does not exist", id="no-such-bucket"),
]
"""A bad S3 setting: the job's ``flink:`` keys (``bucket``: the state directory's), the environment of
the command, the setting the refusal names, and what it says."""


@pytest.mark.parametrize(("flink", "env", "key", "says"), BAD_SETTINGS)
def test_a_bad_s3_setting_is_refused_naming_it(flink: dict[str, str], env: dict[str, str], key: str, says: str,
                                               kafka_broker: LocalBroker, object_store: ObjectStore, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The state directory's check, the first step of every command (`jobs/state/location.py`),
    against the real store: a `ConfigError` naming the setting to fix, one line, no secret. (The
    whole command, one case of it: the test below.)"""
    settings = {**object_store.flink_settings(),
                **{k: v.format(port=object_store.config.port) for k, v in flink.items() if k != "bucket"}}
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, "http://127.0.0.1:9/v1", name="s3-bad",
                     checkpointing={"directory": f"s3://{flink.get('bucket', DEFAULT_BUCKET)}/bad"}, flink=settings)
    for name, value in {**object_store.credentials_env(), **_NO_AWS_FILES, **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        checked_state_dir(setup.config, None, create=True)
    assert err.value.key == key and says in err.value.problem, str(err.value)
    assert "\n" not in str(err.value) and "canary-secret" not in str(err.value)


_NO_AWS_FILES = {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials", "AWS_CONFIG_FILE": "/nonexistent/config",
                 "AWS_EC2_METADATA_DISABLED": "true"}
"""The AWS chain's other links, off: only the environment gives credentials."""


def test_a_wrong_secret_fails_the_command_in_one_line(kafka_broker: LocalBroker, object_store: ObjectStore,
                                                     tmp_path: Path) -> None:
    """`llmstream run` with a key pair the store refuses: one stderr line naming the credential
    settings (botocore's own "Found credentials" line kept out of it), exit 2, no secret shown."""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, "http://127.0.0.1:9/v1", name="s3-bad-secret",
                     checkpointing={"directory": f"s3://{DEFAULT_BUCKET}/bad-secret"}, flink=object_store.flink_settings())
    done = _llmstream("run", "--config", str(setup.path),
                      env={**object_store.credentials_env(), **_NO_AWS_FILES, "AWS_SECRET_ACCESS_KEY": "canary-secret-62b1"})
    _refused(done, "checkpointing.directory", "the store refused the credentials (SignatureDoesNotMatch")
    assert "Traceback" not in done.stderr and "canary-secret" not in done.stderr + done.stdout


@pytest.mark.fault
@LONG_FAULT
def test_a_taskmanager_killed_with_state_on_s3_restores_from_the_bucket_and_loses_nothing(
        kafka_broker: LocalBroker, object_store: ObjectStore, s3_cluster: LocalCluster, tmp_path: Path) -> None:
    """`kill -9` of a standalone cluster's only TaskManager while the job's checkpoints are in the
    bucket; a new TaskManager is started: the job restarts from its last checkpoint there (read back
    through Flink's S3 file system), and every id arrives once (`jobs/dev/history.py`). Prints the
    times from the kill to the job running again and to the first output after it."""
    cluster = s3_cluster
    sim = simulator.spawn(["--latency", "fixed:40", "--seed", "5"])
    reader: CommittedReader | None = None
    try:
        setup, env = _s3_job(tmp_path, kafka_broker, object_store, sim.url, "s3-tm-kill")
        records = unique_records(3000, "s3k")
        ids = [k.decode() for k, _ in records]
        kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
        reader = CommittedReader(setup.bootstrap, [setup.output_topic, setup.dead_letter_topic])
        reader.start()
        submitted = _llmstream("submit", "--config", str(setup.path), "--jobmanager", cluster.address, env=env)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr[-3000:]
        job = str(cluster.live_jobs(setup.config.name)[0]["jid"])
        assert reader.wait_for(600, 900, check=not_failed(cluster, job)), cluster.failure(job)
        state = StateDir.for_job(setup.config)
        latest = state.latest()
        assert latest is not None and latest.uri.startswith(f"s3://{DEFAULT_BUCKET}/"), latest

        killed_at = time.monotonic()
        committed_at_kill = reader.unique_ids()
        cluster.replace_taskmanager(job, start_timeout=180, running_timeout=300)
        running_at = time.monotonic()
        assert reader.wait_for(len(ids), 900, check=not_failed(cluster, job)), cluster.failure(job)
        first = reader.first_arrival_after(running_at)
        assert cluster.num_restarts(job, settle_s=5) >= 1
        print(f"\nTaskManager kill -9 with state on S3: {committed_at_kill} of {len(ids)} committed at the kill; "
              f"job RUNNING again {running_at - killed_at:.1f} s after it, first output after that at "
              f"{(first or running_at) - killed_at:.1f} s")
        stopped = _llmstream("stop", "--config", str(setup.path), "--jobmanager", cluster.address, env=env, timeout=300)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr[-3000:]
    finally:
        if reader is not None:
            reader.stop()
        sim.stop()
    check_exactly_once(final_tally(setup, ids))
