"""The job on a replicated Kafka: three KRaft nodes (`LocalKafkaCluster`), the output leader killed -9.

`llmstream run --until-end` reads a few thousand unique ids from a cluster of three nodes (each
broker and controller, replication 3, min.insync.replicas 2); mid-run the node leading the output
topic's partition 0 is killed -9, output must keep committing while it is down (two replicas are
enough), and the node is started again. A read_committed consumer then sees every id exactly once.
The output topics are made by preflight (`kafka.create_topics`) with the cluster's default
replication, which this checks too.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from jobs.clients import kafka_admin
from jobs.dev.local_kafka import ClusterConfig, LocalKafkaCluster
from jobs.dev.simulator import SpawnedSimulator
from tests.support.committed import CommittedReader, check_exactly_once, final_tally
from tests.support.job_setup import (
    CHECKPOINT_INTERVAL_MS,
    FAULT_CAPACITY,
    JobSetup,
    unique_records,
    write_config,
)
from tests.support.runs import LocalRun
from tests.support.waiting import Hopeless, wait_until
from udfs.config import config_from_dict, load_config, to_dict

pytestmark = [pytest.mark.integration, pytest.mark.fault]

RECORDS = 3000
"""~20 s of work at the paced simulator's 40 ms a call and capacity 6: the kill lands mid-run."""
STARTED = "started in a local mini cluster"


def _job(cluster: LocalKafkaCluster, endpoint: str, directory: Path) -> JobSetup:
    """A job on fresh topics of the cluster: the input made here, output and dead letters by preflight."""
    tag = f"replicated-{uuid.uuid4().hex[:8]}"
    data = to_dict(load_config())
    data["name"] = "llmstream-replicated"
    data["kafka"].update(bootstrap_servers=cluster.bootstrap_servers, input_topic=f"{tag}-in",
                         output_topic=f"{tag}-out", dead_letter_topic=f"{tag}-dead", group_id=f"{tag}-group",
                         transactional_id_prefix=f"{tag}-tx", create_topics=True, topic_partitions=2)
    data["model"]["endpoint"] = endpoint
    data["async"]["capacity"] = FAULT_CAPACITY
    data["checkpointing"].update(interval_ms=CHECKPOINT_INTERVAL_MS, directory=str(directory / "state"))
    config = config_from_dict(data)
    cluster.create_topics([str(config.kafka.input_topic)], partitions=2)
    return JobSetup(config, write_config(config, directory))


def test_run_survives_the_output_leader_killed_and_restarted(
        tmp_path: Path, paced_simulator: SpawnedSimulator) -> None:
    cluster = LocalKafkaCluster(ClusterConfig.ephemeral(tmp_path / "kafka", heap="384m"))
    began = time.monotonic()
    cluster.start(timeout=240)
    print(f"3 nodes up in {time.monotonic() - began:.1f} s at {cluster.bootstrap_servers}")
    reader: CommittedReader | None = None
    run: LocalRun | None = None
    try:
        setup = _job(cluster, paced_simulator.url, tmp_path)
        records = unique_records(RECORDS, "rep")
        kafka_admin.produce(cluster.bootstrap_servers, setup.input_topic, records)
        run = LocalRun(setup.path, tmp_path / "run.log", "--until-end")
        this_run = run

        def started() -> bool:
            if this_run.process.poll() is not None:
                raise Hopeless(f"llmstream run exited {this_run.process.returncode}:\n{this_run.output()[-3000:]}")
            return STARTED in this_run.output()

        wait_until(started, timeout=240, message="llmstream run to start its job")
        replicas = cluster.partition(setup.output_topic, 0)["replica_nodes"]
        assert len(replicas) == 3, f"preflight made {setup.output_topic} with replicas {replicas}, not 3"

        reader = CommittedReader(cluster.bootstrap_servers, [setup.output_topic, setup.dead_letter_topic])
        reader.start()

        def running() -> None:
            if this_run.process.poll() is not None:
                raise Hopeless(f"llmstream run ended before the fault:\n{this_run.output()[-3000:]}")

        assert reader.wait_for(RECORDS // 10, timeout=300, check=running), (
            f"only {reader.unique_ids()} ids committed before the fault")
        before = reader.unique_ids()
        assert before < RECORDS, "the run finished before the fault"

        leader = cluster.leader(setup.output_topic, 0)
        killed_at = time.monotonic()
        cluster.kill(leader)
        print(f"killed node {leader} (leader of {setup.output_topic}-0) at {before} ids committed")

        def elected() -> int | None:
            node = cluster.leader(setup.output_topic, 0)
            return node if node not in (leader, -1) else None

        new_leader = wait_until(elected, timeout=120, message=f"a new leader of {setup.output_topic}-0",
                                ignoring=(Exception,))
        assert reader.wait_for(min(RECORDS, before + 200), timeout=240, check=running), (
            f"output stalled with node {leader} down: {reader.unique_ids()} ids, {before} at the kill")
        down_for = time.monotonic() - killed_at
        print(f"node {new_leader} leads; {reader.unique_ids() - before} more ids committed in {down_for:.1f} s "
              "with one node down")

        cluster.restart(leader, timeout=180)
        print(f"node {leader} back after {time.monotonic() - killed_at:.1f} s")
        code = run.wait(timeout=600)
        assert code == 0, f"llmstream run --until-end exited {code}:\n{run.output()[-3000:]}"
        cluster.wait_in_sync(setup.output_topic, 0, timeout=120)
        reader.stop()
        result = final_tally(setup, [key.decode() for key, _ in records])
        print(f"{result.out} out, {result.dead} dead, {result.duplicates} duplicates, {result.lost} lost; "
              f"{time.monotonic() - began:.1f} s in all")
        check_exactly_once(result)
        assert result.dead == 0, result.dead_reasons
        for internal in ("__transaction_state", "__consumer_offsets"):  # made once the job used them
            assert len(cluster.partition(internal, 0)["replica_nodes"]) == 3, internal
    finally:
        if reader is not None:
            reader.stop()
        if run is not None:
            run.kill_if_running()
        for node in cluster.nodes:  # throwaway data: kill -9 ends it as well as a clean stop, ~10 s sooner
            node.kill()
