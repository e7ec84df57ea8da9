"""Input headers carried through, several input topics, and a topic pattern, on real parts: the
session's broker, the fast simulator, a Flink mini cluster run by `llmstream run`'s runner.

Assertions are on what a read_committed consumer of the output and dead-letter topics sees:
every id exactly once, the headers each record carries, and `source.topic`.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from kafka.consumer.fetcher import ConsumerRecord

from jobs.clients.kafka_admin import consume_committed, create_topics, produce
from jobs.launch.plan import RunOptions
from jobs.launch.run import StopRequest, run_job
from tests.support.committed import check_exactly_once, tally
from tests.support.job_setup import JobConfigFactory
from tests.support.waiting import wait_until
from udfs.config import JobConfig, with_overrides

pytestmark = pytest.mark.integration

TRACEPARENT = "00-{:032x}-{:016x}-01"
Record = tuple[bytes, bytes | None, list[tuple[str, bytes | None]]]


def _request(rid: str) -> bytes:
    return json.dumps({"id": rid, "prompt": f"Say something about {rid}.", "params": {"max_tokens": 8}}).encode()


def _traced(rid: str, i: int) -> list[tuple[str, bytes | None]]:
    return [("traceparent", TRACEPARENT.format(i + 1, i + 1).encode()), ("x-tenant", f"tenant-{i % 3}".encode())]


def _read_all(config: JobConfig, expected: int, timeout_s: float = 60) -> tuple[list[ConsumerRecord], list[ConsumerRecord]]:
    """Output and dead letters once `expected` records are committed across both (or the timeout)."""
    kafka = config.kafka

    def both() -> tuple[list[ConsumerRecord], list[ConsumerRecord]]:
        return (consume_committed(kafka.bootstrap_servers, kafka.output_topic, timeout_s=30),
                consume_committed(kafka.bootstrap_servers, kafka.dead_letter_topic, timeout_s=30))

    return wait_until(both, timeout_s, interval=0.5, done=lambda got: len(got[0]) + len(got[1]) >= expected,
                      or_last=True)


def _check_once(ids: list[str], out: list[ConsumerRecord], dead: list[ConsumerRecord]) -> None:
    check_exactly_once(tally(ids, [r.key.decode() for r in out],
                             [{**json.loads(r.value), "id": r.key.decode()} for r in dead]))


def _headers(record: ConsumerRecord) -> dict[str, bytes | None]:
    names = [name for name, _ in record.headers]
    assert len(names) == len(set(names)), f"repeated header names on {record.key!r}: {record.headers}"
    return dict(record.headers)


def test_headers_reach_results_and_dead_letters(job_config: JobConfigFactory) -> None:
    """Default `forward_headers: all`: a W3C traceparent and a custom header survive end to end;
    dead letters add `llmstream-reason` but keep a user's header of that name; a repeated name
    keeps its last value; no headers stays none. (kafka-python refuses a null header value, so
    that case is a unit test.)"""
    config = job_config()
    assert config.kafka.forward_headers == "all"
    good = [(f"ok-{i}".encode(), _request(f"ok-{i}"), _traced(f"ok-{i}", i)) for i in range(150)]
    bad: list[Record] = [
        (f"bad-{i}".encode(), value, _traced(f"bad-{i}", i))
        for i, value in enumerate([b'{"id": "bad-0"}', b"{not json", b'{"id": "bad-2", "prompt": ""}', b"[1]"])]
    special: list[Record] = [
        (b"plain", _request("plain"), []),
        (b"repeated", _request("repeated"), [("x-dup", b"first"), ("x-dup", b"second")]),
        (b"mine", b"{}", [("llmstream-reason", b"set by the producer")]),
    ]
    records = good + bad + special
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, records)
    assert run_job(config, RunOptions(until_end=True), progress_every_s=0) == "FINISHED"

    out, dead = _read_all(config, len(records))
    _check_once([k.decode() for k, _, _ in records], out, dead)
    sent = {k: dict(h) for k, _, h in records}
    outs = {r.key: _headers(r) for r in out}
    deads = {r.key: (_headers(r), json.loads(r.value)["reason"]) for r in dead}
    for key, _, _ in good:
        assert outs[key] == sent[key], key
    for key, _, _ in bad:
        headers, reason = deads[key]
        assert headers == {**sent[key], "llmstream-reason": reason.encode()}, key
    assert outs[b"plain"] == {}
    assert outs[b"repeated"] == {"x-dup": b"second"}
    assert deads[b"mine"] == ({"llmstream-reason": b"set by the producer"}, "missing_field")


def _two_topics(config: JobConfig, names: list[str]) -> JobConfig:
    create_topics(config.kafka.bootstrap_servers, names, partitions=2)
    return with_overrides(config, kafka={"input_topic": None, "input_topics": names})


def test_two_input_topics_every_id_once_with_its_source_topic(job_config: JobConfigFactory) -> None:
    """Both topics hold the same partitions and offsets: the records must not be confused."""
    run = uuid.uuid4().hex[:8]
    topics = [f"orders-{run}", f"refunds-{run}"]
    config = _two_topics(job_config(), topics)
    sent: dict[str, str] = {}
    for topic in topics:
        records = [(f"{topic}-{i}".encode(), _request(f"{topic}-{i}")) for i in range(120)]
        records.append((f"{topic}-bad".encode(), b"{not json"))
        produce(config.kafka.bootstrap_servers, topic, records)
        sent.update({k.decode(): topic for k, _ in records})
    assert run_job(config, RunOptions(until_end=True), progress_every_s=0) == "FINISHED"

    out, dead = _read_all(config, len(sent))
    _check_once(list(sent), out, dead)
    topics_seen = {r.key.decode(): json.loads(r.value)["source"]["topic"] for r in [*out, *dead]}
    assert topics_seen == sent
    assert Counter(json.loads(r.value)["reason"] for r in dead) == {"invalid_json": 2}


def _wait_for(what: str, condition: Callable[[], Any], timeout: float, alive: threading.Thread) -> Any:
    def found() -> Any:
        value = condition()
        assert value or alive.is_alive(), f"the job ended before {what}"
        return value

    return wait_until(found, timeout, interval=0.5, message=what)


def test_a_topic_created_after_the_start_is_read_under_the_pattern(job_config: JobConfigFactory) -> None:
    run = uuid.uuid4().hex[:8]
    base = job_config()
    config = with_overrides(base, kafka={"input_topic": None, "input_topic_pattern": f"hp-{run}-.*",
                                         "discovery_interval_ms": 1000})
    kafka = config.kafka
    first, later = f"hp-{run}-first", f"hp-{run}-later"
    create_topics(kafka.bootstrap_servers, [first], partitions=2)
    batches = {topic: [(f"{topic}-{i}".encode(), _request(f"{topic}-{i}")) for i in range(100)]
               for topic in (first, later)}
    produce(kafka.bootstrap_servers, first, batches[first])

    stop = StopRequest.new()
    outcome: list[str] = []
    job = threading.Thread(target=lambda: outcome.append(run_job(config, RunOptions(), progress_every_s=0,
                                                                 stop=stop)), daemon=True)
    job.start()
    try:
        def committed(n: int) -> Callable[[], bool]:
            return lambda: len(consume_committed(kafka.bootstrap_servers, kafka.output_topic, expected=n,
                                                 timeout_s=2)) >= n
        _wait_for("output of the first topic", committed(len(batches[first])), 180, job)
        create_topics(kafka.bootstrap_servers, [later], partitions=2)
        produce(kafka.bootstrap_servers, later, batches[later])
        _wait_for("output of the topic created later", committed(len(batches[first]) + len(batches[later])), 120,
                  job)
    finally:
        stop.savepoint.set()
        job.join(timeout=180)
    assert outcome == ["FINISHED"]

    out, dead = _read_all(config, 200)
    expected = {k.decode(): topic for topic, records in batches.items() for k, _ in records}
    _check_once(list(expected), out, dead)
    assert {r.key.decode(): json.loads(r.value)["source"]["topic"] for r in out} == expected
