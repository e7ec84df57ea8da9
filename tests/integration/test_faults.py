"""Fault injection on a real standalone Flink cluster, a real Kafka broker and the model simulator.

Each scenario sends 5,000 requests with unique ids (480 to the 2-second model; in `make test` the
TaskManager kills 2,500: `FAULT_RECORDS`), injects its faults mid-stream, and then checks what a
downstream read_committed consumer sees: every id exactly once in output ∪ dead letters (nothing
lost, nothing duplicated), plus the job restarts the REST API reports and how long committed
output stalled. The numbers go to ``var/fault-report.md``.
Faults that can follow each other in one stream share a run (one job, one submit, one set of
records), each with its own row and assertions: the keyed lane's TaskManager kill then cancel and
stop (rows a, e), the broker stopped, then the model server down, then answering 500s (d, b, c),
a savepoint then a kill with calls in flight (h, f).

Run: ``pytest tests/integration/test_faults.py -m fault`` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from pathlib import Path

import psutil
import pytest

from jobs.clients import kafka_admin
from jobs.dev import local_kafka, simulator
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from tests.support.cluster import wait_for_checkpoints
from tests.support.committed import Tally, check_exactly_once
from tests.support.fault_report import FaultReport, FaultResult
from tests.support.job_setup import (
    fault_lanes,
    lane_sections,
    make_job,
    scaled,
    unique_records,
)
from tests.support.runs import RECORDS, Run, start_run, total_restarts
from tests.support.waiting import METRICS_SETTLE_S, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.fault]

FAULT_RECORDS = scaled(RECORDS)
"""The ids of the runs whose count is not their point (the TaskManager kills, the cancel and
stop): `RECORDS` in the full fault run, half in `make test` (`LLMSTREAM_FAULT_SCALE`). At the
job's pace (capped by its 6 calls of 40 ms, ~150 records/s) 2,500 still leave each fault
mid-stream: each waits for a fraction of them committed, and `wait_mid_stream` asserts the rest
is still to come. The outages' run (broker, model server, 500s) keeps `RECORDS`: its 500s must
last their 60 s."""

def report(fault_report: FaultReport, name: str, run: Run, result: Tally, *, recovery_s: float | None,
           notes: str, restarts: int | None = None, **extra: object) -> None:
    """One row of the fault report; `restarts` (default: the run's jobs', read here) when already read:
    each read waits for the metric store to settle, per job."""
    fault_report.add(FaultResult.counted(
        name, result, restarts=run.restarts() if restarts is None else restarts,
        recovery_s=None if recovery_s is None else round(recovery_s, 1),
        duration_s=round(time.monotonic() - run.started, 1), notes=notes, extra=extra))


def _since(t: float | None, origin: float) -> float | None:
    return None if t is None else t - origin


def _lane_suffix(stage: str) -> str:
    return " (vectorized lane)" if stage == "vectorized" else ""


# ---------------------------------------------------------------------- a. TaskManager crash (vectorized lane)


def test_taskmanager_sigkill_mid_stream_then_a_new_one_in_the_vectorized_lane(
        cluster: LocalCluster, paced_simulator: SpawnedSimulator, tmp_path: Path, kafka_broker: local_kafka.LocalBroker,
        fault_report: FaultReport) -> None:
    """SIGKILL the only TaskManager mid-stream, start a fresh one: the job restarts from the last
    checkpoint, aborts the dead TaskManager's open transactions, and nothing is lost or doubled. In
    the vectorized lane, with Arrow batches of 100, so a batch is a few seconds of work. (The keyed
    lane's run is the first fault of `test_taskmanager_sigkill_cancel_resubmit_and_stop_with_savepoint_in_one_stream`.
    This one stays in `make test`: no other run there reliably restores the vectorized lane after a
    kill: the interrupted-runs test's only SIGKILL in that lane (seeded) lands in its first run, 3 s
    after the job starts, which may be before any checkpoint, so the run after it may have nothing to
    restore.)"""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="tm-kill-vectorized",
                     **lane_sections("vectorized"))
    run = start_run(cluster, setup, "tmkill-vectorized", n=FAULT_RECORDS)
    run.wait_mid_stream(0.2)
    committed_at_kill = run.reader.unique_ids()
    killed_at = time.monotonic()
    killed = cluster.replace_taskmanager(run.job_id)
    running_again = time.monotonic()
    result = run.finish()
    orphans = cluster.reap_orphans(grace_s=2)
    check_exactly_once(result)
    assert run.restarts() >= 1
    first = run.reader.first_arrival_after(running_again)
    report(fault_report, "a. TaskManager SIGKILL + new TaskManager" + _lane_suffix("vectorized"),
           run, result,
           recovery_s=_since(first, killed_at),
           notes="recovery counted from the kill (a new TaskManager is started at once)",
           killed_pid=killed, committed_before_kill=committed_at_kill,
           job_running_again_s=round(running_again - killed_at, 1),
           orphan_python_workers_killed=len(orphans))


# ---------------------------------------------------------------------- d, b, c. broker outage, model server outage, then errors


def _answering(sim: SpawnedSimulator) -> bool:
    """Whether the simulator listens again after an outage (its admin API goes down with it)."""
    try:
        sim.stats(timeout=2)
    except OSError:  # requests' ConnectionError and Timeout are OSErrors
        return False
    return True


def _broker_processes(broker: local_kafka.LocalBroker) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "kafka.Kafka" in cmd and str(broker.properties_file) in cmd:
            found.append(proc)
    return found


def restart_broker(broker: local_kafka.LocalBroker) -> None:
    """`broker.start()`, tolerating a start-up race seen once in LocalBroker (not owned here).

    Symptom: start() raised "kafka broker exited during startup" at once although the new
    broker ran on (its except branch finds no pid either, so the broker leaked). If that
    happens, adopt the running process through the pid file and wait for it again.
    """
    try:
        broker.start(timeout=90)
        return
    except local_kafka.BrokerError as err:
        running = _broker_processes(broker)
        if not running:
            raise
        log_line = f"LocalBroker.start() said {str(err).splitlines()[0]!r} but pid {running[0].pid} runs; adopting it"
        print(log_line)
        broker.pid_file.write_text(f"{running[0].pid}\n")
        broker.start(timeout=90)


@pytest.mark.parametrize("stage", fault_lanes())
def test_broker_stopped_20s_then_model_server_down_30s_then_500_on_20_percent_for_60s(
        cluster: LocalCluster, paced_simulator: SpawnedSimulator, tmp_path: Path, fault_report: FaultReport,
        stage: str) -> None:
    """Three outages one after the other in one stream (rows d, b and c), on a broker of the test's own:

    d. The only Kafka broker stops (clean shutdown) for 20 s and comes back on the same ports and
    data: the job may fail and restart, but every id ends up exactly once.
    b. Once output flows again, the model server refuses connections for 30 s: in-flight calls back
    off and retry within their deadline, the bounded operator stops taking input, then the job
    catches up. In the vectorized lane the batch in progress waits for its calls (and every
    checkpoint with it).
    c. From its return, HTTP 500 on a fifth of the calls for 60 s (the rest of the stream): retried
    in the client, every record answered.

    Nothing lost or doubled, no dead letter (with 30 attempts each, none runs out of them), and no
    restart but the broker outage's: b and c restart nothing. (One stream for the three faults: one
    job start and one drain instead of three.)"""
    broker = local_kafka.LocalBroker(local_kafka.BrokerConfig.ephemeral(tmp_path / "kafka", heap="384m"))
    broker.start(timeout=90)
    try:
        setup = make_job(
            tmp_path, broker.bootstrap_servers, paced_simulator.url, name=f"outages-{stage}",
            retry={"max_attempts": 30, "initial_backoff_s": 0.5, "max_backoff_s": 5},
            async_={"record_deadline_s": 300}, kafka={"transaction_timeout_ms": 900_000}, **lane_sections(stage))
        # `RECORDS`, not `FAULT_RECORDS`: the stream must outlast the 60 s of 500s (the 4,000 ids
        # after the model server's return end ~65 s after it; 2,000 would end half-way through them).
        run = start_run(cluster, setup, f"outages-{stage}", n=RECORDS)

        # d. the broker stopped for 20 s, then output flowing and checkpoints completing again.
        run.wait_mid_stream(0.1)
        before_broker = run.reader.unique_ids()
        stopped_at = time.monotonic()
        broker.stop()
        time.sleep(max(0.0, 20 - (time.monotonic() - stopped_at)))
        restart_broker(broker)
        back_at = time.monotonic()

        def flowing_again() -> float | None:
            run.not_failed()
            return run.reader.first_arrival_after(back_at)

        first_after_broker = wait_until(flowing_again, 300, interval=0.5,
                                        message="committed output after the broker's return")
        wait_for_checkpoints(cluster, run.job_id, 2)
        broker_restarts = run.restarts()
        broker_job_state = cluster.job_status(run.job_id)

        # b. the model server down for 30 s.
        run.wait_mid_stream(0.2)
        before = run.reader.unique_ids()
        down_at = time.monotonic()
        paced_simulator.admin({"down_for_s": 30})
        up_at = down_at + 30
        time.sleep(30)
        during = run.reader.unique_ids()
        assert during < len(run.ids), "the stream finished during the outage"

        # c. 500 on a fifth of the calls for 60 s from the server's return.
        wait_until(lambda: _answering(paced_simulator), 60, interval=0.2, message="the simulator to listen again")
        errors_at = time.monotonic()
        paced_simulator.admin({"error_rate": 0.2, "error_status": 500, "until_s": 60})
        result = run.finish(timeout=420)
        stats = paced_simulator.stats()
        check_exactly_once(result)
        restarts = run.restarts()
        assert restarts == broker_restarts, (
            f"the job restarted {restarts - broker_restarts} time(s) during a model outage and 500s")
        assert stats["errors"] > 100, f"the 500s did not take: {stats}"
        assert result.dead == 0, result.dead_reasons
        report(fault_report, "d. broker stopped 20 s" + _lane_suffix(stage), run, result,
               restarts=broker_restarts, recovery_s=_since(first_after_broker, back_at),
               notes="dedicated broker; recovery counted from the broker answering again; "
                     "the same run as rows b and c, before them",
               committed_before=before_broker, outage_s=round(back_at - stopped_at, 1),
               job_state=broker_job_state)
    finally:
        broker.stop()
        for leftover in _broker_processes(broker):
            leftover.kill()

    first = run.reader.first_arrival_after(up_at)
    report(fault_report, "b. model server down 30 s" + _lane_suffix(stage), run, result,
           restarts=restarts - broker_restarts, recovery_s=_since(first, up_at),
           notes="recovery counted from the server's return; retries back off up to 5 s; "
                 "the same run as rows d and c, after d's broker outage, before c's 500s",
           committed_before=before, committed_while_down=during - before,
           longest_output_gap_s=round(run.reader.longest_gap(first_after_broker), 1),
           simulator_requests=stats.get("requests_total"))
    first_in_errors = run.reader.first_arrival_after(errors_at)
    report(fault_report, "c. model server 500 on 20% for 60 s" + _lane_suffix(stage), run, result,
           restarts=restarts - broker_restarts, recovery_s=None,
           notes="no stall expected: failures are retried per record (30 attempts, 0.5-5 s apart); "
                 "the same run as rows d and b, from the server's return",
           injected_errors=stats["errors"], simulator_requests=stats["requests_total"],
           longest_output_gap_s=round(run.reader.longest_gap(first_in_errors), 1)
           if first_in_errors is not None else None)


# ---------------------------------------------------------------------- a (keyed), e. kill, cancel and resubmit


def test_taskmanager_sigkill_cancel_resubmit_and_stop_with_savepoint_in_one_stream(
        cluster: LocalCluster, paced_simulator: SpawnedSimulator, tmp_path: Path, kafka_broker: local_kafka.LocalBroker,
        fault_report: FaultReport) -> None:
    """Three faults in one stream of the keyed lane (rows a and e), each resuming exactly where the
    committed output ends, nothing lost or doubled:

    a. SIGKILL the only TaskManager mid-stream, start a fresh one: the job restarts from the last
    checkpoint and aborts the dead TaskManager's open transactions.
    e. Cancel mid-stream and resubmit from the retained last checkpoint; later stop with a savepoint
    and resubmit from it. Neither restarts a job.

    (A resubmission WITHOUT a checkpoint also resumes, from the group's committed offsets, but
    offsets and transactions are committed by different operators after a checkpoint, so a
    cancel between the two can replay one checkpoint's worth of records: not exactly once.)
    """
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="tm-kill-resubmit")
    run = start_run(cluster, setup, "tmresub", n=FAULT_RECORDS)

    # a. TaskManager SIGKILL + a new TaskManager.
    run.wait_mid_stream(0.15)
    committed_at_kill = run.reader.unique_ids()
    killed_at = time.monotonic()
    killed = cluster.replace_taskmanager(run.job_id)
    running_again = time.monotonic()
    killed_job = run.job_id

    # e. cancel + resubmit from the retained checkpoint, then stop-with-savepoint + resubmit.
    run.wait_mid_stream(0.4)
    cancelled_at = time.monotonic()
    cluster.cancel(killed_job)
    checkpoint = cluster.latest_checkpoint(killed_job)
    assert checkpoint, "no checkpoint retained on cancel (execution.checkpointing.externalized-checkpoint-retention)"
    at_cancel = run.reader.unique_ids()
    run.submit(savepoint=checkpoint)
    resubmitted = time.monotonic()
    run.wait_mid_stream(0.65)
    stopping_at = time.monotonic()
    savepoint = cluster.stop_with_savepoint(run.job_id)
    at_stop = run.reader.unique_ids()
    run.submit(savepoint=savepoint)
    result = run.finish()
    orphans = cluster.reap_orphans(grace_s=2)
    check_exactly_once(result)
    kill_restarts = cluster.num_restarts(killed_job, settle_s=METRICS_SETTLE_S)
    assert kill_restarts >= 1, "no restart after the TaskManager kill"
    resubmitted_restarts = total_restarts(cluster, run.job_ids[1:])
    assert resubmitted_restarts == 0, f"the resubmitted jobs restarted {resubmitted_restarts} time(s)"

    report(fault_report, "a. TaskManager SIGKILL + new TaskManager", run, result,
           restarts=kill_restarts + resubmitted_restarts,
           recovery_s=_since(run.reader.first_arrival_after(running_again), killed_at),
           notes="recovery counted from the kill (a new TaskManager is started at once); "
                 "the same run as row e, before its cancel",
           killed_pid=killed, committed_before_kill=committed_at_kill,
           job_running_again_s=round(running_again - killed_at, 1),
           orphan_python_workers_killed=len(orphans))
    first_after_cancel = run.reader.first_arrival_after(resubmitted)
    first_after_stop = run.reader.first_arrival_after(stopping_at + 1)
    report(fault_report, "e. cancel + resubmit from checkpoint; stop-with-savepoint + resubmit", run, result,
           restarts=kill_restarts + resubmitted_restarts,
           recovery_s=_since(first_after_cancel, cancelled_at),
           notes="recovery = cancel to output flowing from the resubmitted job (includes `flink run`); "
                 "the same run as row a, after its TaskManager kill (restarts: the kill's)",
           jobs=len(run.job_ids), committed_at_cancel=at_cancel, committed_at_stop=at_stop,
           savepoint_resume_s=round((first_after_stop or stopping_at) - stopping_at, 1),
           checkpoint=Path(checkpoint).name)


# ---------------------------------------------------------------------- f, g. calls in flight at a fault

SLOW_CAPACITY = 24
SLOW_RECORDS = 480  # 24 calls / 2 s = 12 records/s: ~40 s of work


def _wait_for_full_capacity(run: Run, sim: SpawnedSimulator, capacity: int, committed: int,
                            timeout: float = 180) -> int:
    """Until `committed` ids are visible (a checkpoint with calls in flight has completed) and
    the server holds at least `capacity` calls; returns the calls in flight."""
    def full() -> int | None:
        run.not_failed()
        in_flight = int(sim.stats().get("in_flight") or 0)
        return in_flight if in_flight >= capacity and run.reader.unique_ids() >= committed else None

    return wait_until(full, timeout, interval=0.2,
                      message=lambda: f"{capacity} calls in flight with {committed} committed: {sim.stats()}, "
                                      f"{run.reader.unique_ids()} committed")


def test_calls_in_flight_at_a_savepoint_and_at_a_taskmanager_sigkill_are_made_again(
        cluster: LocalCluster, slow_simulator: SpawnedSimulator, tmp_path: Path,
        kafka_broker: local_kafka.LocalBroker, fault_report: FaultReport) -> None:
    """Two faults in one stream, each while `capacity` 2-second calls are in flight (rows h and f).

    h. Stop with a savepoint (no drain) and resubmit from it: the pending requests in the savepoint
    are issued again. f. Then SIGKILL the TaskManager and start a fresh one: the restored inference
    stage starts the calls in its checkpointed state again, the source replays what came after the
    checkpoint. Every id comes out exactly once. (The faults follow each other in one run of
    `SLOW_RECORDS` ids.)"""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, slow_simulator.url, name="inflight-faults",
                     async_={"capacity": SLOW_CAPACITY})
    run = start_run(cluster, setup, "inflight", n=SLOW_RECORDS)

    # h. stop-with-savepoint (no drain) with calls in flight, resubmit from it.
    in_flight_at_stop = _wait_for_full_capacity(run, slow_simulator, SLOW_CAPACITY, committed=SLOW_CAPACITY)
    stopping_at = time.monotonic()
    savepoint = cluster.stop_with_savepoint(run.job_id, drain=False)
    stopped_in = time.monotonic() - stopping_at
    at_stop = run.reader.unique_ids()
    assert at_stop < SLOW_RECORDS, "the stream finished before the savepoint"
    calls_at_stop = int(slow_simulator.stats()["requests_total"])
    saved_job = run.job_id
    run.submit(savepoint=savepoint)

    # f. TaskManager SIGKILL with calls in flight, once the restored job has checkpointed some.
    wait_for_checkpoints(cluster, run.job_id, 1)
    in_flight_at_kill = _wait_for_full_capacity(run, slow_simulator, SLOW_CAPACITY,
                                                committed=at_stop + SLOW_CAPACITY)
    calls_before_kill = int(slow_simulator.stats()["requests_total"])
    committed_at_kill = run.reader.unique_ids()
    assert committed_at_kill < SLOW_RECORDS, "the stream finished before the kill"
    killed_at = time.monotonic()
    cluster.replace_taskmanager(run.job_id)
    result = run.finish()
    cluster.reap_orphans(grace_s=2)
    check_exactly_once(result)
    saved_restarts = cluster.num_restarts(saved_job, settle_s=METRICS_SETTLE_S)
    assert saved_restarts == 0, f"the job stopped with a savepoint restarted {saved_restarts} time(s)"
    kill_restarts = cluster.num_restarts(run.job_id, settle_s=METRICS_SETTLE_S)
    assert kill_restarts >= 1, "no restart after the TaskManager kill"
    calls = int(slow_simulator.stats()["requests_total"])
    # h: the savepoint held the calls in flight at its barrier (up to capacity; fewer if some
    # answered before it); their answers after it were never committed, so the restored job made
    # each of them again (at least one): without that, the exactly-once check above would find
    # them lost. f: the calls in flight at the kill never answered the job, so each was made again
    # (a few of those counted just before the kill may have answered in between). The two sets of
    # repeated calls are different calls, so the two bounds add up.
    assert calls >= SLOW_RECORDS + 1 + in_flight_at_kill // 2, (calls, SLOW_RECORDS, in_flight_at_kill)
    report(fault_report, "h. stop-with-savepoint with capacity 2 s calls in flight, resubmit", run, result,
           restarts=saved_restarts + kill_restarts,
           recovery_s=_since(run.reader.first_arrival_after(stopping_at + stopped_in), stopping_at),
           notes=f"capacity {SLOW_CAPACITY}, 2 s per call; savepoint without drain; "
                 "the same run as row f (model calls count both faults)",
           calls_in_flight_at_stop=in_flight_at_stop, stop_with_savepoint_s=round(stopped_in, 1),
           committed_at_stop=at_stop, calls_at_stop=calls_at_stop, model_calls=calls,
           calls_per_record=round(calls / SLOW_RECORDS, 3))
    report(fault_report, "f. TaskManager SIGKILL with capacity 2 s calls in flight", run, result,
           restarts=saved_restarts + kill_restarts,
           recovery_s=_since(run.reader.first_arrival_after(killed_at), killed_at),
           notes=f"capacity {SLOW_CAPACITY}, 2 s per call; calls/record = model calls ÷ input records; "
                 "the same run as row h, after its savepoint and resubmit",
           calls_in_flight_at_kill=in_flight_at_kill, calls_before_kill=calls_before_kill, model_calls=calls,
           calls_per_record=round(calls / SLOW_RECORDS, 3),
           issue_bound=round(1 + (in_flight_at_stop + in_flight_at_kill) / SLOW_RECORDS, 3),
           committed_before_kill=committed_at_kill)


# ---------------------------------------------------------------------- bounded memory

MEMORY_TEST_SECONDS = float(os.environ.get("LLMSTREAM_MEMORY_TEST_SECONDS", "300"))
BACKLOG = 200_000


def _produce_backlog(bootstrap: str, topic: str, n: int) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=50, batch_size=512 * 1024)
    try:
        for key, value in unique_records(n, "mem"):
            producer.send(topic, key=key, value=value)
        producer.flush(120)
    finally:
        producer.close(10)


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total / 2**20


def _metaspace_mb(cluster: LocalCluster) -> float | None:
    """Metaspace in use on the (first) TaskManager: grows if job classloaders leak classes."""
    with contextlib.suppress(Exception):
        tm = cluster.rest("/taskmanagers")["taskmanagers"][0]["id"]
        metrics = cluster.rest(f"/taskmanagers/{tm}/metrics?get=Status.JVM.Memory.Metaspace.Used")
        return round(float(metrics[0]["value"]) / 2**20, 1)
    return None


@pytest.mark.slow
def test_memory_stays_flat_with_a_200k_backlog_and_a_slow_model(
        cluster: LocalCluster, tmp_path: Path, kafka_broker: local_kafka.LocalBroker,
        fault_report: FaultReport) -> None:
    """200,000 requests waiting, a model at 200 ms: the bounded async operator backpressures the
    source, so TaskManager JVM and Python worker RSS stay flat (`LLMSTREAM_MEMORY_TEST_SECONDS`,
    default 300; after a warm-up, the max of the second half within 15% of the first half's)."""
    sim = simulator.spawn(["--latency", "fixed:200"])
    try:
        setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name="memory",
                         async_={"capacity": 64})
        started = time.monotonic()
        # The backlog is written while `flink run` submits the job (~10 s each): at 320 records/s
        # at most, the job finds nearly all 200,000 waiting either way.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            producing = pool.submit(_produce_backlog, setup.bootstrap, setup.input_topic, BACKLOG)
            job_id = cluster.submit(setup.path)
            producing.result()
        produced_s = time.monotonic() - started
        cluster.wait_for_job_state(job_id, "RUNNING", timeout=180)
        (tm,) = cluster.taskmanager_pids()
        samples: list[tuple[float, float, float]] = []
        worker_count = 0
        t0 = time.monotonic()
        while (now := time.monotonic()) - t0 < MEMORY_TEST_SECONDS:
            workers = cluster.python_worker_pids(tm)
            worker_count = max(worker_count, len(workers))
            samples.append((now - t0, _rss_mb([tm]), _rss_mb(workers)))
            assert cluster.job_status(job_id) == "RUNNING", cluster.failure(job_id)
            time.sleep(2)
        restarts = cluster.num_restarts(job_id, settle_s=METRICS_SETTLE_S)
        metaspace_mb = _metaspace_mb(cluster)
        committed = sum(kafka_admin.committed_offsets(setup.bootstrap, setup.config.kafka.group_id,
                                                      setup.input_topic).values())
        cluster.cancel(job_id)
    finally:
        sim.stop()

    warmup = min(60.0, MEMORY_TEST_SECONDS / 3)
    steady = [s for s in samples if s[0] >= warmup]
    half = len(steady) // 2
    first, second = steady[:half], steady[half:]

    def peak(rows: list[tuple[float, float, float]], col: int) -> float:
        return max(r[col] for r in rows)

    jvm = (peak(first, 1), peak(second, 1))
    py = (peak(first, 2), peak(second, 2))
    total = (max(r[1] + r[2] for r in first), max(r[1] + r[2] for r in second))
    fault_report.add(FaultResult(
        scenario=f"g. memory: 200k backlog, model 200 ms, {MEMORY_TEST_SECONDS:.0f} s", records_in=BACKLOG, out=committed, dead=0,
        duplicates=0, lost=0, restarts=restarts, recovery_s=None, duration_s=round(time.monotonic() - started, 1),
        notes=f"{MEMORY_TEST_SECONDS:.0f} s run; out = input records committed (the rest is backlog)",
        extra={"jvm_rss_peak_mb": round(max(jvm)), "python_rss_peak_mb": round(max(py)),
               "total_rss_peak_mb": round(max(total)),
               "peaks_first_vs_second_half_mb": f"jvm {jvm[0]:.0f}/{jvm[1]:.0f}, python {py[0]:.0f}/{py[1]:.0f}",
               "python_worker_processes": worker_count,
               "taskmanager_metaspace_mb": metaspace_mb,
               "warmup_s": warmup, "samples": len(samples), "produce_and_submit_s": round(produced_s, 1),
               "processed_per_s": round(committed / MEMORY_TEST_SECONDS, 1)}))
    assert restarts == 0
    assert committed < BACKLOG, "the whole backlog was processed: nothing was held back"
    assert jvm[1] <= jvm[0] * 1.15, f"TaskManager JVM RSS grew: first half peak {jvm[0]:.0f} MB, second {jvm[1]:.0f} MB"
    assert py[1] <= py[0] * 1.15, f"Python worker RSS grew: first half peak {py[0]:.0f} MB, second {py[1]:.0f} MB"
