"""Plain helpers for the integration tests (the fixtures themselves live in conftest.py).

Jobs on a standalone cluster with their own uuid topics (`make_job`), the records they read
(`unique_records`; `BAD_RECORDS`, which the job dead-letters), what a downstream consumer sees
(`CommittedReader`, read_committed, with arrival times), the exactly-once tally over output and
dead letters, and the numbers the fault tests write to ``var/fault-report.md`` / ``.json``
(`FaultReport`) for the README. Scenarios built from these are in ``tests/support/runs.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml
from kafka import KafkaConsumer, TopicPartition

from jobs.clients import kafka_admin
from jobs.clients.flink_rest import TERMINAL_STATES, FlinkRest
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from jobs.runtime import jars
from tests.support.waiting import wait_until
from udfs.config import JobConfig, config_from_dict, load_config, to_dict
from udfs.inference.prompts import build_payload, input_tokens

JobConfigFactory = Callable[..., JobConfig]
"""The `job_config` fixture: job configs on fresh uuid topics against the shared simulator."""
SpawnSimulator = Callable[[list[str]], SpawnedSimulator]
"""The `spawn_simulator` fixture: a simulator process started with the given flags."""

log = logging.getLogger("llmstream.tests.cluster")

REPORT_DIR = jars.repo_root() / "var"
CHECKPOINT_INTERVAL_MS = 2000

# Simulator settings of the fault tests: ~40 ms a call, and the job's capacity of 6 in-flight
# calls makes 5,000 records take ~40 s, so a fault injected after a few seconds hits mid-stream.
SIM_ARGS = ["--latency", "fixed:40", "--seed", "7"]
FAULT_CAPACITY = 6


# ---------------------------------------------------------------------- cluster


def heal(cluster: LocalCluster, taskmanagers: int = 1, timeout: float = 180) -> None:
    """Bring the shared cluster back to a clean state: no jobs running, ``taskmanagers`` registered."""
    for job in cluster.jobs():
        if job["state"] not in ("FINISHED", "CANCELED", "FAILED"):
            with contextlib.suppress(Exception):
                cluster.cancel(job["jid"], timeout=60)
    cluster.reap_orphans(grace_s=5)
    cluster.start(taskmanagers=taskmanagers, timeout=timeout)

    def settled() -> bool:
        # A TaskManager can die just after the previous test's job was cancelled: Flink's Python
        # runner sometimes fails its clean-up ("Reference count must not be negative") and that is
        # fatal to the TaskManager. It leaves the JobManager at once and exits seconds later; a
        # check that only compared the two counts passed with none left. Start a new one then.
        if len(cluster.taskmanager_pids()) < taskmanagers:
            cluster.start(taskmanagers=taskmanagers, timeout=timeout)
        ov = cluster.overview() or {}
        return bool(ov.get("taskmanagers") == len(cluster.taskmanager_pids()) >= taskmanagers
                    and ov.get("slots-available") == ov.get("slots-total"))

    wait_until(settled, timeout, interval=1,
               message=lambda: f"the cluster to settle: {cluster.overview()}, TaskManager pids "
                               f"{cluster.taskmanager_pids()}")


def wait_for_checkpoints(cluster: FlinkRest, job_id: str, n: int = 3, timeout: float = 240) -> int:
    """Until ``n`` more checkpoints of ``job_id`` completed, counted from the call, as the REST API
    reports them: what the job had written is then committed, and anything late or duplicated would
    show. Returns the number seen, early if the job stopped running (no checkpoint will come)."""
    start = cluster.completed_checkpoints(job_id)

    def more() -> tuple[int] | None:  # a tuple: 0 more is an answer too, when the job stopped
        done = cluster.completed_checkpoints(job_id) - start
        return (done,) if done >= n or cluster.job_status(job_id) in TERMINAL_STATES else None

    (done,) = wait_until(more, timeout, interval=0.5,
                         message=lambda: f"{n} more checkpoints of job {job_id} "
                                         f"({cluster.completed_checkpoints(job_id) - start} completed)")
    return done


# ---------------------------------------------------------------------- jobs and records


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
             topic_configs: dict[str, str] | None = None, **sections: dict[str, Any]) -> JobSetup:
    """A job config on fresh uuid topics (created here) against ``endpoint``, saved as YAML.

    Defaults suit the fault tests: checkpoints every 2 s (output latency), `FAULT_CAPACITY`
    in-flight calls, everything else from jobs/inference.yaml; ``sections`` override.
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
    for section, values in sections.items():
        key = "async" if section == "async_" else section
        data[key] = {**(data.get(key) or {}), **values}
    config = config_from_dict(data)
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


