"""Micro-batched embeddings (issue 13) on real parts: a real broker, the simulator over HTTP,
a real Flink mini cluster.

2,000 records go through `api: embeddings` with `model.batch` on. A read_committed consumer
must see every id exactly once, each with the vector the simulator computes for that record's
own text (not a neighbour's), and the one input the server refuses (over the simulator's
`--max-input-tokens`) as the only dead letter, although it was sent inside a batch.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from jobs.clients.kafka_admin import consume_committed, produce
from jobs.dev.simulator import embedding_vector
from jobs.launch.plan import RunOptions
from jobs.launch.run import run_job
from tests.support.job_setup import JobConfigFactory, SpawnSimulator

pytestmark = pytest.mark.integration

RECORDS = 2000
BAD_INDEX = 777
DIM = 16


def _text(i: int) -> str:
    if i == BAD_INDEX:
        return "too long for the server " + "word " * 400  # ~500 tokens, over --max-input-tokens 256
    return f"record {i}: the quick brown fox number {i * 7919 % 10007}"


def test_batched_embeddings_exactly_once_own_vectors_bad_input_alone(
        job_config: JobConfigFactory, spawn_simulator: SpawnSimulator) -> None:
    sim = spawn_simulator(["--latency", "fixed:5", "--per-input-ms", "0.1", "--max-input-tokens", "256",
                           "--embedding-dim", str(DIM), "--seed", "7"])
    config = job_config(model={"endpoint": sim.url, "api": "embeddings", "batch": {"max_size": 32, "max_wait_ms": 20}},
                        async_={"capacity": 128})
    records = [(f"e-{i}".encode(), json.dumps({"id": f"e-{i}", "prompt": _text(i)}).encode()) for i in range(RECORDS)]
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, records)

    assert run_job(config, RunOptions(until_end=True), progress_every_s=0) == "FINISHED"

    out = consume_committed(config.kafka.bootstrap_servers, config.kafka.output_topic, expected=RECORDS - 1,
                            timeout_s=60)
    dead = consume_committed(config.kafka.bootstrap_servers, config.kafka.dead_letter_topic, expected=1,
                             timeout_s=30)
    bodies = [json.loads(m.value) for m in out]
    ids = Counter(body["id"] for body in bodies)
    assert len(bodies) == RECORDS - 1 and max(ids.values()) == 1
    assert set(ids) == {f"e-{i}" for i in range(RECORDS) if i != BAD_INDEX}
    for message, body in zip(out, bodies, strict=True):
        i = int(body["id"].removeprefix("e-"))
        assert message.key == body["id"].encode()
        assert body["output"] == embedding_vector(_text(i), DIM), f"{body['id']} carries another input's vector"
        assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 0
        assert body["source"]["topic"] == config.kafka.input_topic and body["source"]["offset"] >= 0
    offsets = Counter((body["source"]["partition"], body["source"]["offset"]) for body in bodies)
    assert max(offsets.values()) == 1

    assert len(dead) == 1
    letter = json.loads(dead[0].value)
    assert letter["id"] == f"e-{BAD_INDEX}"
    assert letter["reason"] == "inference_rejected"
    assert letter["last_status"] == 400 and "256" in letter["error"]

    requests = sim.stats()["requests_total"]
    assert requests < RECORDS / 4, f"{requests} requests for {RECORDS} records: not batched"
