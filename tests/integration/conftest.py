"""Fixtures of the integration tests: a real broker, a real standalone Flink cluster, simulators.

Session fixtures start once whichever module asks first: one Kafka broker and one standalone
cluster (each costs seconds and ~0.5 GB), on free ports and temp dirs so parallel checkouts and
a developer's own ``llmstream kafka start`` on 9092 never collide (``secure_broker``, the same broker
with TLS, SCRAM and ACLs, starts only for the tests that ask for it). Each simulator fixture has its
own name because each means one pace:

- ``fast_simulator``: 5 ms a call, shared by the session (jobs in the mini cluster); faults reset per test;
- ``paced_simulator``: 40 ms a call, per test, so a fault injected after a few seconds hits mid-stream;
- ``slow_simulator``: 2 s a call, per test, so a checkpoint holds a full capacity of calls in flight;
- ``spawn_simulator``: a factory for any other flags, every simulator stopped after the test.

Plain helpers (job configs on uuid topics, the shared cluster's healing, the committed reader, the
exactly-once tally, the fault report) are in ``tests/support/``.
"""
from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from jobs.clients import kafka_admin
from jobs.clients.kafka_admin import create_topics, delete_topics
from jobs.dev import simulator
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.local_kafka import BrokerConfig, LocalBroker
from jobs.dev.schema_registry import LocalRegistry
from jobs.dev.secure_kafka import JOB, SecureBroker, SecureBrokerConfig
from jobs.dev.simulator import SpawnedSimulator
from tests.support.cluster import heal
from tests.support.fault_report import FaultReport
from tests.support.job_setup import SIM_ARGS, JobConfigFactory, SpawnSimulator
from tests.support.release_build import FLINK_2_2, ReleaseBuild
from tests.support.secured import Names, Secured
from udfs.config import JobConfig, load_config, with_overrides

log = logging.getLogger("llmstream.tests")