# ---------------------------------------------------------------------- reading results


@dataclass
class Arrival:
    t: float
    topic: str
    key: bytes | None
    id: str | None
    body: dict[str, Any] | None


class CommittedReader(threading.Thread):
    """Reads the output and dead-letter topics with read_committed for the whole test.

    Keeps every record with its arrival time, so a test can tell when output stopped and
    when it flowed again (what a downstream consumer experiences), and count duplicates.
    """

    def __init__(self, bootstrap: str, topics: Iterable[str]) -> None:
        super().__init__(daemon=True, name="committed-reader")
        self.arrivals: list[Arrival] = []
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._topics = list(topics)
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False,
            auto_offset_reset="earliest", reconnect_backoff_max_ms=1000, request_timeout_ms=15000,
            fetch_max_bytes=64 * 1024 * 1024, max_partition_fetch_bytes=16 * 1024 * 1024,
        )
        parts = []
        for topic in self._topics:
            parts += [TopicPartition(topic, p) for p in kafka_admin._partitions(bootstrap, topic, 30.0)]
        self._consumer.assign(parts)
        self._consumer.seek_to_beginning(*parts)
        self.errors = 0

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                try:
                    batches = self._consumer.poll(timeout_ms=300)
                except Exception as err:  # noqa: BLE001 - the broker may be down on purpose
                    self.errors += 1
                    log.debug("reader poll failed: %s", err)
                    time.sleep(0.5)
                    continue
                now = time.monotonic()
                got = []
                for tp, records in batches.items():
                    for record in records:
                        body = None
                        with contextlib.suppress(ValueError, TypeError):
                            body = json.loads(record.value)
                        rid = body.get("id") if isinstance(body, dict) else None
                        got.append(Arrival(now, tp.topic, record.key, rid, body))
                with self._lock:
                    self.arrivals.extend(got)
        finally:
            self._consumer.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> list[Arrival]:
        with self._lock:
            return list(self.arrivals)

    def count(self) -> int:
        with self._lock:
            return len(self.arrivals)

    def unique_ids(self) -> int:
        return len({a.id for a in self.snapshot() if a.id is not None})

    def wait_for(self, n: int, timeout: float, *, unique: bool = True,
                 check: Callable[[], None] | None = None) -> bool:
        """Wait until ``n`` (unique-id) records arrived; ``check`` runs each second (e.g. job not FAILED)."""
        deadline = time.monotonic() + timeout
        last_check = 0.0
        while time.monotonic() < deadline:
            if (self.unique_ids() if unique else self.count()) >= n:
                return True
            if check is not None and time.monotonic() - last_check >= 1:
                last_check = time.monotonic()
                check()
            time.sleep(0.2)
        return False

    def first_arrival_after(self, t: float) -> float | None:
        times = [a.t for a in self.snapshot() if a.t > t]
        return min(times) if times else None

    def longest_gap(self, start: float | None = None) -> float:
        """Longest time without any committed arrival, from the first arrival on (or from ``start``)."""
        times = sorted(a.t for a in self.snapshot())
        if start is not None:
            times = [start] + [t for t in times if t > start]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@dataclass
class Tally:
    """Every expected id exactly once in output ∪ dead letters?"""

    records_in: int
    out: int
    dead: int
    duplicates: int
    lost: int
    unexpected: int
    dead_reasons: dict[str, int] = field(default_factory=dict)
    lost_sample: list[str] = field(default_factory=list)
    cached: int = 0
    duplicate_sample: list[str] = field(default_factory=list)


def tally(expected_ids: Iterable[str], out_ids: Iterable[str | None], dead: Iterable[dict[str, Any] | None]) -> Tally:
    expected = set(expected_ids)
    dead_bodies = [d or {} for d in dead]
    outs = [i for i in out_ids]
    seen = Counter([i for i in outs] + [d.get("id") for d in dead_bodies])
    duplicates = sorted(i for i, c in seen.items() if c > 1 and i is not None)
    lost = sorted(expected - set(seen))
    return Tally(
        records_in=len(expected), out=len(outs), dead=len(dead_bodies),
        duplicates=sum(seen[i] - 1 for i in duplicates), lost=len(lost),
        unexpected=len([i for i in seen if i not in expected]),
        dead_reasons=dict(Counter(str(d.get("reason")) for d in dead_bodies)),
        lost_sample=lost[:10], duplicate_sample=duplicates[:10],
    )


