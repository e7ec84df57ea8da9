"""Bench scenarios (j), (k) and (l): does the job scale by the model's headroom?

Each runs on a standalone cluster with Flink's adaptive scheduler (`scaling.ADAPTIVE`), its own
broker and simulator, the job submitted with `llmstream submit` and rescaled through
`llmstream scale` (`jobs/launch/scale.py`), as a user would:

- **(j) the scale curve**: the keyed lane at inference parallelism 1, 2, 4 and 8, a fresh job at
  each (its buckets chosen for that parallelism), a backlog it never runs out of and a simulator
  with no concurrency limit, so each subtask is held by its own `async.capacity` (16 calls at
  100 ms: 160/s) and never by the model. Throughput (the slope of the output's committed end
  offsets), the job's CPU a record (TaskManager JVM and Python workers) and the machine's busy
  share in the same window; efficiency against linear. Where the machine's CPU is saturated the
  point says so: the 2-core machine, not the job, stops the curve there.
- **(k) the model's capacity doubles**: a fleet of two endpoints (8 slots each, 100 ms: 80/s
  each), the second one down at the start; the job (capacity 16 a subtask, submitted for 4
  subtasks and brought to 1) under `llmstream scale --auto`; input above the doubled limit. When
  the second endpoint comes up, the job should notice (pipeline-bound: its one subtask is full, the
  endpoints have room), scale, and answer at >= 90% of the new limit (160/s) within 2 minutes; the
  input then ends, and the history checker (`jobs/dev/history.py`) reads every id once.
- **(l) the model saturates while input grows**: one endpoint that answers 429 above 4 calls at
  once (100 ms: 40/s), input growing from 20 to 120/s, `scale --auto` beside it: 0 scale-ups while
  model-bound, calls per record <= 1.01. The inference vertex's `busyTimeMsPerSecond` is sampled
  throughout; then the bench applies what a busy-time policy (Flink's autoscaler: parallelism =
  current x input rate / (true processing rate x target utilization 0.7)) would have chosen, and
  measures the calls it causes against the same input, in the same run.

    llmstream bench --scenarios j        # or k, l, or j,k,l; scale.md / scale.json in --out

Not in CI: each takes minutes and most of this machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import yaml

from jobs.clients import kafka_admin
from jobs.dev import simulator
from jobs.dev.bench.harness import child_environment
from jobs.dev.bench.measure import epoch_ms, process_tree
from jobs.dev.bench.scaling import ADAPTIVE, Ramp, job_config, parse_auto_line
from jobs.dev.bench.workload import InputProducer
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.local_kafka import BrokerConfig, LocalBroker
from udfs.config import load_config

Say = Callable[[str], None]


@dataclass(frozen=True)
class ScaleScenario:
    key: str
    name: str
    target: str


SCALE_SCENARIOS: dict[str, ScaleScenario] = {
    s.key: s for s in (
        ScaleScenario("j", "scale curve", ">= 85% of linear from 1 to 4 inference subtasks where CPU allows"),
        ScaleScenario("k", "model capacity doubles", ">= 90% of the new limit within 120 s of it appearing, "
                                                      "every id once"),
        ScaleScenario("l", "model saturates, input grows", "0 scale-ups while model-bound, calls per record <= 1.01"),
    )
}

CURVE_PARALLELISMS = (1, 2, 4, 8)
CURVE_CAPACITY = 16
CURVE_LATENCY_MS = 100.0
CURVE_WARMUP_S = 20.0
CURVE_WINDOW_S = 40.0
CURVE_TARGET = 0.85
CPU_SATURATED = 0.9
"""A machine busy this share of its CPU time in a window is out of CPU: that point says nothing of the job."""

FLEET_SLOTS = (8, 8)
FLEET_LATENCY_MS = 100.0
DOUBLING_CAPACITY = 16
"""Twice one endpoint's slots: a subtask's capacity counts a record from admission to emission, so
at one endpoint's slots it leaves that endpoint a third idle (54/s of 80/s, the first run), and the
verdict rightly asks for more subtasks before the fleet grows."""
DOUBLING_INPUT_PER_S = 170.0
DOUBLING_BEFORE_S = 45.0
DOUBLING_AFTER_S = 150.0
DOUBLING_TARGET_SHARE = 0.9
DOUBLING_DEADLINE_S = 120.0
RATE_WINDOW_S = 10.0

SATURATION_SLOTS = 4
SATURATION_CAPACITY = 16
SATURATION_RAMP = (20.0, 120.0, 150.0)
BUSY_POLICY_WINDOW_S = 60.0
TARGET_UTILIZATION = 0.7
"""The Flink operator autoscaler's default target utilization (`job.autoscaler.utilization.target`)."""
CALLS_PER_RECORD_TARGET = 1.01
AUTO_FLAGS = ("--auto", "--min", "1", "--max", "4", "--cooldown", "30", "--every", "10")
AUTO_RIG = {"taskmanager.numberOfTaskSlots": 4, "taskmanager.memory.process.size": "2048m"}
"""The cluster of (k) and (l): a slot for each of the 4 subtasks their jobs are submitted at and
`AUTO_FLAGS` may scale to."""


