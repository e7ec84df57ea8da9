"""The job graph from the execution plan: names, parallelism, capacity, sink guarantee.

No broker is needed: building the graph only declares the Kafka tables.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from pyflink.java_gateway import get_gateway

from jobs.graph import key_groups
from jobs.graph import pyflink_private as private
from jobs.graph.pipeline import (
    BUCKETS_PER_SUBTASK,
    bucket_keys,
    build_pipeline,
    create_environment,
    sink_options,
    source_options,
    tick_keys,
)
from jobs.runtime import jars
from udfs.config import JobConfig, load_config, with_overrides

pytestmark = pytest.mark.integration


def _plan(**overrides: Any) -> list[dict[str, Any]]:
    config = with_overrides(load_config(), **overrides)
    env = create_environment(config, jars.connector_jar_urls())
    build_pipeline(env, config)
    return json.loads(env.get_execution_plan())["nodes"]


def _node(nodes: list[dict[str, Any]], name: str) -> dict[str, Any]:
    matches = [n for n in nodes if n["type"] == name or n["type"].startswith(name)]
    assert matches, f"no operator named {name!r} in {[n['type'] for n in nodes]}"
    return matches[0]


def test_stages_and_parallelism_follow_the_config() -> None:
    nodes = _plan(parallelism={"default": 1, "source": 2, "inference": 3, "sink": 2})
    assert _node(nodes, "Source: kafka_requests")["parallelism"] == 2
    assert _node(nodes, "inference")["parallelism"] == 3
    assert _node(nodes, "kafka_results")["parallelism"] == 2


@pytest.mark.parametrize(("api", "vectorized"), [("embeddings", True), ("chat", False)])
def test_stage_auto_plans_the_lane_it_chooses(api: str, vectorized: bool) -> None:
    types = [n["type"] for n in _plan(stage="auto", model={"api": api})]
    assert any(t.startswith("PythonCalc") for t in types) == vectorized, types
    assert ("inference" in types) != vectorized, types


def test_decode_and_inference_are_one_keyed_python_operator() -> None:
    nodes = _plan()
    types = [n["type"] for n in nodes]
    assert not any(t.startswith("decode") for t in types), types
    inference = _node(nodes, "inference")
    # keyed by bucket on the JVM: no PyFlink key-by map operator in front of it
    assert not any("_stream_key_by_map_operator" in t for t in types), types
    assert any(p.get("ship_strategy") == "HASH" for p in inference.get("predecessors", [])), inference


@pytest.mark.parametrize("parallelism", [1, 2, 3, 5])
def test_every_inference_subtask_gets_the_same_number_of_buckets(parallelism: int) -> None:
    create_environment(load_config(), jars.connector_jar_urls())  # starts the JVM gateway
    keys = bucket_keys(parallelism)
    assert len(set(keys)) == BUCKETS_PER_SUBTASK * parallelism
    gateway = get_gateway()
    assign = gateway.jvm.org.apache.flink.runtime.state.KeyGroupRangeAssignment
    max_p = assign.computeDefaultMaxParallelism(parallelism)
    per_subtask = Counter()
    for key in keys:
        row = gateway.jvm.org.apache.flink.types.Row(1)
        row.setField(0, gateway.jvm.java.lang.Integer(key))
        per_subtask[assign.assignKeyToParallelOperator(row, max_p, parallelism)] += 1
    assert per_subtask == {i: BUCKETS_PER_SUBTASK for i in range(parallelism)}


def test_python_key_groups_are_the_jvms() -> None:
    """The bucket keys are chosen in Python (`jobs.graph.key_groups`) for the JVM to route: both must agree
    on every key the job may pick, at every parallelism it ticks and beyond."""
    create_environment(load_config(), jars.connector_jar_urls())  # starts the JVM gateway
    gateway = get_gateway()
    assign = gateway.jvm.org.apache.flink.runtime.state.KeyGroupRangeAssignment
    for parallelism in (1, 2, 3, 16, 100, 200, 30000):
        assert key_groups.default_max_parallelism(parallelism) == assign.computeDefaultMaxParallelism(parallelism)
    keys = [*range(1500), -1, -62, -63, 2**31 - 63, 2**31 - 62, 2**31 - 1, -(2**31)]
    for key in keys:
        row = gateway.jvm.org.apache.flink.types.Row(1)
        row.setField(0, gateway.jvm.java.lang.Integer(key))
        assert key_groups.row_key_hash(key) == row.hashCode(), key
        for max_p, parallelism in ((128, 1), (128, 5), (128, 16), (256, 100)):
            assert key_groups.subtask(key, max_p, parallelism) == assign.assignKeyToParallelOperator(
                row, max_p, parallelism), (key, max_p, parallelism)
        assert key_groups.key_group(key, 128) == assign.assignToKeyGroup(row, 128), key


@pytest.mark.parametrize("parallelism", [1, 2, 5])
def test_ticks_reach_the_buckets_of_every_other_parallelism(parallelism: int) -> None:
    """A job restored from a job with another parallelism finds requests in state under that
    job's bucket keys, and only an element of such a key starts them again."""
    create_environment(load_config(), jars.connector_jar_urls())  # starts the JVM gateway
    own, others = tick_keys(parallelism)
    assert own == bucket_keys(parallelism)
    assert not set(own) & set(others)
    for other in range(1, 17):
        assert set(bucket_keys(other)) <= set(own) | set(others), other


def test_unaligned_checkpoints_follow_the_config() -> None:
    for enabled in (True, False):
        config = with_overrides(load_config(), python={"unaligned_checkpoints": enabled})
        env = create_environment(config, jars.connector_jar_urls())
        build_pipeline(env, config)
        assert env.get_checkpoint_config().is_unaligned_checkpoints_enabled() is enabled


