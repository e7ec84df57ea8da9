"""`llmstream cluster` keeps its TaskManagers running the way a supervisor would.

A standalone cluster started with ``llmstream cluster start`` runs a small supervisor process
(`jobs/dev/cluster_supervisor.py`). Its TaskManager killed with SIGKILL, a new one is started
without anyone asking and registers; ``cluster status`` names the restart, and ``cluster stop``
leaves neither the supervisor nor a daemon behind (in `make test`, ~1 min). With a job running, the
job restores its last checkpoint on the new TaskManager and finishes with every id once (the history
checker's verdict): 163 s at load 15 on 2 cores, so in `make fault` (`LONG_FAULT`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from jobs.dev import local_cluster as cluster_mod
from jobs.dev import local_kafka
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from tests.support.committed import check_exactly_once
from tests.support.job_setup import LONG_FAULT, make_job
from tests.support.runs import start_run
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.fault]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _log(config: ClusterConfig) -> str:
    return (config.work_dir / "log" / "supervisor.log").read_text(errors="replace")


def test_a_killed_taskmanager_is_started_again_and_stop_leaves_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = ClusterConfig.ephemeral(tmp_path / "flink")
    args = ["--work-dir", str(config.work_dir), "--port", str(config.rest_port), "--rpc-port", str(config.rpc_port)]
    cluster = LocalCluster(config)
    try:
        assert cluster_mod.main(["start", *args]) == 0
        out = capsys.readouterr().out
        supervisor = cluster.supervisor_pid()
        assert supervisor is not None
        assert f"supervisor: pid {supervisor}, keeps 1 TaskManager(s) running; none restarted" in out, out
        [victim] = cluster.taskmanager_pids()
        registered = cluster.taskmanager_ids()
        os.kill(victim, signal.SIGKILL)

        wait_until(lambda: cluster.taskmanager_ids() - registered, timeout=180,
                   message=lambda: f"a new TaskManager to register; supervisor log:\n{_log(config)}")
        [replacement] = cluster.taskmanager_pids()
        assert replacement != victim
        assert cluster_mod.main(["status", *args]) == 0
        status = capsys.readouterr().out
        assert "restarted 1 (last at " in status and f"pid {victim} gone, started pid {replacement})" in status, status

        assert cluster_mod.main(["stop", *args]) == 0
        assert "cluster: stopped" in capsys.readouterr().out
        assert _gone(supervisor) and _gone(replacement)
        assert cluster.supervisor_pid() is None and cluster.taskmanager_pids() == []
    finally:
        cluster.stop()


@LONG_FAULT
def test_a_killed_taskmanager_is_started_again_and_the_running_job_loses_and_doubles_nothing(
        tmp_path: Path, kafka_broker: local_kafka.LocalBroker, paced_simulator: SpawnedSimulator,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = ClusterConfig.ephemeral(tmp_path / "flink")
    args = ["--work-dir", str(config.work_dir), "--port", str(config.rest_port), "--rpc-port", str(config.rpc_port)]
    cluster = LocalCluster(config)
    try:
        assert cluster_mod.main(["start", *args]) == 0
        assert "supervisor: pid" in capsys.readouterr().out
        supervisor = cluster.supervisor_pid()
        assert supervisor is not None

        setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="supervised")
        run = start_run(cluster, setup, "supervised", n=2000)
        run.wait_mid_stream(0.2)
        [victim] = cluster.taskmanager_pids()
        registered = cluster.taskmanager_ids()
        workers = cluster.python_worker_pids(victim)
        os.kill(victim, signal.SIGKILL)  # as a crash would: nobody starts a TaskManager by hand

        wait_until(lambda: cluster.taskmanager_ids() - registered, timeout=180,
                   message=lambda: f"a new TaskManager to register; supervisor log:\n{_log(config)}")
        replacement = cluster.taskmanager_pids()
        assert len(replacement) == 1 and victim not in replacement, replacement
        result = run.finish()
        check_exactly_once(result)
        assert run.restarts() >= 1

        assert cluster_mod.main(["status", *args]) == 0
        status = capsys.readouterr().out
        assert f"supervisor: pid {supervisor}, keeps 1 TaskManager(s) running; restarted 1" in status, status
        assert f"pid {victim} gone, started pid {replacement[0]}" in status, status
        # The dead TaskManager's Python workers do not outlive it for long.
        wait_until(lambda: all(_gone(w) for w in workers), timeout=60,
                   message=lambda: f"the killed TaskManager's Python workers {workers} to be gone")

        assert cluster_mod.main(["stop", *args]) == 0
        assert _gone(supervisor) and all(_gone(p) for p in replacement)
        assert cluster.supervisor_pid() is None and cluster.taskmanager_pids() == []
    finally:
        cluster.stop()
