"""Flink upgraded under a running job: a savepoint taken by the Flink 2.2.1 build resumes in this one.

The 2.2.1 build is llmstream as it was before the move to Flink 2.3 (`tests.support.release_build`:
main at 7b3e867 with its own venv, apache-flink 2.2.1, connector and flink-conf/, built once per
machine in ``~/.cache/llmstream/builds/``). Each test starts the job with that build's ``llmstream``,
waits until the inference stage holds its whole capacity of 2-second calls in flight and a
checkpoint with calls in flight has committed output, stops it with a savepoint the way a user
does, then resumes with this checkout (Flink 2.3) from the same state directory and config file.
A read_committed consumer must then see every id exactly once: the calls in flight at the savepoint
are in its keyed state, so the 2.3 job issues them again (more model calls than records).

- locally: the 2.2.1 ``llmstream run``, Ctrl-C (stop with a savepoint), then ``llmstream run
  --until-end`` here;
- on a cluster: the 2.2.1 build's own standalone cluster, ``llmstream submit`` and ``llmstream
  stop``, that cluster stopped, then ``llmstream submit --until-end`` here on a 2.3 cluster. (``llmstream
  upgrade`` resubmits to the cluster it stopped, which cannot change that cluster's Flink.)
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from jobs.clients import kafka_admin
from jobs.clients.flink_rest import FlinkRest
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.local_kafka import LocalBroker
from jobs.dev.simulator import SpawnedSimulator
from jobs.launch import submit as submit_mod
from jobs.launch.plan import RunOptions
from jobs.runtime.ports import free_ports
from tests.support.committed import (
    CommittedReader,
    Tally,
    check_exactly_once,
    final_tally,
)
from tests.support.fault_report import FaultReport, FaultResult
from tests.support.job_setup import LONG_FAULT, JobSetup, make_job, unique_records
from tests.support.release_build import ReleaseBuild
from tests.support.runs import LocalRun
from tests.support.waiting import Hopeless, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.slow]

CAPACITY = 24
RECORDS = 480
"""24 calls of 2 s in flight: 12 records a second, ~40 s of work, most of it after the savepoint."""
STARTED = "started in a local mini cluster"


def portable_config(setup: JobSetup) -> Path:
    """The job's config file with only the keys it sets, the rest left to each build's defaults: the
    same file a user keeps across the upgrade, and one the 2.2.1 build reads whatever keys were
    added since."""
    config = setup.config
    kafka = config.kafka
    data = {
        "name": config.name,
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers, "input_topic": kafka.input_topic,
                  "output_topic": kafka.output_topic, "dead_letter_topic": kafka.dead_letter_topic,
                  "group_id": kafka.group_id, "transactional_id_prefix": kafka.transactional_id_prefix,
                  "create_topics": False, "topic_partitions": kafka.topic_partitions},
        "model": {"endpoint": config.model.endpoint, "model": config.model.model},
        "async": {"capacity": config.async_.capacity},
        "checkpointing": {"interval_ms": config.checkpointing.interval_ms,
                          "directory": config.checkpointing.directory},
    }
    path = setup.path.with_name(f"{setup.path.stem}-portable.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def job_with_backlog(tmp_path: Path, broker: LocalBroker, sim: SpawnedSimulator, name: str,
                     prefix: str) -> tuple[JobSetup, Path, list[str], CommittedReader]:
    """A job of capacity `CAPACITY` on topics of its own, its config file as both builds read it
    (`portable_config`), `RECORDS` requests with ids ``<prefix>-<i>`` waiting in its input, and a
    committed reader started on its output and dead letters."""
    setup = make_job(tmp_path, broker.bootstrap_servers, sim.url, name=name, async_={"capacity": CAPACITY})
    path = portable_config(setup)
    records = unique_records(RECORDS, prefix)
    kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
    reader = CommittedReader(setup.bootstrap, [setup.output_topic, setup.dead_letter_topic])
    reader.start()
    return setup, path, [k.decode() for k, _ in records], reader


def wait_for_full_stage(sim: SpawnedSimulator, reader: CommittedReader, alive: Callable[[], None],
                        timeout: float = 300) -> int:
    """Until the server holds `CAPACITY` calls and `CAPACITY` ids are committed (a checkpoint with
    calls in flight has completed); ``alive()`` raises `Hopeless` when the job it waits on is gone.
    Returns the calls in flight."""
    def full() -> int | None:
        alive()
        in_flight = int(sim.stats().get("in_flight") or 0)
        return in_flight if in_flight >= CAPACITY and reader.unique_ids() >= CAPACITY else None

    return wait_until(full, timeout, interval=0.2,
                      message=lambda: f"{CAPACITY} calls in flight with {CAPACITY} committed: {sim.stats()}, "
                                      f"{reader.unique_ids()} committed")


def record(fault_report: FaultReport, name: str, result: Tally, *, started: float, notes: str, **extra: object) -> None:
    fault_report.add(FaultResult(
        scenario=name, records_in=result.records_in, out=result.out, dead=result.dead,
        duplicates=result.duplicates, lost=result.lost, restarts=0, recovery_s=None,
        duration_s=round(time.monotonic() - started, 1), notes=notes,
        extra={"dead_reasons": result.dead_reasons, **extra}))


def test_a_savepoint_of_llmstream_run_on_flink_2_2_resumes_in_llmstream_run_on_2_3(
        flink22_build: ReleaseBuild, kafka_broker: LocalBroker, slow_simulator: SpawnedSimulator, tmp_path: Path,
        fault_report: FaultReport) -> None:
    sim = slow_simulator
    setup, path, ids, reader = job_with_backlog(tmp_path, kafka_broker, sim, "flink22-run", "up22run")
    started = time.monotonic()
    try:
        old = LocalRun(path, tmp_path / "run-2.2.log", command=flink22_build.command(), env=flink22_build.env(),
                       cwd=tmp_path)

        def alive() -> None:
            if old.process.poll() is not None:
                raise Hopeless(f"the 2.2.1 run exited {old.process.returncode}:\n{old.output()[-3000:]}")

        try:
            def job_started() -> bool:
                alive()
                return STARTED in old.output()

            wait_until(job_started, timeout=300, message="the 2.2.1 run to start its job")
            in_flight = wait_for_full_stage(sim, reader, alive)
            old.signal_group(signal.SIGINT)  # Ctrl-C: stop with a savepoint
            code = old.wait(timeout=300)
        finally:
            old.kill_if_running()
        out = old.output()
        assert code == 0, out[-3000:]
        assert "resumes from savepoint" in out and "no savepoint in time" not in out, out[-3000:]
        committed_at_stop = reader.unique_ids()
        calls_at_stop = int(sim.stats()["requests_total"])
        assert committed_at_stop < RECORDS, "the stream finished before the savepoint"

        new = LocalRun(path, tmp_path / "run-2.3.log", "--until-end", cwd=tmp_path)
        code = new.wait(timeout=600)
        out = new.output()
        assert code == 0, out[-3000:]
        assert "resuming from savepoint" in out, out[-3000:]
    finally:
        reader.stop()
    result = final_tally(setup, ids)
    calls = int(sim.stats()["requests_total"])
    record(fault_report, "u1. llmstream run on Flink 2.2.1, Ctrl-C with calls in flight, llmstream run on 2.3",
           result, started=started, notes=f"capacity {CAPACITY}, 2 s per call; {in_flight} calls in flight at the stop",
           calls_in_flight_at_stop=in_flight, committed_at_stop=committed_at_stop, calls_at_stop=calls_at_stop,
           model_calls=calls, calls_per_record=round(calls / RECORDS, 3))
    check_exactly_once(result)
    assert result.dead == 0, result.dead_reasons
    # The calls in flight at the savepoint never answered the 2.2.1 job; the 2.3 job found them in
    # its restored state and made each again. Without them, the check above would find them lost.
    assert calls > RECORDS, (calls, RECORDS)


@LONG_FAULT
def test_a_savepoint_of_a_flink_2_2_cluster_resumes_on_a_2_3_cluster(
        flink22_build: ReleaseBuild, cluster: LocalCluster, kafka_broker: LocalBroker,
        slow_simulator: SpawnedSimulator, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        fault_report: FaultReport) -> None:
    """In the full fault run only (`LONG_FAULT`: a 2.2.1 cluster of its own, ~135 worker-seconds).
    What it proves is proven in `make test` by others: that a 2.2.1 savepoint (with a full stage of
    calls in flight) restores on 2.3 is the test above; both builds take savepoints in Flink's
    canonical format, by `stopWithSavepoint(.., CANONICAL)` in `llmstream run` and by the REST
    `/stop` (whose default format is canonical) in `llmstream stop`, so the format is the same; that
    `submit --until-end` on a 2.3 standalone cluster resumes from a savepoint and finishes is
    `test_restarts.py::test_cluster_cancel_stop_upgrades_and_a_dead_jobmanager_all_resume_from_state`."""
    sim = slow_simulator
    setup, path, ids, reader = job_with_backlog(tmp_path, kafka_broker, sim, "flink22-cluster", "up22cl")
    started = time.monotonic()
    rest_port, rpc_port = free_ports(2)
    work = tmp_path / "flink-2.2"
    jobmanager = f"localhost:{rest_port}"
    try:
        done = flink22_build.run("cluster", "start", "--taskmanagers", "1", "--port", str(rest_port),
                                 "--rpc-port", str(rpc_port), "--work-dir", str(work), "--timeout", "240",
                                 cwd=tmp_path, timeout=400)
        assert done.returncode == 0, done.stdout + done.stderr
        old_cluster = FlinkRest(f"http://{jobmanager}")
        done = flink22_build.run("submit", "--config", str(path), "--jobmanager", jobmanager, cwd=tmp_path)
        assert done.returncode == 0 and "no snapshot" in done.stdout, done.stdout + done.stderr
        (job,) = old_cluster.live_jobs(setup.config.name)
        job_id = str(job["jid"])

        def alive() -> None:
            if old_cluster.job_status(job_id) in ("FAILED", "CANCELED", "FINISHED"):
                raise Hopeless(f"the 2.2.1 job ended: {old_cluster.failure(job_id)}")

        in_flight = wait_for_full_stage(sim, reader, alive)
        done = flink22_build.run("stop", "--config", str(path), "--jobmanager", jobmanager, cwd=tmp_path)
        assert done.returncode == 0 and "savepoint" in done.stdout, done.stdout + done.stderr
    finally:
        stopped = flink22_build.run("cluster", "stop", "--work-dir", str(work), cwd=tmp_path, timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    try:
        committed_at_stop = reader.unique_ids()
        calls_at_stop = int(sim.stats()["requests_total"])
        assert committed_at_stop < RECORDS, "the stream finished before the savepoint"
        capsys.readouterr()
        code = submit_mod.submit(str(path), jobmanager=cluster.address, options=RunOptions(until_end=True))
        out, err = capsys.readouterr()
        assert code == 0 and "backfill done" in out, out + err
        assert "resuming from savepoint" in out, out
    finally:
        reader.stop()
    result = final_tally(setup, ids)
    calls = int(sim.stats()["requests_total"])
    record(fault_report, "u2. cluster on Flink 2.2.1: submit, `llmstream stop` with calls in flight; "
           "submit on a 2.3 cluster", result, started=started,
           notes=f"capacity {CAPACITY}, 2 s per call; {in_flight} calls in flight at the stop",
           calls_in_flight_at_stop=in_flight, committed_at_stop=committed_at_stop, calls_at_stop=calls_at_stop,
           model_calls=calls, calls_per_record=round(calls / RECORDS, 3))
    check_exactly_once(result)
    assert result.dead == 0, result.dead_reasons
    assert calls > RECORDS, (calls, RECORDS)
