"""Structured output on real parts: a real broker, the simulator over HTTP, a real Flink mini cluster.

The simulator answers schema-shaped JSON, 20% of it invalid on purpose; with
`model.max_invalid_retries: 2` every record must end exactly once, either as an output whose
`output_json` validates against the schema or as an `invalid_model_output` dead letter, and
the job must never restart. The simulator counts what it sent, so the records' counts can be
checked against it: each output used one valid answer plus its `invalid_answers`, each dead
letter three invalid ones.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from typing import Any

import jsonschema
import pytest

from jobs.clients.flink_rest import FlinkRest
from jobs.clients.kafka_admin import consume_committed, produce
from jobs.launch.plan import RunOptions
from jobs.launch.run import run_job
from jobs.runtime.ports import free_port
from tests.support.job_setup import JobConfigFactory

pytestmark = pytest.mark.integration

RECORDS = 1000
MAX_INVALID_RETRIES = 2
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "topic": {"type": "string", "minLength": 1},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["sentiment", "topic", "confidence"],
    "additionalProperties": False,
}


class RestartWatch(threading.Thread):
    """Polls the mini cluster's REST API for the job's `numRestarts` while it runs (a cumulative
    metric: a restart any time before the last poll shows)."""

    def __init__(self, rest_url: str) -> None:
        super().__init__(daemon=True, name="restart-watch")
        self.rest = FlinkRest(rest_url)
        self.seen: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(Exception):  # the REST API is not up yet, or already down
                jobs = self.rest.jobs()
                if jobs:
                    self.seen.append(max(self.rest.num_restarts(j["jid"]) for j in jobs))
            self.done.wait(0.5)


def test_every_record_ends_as_valid_json_or_an_invalid_output_dead_letter(  # type: ignore[no-untyped-def]
        job_config: JobConfigFactory, fast_simulator) -> None:
    port = free_port()
    config = job_config(
        model={"response_format": SCHEMA, "max_invalid_retries": MAX_INVALID_RETRIES},
        cache={"backend": "none"},  # every answer comes from the simulator, so its counts are comparable
        metrics={"rest_port": port},
    )
    records = [(f"s-{i}".encode(), json.dumps({"id": f"s-{i}", "prompt": f"Review {i}: the delivery was late"}).encode())
               for i in range(RECORDS)]
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, records)
    fast_simulator.configure({"invalid_json_rate": 0.2})
    fast_simulator.reset_stats()
    watch = RestartWatch(f"http://127.0.0.1:{port}")
    watch.start()
    try:
        state = run_job(config, RunOptions(until_end=True), progress_every_s=0)
        stats = fast_simulator.stats()
    finally:
        watch.done.set()
        fast_simulator.configure({"invalid_json_rate": 0.0})
    watch.join(10)

    assert state == "FINISHED"
    assert watch.seen, "the REST API never answered while the job ran"
    assert max(watch.seen) == 0, f"the job restarted: numRestarts {watch.seen[-5:]}"

    out = [json.loads(m.value) for m in consume_committed(config.kafka.bootstrap_servers, config.kafka.output_topic,
                                                          timeout_s=30)]
    dead = [json.loads(m.value) for m in consume_committed(config.kafka.bootstrap_servers,
                                                           config.kafka.dead_letter_topic, timeout_s=30)]
    ids = Counter([r["id"] for r in out] + [d["id"] for d in dead])
    assert set(ids) == {f"s-{i}" for i in range(RECORDS)} and max(ids.values()) == 1, (
        f"{len(ids)} ids, duplicates {[i for i, n in ids.items() if n > 1][:5]}")

    validator = jsonschema.Draft202012Validator(SCHEMA)
    for record in out:
        assert validator.is_valid(record["output_json"]), record
        assert record["output_json"] == json.loads(record["output"])
        assert 0 <= record["invalid_answers"] <= MAX_INVALID_RETRIES
    assert Counter(d["reason"] for d in dead) == {"invalid_model_output": len(dead)}
    for letter in dead:
        assert letter["attempts"] == MAX_INVALID_RETRIES + 1 and letter["last_status"] == 200
        assert "last_output" in letter and letter["error"]
        try:
            last = json.loads(letter["last_output"])
        except ValueError:
            continue  # prose around the JSON: invalid by construction
        assert not validator.is_valid(last), letter
    retried = sum(1 for r in out if r["invalid_answers"] > 0)
    assert dead and retried, f"both paths must run: {len(dead)} dead letters, {retried} outputs after a retry"

    # Each output used one valid answer and its invalid ones; each dead letter 1 + max_invalid_retries.
    assert stats["cancelled"] == 0 and stats["errors"] == 0
    assert stats["structured_answers"] - stats["invalid_answers"] == len(out)
    assert stats["invalid_answers"] == (MAX_INVALID_RETRIES + 1) * len(dead) + sum(r["invalid_answers"] for r in out)
    print(f"structured output: {RECORDS} records -> {len(out)} valid ({retried} after invalid answers), "
          f"{len(dead)} invalid_model_output; simulator sent {stats['structured_answers']} answers, "
          f"{stats['invalid_answers']} invalid ({stats['invalid_answers'] / stats['structured_answers']:.1%})")
