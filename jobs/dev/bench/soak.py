"""`llmstream bench --soak MINUTES`: the job on a standalone cluster under a steady input rate for
MINUTES while its parts fail at random moments; at the end, every id exactly once?

The faults (a seeded random schedule, `chaos_schedule`; none overlaps another):
- a fleet endpoint killed (refuses connections) and revived 30 s later,
- a fleet endpoint answering HTTP 500 to everything for 30 s,
- a 429 storm: a fleet endpoint answering 429 (Retry-After 1 s) to everything for 45 s,
- the TaskManager SIGKILLed and a new one started at once,
- the broker stopped (clean shutdown) and started again 15 s later on the same ports and data.

The model is a simulated fleet of three endpoints (concurrency 16, 8, 4; lognormal latency,
median 100 ms), the job llmstream's default config with `model.endpoints`. What the report says
(`soak.md`, `soak.json` in `--out`): produced, answered, dead-lettered, lost and duplicated ids;
job restarts; calls per record; checkpoints completed and failed (with reasons), their duration
p50/p99/max; the TaskManager's RSS (JVM and Python workers) and the checkpoint size, each as a
least-squares slope per hour after a warm-up, per TaskManager process (a kill starts a new one).

Not in CI: it runs for as long as asked. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jobs import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.bench.harness import LlmstreamSettings, Topics, llmstream_config
from jobs.dev.bench.measure import CheckpointSampler, Observer, percentile, tree_rss_mb
from jobs.dev.bench.scenarios import Scenario
from jobs.dev.bench.workload import InputProducer, PacedProducer, record_id
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.simulator import SpawnedFleet, spawn_fleet

log = logging.getLogger(__name__)

FLEET = (16, 8, 4)
LATENCY = "lognormal:100:400"
DEFAULT_RATE = 60.0
"""Records/s produced: about a quarter of the fleet's limit (28 slots ÷ ~0.12 s mean latency), so the
job keeps up with an endpoint gone or storming and a backlog after an outage drains."""
SCENARIO = Scenario("soak", "soak", "steady input, faults at random moments", latency=LATENCY,
                    concurrency=sum(FLEET), fleet=FLEET)

ENDPOINT_KILL, ENDPOINT_500, ENDPOINT_429 = "endpoint killed", "endpoint answers 500", "endpoint 429 storm"
TASKMANAGER_KILL, BROKER_RESTART = "TaskManager SIGKILL", "broker restart"
FAULT_SECONDS = {ENDPOINT_KILL: 30.0, ENDPOINT_500: 30.0, ENDPOINT_429: 45.0, TASKMANAGER_KILL: 0.0,
                 BROKER_RESTART: 15.0}
"""How long each fault lasts (the TaskManager kill is an instant; a new one starts at once)."""
RECOVERY_SECONDS = {ENDPOINT_KILL: 30.0, ENDPOINT_500: 30.0, ENDPOINT_429: 30.0, TASKMANAGER_KILL: 90.0,
                    BROKER_RESTART: 90.0}
"""Quiet time after each fault before the next may start: the job restarts and catches up."""
KINDS = tuple(FAULT_SECONDS)
FAULT_NAMES = {"endpoint-kill": ENDPOINT_KILL, "endpoint-500": ENDPOINT_500, "endpoint-429": ENDPOINT_429,
               "taskmanager-kill": TASKMANAGER_KILL, "broker-restart": BROKER_RESTART}
"""`--soak-faults` names. Without the TaskManager kill one TaskManager lives the whole soak, so its
RSS slope covers hours' worth of trend instead of a few minutes per TaskManager life."""


def fault_kinds(names: str) -> tuple[str, ...]:
    """`--soak-faults` (comma-separated `FAULT_NAMES`, ``all`` or ``none``) as kinds; ValueError names a bad one."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if wanted == ["all"]:
        return KINDS
    if wanted == ["none"]:
        return ()
    unknown = [n for n in wanted if n not in FAULT_NAMES]
    if unknown or not wanted:
        raise ValueError(f"--soak-faults: {', '.join(unknown) or names!r} is not one of all, none, "
                         + ", ".join(FAULT_NAMES))
    return tuple(FAULT_NAMES[n] for n in wanted)
WARMUP_S = 90.0
"""No fault in the first 90 s (the job starts, the first checkpoints complete); the RSS and
checkpoint-size slopes also skip each TaskManager's first 90 s (JIT, Python worker start)."""
SETTLE_S = 120.0
"""No fault starts in the last 120 s of the input: the end counts a job that has recovered."""
SAMPLE_S = 10.0


