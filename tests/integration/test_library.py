"""The stage as a library call (`jobs/library.py`) inside a job of a user's own: the example job
`jobs/examples/enrich_and_infer.py` (Kafka → a PyFlink filter and map → `infer` → the exactly-once
Kafka sink), run in the mini cluster and submitted to the standalone cluster with its TaskManager
killed mid-stream.

Every assertion is on what a user sees: the records a read_committed consumer reads from the
output and dead-letter topics, and the errors the library raises while the graph is built.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pyflink.common import Types
from pyflink.table import StreamTableEnvironment
from pyflink.table.expressions import col

from jobs.clients.kafka_admin import consume_committed, produce
from jobs.dev import local_kafka
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from jobs.graph import pyflink_private as private
from jobs.graph.gate_operator import TICKS_UID
from jobs.graph.pipeline import GATE_UID, TICKS_TABLE
from jobs.launch.driver import MiniClusterDriver
from jobs.library import INPUT_ROW_TYPE, environment, infer, read_kafka, write_kafka
from jobs.runtime import jars
from jobs.state.snapshots import StateDir
from tests.support.committed import CommittedReader, check_exactly_once, final_tally
from tests.support.fault_report import FaultReport, FaultResult
from tests.support.job_setup import JobConfigFactory, make_job
from tests.support.runs import Run
from udfs.config import load_config, with_overrides

pytestmark = pytest.mark.integration

EXAMPLE = "jobs/examples/enrich_and_infer.py"
CUSTOMERS = {"acme": "gold", "globex": "silver", "initech": "standard"}


def _example() -> ModuleType:
    """The example job as a module (it is a script, not a package member). Registered in
    `sys.modules`, so its functions go to the mini cluster's (in-process) Python workers by name."""
    name = "llmstream_example_enrich_and_infer"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, jars.repo_root() / EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _tickets(n: int, prefix: str) -> tuple[list[tuple[bytes, bytes]], list[str], list[str]]:
    """``n`` tickets (key = id) of three customers, every fifth closed: (records, open ids, closed ids)."""
    records: list[tuple[bytes, bytes]] = []
    open_ids: list[str] = []
    closed_ids: list[str] = []
    names = list(CUSTOMERS)
    for i in range(n):
        rid = f"{prefix}-{i:06d}"
        status = "closed" if i % 5 == 4 else "open"
        (closed_ids if status == "closed" else open_ids).append(rid)
        records.append((rid.encode(), json.dumps({
            "id": rid, "prompt": f"Triage ticket {i}.", "params": {"max_tokens": 16},
            "customer": names[i % len(names)], "status": status}).encode()))
    return records, open_ids, closed_ids


def _tier_of(rid: str) -> str:
    return CUSTOMERS[list(CUSTOMERS)[int(rid.rsplit("-", 1)[1]) % len(CUSTOMERS)]]


def _check_answers(bodies: list[dict[str, Any]], open_ids: list[str]) -> None:
    """Each open ticket answered once, with its customer's tier in the prompt the model saw (the
    simulator echoes the prompt's start): the user's map ran before the stage."""
    ids = Counter(b["id"] for b in bodies)
    assert set(ids) == set(open_ids) and max(ids.values()) == 1, ids.most_common(3)
    for body in bodies:
        assert body["output"].startswith(f"Simulated answer to: [{_tier_of(body['id'])} customer] Triage"), body


# ---------------------------------------------------------------------- the graph, no broker


def _uids(env: Any) -> dict[str, str]:
    graph = env._j_stream_execution_environment.getStreamGraph(False)
    return {str(n.getTransformationUID()): str(n.getOperatorName()) for n in graph.getStreamNodes().toArray()}


