"""A savepoint taken before the lanes moved into `udfs/lanes/` restores in this checkout.

The provider-batch lane keeps what it holds (`Held`, `BatchEntry`) in Flink state as pickles, which
name their classes by module path; those modules moved (90b96cf) and the old names stay as aliases
(`udfs/provider_batch/__init__.py`). The build before the move (`tests.support.release_build`,
`BEFORE_LANES`: main at 5c33062, the same Flink) runs the job until every record is in a batch that
is live at the provider, and is stopped with a savepoint the way a user does (Ctrl-C); this checkout
then resumes from it with ``--until-end``. It must read those batches back from its restored state,
not make them again: every id once, and the provider paid for each request once.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from jobs.clients import kafka_admin
from jobs.dev.local_kafka import LocalBroker
from jobs.dev.simulator.batch_engine import LIVE
from tests.support.committed import check_exactly_once, final_tally
from tests.support.job_setup import LONG_FAULT, SpawnSimulator, make_job, unique_records
from tests.support.release_build import BEFORE_LANES, ReleaseBuild
from tests.support.runs import LocalRun
from tests.support.waiting import Hopeless, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.slow, LONG_FAULT]

RECORDS = 60
STARTED = "started in a local mini cluster"


@pytest.fixture(scope="session")
def before_lanes() -> Iterator[ReleaseBuild]:
    """The build before the move, made on first use (minutes, once per machine)."""
    yield BEFORE_LANES.ensure()


def test_a_provider_batch_savepoint_from_before_the_lanes_moved_resumes_without_paying_twice(
        before_lanes: ReleaseBuild, kafka_broker: LocalBroker, spawn_simulator: SpawnSimulator,
        tmp_path: Path) -> None:
    # Batches that would take half an hour: every one is still live when the old build stops.
    sim = spawn_simulator(["--latency", "fixed:5", "--batch-validating-s", "0.2", "--batch-delay-s", "1800",
                           "--batch-finalizing-s", "0.2"])
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name="lane-savepoint")
    kafka = setup.config.kafka
    # The keys both builds read, the rest left to each build's defaults.
    path = tmp_path / "portable.yaml"
    path.write_text(yaml.safe_dump({
        "name": setup.config.name,
        "lane": "provider-batch",
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers, "input_topic": kafka.input_topic,
                  "output_topic": kafka.output_topic, "dead_letter_topic": kafka.dead_letter_topic,
                  "group_id": kafka.group_id, "transactional_id_prefix": kafka.transactional_id_prefix,
                  "create_topics": False, "topic_partitions": kafka.topic_partitions},
        "model": {"endpoint": setup.config.model.endpoint, "model": setup.config.model.model},
        "provider_batch": {"max_requests": 20, "max_wait_s": 1, "poll_initial_s": 0.5, "poll_max_s": 1},
        "checkpointing": {"interval_ms": 1000, "directory": setup.config.checkpointing.directory},
    }, sort_keys=False))
    records = unique_records(RECORDS, "lanesp")
    ids = [k.decode() for k, _ in records]
    kafka_admin.produce(setup.bootstrap, setup.input_topic, records)

    old = LocalRun(path, tmp_path / "run-before.log", command=before_lanes.command(), env=before_lanes.env(),
                   cwd=tmp_path)
    try:
        def all_in_live_batches() -> bool:
            if old.process.poll() is not None:
                raise Hopeless(f"the earlier build's run exited {old.process.returncode}:\n{old.output()[-3000:]}")
            return int(sim.stats()["batches"]["requests_submitted"]) >= RECORDS

        wait_until(all_in_live_batches, timeout=420, interval=0.5,
                   message=lambda: f"every record in a live batch: {sim.stats().get('batches')}")
        old.signal_group(signal.SIGINT)  # Ctrl-C: stop with a savepoint
        code = old.wait(timeout=300)
    finally:
        old.kill_if_running()
    said = old.output()
    assert code == 0, said[-3000:]
    assert "resumes from savepoint" in said, said[-3000:]
    assert final_tally(setup, ids).out == 0, "a batch ended before the savepoint: nothing would be restored"

    # The provider finishes the batches the earlier build made; nothing new is made.
    live = [b["id"] for b in sim.batches() if b.get("status") in LIVE]
    assert live, "no batch was left live at the provider"
    for batch_id in live:
        sim.force_batch(batch_id, {"action": "process"})
    sim.configure_batches({"delay_s": "0.5"})

    new = LocalRun(path, tmp_path / "run-here.log", "--until-end", cwd=tmp_path)
    code = new.wait(timeout=600)
    said = new.output()
    assert code == 0, said[-3000:]
    assert "resuming from savepoint" in said, said[-3000:]
    check_exactly_once(final_tally(setup, ids))
    submitted = int(sim.stats()["batches"]["requests_submitted"])
    assert submitted == RECORDS, f"{submitted} requests paid for {RECORDS} records"
