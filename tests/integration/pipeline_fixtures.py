"""Shared pieces for tests that run the job: a simulator and per-test job configs.

Imported by the test modules that need them (`from tests.integration.pipeline_fixtures
import ...`), so tests that only need the broker don't start a simulator.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs import model_server
from jobs.local_kafka import LocalBroker, create_topics
from udfs.config import JobConfig, load_config, to_dict, with_overrides

JobConfigFactory = Callable[..., JobConfig]


@pytest.fixture(scope="session")
def simulator() -> Iterator[model_server.SpawnedSimulator]:
    """The model-server simulator, fast (5 ms), shared by the session; faults reset per test."""
    handle = model_server.spawn(["--latency", "fixed:5", "--concurrency", "256"])
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def job_config(kafka_broker: LocalBroker, simulator: model_server.SpawnedSimulator,
               tmp_path_factory: pytest.TempPathFactory) -> JobConfigFactory:
    """Factory of job configs on fresh uuid topics, group, transactional prefix and state directory."""
    simulator.admin({})

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
            model={"endpoint": simulator.url},
            checkpointing={"interval_ms": 1000, "directory": str(tmp_path_factory.mktemp(f"state-{run}"))},
            retry={"initial_backoff_s": 0.05, "max_backoff_s": 0.5},
        )
        config = with_overrides(base, **sections) if sections else base
        k = config.kafka
        create_topics(k.bootstrap_servers, [k.input_topic, k.output_topic, k.dead_letter_topic],
                      partitions=k.topic_partitions)
        return config

    return make


def write_config(config: JobConfig, directory: Path) -> Path:
    """The config as a YAML file, for tests that go through the CLI."""
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return path