def test_the_stage_in_a_users_job_has_the_apps_uids_and_a_second_call_its_own() -> None:
    """A savepoint of a user's job finds the stage, its ticks and the Kafka ends by uid, as the app's
    does; a second stage in the same job (another uid) names all of its operators after it."""
    config = with_overrides(load_config(), budget={"max_tokens_per_hour": 100_000})  # gated: ticks and gate too
    env = environment(config)
    requests = read_kafka(env, config)
    enriched = requests.map(lambda row: row, output_type=INPUT_ROW_TYPE).uid("mine")
    write_kafka(infer(enriched, config), config)
    plain = with_overrides(load_config(), budget={})
    write_kafka(infer(enriched, plain, uid="second"), plain, uid="second_results")
    uids = _uids(env)
    assert {"kafka_requests_source", "mine", "inference", GATE_UID, TICKS_UID, "kafka_results_sink",
            "second", "second_ticks_source", "second_results_sink"} <= set(uids), sorted(uids)
    assert TICKS_TABLE == "inference_ticks"
    assert len(uids) == len(env._j_stream_execution_environment.getStreamGraph(False).getStreamNodes().toArray())


def test_the_stage_takes_the_rows_as_they_come_and_leaves_the_users_table_settings_alone() -> None:
    """The bucket's SQL step runs at the parallelism of the user's last operator and takes its rows
    forward (no rebalance to reorder a key's records), and the table settings the library plans
    with do not stay in the user's environment: a table query of the user's own after it gets uids
    of its own, not the sink's."""
    config = with_overrides(load_config(), ordering="per_key", parallelism={"inference": 2})
    env = environment(config)
    mine = read_kafka(env, config).map(lambda row: row, output_type=INPUT_ROW_TYPE).uid("mine").set_parallelism(3)
    answers = infer(mine, config)
    write_kafka(answers, config)
    with private.one_jvm_thread(env):  # other threads of this test process call the JVM too
        t_env = StreamTableEnvironment.create(env)
        t_env.to_data_stream(t_env.from_data_stream(answers).select(col("topic"))).print()
    graph = env._j_stream_execution_environment.getStreamGraph(False)
    nodes = {n.getId(): n for n in graph.getStreamNodes().toArray()}
    step = [n for n in nodes.values() if str(n.getTransformationUID()) == "inference_requests_source"]
    assert len(step) == 1 and step[0].getParallelism() == 3
    (edge,) = step[0].getInEdges().toArray()
    assert str(nodes[edge.getSourceId()].getTransformationUID()) == "mine"
    assert str(edge.getPartitioner()) == "FORWARD"
    uids = [str(n.getTransformationUID()) for n in nodes.values() if n.getTransformationUID() is not None]
    assert len(uids) == len(set(uids)), sorted(uids)


def test_the_library_names_the_row_type_it_expects() -> None:
    config = load_config()
    env = environment(config)
    with pytest.raises(TypeError, match=r"INPUT_ROW_TYPE rows \(ROW<k, v, topic, partition, offset, ts, headers>\)"):
        infer(env.from_collection(["a prompt"], type_info=Types.STRING()), config)
    with pytest.raises(TypeError, match=r"SINK_ROW_TYPE rows \(ROW<k, v, topic, headers>\), got ROW<k, v, topic, partition"):
        write_kafka(read_kafka(env, config), config)


# ---------------------------------------------------------------------- the mini cluster


def _run_example(config: Any, expected: int, *, restore_from: str | None = None) -> str:
    """The example job in a mini cluster until ``expected`` results are committed, then stopped as a
    backfill is (a draining stop-with-savepoint); returns the savepoint."""
    env = environment(config, restore_from=restore_from)
    _example().build(env, config)
    job = MiniClusterDriver(env.execute_async(config.name))
    try:
        consume_committed(config.kafka.bootstrap_servers, config.kafka.output_topic, expected=expected, timeout_s=300)
        savepoint = job.stop_with_savepoint(drain=True, directory=StateDir.for_job(config).savepoints_uri)
    except BaseException:
        job.cancel()
        raise
    assert job.final_state() == "FINISHED", job.failure()
    return savepoint


@pytest.mark.parametrize("sections", [{}, {"ordering": "per_key", "budget": {"max_tokens_per_hour": 10_000_000}}],
                         ids=["plain", "per-key-gated"])
