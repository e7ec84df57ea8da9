"""`llmstream scale` on a standalone cluster with the adaptive scheduler: a job submitted with
`llmstream submit`, scaled 1 -> 2 -> 1 in place while records flow, every id once, in each lane (the
keyed lane in `make test`, the others in the full fault run): the keyed and provider-batch lanes scale
their ``inference`` vertex, the vectorized lane the source vertex its model step is chained to; in the
provider-batch lane no request is paid for twice."""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaProducer

from jobs.dev import local_kafka
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from jobs.launch.scale import INFERENCE_VERTEX, SOURCE_VERTEX
from tests.conftest import SHELL_ENV
from tests.support.cluster import wait_for_checkpoints
from tests.support.committed import check_exactly_once, final_tally
from tests.support.job_setup import (
    LATER_LANE,
    LLMSTREAM,
    SpawnSimulator,
    lane_sections,
    make_job,
    unique_records,
)
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADAPTIVE = {
    "jobmanager.scheduler": "adaptive",
    "taskmanager.numberOfTaskSlots": 4,
    # The scheduler's pause after a rescale (default 30 s) would only make the test wait.
    "jobmanager.adaptive-scheduler.executing.cooldown-after-rescaling": "5 s",
}


@pytest.fixture
def adaptive_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster of its own: the shared one runs the default scheduler."""
    cluster = LocalCluster(ClusterConfig.ephemeral(tmp_path / "flink", settings=ADAPTIVE))
    cluster.start(taskmanagers=1, timeout=180)
    try:
        yield cluster
    finally:
        cluster.stop()


class Producer(threading.Thread):
    """Sends unique records at about `per_s` a second until stopped; `ids` are those it sent."""

    def __init__(self, bootstrap: str, topic: str, per_s: int) -> None:
        super().__init__(daemon=True, name="scale-producer")
        self._servers, self._topic, self._per_s = bootstrap, topic, per_s
        self._done = threading.Event()
        self.ids: list[str] = []

    def run(self) -> None:
        producer = KafkaProducer(bootstrap_servers=self._servers, acks="all", linger_ms=5)
        try:
            batch = 0
            while not self._done.wait(0.5):
                records = unique_records(self._per_s // 2, f"s{batch:04d}")
                for key, value in records:
                    producer.send(self._topic, key=key, value=value)
                producer.flush(timeout=30)
                self.ids += [key.decode() for key, _ in records]
                batch += 1
        finally:
            producer.close()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=30)


def _llmstream(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LLMSTREAM), *args], check=False, capture_output=True, text=True, timeout=400,
                          env=SHELL_ENV)


@pytest.mark.parametrize("lane", ["keyed", pytest.param("vectorized", marks=LATER_LANE),
                                  pytest.param("provider-batch", marks=LATER_LANE)])
def test_scale_in_place_while_records_flow(adaptive_cluster: LocalCluster, spawn_simulator: SpawnSimulator,
                                           kafka_broker: local_kafka.LocalBroker, tmp_path: Path, lane: str) -> None:
    cluster = adaptive_cluster
    simulator: SpawnedSimulator = spawn_simulator(["--latency", "fixed:40", "--seed", "7", "--batch-validating-s", "0.2",
                                                   "--batch-delay-s", "1", "--batch-finalizing-s", "0.2"])
    if lane == "provider-batch":
        sections = {"lane": "provider-batch",
                    "provider_batch": {"max_requests": 20, "max_wait_s": 1, "poll_initial_s": 0.5, "poll_max_s": 1}}
    else:
        sections = lane_sections(lane, batch_size=20)
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, simulator.url, name=f"scale-{lane}", **sections)
    vertex = SOURCE_VERTEX if lane == "vectorized" else INFERENCE_VERTEX
    submitted = _llmstream("submit", "--config", str(setup.path), "--jobmanager", cluster.address)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    [job] = cluster.live_jobs(setup.config.name)
    job_id = str(job["jid"])
    cluster.wait_for_job_state(job_id, "RUNNING", timeout=360)
    producer = Producer(setup.bootstrap, setup.input_topic, per_s=20)
    producer.start()
    try:
        wait_for_checkpoints(cluster, job_id, n=1)
        for n in (2, 1):
            scaled = _llmstream("scale", "--config", str(setup.path), "--jobmanager", cluster.address,
                                "--inference", str(n))
            assert scaled.returncode == 0, scaled.stderr[-2000:]
            # The vertex's name goes on with what is chained to it (the provider-batch lane's admission gate).
            assert re.search(rf"llmstream: {re.escape(vertex)}[^\n]* runs at {n} subtasks", scaled.stdout), scaled.stdout
            assert next(p for name, p in cluster.vertex_parallelism(job_id).items()
                        if name.startswith(vertex)) == n
            wait_for_checkpoints(cluster, job_id, n=2)
        status = _llmstream("status", "--config", str(setup.path), "--jobmanager", cluster.address, "--json")
        assert status.returncode == 0, status.stderr[-2000:]
        assert json.loads(status.stdout)["scaling"]["verdict"] in ("input-bound", "pipeline-bound", "model-bound")
    finally:
        producer.stop()
    assert cluster.job_status(job_id) == "RUNNING"  # the same job throughout: no resubmission
    expected = list(producer.ids)
    assert len(expected) > 200

    result = wait_until(lambda: final_tally(setup, expected), timeout=240, interval=3, or_last=True,
                        done=lambda tally: tally.out + tally.dead >= len(expected))
    check_exactly_once(result)
    if lane == "provider-batch":
        submitted = int(simulator.stats()["batches"]["requests_submitted"])
        assert submitted == len(expected), f"{submitted} requests paid for {len(expected)} records"
    cluster.cancel(job_id)