@dataclass(frozen=True)
class ChaosEvent:
    at_s: float
    """Seconds after the input starts."""
    kind: str
    endpoint: int | None = None
    """The fleet endpoint (0-based) of an endpoint fault."""
    duration_s: float = 0.0


def chaos_schedule(minutes: float, seed: int, endpoints: int = len(FLEET),
                   kinds_allowed: Sequence[str] = KINDS) -> list[ChaosEvent]:
    """Faults at random moments between `WARMUP_S` and `SETTLE_S` before the end, one at a time:
    each starts after the previous one has ended and its `RECOVERY_SECONDS` have passed, plus a
    random 0-60 s. Kinds come in shuffled rounds, so a soak long enough for five faults has each
    kind once; an endpoint fault picks a random endpoint."""
    rng = random.Random(seed)
    end = minutes * 60 - SETTLE_S
    events: list[ChaosEvent] = []
    at = WARMUP_S + rng.uniform(0, 60)
    kinds: list[str] = []
    while at < end and kinds_allowed:
        if not kinds:
            kinds = list(kinds_allowed)
            rng.shuffle(kinds)
        kind = kinds.pop()
        endpoint = rng.randrange(endpoints) if kind in (ENDPOINT_KILL, ENDPOINT_500, ENDPOINT_429) else None
        events.append(ChaosEvent(round(at, 1), kind, endpoint, FAULT_SECONDS[kind]))
        at += FAULT_SECONDS[kind] + RECOVERY_SECONDS[kind] + rng.uniform(0, 60)
    return events


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, in value per hour; None for fewer than 5
    points or no time spread."""
    if len(points) < 5:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread * 3600


@dataclass(frozen=True)
class Sample:
    at_s: float
    taskmanager_pid: int | None
    taskmanager_rss_mb: float | None
    """The TaskManager JVM and its Python workers."""
    checkpoint_kb: float | None
    """The latest completed checkpoint's size (kilobytes: a few tens of them, measured)."""