# ---------------------------------------------------------------------- Kafka


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    broker = LocalBroker(BrokerConfig.ephemeral(tmp_path_factory.mktemp("kafka"), heap="512m"))
    broker.start(timeout=180)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    """A second broker with TLS, SASL/SCRAM, mutual TLS and ACLs (`jobs/dev/secure_kafka.py`), started
    on first use, on four free ports; its users exist, no ACL is granted (tests grant on uuid names)."""
    broker = SecureBroker(SecureBrokerConfig.ephemeral(tmp_path_factory.mktemp("kafka-secure"), heap="512m"))
    started = time.monotonic()
    broker.start(timeout=180)
    log.info("secured kafka up at %s in %.1f s", broker.bootstrap_servers, time.monotonic() - started)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def secured(secure_broker: SecureBroker, fast_simulator: SpawnedSimulator,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """Factory ``secured(user=JOB, via="scram", omit=None, **sections)``: a job config on fresh topics
    of the secured broker (created as admin), ``user`` granted what the job needs but ``omit``."""
    made: list[str] = []

    def make(user: str = JOB, via: str = "scram", omit: str | None = None, **sections: Any) -> tuple[JobConfig, Names]:
        names = Names(uuid.uuid4().hex[:10])
        topics = [*names.inputs, names.output, names.dead_letter]
        kafka_admin.create_topics(secure_broker.kafka_python_config("admin"), topics, partitions=2)
        made.extend(topics)
        secure_broker.grant(user, input_topics=names.inputs, output_topic=names.output,
                            dead_letter_topic=names.dead_letter, group_id=names.kafka()["group_id"],
                            transactional_id_prefix=names.kafka()["transactional_id_prefix"],
                            omit=omit)  # type: ignore[arg-type]
        bootstrap = secure_broker.bootstrap_servers if via == "scram" else secure_broker.ssl_bootstrap_servers
        kafka = {"bootstrap_servers": bootstrap, "input_topic": None, "input_topics": names.inputs, **names.kafka(),
                 "properties": secure_broker.client_properties(user, via),  # type: ignore[arg-type]
                 **sections.pop("kafka", {})}
        config = with_overrides(
            load_config(), kafka=kafka, model={"endpoint": fast_simulator.url, **sections.pop("model", {})},
            checkpointing={"interval_ms": 1000, "directory": str(tmp_path_factory.mktemp(f"state-{names.tag}"))},
            retry={"initial_backoff_s": 0.05, "max_backoff_s": 0.5}, **sections)
        return config, names

    yield make
    with kafka_admin.admin(secure_broker.kafka_python_config("admin")) as admin:
        admin.delete_topics(made)


@pytest.fixture
def bootstrap(kafka_broker: LocalBroker) -> str:
    return kafka_broker.bootstrap_servers


@pytest.fixture
def topic_names(kafka_broker: LocalBroker) -> Iterator[Callable[..., list[str]]]:
    """Factory ``topic_names(n=1, prefix="t")`` of unique names; the topics are deleted after the test."""
    made: list[str] = []

    def make(n: int = 1, prefix: str = "t") -> list[str]:
        names = [f"{prefix}-{uuid.uuid4().hex[:12]}" for _ in range(n)]
        made.extend(names)
        return names

    yield make
    if made:
        delete_topics(kafka_broker.bootstrap_servers, made, missing_ok=True)


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    """A real Schema Registry (Apicurio 3.0.9 from pom-free, `jobs/dev/schema_registry.py`) on a free
    port, started on first use; its schemas are in a file, so a test may stop and start it again."""
    registry = LocalRegistry(tmp_path_factory.mktemp("schema-registry"))
    started = time.monotonic()
    registry.start(timeout=240)
    log.info("schema registry up at %s in %.1f s", registry.url, time.monotonic() - started)
    try:
        yield registry
    finally:
        registry.stop()


# ---------------------------------------------------------------------- the standalone cluster


@pytest.fixture(scope="session")
def flink_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One standalone cluster (JobManager + one 2-slot TaskManager) for the whole session."""
    cluster = LocalCluster(ClusterConfig.ephemeral(tmp_path_factory.mktemp("flink")))
    started = time.monotonic()
    cluster.start(taskmanagers=1, timeout=180)
    log.info("flink cluster up at %s in %.1f s", cluster.rest_url, time.monotonic() - started)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(flink_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The shared cluster, healed before the test; jobs the test leaves running are cancelled after it."""
    heal(flink_cluster)
    yield flink_cluster
    for job in flink_cluster.jobs():
        if job["state"] not in ("FINISHED", "CANCELED", "FAILED"):
            with contextlib.suppress(Exception):
                flink_cluster.cancel(job["jid"], timeout=60)


@pytest.fixture(scope="session")
def flink22_build() -> ReleaseBuild:
    """llmstream as it was on Flink 2.2.1, in a venv of its own, built on first use (minutes, once per
    machine, in ``~/.cache/llmstream/builds/``; `tests/support/release_build.py`)."""
    started = time.monotonic()
    build = FLINK_2_2.ensure()
    log.info("the Flink 2.2.1 build is ready in %.1f s at %s", time.monotonic() - started, build.root)
    return build


@pytest.fixture(scope="session")
def fault_report() -> FaultReport:
    return FaultReport()


# ---------------------------------------------------------------------- simulators


@pytest.fixture
def spawn_simulator() -> Iterator[SpawnSimulator]:
    """Factory ``spawn_simulator(flags)`` of simulator processes, all stopped after the test."""
    started: list[SpawnedSimulator] = []

    def spawn(args: list[str]) -> SpawnedSimulator:
        handle = simulator.spawn(args)
        started.append(handle)
        return handle

    yield spawn
    for handle in started:
        handle.stop()


@pytest.fixture
def paced_simulator(spawn_simulator: SpawnSimulator) -> SpawnedSimulator:
    """The simulator at ~40 ms per call (`SIM_ARGS`), for the tests on the standalone cluster."""
    return spawn_simulator(SIM_ARGS)


@pytest.fixture
def slow_simulator(spawn_simulator: SpawnSimulator) -> SpawnedSimulator:
    """The simulator at 2 s per call, unlimited concurrency."""
    return spawn_simulator(["--latency", "fixed:2000", "--seed", "7"])


@pytest.fixture(scope="session")
def fast_simulator() -> Iterator[SpawnedSimulator]:
    """The simulator at 5 ms per call, shared by the session; `job_config` resets its faults per test."""
    handle = simulator.spawn(["--latency", "fixed:5", "--concurrency", "256"])
    try:
        yield handle
    finally:
        handle.stop()


# ---------------------------------------------------------------------- jobs in the mini cluster


@pytest.fixture
def job_config(kafka_broker: LocalBroker, fast_simulator: SpawnedSimulator,
               tmp_path_factory: pytest.TempPathFactory) -> JobConfigFactory:
    """Factory of job configs against `fast_simulator`, on fresh uuid topics (created here), group,
    transactional prefix and state directory; keyword sections override."""
    fast_simulator.admin({})

    def make(**sections: dict[str, Any]) -> JobConfig:
        run = uuid.uuid4().hex[:10]
        base = with_overrides(
            load_config(),
            kafka={
                "bootstrap_servers": kafka_broker.bootstrap_servers,
                "input_topic": f"requests-{run}",
                "output_topic": f"results-{run}",
                "dead_letter_topic": f"dead-{run}",
                "group_id": f"group-{run}",
                "transactional_id_prefix": f"tx-{run}",
                "create_topics": True,
                "topic_partitions": 2,
            },
            model={"endpoint": fast_simulator.url},
            checkpointing={"interval_ms": 1000, "directory": str(tmp_path_factory.mktemp(f"state-{run}"))},
            retry={"initial_backoff_s": 0.05, "max_backoff_s": 0.5},
        )
        config = with_overrides(base, **sections) if sections else base
        k = config.kafka
        create_topics(k.bootstrap_servers, [k.input_topic, k.output_topic, k.dead_letter_topic],
                      partitions=k.topic_partitions)
        return config

    return make
