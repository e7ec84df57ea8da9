"""Observability on the standalone cluster: the reporter from flink-conf/ and lib/, and
`llmstream status --jobmanager` on a submitted job."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from tests.conftest import SHELL_ENV
from tests.support.job_setup import BAD_RECORDS, LLMSTREAM, make_job, unique_records
from tests.support.prometheus import parse_prometheus, total
from tests.support.waiting import wait_until

# The cluster and simulator fixtures, registered once per session (as test_cluster.py does).

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPORTER_PORTS = range(9249, 9259)   # flink-conf/config.yaml metrics.reporter.prom.port
PREFIX = "flink_taskmanager_job_task_operator_llmstream_"


def _scrape_job(job_id: str) -> dict[str, float] | None:
    """llmstream's metrics of `job_id` from whichever reporter port serves them (other clusters on
    this host may hold some of the range)."""
    for port in REPORTER_PORTS:
        try:
            body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=3).text
        except requests.RequestException:
            continue
        if f'job_id="{job_id}"' not in body:
            continue
        samples = parse_prometheus(body)
        mine = {name: [(labels, v) for labels, v in values if labels.get("job_id") == job_id]
                for name, values in samples.items() if name.startswith(PREFIX)}
        if mine:
            return {name[len(PREFIX):]: total(mine, name) for name in mine}
    return None


def test_cluster_reporter_and_status_of_a_submitted_job(
        cluster: LocalCluster, paced_simulator: SpawnedSimulator, tmp_path: Path,
        kafka_broker: local_kafka.LocalBroker) -> None:
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="observe")
    good = 300
    kafka_admin.produce(setup.bootstrap, setup.input_topic, unique_records(good, "obs") + BAD_RECORDS)
    job_id = cluster.submit(setup.path)
    cluster.wait_for_job_state(job_id, "RUNNING", timeout=180)

    def status() -> dict[str, Any]:
        result = subprocess.run([str(LLMSTREAM), "status", "--config", str(setup.path), "--jobmanager",
                                 cluster.address, "--json"],
                                check=False, capture_output=True, text=True, timeout=120, env=SHELL_ENV)
        assert result.returncode == 0, result.stderr[-2000:]
        figures: dict[str, Any] = json.loads(result.stdout)
        return figures

    def done() -> dict[str, Any] | None:
        figures = status()
        ok = (figures["job"]["id"] == job_id and figures["records"]["processed"] == good + len(BAD_RECORDS)
              and figures["calls"]["requests"] == paced_simulator.stats()["requests_total"] == good
              and sum(figures["dead_letters"]["by_reason"].values()) == len(BAD_RECORDS))
        return figures if ok else None

    figures = wait_until(done, timeout=300, message="llmstream status --jobmanager to show every record processed",
                         ignoring=(Exception,))
    assert figures["job"]["state"] == "RUNNING" and figures["job"]["restarts"] == 0
    assert figures["calls"]["capacity"] == setup.config.async_.capacity
    def served() -> dict[str, float] | None:
        m = _scrape_job(job_id)
        return m if m and m.get("requests", 0) >= good else None

    scraped = wait_until(served, timeout=120, message="the cluster's reporter to serve the job's llmstream metrics",
                         ignoring=(Exception,))
    assert scraped["records_in"] == good + len(BAD_RECORDS) and scraped["bad_input"] == len(BAD_RECORDS)
    assert scraped["latency_count"] >= good and scraped["latency_p99_ms"] >= scraped["latency_p50_ms"] > 0
    cluster.cancel(job_id)
