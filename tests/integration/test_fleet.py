"""A model fleet on a real standalone Flink cluster and a real Kafka broker (issue 21): three
simulated endpoints and a fallback, served by one simulator process (`spawn_fleet`), under
one running job.

One endpoint answers HTTP 500 to everything from the start; the biggest is killed mid-run and
revived; then every primary is down and the fallback (another model) serves; then the
primaries come back. What a read_committed consumer sees at the end: every id exactly once,
no dead letter, no job restart, and the fallback's records carrying its model. Every phase
waits for a condition, never a fixed time.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.simulator import SpawnedFleet, spawn_fleet
from tests.support.committed import check_exactly_once
from tests.support.job_setup import make_job
from tests.support.runs import start_run
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.integration]

RECORDS = 10_000
BIG, FAILING, SMALL, FALLBACK = 0, 1, 2, 3
LIMITS = (8, 4, 6, 4)
FALLBACK_MODEL = "fallback-model"
COOLDOWN_S = 2.0
MAX_COOLDOWN_S = 8.0


@pytest.fixture
def fleet() -> Iterator[SpawnedFleet]:
    handle = spawn_fleet(LIMITS, ["--latency", "fixed:40", "--seed", "7"])
    try:
        yield handle
    finally:
        handle.stop()


def _requests(fleet: SpawnedFleet) -> list[int]:
    return [s["requests_total"] for s in fleet.endpoint_stats()]


def _served(fleet: SpawnedFleet, index: int) -> int:
    return int(fleet.endpoint_stats()[index]["served"])


def test_a_fleet_routes_around_dead_and_failing_endpoints_and_falls_back(
        cluster: LocalCluster, fleet: SpawnedFleet, tmp_path: Path, kafka_broker: local_kafka.LocalBroker) -> None:
    urls = fleet.urls
    model = {"endpoint": None,
             "endpoints": [{"url": urls[i], "max_concurrency": LIMITS[i], "name": f"e{i}"}
                           for i in (BIG, FAILING, SMALL)],
             "circuit": {"failures": 5, "cooldown_s": COOLDOWN_S, "max_cooldown_s": MAX_COOLDOWN_S},
             "fallback": {"endpoints": [{"url": urls[FALLBACK], "max_concurrency": LIMITS[FALLBACK],
                                         "model": FALLBACK_MODEL, "name": "fallback"}]}}
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, urls[BIG], name="fleet", model=model,
                     async_={"capacity": 16})
    fleet.faults(FAILING, {"error_rate": 1.0, "error_status": 500})
    run = start_run(cluster, setup, "fleet", RECORDS)

    # the failing endpoint's circuit opens: from here on it gets probes only
    run.wait_mid_stream(0.05, timeout=180)
    before = _requests(fleet)

    # the biggest endpoint dies: the stream goes on without it, then it rejoins
    fleet.kill(BIG)
    committed = run.reader.unique_ids()
    run.wait_mid_stream(committed / RECORDS + 0.05)
    fleet.revive(BIG)
    revived_at, served_at_revival = time.monotonic(), _served(fleet, BIG)
    wait_until(lambda: _served(fleet, BIG) >= served_at_revival + 50, timeout=180, interval=0.2,
               message="the revived endpoint to take traffic again")
    rejoined_s = time.monotonic() - revived_at

    # every primary down: the fallback serves
    fleet.kill(BIG)
    fleet.kill(SMALL)
    fallback_before = _served(fleet, FALLBACK)
    wait_until(lambda: _served(fleet, FALLBACK) >= fallback_before + 200, timeout=120, interval=0.2,
               message="the fallback to serve while every primary is down")
    after = _requests(fleet)

    # the primaries come back and take the traffic again
    fleet.revive(BIG)
    fleet.revive(SMALL)
    fleet.faults(FAILING, {})
    back = _served(fleet, BIG) + _served(fleet, SMALL)
    wait_until(lambda: _served(fleet, BIG) + _served(fleet, SMALL) >= back + 100, timeout=120, interval=0.2,
               message="traffic to return to the primaries")
    assert run.reader.unique_ids() < RECORDS, "the input ran out before the last phase: raise RECORDS"

    result = run.finish()
    check_exactly_once(result)
    assert result.dead == 0, result.dead_reasons
    assert run.restarts() == 0

    window = [a - b for a, b in zip(after, before, strict=True)]
    failing_share = window[FAILING] / sum(window)
    assert failing_share < 0.02, f"the failing endpoint got {failing_share:.1%} of {sum(window)} requests: {window}"
    # How fast it rejoins (within the cooldown + 5 s) is a target for `llmstream bench`, not a timed
    # test: on a busy machine the 50 answers it must serve take their time. It must rejoin at all.

    bodies = [json.loads(r.value) for r in kafka_admin.consume_committed(
        setup.bootstrap, setup.config.kafka.output_topic, timeout_s=60)]
    by_model = Counter(b["model"] for b in bodies)
    fallback_bodies = [b for b in bodies if b["model"] == FALLBACK_MODEL]
    assert len(fallback_bodies) >= 200, by_model
    assert all(b["endpoint"].startswith(urls[FALLBACK]) for b in fallback_bodies)
    assert {b["endpoint"].rsplit("/chat", 1)[0] for b in bodies} <= set(urls)
    print(f"fleet: {result}, failing share {failing_share:.2%} of {sum(window)}, rejoined in {rejoined_s:.1f} s, "
          f"models {dict(by_model)}, requests {_requests(fleet)}")


def test_every_endpoint_down_never_holds_a_checkpoint(
        cluster: LocalCluster, tmp_path: Path, kafka_broker: local_kafka.LocalBroker) -> None:
    """Both endpoints of a fleet without a fallback killed: the calls out wait for a probe (the
    cooldown doubles up to 30 s), the stage parks the rest and its admission gate stops the
    input (`jobs/graph/gate_operator.py`), so checkpoints keep completing within a 10 s checkpoint timeout that
    a wait in the bundle would exceed (a failed checkpoint is a failover here). Revived, every
    id comes out once, none dead-lettered, and the job never restarted."""
    fleet = spawn_fleet((8, 8), ["--latency", "fixed:40", "--seed", "11"])
    try:
        model = {"endpoint": None,
                 "endpoints": [{"url": url, "max_concurrency": 8, "name": f"e{i}"} for i, url in enumerate(fleet.urls)],
                 "circuit": {"failures": 3, "cooldown_s": 4.0, "max_cooldown_s": 30.0}}
        setup = make_job(tmp_path, kafka_broker.bootstrap_servers, fleet.urls[0], name="fleet-down", model=model,
                         async_={"capacity": 16, "record_deadline_s": 900.0},
                         checkpointing={"timeout_ms": 10_000})
        run = start_run(cluster, setup, "down", 4000)
        run.wait_mid_stream(0.05, timeout=180)
        for index in (0, 1):
            fleet.kill(index)
        killed_ms = time.time() * 1000
        before = cluster.completed_checkpoints(run.job_id)
        wait_until(lambda: (run.not_failed(), cluster.completed_checkpoints(run.job_id) >= before + 5)[-1],
                   timeout=240, interval=0.5, message="five checkpoints completed with every endpoint down")
        history = [c for c in cluster.checkpoint_stats(run.job_id).get("history", [])
                   if c.get("trigger_timestamp", 0) >= killed_ms]
        down_for_s = time.time() - killed_ms / 1000
        served_while_down = run.reader.unique_ids()
        for index in (0, 1):
            fleet.revive(index)
        assert run.reader.unique_ids() < len(run.ids), "the input ran out before the endpoints came back"
        result = run.finish(timeout=600)
    finally:
        fleet.stop()
    check_exactly_once(result)
    assert result.dead == 0, result.dead_reasons
    assert run.restarts() == 0
    completed = [c for c in history if c.get("status") == "COMPLETED"]
    assert completed, history
    longest = max(int(c["end_to_end_duration"]) for c in completed)
    print(f"every endpoint down {down_for_s:.1f} s: {len(completed)} checkpoints completed in it, "
          f"the longest {longest} ms, {len(history) - len(completed)} not completed; "
          f"{served_while_down} ids committed at revival; {result}")
