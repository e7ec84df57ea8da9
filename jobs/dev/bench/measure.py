"""What the harness observes while an approach runs, and the statistics made of it.

`Observer` is a downstream `read_committed` consumer: an answer counts when such a consumer
can see it, and its wall-clock arrival is what end-to-end latency ends at. `RssSampler`
sums the resident memory of each role's process tree every 0.5 s; `ServerSampler` records
the simulator's `/stats` so utilisation can be taken over the steady-state window only.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psutil
import requests
from kafka import KafkaConsumer, TopicPartition  # type: ignore[import-untyped]
from kafka.errors import KafkaError  # type: ignore[import-untyped]

log = logging.getLogger("llmstream.bench")


def now_ms() -> float:
    return time.time() * 1000.0


@dataclass(frozen=True)
class Seen:
    """The first sighting of one id by the read_committed observer (epoch ms)."""

    visible_ms: float
    produced_ms: float | None
    started_ms: float | None
    completed_ms: float | None
    dead: bool


class Observer(threading.Thread):
    """Reads the output and dead-letter topics with isolation.level=read_committed from the
    beginning, recording when each id first becomes visible and how often it appears."""

    def __init__(self, bootstrap: str, output: str, dead_letter: str) -> None:
        super().__init__(name="bench-observer", daemon=True)
        self.first: dict[str, Seen] = {}
        self.counts: Counter[str] = Counter()
        self.unparsable = 0
        self._dead_letter = dead_letter
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_max_wait_ms=50, client_id="bench-observer",
        )
        self._partitions = [TopicPartition(output, 0), TopicPartition(dead_letter, 0)]
        self._consumer.assign(self._partitions)
        self._consumer.seek_to_beginning(*self._partitions)
        self.positions: dict[str, int] = {}
        self.cached = 0
        """Ids first seen with `"cached": true` (answered from the result cache)."""
        self.broker_errors = 0
        """Reads that failed because the broker did not answer (read again a second later)."""

    @property
    def seen(self) -> int:
        with self._lock:
            return len(self.first)

    def snapshot(self) -> tuple[dict[str, Seen], Counter[str]]:
        """Copies of the first sightings and the per-id counts, taken under the lock."""
        with self._lock:
            return dict(self.first), Counter(self.counts)

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                try:
                    batches = self._consumer.poll(timeout_ms=100)
                    arrival = now_ms()
                    for batch in batches.values():
                        for message in batch:
                            self._record(message, arrival)
                    self.positions = {tp.topic: int(self._consumer.position(tp)) for tp in self._partitions}
                except KafkaError as err:
                    # The broker restarting (the soak does that): the consumer keeps its position,
                    # so reading on once it answers again neither skips nor repeats a record.
                    self.broker_errors += 1
                    log.debug("observer: %s; reading on in 1 s", err)
                    self._stop_event.wait(1.0)
        finally:
            self._consumer.close()

    def _record(self, message: Any, arrival: float) -> None:
        try:
            body = json.loads(message.value)
            rid = body.get("id")
        except (ValueError, AttributeError):
            body, rid = {}, None
        if not isinstance(rid, str):
            self.unparsable += 1
            return
        stamps = body.get("timestamps") or {}
        with self._lock:
            self.counts[rid] += 1
            if rid not in self.first and body.get("cached") is True:
                self.cached += 1
            if rid not in self.first:
                self.first[rid] = Seen(arrival, epoch_ms(stamps.get("produced")), epoch_ms(stamps.get("started")),
                                       epoch_ms(stamps.get("completed")), message.topic == self._dead_letter)

    def caught_up(self, stable_ends: dict[str, int]) -> bool:
        """True once this consumer has read up to the given last stable offsets (by topic)."""
        positions = self.positions
        return all(positions.get(topic, -1) >= end for topic, end in stable_ends.items())

    def stop(self) -> None:
        self._stop_event.set()


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def epoch_ms(value: Any) -> float | None:
    """A timestamp of an answer as epoch ms: a number (llmstream, the baselines) or an ISO-8601
    string with its zone (Flink's JSON format writes TIMESTAMP_LTZ so: ml-predict); else None."""
    if isinstance(value, str):
        try:
            stamp = datetime.fromisoformat(value)
        except ValueError:
            return None
        return stamp.timestamp() * 1000 if stamp.tzinfo is not None else None
    return _num(value)


class PeriodicSampler(threading.Thread):
    """A daemon thread that calls `sample()` every `interval_s` until `stop()`."""

    def __init__(self, name: str, interval_s: float) -> None:
        super().__init__(name=name, daemon=True)
        self.interval_s = interval_s
        self._stop_event = threading.Event()

    def sample(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()


def process_tree(root: psutil.Process) -> list[psutil.Process]:
    """A process and all its descendants (a TaskManager and its Python workers)."""
    return [root, *root.children(recursive=True)]


def tree_rss_mb(pid: int) -> float | None:
    """The resident memory of a process tree in MB; None if the process is gone."""
    try:
        return sum(proc.memory_info().rss for proc in process_tree(psutil.Process(pid))) / 2**20
    except psutil.Error:
        return None


class RssSampler(PeriodicSampler):
    """Every `interval_s`, the summed RSS of each role's process tree (root and descendants).

    Roles are named pids, e.g. broker, simulator, approach; a root may be added late (the
    approach starts after the sampler). The approach tree's peak is also broken down by
    process kind (the `llmstream run` client, its JVM, the Python workers).
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        super().__init__("bench-rss", interval_s)
        self.roots: dict[str, int] = {}
        self.series: list[tuple[float, dict[str, int]]] = []
        self.peak_breakdown: dict[str, int] = {}
        self._peak_approach = 0
        self._procs: dict[int, psutil.Process] = {}
        self._cpu_first: dict[int, tuple[float, str]] = {}
        self._cpu_last: dict[int, tuple[float, str]] = {}
        self.approach_cpu: list[tuple[float, float]] = []
        """(wall ms, CPU seconds of the approach's live process tree) per sample."""
        self._lock = threading.Lock()

    def watch(self, role: str, pid: int | None) -> None:
        if pid is not None:
            with self._lock:
                self.roots[role] = pid

    def _process(self, pid: int) -> psutil.Process:
        proc = self._procs.get(pid)
        if proc is None:
            proc = self._procs[pid] = psutil.Process(pid)
        return proc

    def _tree(self, pid: int) -> list[psutil.Process]:
        try:
            return process_tree(self._process(pid))
        except psutil.Error:
            return []

    def sample(self) -> None:
        with self._lock:
            roots = dict(self.roots)
        totals: dict[str, int] = {}
        for role, pid in roots.items():
            total, kinds, cpu_total = 0, Counter[str](), 0.0
            for proc in self._tree(pid):
                try:
                    rss = int(proc.memory_info().rss)
                    kind = _kind(proc) if role == "approach" else role
                    cpu = proc.cpu_times()
                except psutil.Error:
                    continue
                total += rss
                kinds[kind] += rss
                seconds = float(cpu.user + cpu.system + cpu.children_user + cpu.children_system)
                self._cpu_first.setdefault(proc.pid, (seconds, f"{role}:{kind}"))
                self._cpu_last[proc.pid] = (seconds, f"{role}:{kind}")
                cpu_total += seconds
            totals[role] = total
            if role == "approach" and total:
                self.approach_cpu.append((now_ms(), cpu_total))
            if role == "approach" and total > self._peak_approach:
                self._peak_approach = total
                self.peak_breakdown = dict(kinds)
        self.series.append((now_ms(), totals))


    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used while sampled, by role (and, for the approach, by process kind).

        A process's time counts from its first sample, so start-up before that is missed
        for processes that were already running (broker, simulator)."""
        used: dict[str, float] = {}
        for pid, (last, label) in self._cpu_last.items():
            used[label] = used.get(label, 0.0) + last - self._cpu_first[pid][0]
        return {label: round(seconds, 1) for label, seconds in sorted(used.items())}

    def cpu_ms_per_record(self, start_ms: float, end_ms: float, records: float) -> float | None:
        """CPU milliseconds the approach's process tree spent per record between two wall times
        (the steady window, so JVM start-up and the final drain are left out)."""
        series = [(t, cpu, 0) for t, cpu in self.approach_cpu]
        if not series:
            return None
        first, last = _interpolate(series, start_ms), _interpolate(series, end_ms)
        if first is None or last is None or records <= 0 or last < first:
            return None
        return (last - first) * 1000 / records

    def peak_mb(self, role: str) -> float | None:
        values = [totals[role] for _, totals in self.series if role in totals]
        return max(values) / 2**20 if values else None

    def peak_total_mb(self) -> float | None:
        return max((sum(t.values()) for _, t in self.series), default=0) / 2**20 or None

    def drift_mb(self, role: str) -> float | None:
        """Mean RSS over the last quarter of the run minus the mean over the third quarter.

        Start-up (a JVM and Python workers growing to their working size) falls in the
        first half of any run long enough to judge, so this is near zero when memory is
        flat once running, and positive when it keeps growing, e.g. with a growing backlog.
        """
        values = [totals[role] for _, totals in self.series if totals.get(role)]
        if len(values) < 16:
            return None
        q = len(values) // 4
        return (sum(values[-q:]) / q - sum(values[-2 * q:-q]) / q) / 2**20


def _kind(proc: psutil.Process) -> str:
    """A short label for a process of the approach's tree."""
    name = proc.name()
    if name == "java":
        return "jvm"
    cmd = " ".join(proc.cmdline()[:6])
    if "pyflink" in cmd and ("fn_execution" in cmd or "beam" in cmd or "worker" in cmd):
        return "python-workers"
    if name.startswith("python") or name == "llmstream":
        return "python"
    return "other"


class ServerSampler(PeriodicSampler):
    """Polls the simulator's `/stats` to integrate in-flight requests over any window."""

    def __init__(self, stats: Callable[[], dict[str, Any]], interval_s: float = 1.0) -> None:
        super().__init__("bench-server-stats", interval_s)
        self._stats = stats
        # (epoch ms, area = mean_in_flight * seconds since reset, served)
        self.samples: list[tuple[float, float, int]] = []
        self.last: dict[str, Any] = {}

    def sample(self) -> None:
        try:
            stats = self._stats()
        except (requests.RequestException, OSError, ValueError) as err:
            log.debug("simulator stats unavailable: %s", err)
            return
        self.last = stats
        self.samples.append((now_ms(), float(stats["mean_in_flight"]) * float(stats["since_reset_s"]),
                             int(stats.get("served", 0))))


    def mean_in_flight(self, start_ms: float, end_ms: float) -> float | None:
        """Time-weighted mean of requests in flight between two epoch-ms instants."""
        if len(self.samples) < 2 or end_ms <= start_ms:
            return None
        a0, a1 = _interpolate(self.samples, start_ms), _interpolate(self.samples, end_ms)
        if a0 is None or a1 is None:
            return None
        return (a1 - a0) / ((end_ms - start_ms) / 1000)


def _interpolate(samples: Sequence[tuple[float, float, int]], at_ms: float) -> float | None:
    if at_ms < samples[0][0] or at_ms > samples[-1][0]:
        at_ms = min(max(at_ms, samples[0][0]), samples[-1][0])
    for (t0, a0, _), (t1, a1, _) in itertools.pairwise(samples):
        if t0 <= at_ms <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (at_ms - t0) / (t1 - t0)
    return samples[-1][1]


class CheckpointSampler(PeriodicSampler):
    """Finds the REST endpoint of the mini cluster under `root_pid` (it listens on a random
    port) and keeps its latest `/jobs/<id>/checkpoints` answer: how many checkpoints
    completed and how long they took, which bounds how late exactly-once output is visible.

    Why a checkpoint failed: Flink keeps the reason of a checkpoint that was triggered in its
    history (the last ``web.checkpoints.history`` ones, so each sample's are kept here), but a
    trigger refused before any task was asked (not all tasks running yet, or some finished at the
    end of a bounded run) only adds to ``counts.failed``. Flink's CheckpointFailureManager never
    counts those against ``tolerable-failed-checkpoints``; the summary tells them apart."""

    def __init__(self, root_pid: int, interval_s: float = 2.0) -> None:
        super().__init__("bench-checkpoints", interval_s)
        self.root_pid = root_pid
        self.latest: dict[str, Any] = {}
        self.failed: dict[Any, str] = {}
        """Failure reason of each triggered checkpoint seen failed, by checkpoint id."""
        self._base: str | None = None
        self._job: str | None = None

    def _discover(self) -> None:
        try:
            procs = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return
        for proc in procs:
            try:
                if proc.name() != "java":
                    continue
                ports = [c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
            except psutil.Error:
                continue
            for port in ports:
                base = f"http://127.0.0.1:{port}"
                try:
                    jobs = requests.get(f"{base}/jobs/overview", timeout=0.5).json().get("jobs") or []
                except (requests.RequestException, ValueError, AttributeError):
                    continue
                if jobs:
                    self._base, self._job = base, str(jobs[0]["jid"])
                    return

    def sample(self) -> None:
        if self._base is None:
            self._discover()
        if self._base is None:
            return
        try:
            data = requests.get(f"{self._base}/jobs/{self._job}/checkpoints", timeout=1.0).json()
        except (requests.RequestException, ValueError):
            return
        self.take(data)

    def take(self, data: Any) -> None:
        """Keep one `/checkpoints` answer, and the reasons of the failed checkpoints in its history."""
        if isinstance(data, dict) and "counts" in data:
            self.latest = data
            for entry in data.get("history") or []:
                if entry.get("status") == "FAILED":
                    self.failed[entry.get("id")] = str(entry.get("failure_message") or "no reason given")[:200]


    def summary(self) -> dict[str, Any] | None:
        """Completed/failed counts and end-to-end durations (ms) of the checkpoints seen."""
        if not self.latest:
            return None
        counts = self.latest.get("counts") or {}
        durations = (self.latest.get("summary") or {}).get("end_to_end_duration") or {}
        history = [h for h in self.latest.get("history") or [] if h.get("status") == "COMPLETED"]
        failed = int(counts.get("failed") or 0)
        return {
            "completed": counts.get("completed"),
            "failed": failed,
            "failed_untriggered": max(0, failed - len(self.failed)),
            "in_progress": counts.get("in_progress"),
            "duration_ms": {k: _num(durations.get(k)) for k in ("min", "p50", "p99", "avg", "max")},
            "recent_durations_ms": [h.get("end_to_end_duration") for h in history[:10]],
            "failures": dict(Counter(self.failed.values())),
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class SteadyWindow:
    """Completions between the 10th and 90th percentile of completion times: start-up
    (JVM, first bundle) and the drain at the end are left out."""

    start_ms: float
    end_ms: float
    count: int

    @property
    def seconds(self) -> float:
        return (self.end_ms - self.start_ms) / 1000

    @property
    def rate(self) -> float | None:
        return self.count / self.seconds if self.seconds > 0 else None


def steady_window(completions_ms: Sequence[float], low: float = 10, high: float = 90) -> SteadyWindow | None:
    if len(completions_ms) < 10:
        return None
    ordered = sorted(completions_ms)
    lo = ordered[int(len(ordered) * low / 100)]
    hi = ordered[max(0, math.ceil(len(ordered) * high / 100) - 1)]
    count = sum(1 for t in ordered if lo <= t <= hi)
    return SteadyWindow(lo, hi, count) if hi > lo else None


@dataclass
class Latencies:
    """p50/p99 of one latency, in ms."""

    p50: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Latencies:
        return cls(percentile(values, 50), percentile(values, 99))


@dataclass
class DeliveryTally:
    """Which ids were answered, twice, or not at all, judged by the read_committed observer.

    `missing` ids never became visible. Those at offsets the approach's group had committed
    (it claimed them done) are `lost`; the rest are `not_reached` (the run was stopped first).
    """

    expected: int
    seen: int
    duplicates: int
    dead_lettered: int
    missing: int
    lost: int
    not_reached: int
    lost_ids: list[str] = field(default_factory=list)
    cache_hits: int = 0



def tally_delivery(offsets: dict[str, int], observer: Observer, committed: int) -> DeliveryTally:
    """Judges every produced id (`offsets`: id -> input offset) against what became visible;
    `committed` is the approach group's committed input offset at the end."""
    first, counts = observer.snapshot()
    missing = [rid for rid in offsets if rid not in first]
    lost = sorted(rid for rid in missing if offsets[rid] < committed)
    return DeliveryTally(
        expected=len(offsets),
        seen=sum(1 for rid in offsets if rid in first),
        duplicates=sum(1 for n in counts.values() if n > 1),
        dead_lettered=sum(1 for s in first.values() if s.dead),
        missing=len(missing),
        lost=len(lost),
        not_reached=len(missing) - len(lost),
        lost_ids=lost[:20],
        cache_hits=observer.cached,
    )
