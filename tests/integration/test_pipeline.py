"""The spine on real parts: a real broker, the simulator over HTTP, a real Flink mini cluster.

Every assertion is on what a user sees: records in the output and dead-letter topics,
read by a read_committed consumer, and the CLI's exit code and messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import psutil
import pytest

from jobs.clients.kafka_admin import (
    committed_offsets,
    consume_committed,
    end_offsets,
    produce,
)
from jobs.launch.plan import RunOptions
from jobs.launch.run import run_job
from tests.conftest import SHELL_ENV
from tests.support.job_setup import JobConfigFactory, write_config
from tests.support.waiting import wait_until
from udfs.config import JobConfig

pytestmark = pytest.mark.integration


def _good(n: int, prefix: str) -> list[tuple[bytes, bytes]]:
    return [(f"{prefix}-{i}".encode(), json.dumps({"id": f"{prefix}-{i}", "prompt": f"Question number {i}?"}).encode())
            for i in range(n)]


def _read(config: JobConfig, topic: str) -> list:
    """Every committed record of ``topic``, read to its last stable offset: after a run that
    finished that is all the job wrote, so an extra or repeated record is counted too, and an
    empty topic is read at once rather than waited on."""
    return consume_committed(config.kafka.bootstrap_servers, topic, timeout_s=60)


def _run_until_end(config: JobConfig) -> None:
    assert run_job(config, RunOptions(until_end=True), progress_every_s=0) == "FINISHED"


@pytest.mark.parametrize(("stage", "python"), [
    ("keyed", {}), ("keyed", {"bundle_size": 1000, "bundle_target_ms": 250}), ("vectorized", {}),
], ids=["fixed", "adaptive", "vectorized"])
def test_thousand_records_exactly_once(job_config: JobConfigFactory, stage: str, python: dict[str, int]) -> None:
    """Also with bundles that follow throughput (`python.bundle_target_ms`: another operator class
    in the stage's place, test_plan.py), and in the vectorized lane (Arrow batches of 100 here, so
    the thousand records cross in several)."""
    config = job_config(python=python, **({"stage": stage, "vectorized": {"batch_size": 100}}
                                          if stage == "vectorized" else {}))
    records = _good(1000, "r")
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, records)
    _run_until_end(config)

    out = _read(config, config.kafka.output_topic)
    ids = Counter(json.loads(m.value)["id"] for m in out)
    assert len(out) == 1000
    assert max(ids.values()) == 1
    assert set(ids) == {f"r-{i}" for i in range(1000)}
    first = json.loads(out[0].value)
    assert out[0].key == first["id"].encode()
    assert first["output"].startswith("Simulated answer to: Question number")
    assert first["usage"]["prompt_tokens"] > 0 and first["usage"]["completion_tokens"] > 0
    assert first["attempts"] == 1
    assert first["timestamps"]["produced"] <= first["timestamps"]["started"] <= first["timestamps"]["completed"]
    assert _read(config, config.kafka.dead_letter_topic) == []
    committed = committed_offsets(config.kafka.bootstrap_servers, config.kafka.group_id, config.kafka.input_topic)
    assert committed == end_offsets(config.kafka.bootstrap_servers, config.kafka.input_topic)


BAD_RECORDS: list[tuple[bytes | None, str]] = [
    (b'{"id": "b1", "prompt": "unterminated', "invalid_json"),
    (b"\x00\x01\x02 binary \xff", "invalid_utf8"),
    (None, "null_value"),
    (b'{"id": "b4"}', "missing_field"),
    (b'{"id": 4, "prompt": "p"}', "wrong_type"),
    (b'{"id": "b6", "prompt": ""}', "empty_prompt"),
    (json.dumps({"id": "b7", "prompt": "x" * 100_001}).encode(), "prompt_too_large"),
    (b"[1, 2, 3]", "not_an_object"),
    (b'{"id": "b9", "prompt": "p", "params": {"max_tokens": -1}}', "invalid_params"),
    (b'{"id": "b10", "messages": [{"role": "user"}]}', "invalid_messages"),
]


@pytest.mark.parametrize("stage", ["keyed", "vectorized"])
def test_bad_records_are_dead_lettered_good_ones_answered(job_config: JobConfigFactory, stage: str) -> None:
    # A keyed null value is a delete forwarded by default (test_ordering.py); here it is bad input.
    config = job_config(kafka={"topic_partitions": 1}, input={"tombstones": "dead-letter"}, stage=stage)
    good = _good(100, "g")
    stream: list[tuple[bytes | None, bytes | None]] = []
    expected_reason: dict[int, str] = {}
    for i, record in enumerate(good):
        stream.append(record)
        if i % 10 == 5:
            value, reason = BAD_RECORDS[i // 10]
            expected_reason[len(stream)] = reason
            stream.append((f"bad-{i}".encode(), value))
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, stream)
    _run_until_end(config)

    out = _read(config, config.kafka.output_topic)
    assert sorted(json.loads(m.value)["id"] for m in out) == sorted(k.decode() for k, _ in good)
    dead = _read(config, config.kafka.dead_letter_topic)
    assert len(dead) == len(BAD_RECORDS)
    for message in dead:
        body = json.loads(message.value)
        offset = body["source"]["offset"]
        assert body["reason"] == expected_reason[offset], body
        assert body["source"]["topic"] == config.kafka.input_topic
        assert message.key == stream[offset][0]
        original = stream[offset][1]
        if original is None:
            assert body["original"]["value"] is None
        elif body["original"]["encoding"] == "utf-8" and not body["original"]["truncated"]:
            assert body["original"]["value"].encode() == original


def test_model_rejection_is_dead_lettered_without_restart(job_config: JobConfigFactory,
                                                          fast_simulator) -> None:  # type: ignore[no-untyped-def]
    config = job_config(retry={"max_attempts": 3, "initial_backoff_s": 0.01, "max_backoff_s": 0.05})
    fast_simulator.admin({"error_rate": 1.0, "error_status": 503})
    try:
        produce(config.kafka.bootstrap_servers, config.kafka.input_topic, _good(20, "m"))
        _run_until_end(config)
    finally:
        fast_simulator.admin({})
    dead = _read(config, config.kafka.dead_letter_topic)
    assert len(dead) == 20
    body = json.loads(dead[0].value)
    assert body["reason"] == "inference_retries_exhausted"
    assert body["attempts"] == 3
    assert body["last_status"] == 503


def test_second_run_of_the_same_group_processes_nothing_twice(job_config: JobConfigFactory) -> None:
    config = job_config()
    bootstrap, kafka = config.kafka.bootstrap_servers, config.kafka
    produce(bootstrap, kafka.input_topic, _good(300, "first"))
    _run_until_end(config)
    assert committed_offsets(bootstrap, kafka.group_id, kafka.input_topic) == end_offsets(bootstrap, kafka.input_topic)
    _run_until_end(config)
    produce(bootstrap, kafka.input_topic, _good(200, "second"))
    _run_until_end(config)

    out = _read(config, kafka.output_topic)
    ids = Counter(json.loads(m.value)["id"] for m in out)
    assert len(out) == 500
    assert max(ids.values()) == 1


def test_cli_runs_a_backfill_and_rejects_bad_config(job_config: JobConfigFactory, tmp_path: Path) -> None:
    config = job_config()
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, _good(50, "cli"))
    path = write_config(config, tmp_path)
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "--config", str(path), "--until-end"],
                          check=False, capture_output=True, text=True, timeout=300, env=SHELL_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "job finished; committed 50/50 input records" in done.stdout
    assert len(_read(config, config.kafka.output_topic)) == 50

    path.write_text(path.read_text().replace("capacity: 64", "capacity: many"))
    bad = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "--config", str(path)],
                         check=False, capture_output=True, text=True, timeout=300, env=SHELL_ENV)
    assert bad.returncode == 2
    assert "async.capacity: expected an integer" in bad.stderr


def test_two_inference_subtasks_run_their_python_in_worker_processes_of_their_own(
        job_config: JobConfigFactory, tmp_path: Path) -> None:
    """`llmstream run` with `parallelism.inference: 2`: each subtask's Python in a worker process
    the TaskManager starts, not both in the command's own process (PyFlink's loopback default,
    one GIL for all; jobs.launch.run.python_worker_processes), and every id once. The workers get the
    model's key as the loopback stage does, and it is in none of the files the run writes (Flink
    logs what a worker process starts with)."""
    key = f"sk-worker-canary-{uuid.uuid4().hex}"
    config = job_config(parallelism={"inference": 2}, model={"api_key_env": "LLMSTREAM_TEST_WORKER_KEY"})
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, _good(600, "w"))
    path = write_config(config, tmp_path)
    run = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", "--config", str(path), "--until-end"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**SHELL_ENV, "LLMSTREAM_TEST_WORKER_KEY": key})
    workers: set[int] = set()

    def ended_noting_workers() -> bool:
        try:
            for child in psutil.Process(run.pid).children(recursive=True):
                if "pyflink.fn_execution.beam.beam_boot" in " ".join(child.cmdline()):
                    workers.add(child.pid)
        except psutil.Error:
            pass  # a child that ended while being looked at
        return run.poll() is not None

    # Not ended at the timeout: the run is killed and its output is the failure's message.
    wait_until(ended_noting_workers, 300, interval=0.2, or_last=True)
    if run.poll() is None:
        run.kill()
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "2 inference subtasks, each with a Python worker process of its own" in stdout
    assert "job finished; committed 600/600 input records" in stdout
    assert len(workers) == 2, workers
    ids = Counter(json.loads(m.value)["id"] for m in _read(config, config.kafka.output_topic))
    assert set(ids) == {f"w-{i}" for i in range(600)} and max(ids.values()) == 1
    state = Path(config.checkpointing.directory or "")
    assert (state / "log").is_dir()
    written = [p for p in (*state.rglob("*"), path) if p.is_file() and key.encode() in p.read_bytes()]
    assert written == [] and key not in stdout + stderr