def test_the_example_job_in_the_mini_cluster_stops_with_a_savepoint_and_resumes(
        job_config: JobConfigFactory, sections: dict[str, Any]) -> None:
    """The example job as a user runs it on their machine (`env.execute`: a mini cluster): open
    tickets answered once each with their tier, closed ones never reach the model, bad input is
    a dead letter, all read_committed. Stopped with a savepoint and started again from it
    (`environment(config, restore_from=...)`), it answers only what came since. Also with per-key
    order and a (never reached) token budget: the key-hash buckets, the admission gate and its ticks."""
    config = job_config(**sections)
    bootstrap, kafka = config.kafka.bootstrap_servers, config.kafka
    first, first_open, _ = _tickets(150, "first")
    produce(bootstrap, kafka.input_topic, [*first, (b"bad-1", b'{"id": "bad-1", "prompt": ')])
    savepoint = _run_example(config, len(first_open))
    second, second_open, _ = _tickets(100, "second")
    produce(bootstrap, kafka.input_topic, second)
    _run_example(config, len(first_open) + len(second_open), restore_from=savepoint)

    out = consume_committed(bootstrap, kafka.output_topic, timeout_s=60)
    _check_answers([json.loads(m.value) for m in out], first_open + second_open)
    dead = consume_committed(bootstrap, kafka.dead_letter_topic, timeout_s=60)
    assert [json.loads(m.value)["reason"] for m in dead] == ["invalid_json"]


# ---------------------------------------------------------------------- the standalone cluster


LIBRARY_RECORDS = 4000
"""~30 s of work at the fault tests' pace (capacity 6, 40 ms a call), so the kill lands mid-stream."""


@pytest.mark.fault
def test_the_example_job_survives_a_taskmanager_kill_every_id_once(
        cluster: LocalCluster, paced_simulator: SpawnedSimulator, tmp_path: Path,
        kafka_broker: local_kafka.LocalBroker, fault_report: FaultReport) -> None:
    """The example submitted as a user submits their own job (`flink run -py`), its only
    TaskManager SIGKILLed mid-stream and a new one started: the job restarts from its last
    checkpoint, the stage starts again the calls its state held, the sink aborts the dead
    TaskManager's transactions; every open ticket is answered exactly once, no closed one."""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="library-kill")
    records, open_ids, closed_ids = _tickets(LIBRARY_RECORDS, "lib")
    produce(setup.bootstrap, setup.input_topic, records)
    reader = CommittedReader(setup.bootstrap, [setup.output_topic, setup.dead_letter_topic])
    reader.start()
    run = Run(cluster, setup, open_ids, reader)
    job_id = cluster.submit(setup.path, script=EXAMPLE)
    run.job_ids.append(job_id)
    cluster.wait_for_job_state(job_id, "RUNNING", timeout=180)
    run.wait_mid_stream(0.2, timeout=240)
    committed_at_kill = reader.unique_ids()
    killed_at = time.monotonic()
    cluster.replace_taskmanager(job_id)
    result = run.finish(timeout=420)
    cluster.reap_orphans(grace_s=2)

    check_exactly_once(result)
    assert run.restarts() >= 1
    everything = final_tally(setup, open_ids + closed_ids)
    assert everything.lost == len(closed_ids), "a closed ticket reached the stage"
    out = consume_committed(setup.bootstrap, setup.output_topic, timeout_s=60)
    _check_answers([json.loads(m.value) for m in out], open_ids)
    first = reader.first_arrival_after(killed_at)
    fault_report.add(FaultResult(
        scenario="p. TaskManager SIGKILL under a user's own job calling the stage (jobs/examples/enrich_and_infer.py)",
        records_in=result.records_in, out=result.out, dead=result.dead, duplicates=result.duplicates,
        lost=result.lost, restarts=run.restarts(),
        recovery_s=None if first is None else round(first - killed_at, 1),
        duration_s=round(time.monotonic() - run.started, 1),
        notes=f"{len(closed_ids)} closed tickets filtered before the stage; recovery counted from the kill",
        extra={"committed_before_kill": committed_at_kill, "dead_reasons": result.dead_reasons}))