# ------------------------------------------------------------------------------ the jobs

@dataclass(frozen=True)
class JobSpec:
    """What a scenario's job differs in from the default config (`scaling.job_config` takes these)."""

    model: dict[str, Any]
    capacity: int
    inference: int


def curve_job(parallelism: int, url: str) -> JobSpec:
    """(j): one endpoint with no limit; each subtask holds `CURVE_CAPACITY` calls, its buckets chosen
    for `parallelism` (submitted at it)."""
    return JobSpec({"endpoint": url}, CURVE_CAPACITY, parallelism)


def doubling_job(urls: list[str]) -> JobSpec:
    """(k): the fleet, each endpoint at its server's slots (`max_concurrency` is per subtask); a
    subtask holds twice one endpoint's slots, so one subtask fills one endpoint (model-bound while
    the other is down) and not two. Submitted for 4 subtasks
    (buckets that spread evenly over 1, 2 and 4) and brought to 1 before the input starts. The
    circuit's cooldown is capped at 10 s so that the endpoint that comes back is probed within 10 s."""
    endpoints = [{"url": url, "max_concurrency": slots, "name": f"ep{i}"}
                 for i, (url, slots) in enumerate(zip(urls, FLEET_SLOTS, strict=True))]
    return JobSpec({"endpoint": None, "endpoints": endpoints, "circuit": {"cooldown_s": 5.0, "max_cooldown_s": 10.0}},
                   DOUBLING_CAPACITY, 4)


def saturation_job(url: str) -> JobSpec:
    """(l): one endpoint that rejects calls above its slots; 16 calls a subtask (4x its slots)."""
    return JobSpec({"endpoint": url}, SATURATION_CAPACITY, 4)


def write_job(r: Rig, tag: str, spec: JobSpec) -> Path:
    return job_config(r.work, r.broker.bootstrap_servers, tag, model=spec.model, capacity=spec.capacity,
                      inference=spec.inference)


# ------------------------------------------------------------------------------ verdicts (pure)

@dataclass(frozen=True)
class CurvePoint:
    """One parallelism of (j): what the job did in its measuring window, and the machine's CPU then."""

    parallelism: int
    records_per_s: float
    job_cpu_ms_per_record: float | None
    job_cores: float | None
    machine_busy: float
    load_avg: float


def curve_verdict(points: list[CurvePoint], target: float = CURVE_TARGET) -> dict[str, Any]:
    """Efficiency of each point against linear from parallelism 1 (`rate / (p x rate at 1)`), which
    points the machine's CPU stopped (busy >= `CPU_SATURATED`), and the target: >= `target` at 4, or,
    when CPU stopped the curve before 4, at the largest parallelism up to 4 it did not stop (said)."""
    by_p = {p.parallelism: p for p in points}
    base = by_p.get(1)
    if base is None or base.records_per_s <= 0:
        return {"met": None, "detail": "no measurement at parallelism 1", "efficiency": {}}
    efficiency = {p.parallelism: round(p.records_per_s / (p.parallelism * base.records_per_s), 3) for p in points}
    cpu_bound = [p.parallelism for p in points if p.machine_busy >= CPU_SATURATED]
    judged = [p for p in sorted(by_p) if 1 < p <= 4 and p not in cpu_bound]
    first_cpu = min(cpu_bound) if cpu_bound else None
    cpu_text = (f"CPU stops the curve at {first_cpu} subtasks (machine {by_p[first_cpu].machine_busy:.0%} busy, "
                f"the job {by_p[first_cpu].job_cores} cores of it, load {by_p[first_cpu].load_avg:.1f} on "
                f"{os.cpu_count()} cores)" if first_cpu else "the CPU never ran out")
    if not judged:
        return {"met": None, "efficiency": efficiency, "cpu_bound": cpu_bound,
                "detail": f"no point between 2 and 4 subtasks had CPU to spare: {cpu_text}"}
    at = max(judged)
    met = efficiency[at] >= target
    return {"met": met, "efficiency": efficiency, "cpu_bound": cpu_bound, "judged_at": at,
            "detail": f"{efficiency[at]:.0%} of linear at {at} subtasks (target {target:.0%}); {cpu_text}"}


def time_to_share(samples: list[tuple[float, int]], since: float, limit_per_s: float, share: float,
                  window_s: float = RATE_WINDOW_S) -> float | None:
    """Seconds from `since` until the rate over a `window_s` window of (time, records out) `samples`
    first reaches `share` x `limit_per_s` (windows ending after `since`); None if it never does."""
    for i, (t_end, n_end) in enumerate(samples):
        if t_end <= since:
            continue
        start = next((samples[j] for j in range(i, -1, -1) if t_end - samples[j][0] >= window_s), None)
        if start is None:
            continue
        rate = (n_end - start[1]) / (t_end - start[0])
        if rate >= share * limit_per_s:
            return round(t_end - since, 1)
    return None


