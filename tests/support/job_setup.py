"""Jobs on their own uuid topics and the records they read, for the integration tests.

`make_job` writes a job config (fresh topics, group and transactional ids, created here) to a YAML
file for the standalone cluster; `write_config` does the same for tests that go through the CLI.
`unique_records` makes valid requests with unique ids, `BAD_RECORDS` three the job dead-letters,
and `estimated_tokens` what the client charges the budget for records up front.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.clients import kafka_admin
from jobs.dev.simulator import SpawnedSimulator
from udfs.config import JobConfig, config_from_dict, load_config, overridden, to_dict
from udfs.inference.prompts import build_payload, input_tokens

JobConfigFactory = Callable[..., JobConfig]
"""The `job_config` fixture: job configs on fresh uuid topics against the shared simulator."""
SpawnSimulator = Callable[[list[str]], SpawnedSimulator]
"""The `spawn_simulator` fixture: a simulator process started with the given flags."""

CHECKPOINT_INTERVAL_MS = 2000

# Simulator settings of the fault tests: ~40 ms a call, and the job's capacity of 6 in-flight
# calls makes 5,000 records take ~40 s, so a fault injected after a few seconds hits mid-stream.
SIM_ARGS = ["--latency", "fixed:40", "--seed", "7"]
FAULT_CAPACITY = 6


FAULT_LANES = os.environ.get("LLMSTREAM_FAULT_LANES", "both")
"""Which lanes the outage tests run in: `both` in the full fault run and straight from pytest,
`keyed` in `make test` (its Makefile sets it), to keep the suite's time down."""


FAULT_SCALE = float(os.environ.get("LLMSTREAM_FAULT_SCALE", "1"))
"""The share of their full record counts (and of the 429 storm's refusals) that the fault tests
whose counts are not their point run: 1 in the full fault run and straight from pytest, 0.5 in
`make test` (its Makefile sets it), to keep the suite's time down. Their faults still land
mid-stream: each waits for a fraction of the ids to be committed, not for a number."""


def scaled(full: int) -> int:
    """`full` at `FAULT_SCALE`: a count of records (or refusals) for this run."""
    return max(1, round(full * FAULT_SCALE))


LONG_FAULT = pytest.mark.skipif(
    os.environ.get("LLMSTREAM_LONG_FAULTS") != "1",
    reason="minutes long: in the full fault run (make fault sets LLMSTREAM_LONG_FAULTS=1), not in make test")
"""The mark of a fault test too long for `make test`: a frozen broker, a JobManager failover, the estate."""


LATER_LANE = pytest.mark.skipif(FAULT_LANES == "keyed", reason="this lane's run is in the full fault run "
                                "(LLMSTREAM_FAULT_LANES=both)")
"""The mark of a test's vectorized or provider-batch parameter whose keyed run is in `make test` already."""


def fault_lanes() -> list[Any]:
    """The `stage` parameters of an outage test: keyed, and vectorized unless `FAULT_LANES` is `keyed`."""
    return ["keyed", pytest.param("vectorized", marks=pytest.mark.skipif(
        FAULT_LANES == "keyed", reason="the vectorized lane's outage runs are in the full fault run "
                                       "(LLMSTREAM_FAULT_LANES=both)"))]


def lane_sections(stage: str, batch_size: int = 100) -> dict[str, Any]:
    """`make_job`'s sections for `stage`: the vectorized lane with Arrow batches of `batch_size` (100:
    a batch is a few seconds of a fault test's work, so a fault lands inside one), or nothing."""
    return {"stage": "vectorized", "vectorized": {"batch_size": batch_size}} if stage == "vectorized" else {}


@dataclass(frozen=True)
class JobSetup:
    """A job config written to a YAML file, with its own topics, group and transactional ids."""

    config: JobConfig
    path: Path

    @property
    def bootstrap(self) -> str:
        return self.config.kafka.bootstrap_servers

    @property
    def input_topic(self) -> str:
        return self.config.kafka.input_topic

    @property
    def output_topic(self) -> str:
        return self.config.kafka.output_topic

    @property
    def dead_letter_topic(self) -> str:
        return self.config.kafka.dead_letter_topic


def make_job(directory: Path, bootstrap: str, endpoint: str, *, name: str, partitions: int = 2,
             topic_configs: dict[str, str] | None = None, **sections: Any) -> JobSetup:
    """A job config on fresh uuid topics (created here) against ``endpoint``, saved as YAML.

    Defaults suit the fault tests: checkpoints every 2 s (output latency), `FAULT_CAPACITY`
    in-flight calls, everything else from jobs/inference.yaml; ``sections`` override (a
    top-level value such as ``stage`` is replaced whole).
    """
    tag = f"{name}-{uuid.uuid4().hex[:8]}"
    data = to_dict(load_config())
    data["name"] = f"llmstream-{name}"
    data["kafka"].update(bootstrap_servers=bootstrap, input_topic=f"{tag}-in", output_topic=f"{tag}-out",
                         dead_letter_topic=f"{tag}-dead", group_id=f"{tag}-group",
                         transactional_id_prefix=f"{tag}-tx", create_topics=False, topic_partitions=partitions)
    data["model"]["endpoint"] = endpoint
    data["async"]["capacity"] = FAULT_CAPACITY
    data["checkpointing"]["interval_ms"] = CHECKPOINT_INTERVAL_MS
    data["checkpointing"]["directory"] = str(directory / f"{tag}-state")
    config = config_from_dict(overridden(data, **sections))
    kafka = config.kafka
    kafka_admin.create_topics(bootstrap, [kafka.input_topic], partitions=partitions, configs=topic_configs)
    kafka_admin.create_topics(bootstrap, [kafka.output_topic, kafka.dead_letter_topic], partitions=partitions)
    path = directory / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return JobSetup(config, path)


LLMSTREAM = Path(sys.executable).parent / "llmstream"
"""The installed entry point, for tests that run a command as a user does."""


def write_config(config: JobConfig, directory: Path) -> Path:
    """The config as a YAML file, for tests that go through the CLI."""
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return path


BAD_RECORDS: list[tuple[bytes, bytes]] = [(b"bad-1", b'{"id": "x" "prompt": 1}'), (b"bad-2", b"[1, 2]"),
                                          (b"bad-3", b'{"id": "b3"}')]
"""Three records the decode stage dead-letters: invalid_json, not_an_object, missing_field."""


def estimated_tokens(config: JobConfig, records: list[tuple[bytes, bytes]]) -> int:
    """What the client charges the budget up front for these records (prompt estimate + max_tokens)."""
    from udfs.records import Request, SourceRef

    total = 0
    for key, value in records:
        body = json.loads(value)
        request = Request(id=body["id"], key=key, source=SourceRef("t", 0, 0), prompt=body["prompt"],
                          params=body["params"], fields=body)
        payload = build_payload(request, config.model)
        total += input_tokens(payload) + int(payload.get("max_tokens") or 0)
    return total


def unique_records(n: int, prefix: str) -> list[tuple[bytes, bytes]]:
    """``n`` valid requests with unique ids ``<prefix>-<i>`` (the key is the id)."""
    out = []
    for i in range(n):
        rid = f"{prefix}-{i:06d}"
        out.append((rid.encode(), json.dumps({"id": rid, "prompt": f"Summarise item {i} in one line.",
                                              "params": {"max_tokens": 16}}).encode()))
    return out

