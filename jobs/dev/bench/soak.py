"""`llmstream bench --soak MINUTES`: the job on a standalone cluster under a steady input rate for
MINUTES while its parts fail at random moments; at the end, every id exactly once?

The faults (a seeded random schedule, `chaos_schedule`; none overlaps another):
- a fleet endpoint killed (refuses connections) and revived 30 s later,
- a fleet endpoint answering HTTP 500 to everything for 30 s,
- a 429 storm: a fleet endpoint answering 429 (Retry-After 1 s) to everything for 45 s,
- the TaskManager SIGKILLed and a new one started at once,
- the broker stopped (clean shutdown) and started again 15 s later on the same ports and data.

Each endpoint fault also gets its traffic (`fault_traffic`, from each endpoint's request and
answer counts sampled every `TRAFFIC_SAMPLE_S`): the endpoint's share of the requests and of the
answers while it was down (after the first `SETTLE_FAULT_S`) and the fleet's answers per second
then, how soon its requests stopped (a circuit opening), and how soon after the fault it answered
again (a circuit closing).

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

from jobs.clients import kafka_admin
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
TRAFFIC_SAMPLE_S = 0.5
"""How often each endpoint's request and answer counts are read (the simulator's control port)."""
SETTLE_FAULT_S = 2.0
"""An endpoint fault's shares are counted from this long after it began: how long a circuit may
take to open (issue 21: within 2 s)."""


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
    """The latest completed checkpoint's size, in kilobytes (the soak's sizes: docs/operations.md)."""


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


Traffic = tuple[float, list[int], list[int]]
"""(seconds into the soak, requests per endpoint, answers per endpoint), cumulative counts."""


def fault_traffic(traffic: Sequence[Traffic], start_s: float, end_s: float, index: int,
                  settle_s: float = SETTLE_FAULT_S) -> dict[str, float | None]:
    """What endpoint `index` got while a fault held it (`start_s`..`end_s`), from cumulative counts:
    its share of all requests and of all answers from `settle_s` after the start to the end, and
    the fleet's answers per second then; `quiet_after_s`, seconds from the start until its requests
    stop growing (at most one more within the next second: a probe), None if they never do;
    `answering_after_s`, seconds from the end until it answers again, None if it did not within
    the samples."""
    during = [t for t in traffic if start_s + settle_s <= t[0] <= end_s]
    requests_share = answers_share = answers_per_s = None
    if len(during) >= 2:
        first, last = during[0], during[-1]
        requests = sum(last[1]) - sum(first[1])
        answers = sum(last[2]) - sum(first[2])
        requests_share = (last[1][index] - first[1][index]) / requests if requests else None
        answers_share = (last[2][index] - first[2][index]) / answers if answers else None
        answers_per_s = answers / (last[0] - first[0]) if last[0] > first[0] else None
    quiet_after = None
    held = [t for t in traffic if start_s <= t[0] <= end_s]
    for i, (at, requests_now, _) in enumerate(held):
        if held[-1][0] < at + 1.0:
            break
        if all(t[1][index] - requests_now[index] <= 1 for t in held[i:] if t[0] <= at + 1.0):
            quiet_after = at - start_s
            break
    answering_after = None
    after = [t for t in traffic if t[0] >= end_s]
    if after:
        base = after[0][2][index]
        answering_after = next((t[0] - end_s for t in after if t[2][index] > base), None)
    return {"requests_share": _round(requests_share, 4), "answers_share": _round(answers_share, 4),
            "answers_per_s": _round(answers_per_s), "quiet_after_s": _round(quiet_after),
            "answering_after_s": _round(answering_after)}


def remaining_limit_per_s(index: int) -> float:
    """The fleet's limit (Little's law: slots ÷ mean latency) without endpoint `index`."""
    return (sum(FLEET) - FLEET[index]) / (SCENARIO.mean_latency_ms / 1000)


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _pct(share: float | None) -> str:
    return "–" if share is None else f"{share:.1%}"


def _dash(value: float | None) -> str:
    return "–" if value is None else f"{value:g}"


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
        lines += self._fault_lines()
        for title, rows, unit in (("TaskManager RSS (JVM + Python workers)", self.rss, "MB"),
                                  ("Checkpoint size", self.checkpoint_size, "KB")):
            lines += ["", f"{title}, least-squares slope after each TaskManager's first {WARMUP_S:.0f} s:", "",
                      (f"| TaskManager pid | minutes | first {unit} | last {unit} | slope {unit}/h | "
                       f"second half's slope {unit}/h |"), "|---|---|---|---|---|---|"]
            lines += [f"| {r['pid']} | {r['minutes']} | {r['first']} | {r['last']} | {r['slope_per_h']} | "
                      f"{r['later_slope_per_h']} |" for r in rows]
        return "\n".join(lines) + "\n"


    def _fault_lines(self) -> list[str]:
        """The faults, each endpoint fault with its traffic (`fault_traffic`)."""
        shares = " / ".join(f"endpoint {i} {limit / sum(FLEET):.1%}" for i, limit in enumerate(FLEET))
        lines = ["", (f"Each endpoint fault's traffic (`fault_traffic`), from {SETTLE_FAULT_S:g} s into it to its end: "
                      "the endpoint's share of all requests and of all answers, and the fleet's answers per second "
                      "(in brackets the other endpoints' limit, slots ÷ mean latency: the input may be lower); "
                      "seconds until its requests stopped (its circuit open: a probe at most a second after), and "
                      f"after the fault until it answered again. Shares of the fleet's limit: {shares}."), "",
                 ("| at (s) | fault | endpoint | lasted (s) | its requests | its answers | fleet answers/s | "
                  "quiet after (s) | answering again after (s) |"), "|---|---|---|---|---|---|---|---|---|"]
        for e in self.events:
            index = e["endpoint"]
            rate = (f"{_dash(e.get('answers_per_s'))} ({remaining_limit_per_s(int(index)):.0f})"
                    if index is not None else "–")
            lines.append(f"| {e['at_s']:.0f} | {e['kind']} | {'' if index is None else index} | {e['lasted_s']:.0f} | "
                         f"{_pct(e.get('requests_share'))} | {_pct(e.get('answers_share'))} | {rate} | "
                         f"{_dash(e.get('quiet_after_s'))} | {_dash(e.get('answering_after_s'))} |")
        return lines

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
        self.traffic: list[Traffic] = []
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
            producer = InputProducer(broker.bootstrap_servers, topics.input, delivery_timeout_s=600)
            stack.callback(producer.close)
            paced = PacedProducer(producer, self.rate, self.minutes * 60)
            self._started = time.monotonic()
            paced.start()
            sampler = threading.Thread(target=self._sample_loop, args=(cluster,), name="soak-sampler", daemon=True)
            sampler.start()
            traffic = threading.Thread(target=self._traffic_loop, args=(fleet,), name="soak-traffic", daemon=True)
            traffic.start()
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
                traffic.join(timeout=30)
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

    def _traffic_loop(self, fleet: SpawnedFleet) -> None:
        while not self._ended.is_set():
            with contextlib.suppress(Exception):
                stats = fleet.endpoint_stats()
                self.traffic.append((round(self._elapsed(), 2), [int(s["requests_total"]) for s in stats],
                                     [int(s["served"]) for s in stats]))
            self._ended.wait(TRAFFIC_SAMPLE_S)

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
        for event in result.events:
            if event["endpoint"] is not None:
                event.update(fault_traffic(self.traffic, event["at_s"], event["at_s"] + event["lasted_s"],
                                           int(event["endpoint"])))
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