def doubling_verdict(reached_after_s: float | None, history_ok: bool | None,
                     deadline_s: float = DOUBLING_DEADLINE_S) -> dict[str, Any]:
    met = reached_after_s is not None and reached_after_s <= deadline_s and bool(history_ok)
    reach = (f"{DOUBLING_TARGET_SHARE:.0%} of the new limit after {reached_after_s:g} s" if reached_after_s is not None
             else f"never {DOUBLING_TARGET_SHARE:.0%} of the new limit")
    ids = "every id once" if history_ok else "ids NOT once" if history_ok is False else "ids not checked"
    return {"met": met, "detail": f"{reach} (deadline {deadline_s:g} s); {ids}"}


def busy_time_parallelism(current: int, busy_ms_per_s: float, in_per_s: float, out_per_s: float,
                          utilization: float = TARGET_UTILIZATION) -> int | None:
    """What a busy-time policy (Flink's autoscaler) asks for: the vertex's true processing rate is
    its output rate over its busy share; it wants `in_per_s` at `utilization` of that rate a
    subtask. No backlog catch-up term, so no more than the autoscaler itself would ask."""
    busy = busy_ms_per_s / 1000
    if busy <= 0 or out_per_s <= 0 or current < 1:
        return None
    true_per_subtask = out_per_s / busy / current
    return max(1, math.ceil(in_per_s / (true_per_subtask * utilization)))


def saturation_verdict(scale_ups_model_bound: int, calls_per_record: float | None) -> dict[str, Any]:
    ok_calls = calls_per_record is not None and calls_per_record <= CALLS_PER_RECORD_TARGET
    met = scale_ups_model_bound == 0 and ok_calls
    cpr = "unknown" if calls_per_record is None else f"{calls_per_record:.3f}"
    return {"met": met, "detail": f"{scale_ups_model_bound} scale-ups while model-bound, {cpr} calls a record "
                                  f"(target 0 and <= {CALLS_PER_RECORD_TARGET})"}


# ------------------------------------------------------------------------------ the rig

