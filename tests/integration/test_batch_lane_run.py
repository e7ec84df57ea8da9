"""The provider-batch lane (`model.mode: batch`) on real parts: a real broker, the simulator's batch
APIs over HTTP, `llmstream run` in a mini cluster and a job on the standalone cluster whose
TaskManager is killed while batches are live at the provider.

What a user sees is asserted (every id once in output ∪ dead letters, read_committed) and what they
pay: the requests submitted to the provider, counted at the simulator, against the records; and
with the provider's bad days forced on live batches, each record's end and its reason.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from jobs.dev.simulator.batch_engine import LIVE
from jobs.dev.simulator.batch_faults import ForcedOutcomes
from tests.conftest import SHELL_ENV
from tests.support.committed import check_exactly_once
from tests.support.job_setup import LLMSTREAM, SpawnSimulator, make_job, unique_records
from tests.support.runs import start_records
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

LANE = {"mode": "batch"}


def _batches(sim: SpawnedSimulator) -> dict[str, object]:
    return sim.stats()["batches"]  # type: ignore[no-any-return]


def _live_batches(sim: SpawnedSimulator) -> int:
    """The job's batches made and not yet answered at the provider: the OpenAI API's, whose
    statuses are the simulator's own `LIVE` ones (Anthropic's are named differently)."""
    openai: dict[str, Any] = _batches(sim)["openai"]  # type: ignore[assignment]
    return sum(int(openai["batches_by_status"].get(state, 0)) for state in LIVE)


@pytest.fixture
def batch_simulator(spawn_simulator: SpawnSimulator) -> SpawnedSimulator:
    """Batches that take 2-4 s to answer, so some are live when a test acts on the job."""
    return spawn_simulator(["--latency", "fixed:5", "--batch-validating-s", "0.2", "--batch-delay-s", "2:4",
                            "--batch-finalizing-s", "0.2"])


def test_run_until_end_answers_every_record_once_through_batches(
        tmp_path: Path, kafka_broker: local_kafka.LocalBroker, batch_simulator: SpawnedSimulator) -> None:
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, batch_simulator.url, name="batch-run", model=LANE,
                     provider_batch={"max_requests": 100, "max_wait_s": 1, "poll_initial_s": 0.5, "poll_max_s": 2})
    records = unique_records(400, "bl")
    kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
    done = subprocess.run([str(LLMSTREAM), "run", "--config", str(setup.path), "--until-end"], cwd=tmp_path,
                          env=SHELL_ENV, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, expected=400, timeout_s=60)
    bodies = [json.loads(r.value) for r in out]
    assert Counter(b["id"] for b in bodies) == Counter(k.decode() for k, _ in records)
    assert {b["lane"] for b in bodies} == {"batch"}
    assert _batches(batch_simulator)["requests_submitted"] == 400  # paid once each


def test_a_taskmanager_killed_while_batches_are_live_pays_for_nothing_twice(
        cluster: LocalCluster, tmp_path: Path, kafka_broker: local_kafka.LocalBroker,
        batch_simulator: SpawnedSimulator) -> None:
    """Batches are made only once a completed checkpoint holds them (the gate's `.durable`), so the
    restored job views the batches it made instead of making them again: requests submitted ÷
    records = 1.000 through a TaskManager SIGKILL."""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, batch_simulator.url, name="batch-tm-kill", model=LANE,
                     provider_batch={"max_requests": 150, "max_wait_s": 2, "poll_initial_s": 0.5, "poll_max_s": 2})
    records = unique_records(1500, "bk")
    run = start_records(cluster, setup, records)

    def live() -> int:
        run.not_failed()
        return _live_batches(batch_simulator)

    # The kill waits for a batch at the provider, not for a share of the output: the job reads all
    # 1,500 records at once and its batches end within seconds of each other, so on a slow machine
    # the output can go from none to all between two looks.
    wait_until(live, timeout=180, interval=0.2, message="a batch live at the provider")
    cluster.replace_taskmanager(run.job_id)
    result = run.finish(timeout=400)
    check_exactly_once(result)
    assert run.restarts() >= 1
    submitted = int(_batches(batch_simulator)["requests_submitted"])  # type: ignore[call-overload]
    assert submitted == len(records), f"{submitted} requests submitted for {len(records)} records"


def test_every_provider_outcome_ends_each_record_once_as_an_answer_or_a_dead_letter_with_its_reason(
        tmp_path: Path, kafka_broker: local_kafka.LocalBroker, spawn_simulator: SpawnSimulator) -> None:
    """Refused requests (20%, two tries), and one batch each expired part-way, failed in validation,
    deleted and cancelled by someone else, on `llmstream run`: every id ends once; the dead letters
    carry the reasons of docs/cost.md; every request paid for beyond one a record has its cause."""
    sim = spawn_simulator(["--latency", "fixed:5", "--batch-validating-s", "0.2", "--batch-delay-s", "4:6",
                           "--batch-finalizing-s", "0.2", "--batch-error-rate", "0.2", "--batch-error-status", "500"])
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name="batch-outcomes", model=LANE,
                     retry={"max_attempts": 2},
                     provider_batch={"max_requests": 100, "max_wait_s": 1, "poll_initial_s": 0.5, "poll_max_s": 2})
    records = unique_records(800, "bo")
    kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
    forced = ForcedOutcomes(sim).start()
    try:
        done = subprocess.run([str(LLMSTREAM), "run", "--config", str(setup.path), "--until-end"], cwd=tmp_path,
                              env=SHELL_ENV, capture_output=True, text=True, timeout=900, check=False)
    finally:
        forced.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    assert forced.done, f"not every outcome found a live batch: {forced.forced}"
    out = [json.loads(r.value) for r in kafka_admin.consume_committed(setup.bootstrap, setup.output_topic,
                                                                               timeout_s=60)]
    dead = [json.loads(r.value) for r in kafka_admin.consume_committed(setup.bootstrap, setup.dead_letter_topic,
                                                                                timeout_s=60)]
    ends = Counter([b["id"] for b in out] + [d["id"] for d in dead])
    assert ends == Counter(k.decode() for k, _ in records)  # each record once, answered or dead-lettered
    reasons = Counter(d["reason"] for d in dead)
    assert set(reasons) == {"batch_failed", "batch_cancelled", "batch_request_failed"}, reasons
    failed = next(d for d in dead if d["reason"] == "batch_failed")
    assert "Injected validation failure of line 2" in failed["error"], failed
    openai = _batches(sim)["openai"]
    paid = forced.accounting(openai, (d["reason"] for d in dead), len(records))  # type: ignore[arg-type]
    assert paid["unexplained"] == 0, paid
