"""A highly available standalone cluster (`llmstream cluster start --ha`): ZooKeeper, two
JobManagers and a TaskManager on free ports. The leading JobManager is killed with SIGKILL
mid-stream; the standby wins the election and recovers the running job from ZooKeeper and the HA
storage (the same job id, no resubmit), and a read_committed consumer sees every id exactly once.
The time from the kill until committed output flows again goes to ``var/fault-report.md``.

Run: ``pytest tests/integration/test_ha_cluster.py -m fault -s`` (11 minutes on 2 cores shared with
other jobs at load ~45, most of it starting the cluster and submitting; it prints the failover times).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jobs.clients import kafka_admin
from jobs.clients.cluster_address import ClusterAddress
from jobs.dev import local_cluster as cluster_mod
from jobs.dev import local_kafka
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from tests.support.committed import CommittedReader, check_exactly_once
from tests.support.fault_report import FaultReport, FaultResult
from tests.support.job_setup import LONG_FAULT, make_job, unique_records
from tests.support.runs import Run
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.fault, LONG_FAULT]


def test_leader_jobmanager_sigkill_mid_stream_the_standby_takes_over_the_job(
        tmp_path: Path, paced_simulator: SpawnedSimulator, kafka_broker: local_kafka.LocalBroker,
        fault_report: FaultReport, capsys: pytest.CaptureFixture[str]) -> None:
    config = ClusterConfig.ephemeral(tmp_path / "flink", ha=True)
    cluster = LocalCluster(config)
    try:
        started = time.monotonic()
        cluster.start(taskmanagers=1, timeout=240)
        start_s = time.monotonic() - started
        record = ClusterAddress.local(config.work_dir)
        assert record is not None and record.addresses == cluster.rest_addresses()
        assert ClusterConfig.existing(config.work_dir).ha
        first_leader = cluster.leading_rest_port()
        assert first_leader == config.rest_port
        assert sorted(cluster.jobmanager_pids()) == sorted([config.rest_port, config.standby_rest_port])

        setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="jm-kill")
        # 1,500 records (~15 s of work on a quiet machine): enough for a kill mid-stream, and the
        # generous wait for it is for a machine shared with other jobs (300 committed took 120 s).
        records = unique_records(1500, "jmkill")
        kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
        reader = CommittedReader(setup.bootstrap, [setup.output_topic, setup.dead_letter_topic])
        reader.start()
        run = Run(cluster, setup, [k.decode() for k, _ in records], reader)
        run.job_ids.append(cluster.submit(setup.path))
        # `Run.submit` waits 180 s for every task to run: on this shared machine at load ~60 its
        # first deployments timed out and restarted for longer than that.
        cluster.wait_for_job_state(run.job_id, "RUNNING", timeout=420)
        run.wait_mid_stream(0.2, timeout=300)
        committed_at_kill = run.reader.unique_ids()
        killed_at = time.monotonic()
        killed = cluster.kill_jobmanager()

        (new_leader,) = wait_until(
            lambda: (port,) if (port := cluster.leading_rest_port()) not in (None, first_leader) else None,
            180, interval=0.5, message=lambda: "the standby JobManager to be granted leadership")
        leader_at = time.monotonic()
        assert new_leader == config.standby_rest_port
        # Its REST API answers once the election is over (before, 500 and 503: `leader_of`).
        wait_until(cluster.overview, 120, interval=0.5, message="the new leader's REST API")
        # The standby runs the job it recovered: the same id, and no other job was submitted.
        cluster.wait_for_job_state(run.job_id, "RUNNING", timeout=300)
        running_again = time.monotonic()
        assert [job["jid"] for job in cluster.jobs()] == [run.job_id]
        # Every client follows the leader: the record's first address is dead, the standby answers.
        followed = ClusterAddress.local(config.work_dir)
        assert followed is not None and followed.following_leader().address == f"localhost:{new_leader}"
        assert cluster_mod.main(["status", "--work-dir", str(config.work_dir)]) == 0
        status = capsys.readouterr().out
        assert f"leader pid {cluster.jobmanager_pids()[new_leader]} REST :{new_leader}" in status, status

        result = run.finish()
        check_exactly_once(result)
        first = run.reader.first_arrival_after(leader_at)
        assert first is not None
        recovery_s = round(first - killed_at, 1)
        print(f"HA failover: kill -9 of the leader -> standby leads {leader_at - killed_at:.1f} s, "
              f"job RUNNING {running_again - killed_at:.1f} s, output flows {recovery_s} s")
        fault_report.add(FaultResult.counted(
            "j. leading JobManager SIGKILL, standby takes over (HA)", result, restarts=run.restarts(),
            recovery_s=recovery_s, duration_s=round(time.monotonic() - run.started, 1),
            notes="ZooKeeper HA, session timeout 15 s; recovery counted from the kill to the first "
                  "output committed under the new leader",
            extra={"killed_pid": killed, "committed_before_kill": committed_at_kill,
                   "standby_leads_s": round(leader_at - killed_at, 1),
                   "job_running_again_s": round(running_again - killed_at, 1),
                   "cluster_start_s": round(start_s, 1)}))
    finally:
        cluster.stop()
    assert cluster.zookeeper is not None and cluster.zookeeper.pid() is None