def check_exactly_once(result: Tally) -> None:
    """Every expected id exactly once in output ∪ dead letters, nothing else."""
    assert result.lost == 0, f"lost {result.lost}: {result.lost_sample}"
    assert result.duplicates == 0, f"duplicates {result.duplicates}: {result.duplicate_sample}"
    assert result.unexpected == 0
    assert result.out + result.dead == result.records_in


def final_tally(setup: JobSetup, expected_ids: Iterable[str], *, timeout_s: float = 60) -> Tally:
    """An independent read_committed pass over both topics, to the last stable offset."""
    out = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, timeout_s=timeout_s)
    dead = kafka_admin.consume_committed(setup.bootstrap, setup.dead_letter_topic, timeout_s=timeout_s)
    bodies = [json.loads(r.value) for r in out]
    result = tally(expected_ids, [b.get("id") for b in bodies], [json.loads(r.value) for r in dead])
    result.cached = sum(1 for b in bodies if b.get("cached") is True)
    return result


# ---------------------------------------------------------------------- report


@dataclass
class FaultResult:
    """One scenario's numbers, as they go into var/fault-report.md."""

    scenario: str
    records_in: int
    out: int
    dead: int
    duplicates: int
    lost: int
    restarts: int
    recovery_s: float | None
    duration_s: float
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    model_calls: int | None = None
    cache_hits: int | None = None

    @property
    def calls_per_record(self) -> float | None:
        """Model calls the server answered (the simulator's `served`) per input record."""
        return None if self.model_calls is None or not self.records_in else self.model_calls / self.records_in


class FaultReport:
    """Appends results to ``var/fault-report.json`` and re-renders ``var/fault-report.md`` after each."""

    def __init__(self, directory: Path = REPORT_DIR) -> None:
        self.json_path = directory / "fault-report.json"
        self.md_path = directory / "fault-report.md"

    def load(self) -> dict[str, dict[str, Any]]:
        try:
            data: dict[str, dict[str, Any]] = json.loads(self.json_path.read_text())
            return data
        except (OSError, ValueError):
            return {}

    def add(self, result: FaultResult) -> None:
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        entry = asdict(result)
        entry["recorded_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        # `make test` runs two workers, each with its own report object: read, add and write
        # under one lock so neither drops the other's entry.
        with open(self.json_path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.load()
            data[result.scenario] = entry
            self.json_path.write_text(json.dumps(data, indent=2, sort_keys=True))
            self.md_path.write_text(render_report(data))
        log.warning("fault report: %s", json.dumps(entry))


def render_report(data: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# llmstream fault and memory tests: measured results",
        "",
        "Written by tests/integration/test_faults.py (standalone Flink cluster from the pip package, real",
        "single-node Kafka broker, model-server simulator). Counts come from a read_committed consumer;",
        "`dup` = records beyond the first per id, `lost` = ids in neither output nor dead letters,",
        "`recovery` = seconds from the end of the fault until committed output flowed again.",
        "",
        "`calls/record` = model calls the server answered (the simulator's `served`) per input record,",
        "`cache hits` = output records answered from the result cache (`cached: true`).",
        "",
        ("| scenario | in | out | dead | dup | lost | restarts | recovery s | test s | calls/record | cache hits "
         "| notes |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(data):
        r = data[name]
        rec = "-" if r.get("recovery_s") is None else f"{r['recovery_s']:.1f}"
        calls = "-" if r.get("model_calls") is None else f"{r['model_calls'] / max(1, r['records_in']):.3f}"
        hits = "-" if r.get("cache_hits") is None else str(r["cache_hits"])
        lines.append(f"| {name} | {r['records_in']} | {r['out']} | {r['dead']} | {r['duplicates']} | {r['lost']} "
                     f"| {r['restarts']} | {rec} | {r['duration_s']:.0f} | {calls} | {hits} | {r.get('notes', '')} |")
    extras = [(n, data[n]["extra"]) for n in sorted(data) if data[n].get("extra")]
    if extras:
        lines += ["", "## Details", ""]
        for name, extra in extras:
            lines.append(f"- **{name}**: " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    return "\n".join(lines) + "\n"