def _inference_operator_class(config: JobConfig) -> str:
    env = create_environment(config, jars.connector_jar_urls())
    build_pipeline(env, config)
    for transformation in env._j_stream_execution_environment.getTransformations():
        for t in transformation.getTransitivePredecessors():
            if t.getName() == "inference":
                return str(t.getOperatorFactory().getStreamOperatorClass(get_gateway().jvm.Thread.currentThread()
                                                                         .getContextClassLoader()).getName())
    raise AssertionError("no transformation named inference")


def test_bundle_target_swaps_in_the_adaptive_bundles_operator_with_the_same_uid() -> None:
    fixed = with_overrides(load_config(), parallelism={"inference": 2})
    adaptive = with_overrides(fixed, python={"bundle_size": 1000, "bundle_target_ms": 250})
    assert _inference_operator_class(fixed).endswith(".ExternalPythonKeyedProcessOperator")
    assert _inference_operator_class(adaptive) == "llmstream.AdaptiveBundles"
    node = _node(_plan(parallelism={"inference": 2}, python={"bundle_target_ms": 250}), "inference")
    assert node["parallelism"] == 2
    assert any(p.get("ship_strategy") == "HASH" for p in node.get("predecessors", [])), node


def test_changing_inference_parallelism_changes_the_graph() -> None:
    one = _node(_plan(parallelism={"inference": 1}), "inference")["parallelism"]
    four = _node(_plan(parallelism={"inference": 4}), "inference")["parallelism"]
    assert (one, four) == (1, 4)


def test_sink_is_exactly_once_with_the_configured_transactions() -> None:
    config = load_config()
    options = sink_options(config)
    assert options["sink.delivery-guarantee"] == "exactly-once"
    assert options["sink.transactional-id-prefix"] == config.kafka.transactional_id_prefix
    assert options["properties.transaction.timeout.ms"] == str(config.kafka.transaction_timeout_ms)
    types = [n["type"] for n in _plan()]
    assert any(t.startswith("kafka_results") and t.endswith(": Writer") for t in types)
    assert any(t.startswith("kafka_results") and t.endswith(": Committer") for t in types)


def test_source_uses_group_offsets_and_is_never_bounded() -> None:
    """Backfills end by a draining stop-with-savepoint: a bounded source restored from an
    unbounded run's state would never end (its splits keep their stopping offsets)."""
    config = load_config()
    options = source_options(config)
    assert options["properties.group.id"] == config.kafka.group_id
    assert options["scan.startup.mode"] == "group-offsets"
    assert options["properties.auto.offset.reset"] == "earliest"
    assert not any(key.startswith("scan.bounded") for key in options)


def _uids(config: JobConfig) -> dict[str, str]:
    env = create_environment(config, jars.connector_jar_urls())
    build_pipeline(env, config)
    graph = env._j_stream_execution_environment.getStreamGraph(False)
    return {str(n.getOperatorName()): str(n.getTransformationUID()) for n in graph.getStreamNodes().toArray()}


def test_stateful_operators_keep_their_uids_across_builds_and_parallelism() -> None:
    """Savepoints map state to operators by uid: the Kafka source, the inference stage and the
    sink must keep theirs when the job is built again (a new run, an upgrade) or rescaled, and
    across Flink versions: the source's is the uid Flink 2.2's planner gave it, which 2.3's would
    not (`pipeline.SOURCE_UID`; the real 2.2 savepoint: tests/integration/test_flink_upgrade.py)."""
    config = load_config()
    first, second = _uids(config), _uids(config)
    wider = _uids(with_overrides(config, parallelism={"inference": 2, "sink": 2}))
    stateful = {uid for uid in first.values() if uid.endswith(("_source", "_sink")) or uid == "inference"}
    assert {"kafka_requests_source", "kafka_results_sink", "inference"} <= stateful
    assert sorted(first.values()) == sorted(second.values()) == sorted(wider.values())
    assert len(set(first.values())) == len(first), f"duplicate uids: {first}"


@contextlib.contextmanager
def _another_thread_calling_the_jvm() -> Iterator[None]:
    """What a test process (or a reporter thread) does beside a build: calls the JVM from another
    thread, so that Py4J's pool holds several connections, each served on its own JVM thread."""
    stop = threading.Event()
    calls = 0

    def call() -> None:
        nonlocal calls
        jvm = get_gateway().jvm
        while not stop.is_set():
            jvm.java.lang.System.nanoTime()
            calls += 1

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    try:
        yield
    finally:
        stop.set()
        caller.join()
    assert calls > 0


def test_the_job_plans_while_another_thread_calls_the_jvm() -> None:
    """Without one JVM thread for the whole build, the table environment is made on a thread whose
    context class loader lacks the connector ("Could not find any factory for identifier 'kafka'"),
    or Calcite's metadata is missing (FLINK-23020): every one of five builds failed so."""
    config = load_config()
    once = _plan()
    for _ in range(5):
        env = create_environment(config, jars.connector_jar_urls())
        with _another_thread_calling_the_jvm():
            build_pipeline(env, config)
        assert len(json.loads(env.get_execution_plan())["nodes"]) == len(once)


def test_inside_one_jvm_thread_every_call_runs_on_the_same_jvm_thread() -> None:
    env = create_environment(load_config(), jars.connector_jar_urls())
    current = get_gateway().jvm.java.lang.Thread.currentThread
    with _another_thread_calling_the_jvm(), private.one_jvm_thread(env):
        names = {str(current().getName()) for _ in range(200)}
        with private.one_jvm_thread(env):  # nested: the same thread
            names.add(str(current().getName()))
    assert len(names) == 1, names
