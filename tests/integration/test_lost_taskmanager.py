"""A run that outlives its TaskManager: the broker unreachable for longer than the sink can wait to
abort its transaction makes Flink stop a mini cluster's only TaskManager ("FATAL - exception in
exception handler of task … kafka_results: Writer"), after which every restart of the job failed for
want of one and `llmstream run` never ended. Now the run says so, cancels the job (its last
checkpoint kept) and starts a new mini cluster from that checkpoint by itself: every id once.

The broker is frozen (SIGSTOP, a partition as its clients see it: connections open, no answers)
for 150 s, longer than the producer's 60 s `max.block.ms` the abort waits. Minutes long, so it runs
in the documented full fault run (`make fault`), not in `make test`.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from jobs.clients import kafka_admin
from jobs.dev.local_kafka import BrokerConfig, LocalBroker
from tests.support.committed import check_exactly_once, final_tally
from tests.support.job_setup import LONG_FAULT, SpawnSimulator, make_job, unique_records
from tests.support.runs import LocalRun
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.fault, LONG_FAULT]

FROZEN_S = 150.0


def test_a_run_whose_taskmanager_flink_stopped_starts_a_new_mini_cluster_and_loses_nothing(
        tmp_path: Path, spawn_simulator: SpawnSimulator) -> None:
    broker = LocalBroker(BrokerConfig.ephemeral(tmp_path / "kafka", heap="384m"))
    broker.start(timeout=180)
    sim = spawn_simulator(["--latency", "fixed:20", "--concurrency", "16"])
    try:
        setup = make_job(tmp_path, broker.bootstrap_servers, sim.url, name="lost-tm", async_={"capacity": 16})
        records = unique_records(6000, "tm")
        kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
        run = LocalRun(setup.path, tmp_path / "run.log", "--until-end")
        wait_until(lambda: re.search(r"\| out [1-9]", run.output()) is not None or run.process.poll() is not None,
                   timeout=240, message="the run to make progress")
        assert run.process.poll() is None, run.output()[-3000:]
        pid = broker.pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(FROZEN_S)  # the fault's own length, not a wait for a condition
        finally:
            os.kill(pid, signal.SIGCONT)
        code = run.wait(timeout=900)
        out = run.output()
        assert code == 0, out[-4000:]
        result = final_tally(setup, [k.decode() for k, _ in records])
    finally:
        broker.stop()
    check_exactly_once(result)
    assert "RESTARTING" not in out.splitlines()[-1], out[-2000:]
    if "no TaskManager has been registered" in out:  # the fatal path happened: the run recovered from it
        assert "starting a new mini cluster" in out, out[-4000:]