@dataclass
class Rig:
    """A broker, a standalone cluster with the adaptive scheduler, and a work dir; `submit` a config."""

    work: Path
    broker: LocalBroker
    cluster: LocalCluster
    say: Say
    env: dict[str, str] = field(default_factory=child_environment)

    @property
    def llmstream(self) -> list[str]:
        return [sys.executable, "-m", "jobs.cli"]

    def submit(self, path: Path) -> str:
        name = yaml.safe_load(path.read_text())["name"]
        done = subprocess.run([*self.llmstream, "submit", "--config", str(path), "--jobmanager", self.cluster.address],
                              check=False, env=self.env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"llmstream submit failed: {(done.stderr or done.stdout).strip()[-500:]}")
        [job] = self.cluster.live_jobs(name)
        job_id = str(job["jid"])
        self.cluster.wait_for_job_state(job_id, "RUNNING", timeout=300)
        deadline = time.monotonic() + 300
        while not self.cluster.is_fully_running(job_id) and time.monotonic() < deadline:
            time.sleep(1)
        return job_id

    def scale_to(self, path: Path, job_id: str, inference: int) -> None:
        from jobs.launch.scale import apply

        apply(self.cluster, job_id, load_config(str(path)), inference=inference, say=False)

    def auto(self, path: Path) -> subprocess.Popen[str]:
        return subprocess.Popen([*self.llmstream, "scale", "--config", str(path), "--jobmanager", self.cluster.address,
                                 *AUTO_FLAGS], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def committed_out(self, path: Path) -> int:
        kafka = yaml.safe_load(path.read_text())["kafka"]
        return sum(sum(kafka_admin.end_offsets(self.broker.bootstrap_servers, kafka[t], committed_only=True).values())
                   for t in ("output_topic", "dead_letter_topic"))

    def vertex_metrics(self, job_id: str, prefix: str, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
        """Metric -> {avg, max, sum} over the subtasks of the first vertex named `prefix`..."""
        vertex = next(v for v in self.cluster.job(job_id)["vertices"] if str(v["name"]).startswith(prefix))
        body = self.cluster.rest(f"/jobs/{job_id}/vertices/{vertex['id']}/subtasks/metrics?get={','.join(names)}"
                                 "&agg=avg,max,sum") or []
        return {str(m["id"]): {k: float(m[k]) for k in ("avg", "max", "sum") if k in m} for m in body}


@contextlib.contextmanager
def rig(label: str, say: Say, settings: dict[str, Any]) -> Iterator[Rig]:
    with tempfile.TemporaryDirectory(prefix=f"llmstream-bench-{label}-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        broker = LocalBroker(BrokerConfig.ephemeral(work / "kafka", heap="512m"))
        broker.start(timeout=180)
        stack.callback(broker.stop)
        cluster = LocalCluster(ClusterConfig.ephemeral(work / "flink", settings={**ADAPTIVE, **settings}))
        cluster.start(taskmanagers=1, timeout=180)
        stack.callback(cluster.stop)
        yield Rig(work, broker, cluster, say)


class AutoReader(threading.Thread):
    """Reads `scale --auto`'s lines, timestamped (monotonic), and says them."""

    def __init__(self, process: subprocess.Popen[str], say: Say, label: str) -> None:
        super().__init__(daemon=True, name=f"auto-{label}")
        self.process, self.say, self.label = process, say, label
        self.lines: list[tuple[float, str]] = []

    def run(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.rstrip()
            if line.startswith("llmstream: ") and "deprecated" not in line:
                self.lines.append((time.monotonic(), line))
                self.say(f"[{self.label}] {line}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        if self.process.poll() is None:
            self.process.kill()
        self.join(timeout=10)

    def decisions(self) -> list[dict[str, Any]]:
        out = []
        for at, line in self.lines:
            parsed = parse_auto_line(line)
            if parsed is not None:
                out.append({"at": at, **asdict(parsed), "line": line.removeprefix("llmstream: ")})
        return out


class AutoScaled(NamedTuple):
    """A job of (k) or (l) running at 1 inference subtask with `scale --auto` read beside it."""

    path: Path
    job_id: str
    kafka: dict[str, Any]
    producer: InputProducer
    reader: AutoReader


def start_auto_scaled(r: Rig, key: str, spec: JobSpec, say: Say, situation: str) -> AutoScaled:
    """Submits scenario `key`'s job, brings it to 1 inference subtask, says so (`situation` ends
    the line), makes a producer for its input (nothing produced yet) and starts reading
    `scale --auto` beside it."""
    path = write_job(r, f"bench-{key}-{int(time.time())}", spec)
    job_id = r.submit(path)
    r.scale_to(path, job_id, 1)
    say(f"[{key}] the job runs at 1 inference subtask{situation}")
    kafka = yaml.safe_load(path.read_text())["kafka"]
    producer = InputProducer(r.broker.bootstrap_servers, kafka["input_topic"])
    reader = AutoReader(r.auto(path), say, key)
    reader.start()
    return AutoScaled(path, job_id, kafka, producer, reader)


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for proc in process_tree(psutil.Process(pid)):
                with contextlib.suppress(psutil.Error):
                    times = proc.cpu_times()
                    total += times.user + times.system
    return total


def _machine_busy(before: Any, after: Any) -> float:
    idle = lambda t: t.idle + getattr(t, "iowait", 0.0)
    total = sum(after) - sum(before)
    return 0.0 if total <= 0 else 1 - (idle(after) - idle(before)) / total


def _slope(samples: list[tuple[float, int]]) -> float:
    """Least squares records a second over (time, records) samples."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    den = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if den == 0 else sum((t - mt) * (v - mv) for t, v in samples) / den


# ------------------------------------------------------------------------------ (j)

def run_curve(say: Say, parallelisms: tuple[int, ...] = CURVE_PARALLELISMS) -> dict[str, Any]:
    top = max(parallelisms)
    settings = {"taskmanager.numberOfTaskSlots": top, "taskmanager.memory.process.size": "3072m"}
    points: list[CurvePoint] = []
    with rig("j", say, settings) as r:
        sim = simulator.spawn(["--latency", f"fixed:{CURVE_LATENCY_MS:g}", "--concurrency", "0", "--per-token-ms", "0",
                               "--stats-interval-s", "0", "--log-level", "WARNING"])
        try:
            for p in parallelisms:
                points.append(_curve_point(r, sim, p, say))
        finally:
            sim.stop()
    verdict = curve_verdict(points)
    return {"scenario": "j", "points": [asdict(p) for p in points], "verdict": verdict,
            "settings": {"capacity_per_subtask": CURVE_CAPACITY, "latency_ms": CURVE_LATENCY_MS,
                         "ceiling_per_subtask": CURVE_CAPACITY * 1000 / CURVE_LATENCY_MS,
                         "warmup_s": CURVE_WARMUP_S, "window_s": CURVE_WINDOW_S, "slots": top}}


def _curve_point(r: Rig, sim: Any, p: int, say: Say) -> CurvePoint:
    tag = f"bench-j-p{p}-{int(time.time())}"
    path = write_job(r, tag, curve_job(p, sim.url))
    kafka = yaml.safe_load(path.read_text())["kafka"]
    ceiling = p * CURVE_CAPACITY * 1000 / CURVE_LATENCY_MS
    backlog = int(ceiling * (CURVE_WARMUP_S + CURVE_WINDOW_S + 60))
    producer = InputProducer(r.broker.bootstrap_servers, kafka["input_topic"])
    try:
        say(f"[j] parallelism {p}: {backlog:,} records in, then submit")
        producer.preload(backlog, timeout_s=300)
    finally:
        producer.close()
    job_id = r.submit(path)
    try:
        deadline = time.monotonic() + 300
        while r.committed_out(path) == 0 and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(CURVE_WARMUP_S)
        tm = r.cluster.taskmanager_pids()
        cpu0, machine0, t0 = _cpu_seconds(tm), psutil.cpu_times(), time.monotonic()
        samples: list[tuple[float, int]] = []
        while time.monotonic() - t0 < CURVE_WINDOW_S:
            samples.append((time.monotonic(), r.committed_out(path)))
            time.sleep(2)
        samples.append((time.monotonic(), r.committed_out(path)))
        cpu1, machine1, t1 = _cpu_seconds(tm), psutil.cpu_times(), time.monotonic()
        rate = _slope(samples)
        records = samples[-1][1] - samples[0][1]
        point = CurvePoint(p, round(rate, 1), round(1000 * (cpu1 - cpu0) / records, 3) if records > 0 else None,
                           round((cpu1 - cpu0) / (t1 - t0), 2), round(_machine_busy(machine0, machine1), 3),
                           round(os.getloadavg()[0], 2))
        if samples[-1][1] >= backlog:
            say(f"[j] parallelism {p}: the backlog ran out in the window; the rate is a floor")
        say(f"[j] parallelism {p}: {point.records_per_s:,.1f}/s (ceiling {ceiling:,.0f}/s), job CPU "
            f"{point.job_cpu_ms_per_record} ms a record ({point.job_cores} cores), machine {point.machine_busy:.0%} "
            f"busy, load {point.load_avg}")
        return point
    finally:
        r.cluster.cancel(job_id)


# ------------------------------------------------------------------------------ (k)

class OutputSampler(threading.Thread):
    """(monotonic time, records out) every `interval_s`, and the inference subtasks then."""

    def __init__(self, r: Rig, path: Path, job_id: str, interval_s: float = 2.0) -> None:
        super().__init__(daemon=True, name="output-sampler")
        self.r, self.path, self.job_id, self.interval_s = r, path, job_id, interval_s
        self.samples: list[tuple[float, int]] = []
        self.parallelism: list[tuple[float, int]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            with contextlib.suppress(Exception):
                self.samples.append((time.monotonic(), self.r.committed_out(self.path)))
            with contextlib.suppress(Exception):
                p = next(v for name, v in self.r.cluster.vertex_parallelism(self.job_id).items()
                         if name.startswith("inference"))
                self.parallelism.append((time.monotonic(), p))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


def run_doubling(say: Say) -> dict[str, Any]:
    from jobs.dev.history import read_history
    from jobs.dev.simulator import spawn_fleet

    new_limit = sum(FLEET_SLOTS) * 1000 / FLEET_LATENCY_MS
    with rig("k", say, AUTO_RIG) as r:
        fleet = spawn_fleet(FLEET_SLOTS, ["--latency", f"fixed:{FLEET_LATENCY_MS:g}", "--per-token-ms", "0",
                                          "--stats-interval-s", "0", "--log-level", "WARNING"])
        try:
            fleet.kill(1)
            path, job_id, kafka, producer, reader = start_auto_scaled(r, "k", doubling_job(fleet.urls), say,
                                                                      "; endpoint ep1 is down")
            sampler = OutputSampler(r, path, job_id)
            total_s = DOUBLING_BEFORE_S + DOUBLING_AFTER_S
            ramp = Ramp(producer, DOUBLING_INPUT_PER_S, DOUBLING_INPUT_PER_S, total_s)
            began = time.monotonic()
            sampler.start()
            ramp.start()
            time.sleep(DOUBLING_BEFORE_S)
            fleet.revive(1)
            joined = time.monotonic()
            say(f"[k] endpoint ep1 is up: the fleet's limit doubles to {new_limit:g}/s")
            ramp.join(timeout=total_s + 120)
            produced = producer.produced
            say(f"[k] input ended at {produced:,} records; waiting until every one is out")
            deadline = time.monotonic() + 600
            while r.committed_out(path) < produced and time.monotonic() < deadline:
                time.sleep(2)
            reader.stop()
            sampler.stop()
            producer.close()
            stats = fleet.stats()
            verdict_history = read_history(r.broker.bootstrap_servers, kafka["output_topic"],
                                           kafka["dead_letter_topic"], model_calls=int(stats["served"]))
            checked = verdict_history.check(producer.offsets)
            r.cluster.cancel(job_id)
        finally:
            fleet.stop()
    decisions = [{**d, "at": round(d["at"] - joined, 1)} for d in reader.decisions()]
    before = [d for d in decisions if d["at"] < 0 and d["target"] is not None and d["target"] > d["current"]]
    reached = time_to_share(sampler.samples, joined, new_limit, DOUBLING_TARGET_SHARE)
    after = [(t, n) for t, n in sampler.samples if joined + 60 <= t <= began + total_s]
    return {"scenario": "k", "new_limit_per_s": new_limit, "old_limit_per_s": new_limit / 2,
            "input_per_s": DOUBLING_INPUT_PER_S, "joined_after_s": round(joined - began, 1),
            "reached_90pct_after_s": reached, "rate_from_60s_after_join": round(_slope(after), 1),
            "scale_ups_before_join": len(before), "decisions": decisions,
            "parallelism": [(round(t - joined, 1), p) for t, p in sampler.parallelism],
            "output": [(round(t - joined, 1), n) for t, n in sampler.samples],
            "history": checked.as_json() | {"summary": checked.summary()}, "served": stats["served"], "rejected": stats["rejected"],
            "load_avg": round(os.getloadavg()[0], 2),
            "verdict": doubling_verdict(reached, checked.ok)}


# ------------------------------------------------------------------------------ (l)

class BusySampler(threading.Thread):
    """The inference vertex's `busyTimeMsPerSecond` (avg and max over subtasks), the source's and the
    inference's records a second, and the simulator's counters, every `interval_s`."""

    def __init__(self, r: Rig, job_id: str, sim: Any, interval_s: float = 5.0) -> None:
        super().__init__(daemon=True, name="busy-sampler")
        self.r, self.job_id, self.sim, self.interval_s = r, job_id, sim, interval_s
        self.samples: list[dict[str, Any]] = []
        self._halt = threading.Event()

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"at": time.monotonic(), "wall_ms": time.time() * 1000}
        with contextlib.suppress(Exception):
            inf = self.r.vertex_metrics(self.job_id, "inference", ("busyTimeMsPerSecond", "inference.numRecordsOut",
                                                                    "inference.numRecordsOutPerSecond"))
            row["busy_ms_per_s_avg"] = inf.get("busyTimeMsPerSecond", {}).get("avg")
            row["busy_ms_per_s_max"] = inf.get("busyTimeMsPerSecond", {}).get("max")
            row["out"] = inf.get("inference.numRecordsOut", {}).get("sum")
            row["out_per_s"] = inf.get("inference.numRecordsOutPerSecond", {}).get("sum")
        with contextlib.suppress(Exception):
            src = self.r.vertex_metrics(self.job_id, "Source", ("numRecordsOutPerSecond",))
            row["in_per_s"] = src.get("numRecordsOutPerSecond", {}).get("sum")
        with contextlib.suppress(Exception):
            stats = self.sim.stats()
            row["served"], row["rejected"] = stats["served"], stats["rejected"]
        with contextlib.suppress(Exception):
            row["parallelism"] = next(v for name, v in self.r.cluster.vertex_parallelism(self.job_id).items()
                                      if name.startswith("inference"))
        self.samples.append(row)
        return row

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


def completed_between(bodies: list[dict[str, Any]], start_ms: float, end_ms: float) -> tuple[int, int]:
    """(results, their attempts) among output `bodies` whose answer completed in [start_ms, end_ms)
    (`timestamps.completed`): the records a window's calls were for, whatever their commit lagged."""
    count = attempts = 0
    for body in bodies:
        completed = epoch_ms((body.get("timestamps") or {}).get("completed"))
        if completed is not None and start_ms <= completed < end_ms:
            count += 1
            attempts += int(body.get("attempts") or 0)
    return count, attempts


def calls_in(first: dict[str, Any], last: dict[str, Any], bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """Calls answered and sent (answered + 429s), counted at the simulator between two `BusySampler`
    rows, a result completed between them. The results are read from the committed output by their
    completion time, so neither the commit's lag behind the answers nor the REST API's metric
    refresh (10 s) skews the ratio; what remains is a call answered within milliseconds of an edge."""
    results, attempts = completed_between(bodies, first["wall_ms"], last["wall_ms"])
    served = (last.get("served") or 0) - (first.get("served") or 0)
    rejected = (last.get("rejected") or 0) - (first.get("rejected") or 0)
    seconds = last["at"] - first["at"]
    return {"seconds": round(seconds, 1), "results": results,
            "results_per_s": round(results / seconds, 1) if seconds else None,
            "served": served, "rejected_429": rejected,
            "calls_per_record": round(served / results, 4) if results else None,
            "sent_per_record": round((served + rejected) / results, 3) if results else None,
            "attempts_per_record": round(attempts / results, 3) if results else None,
            "rejected_per_s": round(rejected / seconds, 1) if seconds else None}


def _output_bodies(r: Rig, path: Path) -> list[dict[str, Any]]:
    topic = yaml.safe_load(path.read_text())["kafka"]["output_topic"]
    bodies = []
    for record in kafka_admin.consume_committed(r.broker.bootstrap_servers, topic, timeout_s=120):
        with contextlib.suppress(ValueError, TypeError):
            bodies.append(json.loads(record.value))
    return bodies


def run_saturation(say: Say) -> dict[str, Any]:
    start, end, seconds = SATURATION_RAMP
    with rig("l", say, AUTO_RIG) as r:
        sim = simulator.spawn(["--latency", "fixed:100", "--concurrency", str(SATURATION_SLOTS), "--reject-over-limit",
                               "--per-token-ms", "0", "--stats-interval-s", "0", "--log-level", "WARNING"])
        try:
            path, job_id, _, producer, reader = start_auto_scaled(
                r, "l", saturation_job(sim.url), say, " against a model that takes 4 calls at once (40/s)")
            busy = BusySampler(r, job_id, sim)
            ramp = Ramp(producer, start, end, seconds, hold_s=BUSY_POLICY_WINDOW_S + 300)
            busy.start()
            ramp.start()
            say(f"[l] input from {start:g}/s growing ~{(end - start) / seconds:.2f}/s a second; scale --auto beside it")
            time.sleep(seconds)
            reader.stop()
            busy.stop()
            first_auto = next((row for row in busy.samples if row.get("served") is not None), None)
            last_auto = busy.sample()
            tail = [row for row in busy.samples if row["at"] >= last_auto["at"] - 30 and row.get("busy_ms_per_s_avg")
                    is not None]
            p_now = int(last_auto.get("parallelism") or 1)
            busy_avg = sum(row["busy_ms_per_s_avg"] for row in tail) / len(tail) if tail else 0.0
            in_rate = sum(row.get("in_per_s") or 0 for row in tail) / len(tail) if tail else 0.0
            out_rate = sum(row.get("out_per_s") or 0 for row in tail) / len(tail) if tail else 0.0
            input_rate = ramp.rate_now()
            busy_p = busy_time_parallelism(p_now, busy_avg, input_rate, out_rate)
            forced = min(busy_p or p_now, 4)
            say(f"[l] busy {busy_avg:,.0f} ms/s at {p_now} subtask(s), input {input_rate:,.1f}/s (source reads {in_rate:,.1f}/s), out {out_rate:,.1f}/s: a "
                f"busy-time policy would run {busy_p} subtasks; applying {forced} to measure what they cost")
            busy_window: tuple[dict[str, Any], dict[str, Any]] | None = None
            if forced > p_now:
                r.scale_to(path, job_id, forced)
                busy2 = BusySampler(r, job_id, sim)
                time.sleep(15)
                first = busy2.sample()
                time.sleep(BUSY_POLICY_WINDOW_S)
                busy_window = (first, busy2.sample())
            ramp.stop()
            producer.close()
            time.sleep(10)  # the answers of the last window committed (checkpoints every 2 s)
            bodies = _output_bodies(r, path)
            auto_calls = calls_in(first_auto, last_auto, bodies) if first_auto else {}
            busy_calls: dict[str, Any] = {}
            if busy_window is not None:
                busy_calls = calls_in(*busy_window, bodies) | {
                    "parallelism": forced, "busy_ms_per_s_avg": busy_window[1].get("busy_ms_per_s_avg")}
            r.cluster.cancel(job_id)
        finally:
            sim.stop()
    decisions = reader.decisions()
    ups_model_bound = sum(1 for d in decisions if d["kind"] == "model-bound" and d["target"] is not None
                          and d["target"] > d["current"])
    ups = sum(1 for d in decisions if d["target"] is not None and d["target"] > d["current"])
    kinds: dict[str, int] = {}
    for d in decisions:
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
    return {"scenario": "l", "model_limit_per_s": SATURATION_SLOTS * 10, "ramp_per_s": [start, end],
            "ramp_seconds": seconds, "scale_ups": ups, "scale_ups_model_bound": ups_model_bound, "verdicts": kinds,
            "decisions": [{**d, "at": round(d["at"] - decisions[0]["at"], 1)} for d in decisions] if decisions else [],
            "under_policy": auto_calls, "busy_ms_per_s_avg": round(busy_avg, 1),
            "busy_samples": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}
                             for row in busy.samples],
            "input_per_s_at_judgement": round(input_rate, 1), "out_per_s_at_judgement": round(out_rate, 1),
            "busy_time_policy": {"parallelism": busy_p, "applied": forced, "formula":
                                 "ceil(input rate / (output rate / busy share / subtasks x 0.7))", **busy_calls},
            "load_avg": round(os.getloadavg()[0], 2),
            "verdict": saturation_verdict(ups_model_bound, auto_calls.get("calls_per_record"))}


# ------------------------------------------------------------------------------ report

RUNNERS: dict[str, Callable[[Say], dict[str, Any]]] = {"j": run_curve, "k": run_doubling, "l": run_saturation}


def render(results: list[dict[str, Any]], command: str) -> str:
    lines = [f"# Scaling scenarios ({', '.join(r['scenario'] for r in results)})", "", f"`{command}`", ""]
    for res in results:
        s = SCALE_SCENARIOS[res["scenario"]]
        v = res.get("verdict") or {}
        mark = "met" if v.get("met") else "not met" if v.get("met") is False else "not judged"
        lines += [f"## ({s.key}) {s.name}", "", f"target: {s.target}: **{mark}** — {v.get('detail', res.get('error'))}", ""]
        if s.key == "j" and res.get("points"):
            lines += ["| inference subtasks | records/s | of linear | job CPU ms a record | job cores | machine busy | load |",
                      "|---|---|---|---|---|---|---|"]
            eff = v.get("efficiency", {})
            for p in res["points"]:
                e = eff.get(p["parallelism"], eff.get(str(p["parallelism"])))
                lines.append(f"| {p['parallelism']} | {p['records_per_s']:,.1f} | {'' if e is None else f'{e:.0%}'} | "
                             f"{p['job_cpu_ms_per_record']} | {p['job_cores']} | {p['machine_busy']:.0%} | {p['load_avg']} |")
        if s.key == "k" and "reached_90pct_after_s" in res:
            lines += [(f"new limit {res['new_limit_per_s']:g}/s (was {res['old_limit_per_s']:g}/s), input "
                      f"{res['input_per_s']:g}/s; 90% reached {res['reached_90pct_after_s']} s after the endpoint "
                      f"joined; {res['rate_from_60s_after_join']:,.1f}/s from 60 s after it; scale-ups before it joined: "
                      f"{res['scale_ups_before_join']}; {res['history'].get('summary', '')}"), ""]
            lines += [f"- {d['at']:+.0f} s: {d['line']}" for d in res["decisions"] if d["target"] is not None]
        if s.key == "l" and "under_policy" in res:
            u, b = res["under_policy"], res["busy_time_policy"]
            lines += [(f"under `scale --auto`: {res['scale_ups']} scale-ups ({res['scale_ups_model_bound']} while "
                      f"model-bound), verdicts {json.dumps(res['verdicts'])}; {u.get('results_per_s')} results/s, "
                      f"{u.get('calls_per_record')} calls answered a record, {u.get('sent_per_record')} sent (429s "
                      f"included); inference busyTimeMsPerSecond {res['busy_ms_per_s_avg']:,.0f}"), "",
                      (f"a busy-time policy: {b.get('parallelism')} subtasks (applied {b.get('applied')}): "
                      f"{b.get('results_per_s')} results/s, {b.get('calls_per_record')} calls answered a record, "
                      f"{b.get('sent_per_record')} sent, {b.get('rejected_per_s')} 429s a second"), ""]
        lines.append("")
    return "\n".join(lines)


def rerender(out_dir: Path) -> Path:
    """scale.md again from the scale.json in `out_dir` (its verdicts recomputed), after a report change."""
    data = json.loads((out_dir / "scale.json").read_text())
    for result in data["results"]:
        if result["scenario"] == "j" and result.get("points"):
            result["verdict"] = curve_verdict([CurvePoint(**p) for p in result["points"]])
    (out_dir / "scale.md").write_text(render(data["results"], data["command"]))
    return out_dir / "scale.md"


def run(keys: list[str], out_dir: Path, command: str, say: Say) -> int:
    """Runs the scenarios `keys` one after another; writes scale.json and scale.md into `out_dir`.
    0 when each ran (targets are reported, never enforced), 1 when one failed."""
    results: list[dict[str, Any]] = []
    failed = False
    for key in keys:
        load = os.getloadavg()
        say(f"bench: scenario ({key}) {SCALE_SCENARIOS[key].name}; load average {load[0]:.2f} on {os.cpu_count()} CPUs")
        began = time.monotonic()
        try:
            result = RUNNERS[key](say)
        except Exception as err:  # noqa: BLE001 - one broken scenario must not lose the others' numbers
            import traceback

            say(f"[{key}] FAILED:\n{traceback.format_exc()}")
            result, failed = {"scenario": key, "error": f"{type(err).__name__}: {err}"}, True
        result["load_avg_before"] = round(load[0], 2)
        result["elapsed_s"] = round(time.monotonic() - began, 1)
        results.append(result)
        verdict = result.get("verdict") or {}
        say(f"target ({key}) {SCALE_SCENARIOS[key].target}: "
            f"{'met' if verdict.get('met') else 'NOT met' if verdict.get('met') is False else 'not judged'} — "
            f"{verdict.get('detail', result.get('error'))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scale.json").write_text(json.dumps({"command": command, "results": results}, indent=1, default=str))
    (out_dir / "scale.md").write_text(render(results, command))
    say(f"bench: wrote {out_dir / 'scale.md'} and scale.json")
    return 1 if failed else 0