def segment_slopes(samples: Sequence[Sample], value: Callable[[Sample], float | None],
                   warmup_s: float = WARMUP_S) -> list[dict[str, Any]]:
    """A slope per hour of `value` for each TaskManager process's samples (a kill starts a new one),
    skipping each one's first `warmup_s`: [{pid, minutes, slope_per_h, later_slope_per_h, first,
    last}]; `later_slope_per_h` is the slope over the second half of those samples, so a rise
    that levels off reads differently from one that keeps going."""
    by_pid: dict[int, list[Sample]] = {}
    for sample in samples:
        if sample.taskmanager_pid is not None:
            by_pid.setdefault(sample.taskmanager_pid, []).append(sample)
    out = []
    for pid, group in by_pid.items():
        start = group[0].at_s + warmup_s
        points = [(s.at_s, v) for s in group if s.at_s >= start and (v := value(s)) is not None]
        if len(points) < 2:
            continue
        out.append({"pid": pid, "minutes": round((points[-1][0] - points[0][0]) / 60, 1),
                    "slope_per_h": _round(slope_per_hour(points)),
                    "later_slope_per_h": _round(slope_per_hour(points[len(points) // 2:])),
                    "first": round(points[0][1], 1),
                    "last": round(points[-1][1], 1)})
    return out


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class SoakResult:
    minutes: float
    rate_per_s: float
    seed: int
    faults: list[str] = field(default_factory=lambda: list(KINDS))
    """The kinds of fault this soak drew from (`--soak-faults`)."""
    produced: int = 0
    answered: int = 0
    dead_lettered: int = 0
    lost: int = 0
    duplicates: int = 0
    restarts: int = 0
    calls_per_record: float | None = None
    checkpoints: dict[str, Any] = field(default_factory=dict)
    rss: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_size: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    drained_s: float | None = None
    """Seconds from the end of the input until every id was seen."""
    error: str | None = None

    @property
    def exactly_once(self) -> bool:
        return self.produced > 0 and self.lost == 0 and self.duplicates == 0 and self.error is None

    def markdown(self) -> str:
        """The report: the outcome first, then each fault, checkpoints and the slopes."""
        if self.exactly_once:
            verdict = "every id exactly once"
        elif self.drained_s is None and self.duplicates == 0:
            verdict = "not finished"  # stopped before every id could come out: unseen is not lost
        else:
            verdict = "NOT exactly once"
        missing = "lost" if self.drained_s is not None else "not seen yet"
        kinds = "every kind of fault" if set(self.faults) == set(KINDS) else (
            "faults: " + ", ".join(self.faults) if self.faults else "no faults")
        lines = [f"# Soak: {self.minutes:g} min at {self.rate_per_s:g} records/s (seed {self.seed}; {kinds})", "",
                 f"- **{verdict}**: {self.produced:,} produced, {self.answered:,} answered, "
                 f"{self.dead_lettered:,} dead-lettered, {self.lost:,} {missing}, {self.duplicates:,} duplicated"
                 + (f"; all seen {self.drained_s:.0f} s after the input ended" if self.drained_s is not None else ""),
                 f"- job restarts: {self.restarts}; model calls per record: {self.calls_per_record}",
                 (f"- checkpoints: {self.checkpoints.get('completed')} completed, {self.checkpoints.get('failed')} "
                 f"failed ({self._failed_reasons()}); duration p50 / p99 / max "
                 f"{self.checkpoints.get('p50_ms')} / {self.checkpoints.get('p99_ms')} / {self.checkpoints.get('max_ms')} ms "
                 f"(over {self.checkpoints.get('seen')} completed checkpoints seen)")]
        if self.error:
            lines.append(f"- error: {self.error}")
        lines += ["", "| at (s) | fault | endpoint | lasted (s) |", "|---|---|---|---|"]
        lines += [f"| {e['at_s']:.0f} | {e['kind']} | {'' if e['endpoint'] is None else e['endpoint']} | "
                  f"{e['lasted_s']:.0f} |" for e in self.events]
        for title, rows, unit in (("TaskManager RSS (JVM + Python workers)", self.rss, "MB"),
                                  ("Checkpoint size", self.checkpoint_size, "KB")):
            lines += ["", f"{title}, least-squares slope after each TaskManager's first {WARMUP_S:.0f} s:", "",
                      (f"| TaskManager pid | minutes | first {unit} | last {unit} | slope {unit}/h | "
                       f"second half's slope {unit}/h |"), "|---|---|---|---|---|---|"]
            lines += [f"| {r['pid']} | {r['minutes']} | {r['first']} | {r['last']} | {r['slope_per_h']} | "
                      f"{r['later_slope_per_h']} |" for r in rows]
        return "\n".join(lines) + "\n"


    def _failed_reasons(self) -> str:
        """Reasons of the failed checkpoints: each triggered one's, and how many Flink refused at the
        trigger (a job not yet running everywhere, e.g. while it restarts), which it never counts as
        failures against `tolerable-failed-checkpoints`."""
        parts = [f"{n}× {reason}" for reason, n in (self.checkpoints.get("failures") or {}).items()]
        if self.checkpoints.get("failed_untriggered"):
            parts.append(f"{self.checkpoints['failed_untriggered']}× refused at trigger, not counted by Flink")
        return "; ".join(parts) or "none"


class Soak:
    """One soak: services up, the job submitted, the input paced, the faults applied, the count."""

    def __init__(self, minutes: float, rate_per_s: float, seed: int, workdir: Path,
                 say: Callable[[str], None] = print, kinds: Sequence[str] = KINDS) -> None:
        self.minutes, self.rate, self.seed, self.workdir, self.say = minutes, rate_per_s, seed, workdir, say
        self.result = SoakResult(minutes, rate_per_s, seed, list(kinds))
        self.samples: list[Sample] = []
        self.durations: dict[Any, float] = {}
        self.failures = CheckpointSampler(root_pid=0)
        """Keeps the failure reasons of each `/checkpoints` answer given to its `take`."""
        self.job_id: str | None = None
        self._ended = threading.Event()
        self._started = 0.0

    def run(self) -> SoakResult:
        with contextlib.ExitStack() as stack:
            broker = local_kafka.LocalBroker(local_kafka.BrokerConfig.ephemeral(self.workdir / "kafka", heap="512m"))
            broker.start(timeout=120)
            stack.callback(broker.stop)
            fleet = spawn_fleet(FLEET, ["--latency", LATENCY, "--per-token-ms", "0", "--seed", str(self.seed),
                                        "--stats-interval-s", "0", "--log-level", "WARNING"])
            stack.callback(fleet.stop)
            cluster = LocalCluster(ClusterConfig.ephemeral(self.workdir / "flink"))
            cluster.start(taskmanagers=1, timeout=180)
            stack.callback(cluster.stop)
            self.say(f"soak: broker {broker.bootstrap_servers}, fleet {fleet.url}, cluster {cluster.rest_url}")
            topics = Topics(*(f"soak-{part}-{uuid.uuid4().hex[:8]}" for part in ("in", "out", "dlq", "group")))
            kafka_admin.create_topics(broker.bootstrap_servers, [topics.input, topics.output, topics.dead_letter],
                                      partitions=1)
            config = llmstream_config(topics, broker.bootstrap_servers, fleet.url,
                                      LlmstreamSettings.recommended(SCENARIO), SCENARIO, self.workdir / "state")
            config["name"] = "llmstream-soak"
            config_path = self.workdir / "soak.yaml"
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))
            observer = Observer(broker.bootstrap_servers, topics.output, topics.dead_letter)
            observer.start()
            stack.callback(observer.stop)
            self.job_id = cluster.submit(config_path)
            cluster.wait_for_job_state(self.job_id, "RUNNING", timeout=180)
            stack.callback(self._cancel, cluster)
            producer = InputProducer(broker.bootstrap_servers, topics.input)
            stack.callback(producer.close)
            paced = PacedProducer(producer, self.rate, self.minutes * 60)
            self._started = time.monotonic()
            paced.start()
            sampler = threading.Thread(target=self._sample_loop, args=(cluster,), name="soak-sampler", daemon=True)
            sampler.start()
            try:
                self._apply_faults(chaos_schedule(self.minutes, self.seed, kinds_allowed=self.result.faults), cluster, broker, fleet, paced)
                paced.finished.wait()
                if paced.error is not None:
                    raise RuntimeError(f"the input producer failed: {paced.error!r}")
                self._drain(observer, producer.produced, cluster)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM (`run_soak`): count what came out, then tear down
                self.result.error = f"interrupted {self._elapsed():.0f} s into the soak"
            except Exception as err:  # the report says what happened, with the counts so far
                self.result.error = f"{type(err).__name__}: {err}"
                log.warning("soak failed", exc_info=True)
            finally:
                self._ended.set()
                sampler.join(timeout=30)
            self._count(observer, producer.produced, cluster, fleet)
        return self.result

    def _elapsed(self) -> float:
        return time.monotonic() - self._started

    def _wait_until(self, at_s: float) -> bool:
        """Sleep until `at_s` into the soak; False if it ended first."""
        return not self._ended.wait(max(0.0, at_s - self._elapsed()))

    def _apply_faults(self, events: list[ChaosEvent], cluster: LocalCluster, broker: local_kafka.LocalBroker,
                      fleet: SpawnedFleet, paced: PacedProducer) -> None:
        for event in events:
            if not self._wait_until(event.at_s) or paced.finished.is_set():
                return
            began = self._elapsed()
            self.say(f"soak: {began:6.0f}s  {event.kind}"
                     + (f" (endpoint {event.endpoint})" if event.endpoint is not None else ""))
            if event.kind == TASKMANAGER_KILL:
                cluster.kill_taskmanager()
                cluster.add_taskmanager(timeout=180)
                cluster.reap_orphans(grace_s=5)
            elif event.kind == BROKER_RESTART:
                broker.stop()
                self._wait_until(began + event.duration_s)
                broker.start(timeout=120)
            else:
                index = int(event.endpoint or 0)
                if event.kind == ENDPOINT_KILL:
                    fleet.kill(index)
                elif event.kind == ENDPOINT_500:
                    fleet.faults(index, {"error_rate": 1.0})
                else:
                    fleet.faults(index, {"rate_limit_rate": 1.0, "retry_after_s": 1})
                self._wait_until(began + event.duration_s)
                if event.kind == ENDPOINT_KILL:
                    fleet.revive(index)
                else:
                    fleet.faults(index, {})
            self.result.events.append({**asdict(event), "at_s": round(began, 1),
                                       "lasted_s": round(self._elapsed() - began, 1)})

    def _sample_loop(self, cluster: LocalCluster) -> None:
        while not self._ended.is_set():
            with contextlib.suppress(Exception):
                self._sample(cluster)
            self._ended.wait(SAMPLE_S)

    def _sample(self, cluster: LocalCluster) -> None:
        pids = cluster.taskmanager_pids()
        pid = pids[-1] if pids else None
        rss = tree_rss_mb(pid) if pid is not None else None
        size = None
        if self.job_id is not None:
            stats = cluster.checkpoint_stats(self.job_id)
            self.failures.take(stats)
            for entry in stats.get("history") or []:
                if entry.get("status") == "COMPLETED" and entry.get("end_to_end_duration") is not None:
                    self.durations[entry.get("id")] = float(entry["end_to_end_duration"])
            latest = (stats.get("latest") or {}).get("completed") or {}
            if latest.get("checkpointed_size") is not None:
                size = float(latest["checkpointed_size"]) / 2**10
        self.samples.append(Sample(round(self._elapsed(), 1), pid, rss, size))

    def _drain(self, observer: Observer, produced: int, cluster: LocalCluster, timeout_s: float = 900) -> None:
        """Until every produced id is seen (answered or dead-lettered), then three more checkpoints, so a
        late duplicate would show."""
        input_end = time.monotonic()
        deadline = input_end + timeout_s
        while observer.seen < produced:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{produced - observer.seen:,} of {produced:,} ids unseen {timeout_s:.0f} s "
                                   "after the input ended")
            time.sleep(1)
        self.result.drained_s = round(time.monotonic() - input_end, 1)
        assert self.job_id is not None
        target = cluster.completed_checkpoints(self.job_id) + 3
        while cluster.completed_checkpoints(self.job_id) < target and time.monotonic() < deadline:
            time.sleep(1)

    def _count(self, observer: Observer, produced: int, cluster: LocalCluster, fleet: SpawnedFleet) -> None:
        result = self.result
        first, counts = observer.snapshot()
        ids = {record_id(i) for i in range(produced)}
        result.produced = produced
        result.dead_lettered = sum(1 for rid, seen in first.items() if rid in ids and seen.dead)
        result.answered = sum(1 for rid in first if rid in ids) - result.dead_lettered
        result.lost = len(ids - set(first))
        result.duplicates = sum(n - 1 for rid, n in counts.items() if rid in ids and n > 1)
        with contextlib.suppress(Exception):
            result.restarts = cluster.num_restarts(self.job_id or "", settle_s=3.0)
        with contextlib.suppress(Exception):
            result.calls_per_record = round(int(fleet.stats()["requests_total"]) / max(1, produced), 3)
        durations = sorted(self.durations.values())
        summary = self.failures.summary() or {}
        result.checkpoints = {"completed": summary.get("completed"), "failed": summary.get("failed"),
                              "failures": summary.get("failures"),
                              "failed_untriggered": summary.get("failed_untriggered"), "seen": len(durations),
                              "p50_ms": _round(percentile(durations, 50), 0), "p99_ms": _round(percentile(durations, 99), 0),
                              "max_ms": durations[-1] if durations else None}
        result.rss = segment_slopes(self.samples, lambda s: s.taskmanager_rss_mb)
        result.checkpoint_size = segment_slopes(self.samples, lambda s: s.checkpoint_kb)

    def _cancel(self, cluster: LocalCluster) -> None:
        if self.job_id is not None:
            with contextlib.suppress(Exception):
                cluster.cancel(self.job_id, timeout=60)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_soak(minutes: float, rate_per_s: float, seed: int, out_dir: Path, keep: bool,
             say: Callable[[str], None] = print, kinds: Sequence[str] = KINDS) -> int:
    """`llmstream bench --soak`: 0 if every id came out exactly once."""
    if minutes <= 0 or not math.isfinite(minutes):
        say("bench: --soak takes a number of minutes above 0")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="llmstream-soak-"))
    say(f"soak: {minutes:g} min at {rate_per_s:g} records/s, seed {seed}; faults: "
        + ("; ".join(f"{e.at_s:.0f}s {e.kind}" for e in chaos_schedule(minutes, seed, kinds_allowed=kinds))
           or "none"))
    # SIGTERM as Ctrl-C: the broker, the cluster and the fleet are stopped either way (a shell
    # that starts the soak in the background leaves SIGINT ignored, so `kill` is the way to stop it).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = Soak(minutes, rate_per_s, seed, workdir, say, kinds).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if keep:
            say(f"soak: work dir kept at {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    (out_dir / "soak.md").write_text(result.markdown())
    say(result.markdown())
    say(f"soak: wrote {out_dir / 'soak.md'} and soak.json")
    return 0 if result.exactly_once else 1


__all__ = ["FAULT_NAMES", "ChaosEvent", "SoakResult", "chaos_schedule", "fault_kinds", "run_soak", "segment_slopes",
           "slope_per_hour"]
