"""The job's figures: what `llmstream status` shows and `llmstream run` prints as progress.

Collected from the Flink REST API (`JobMetrics`: job state, restarts, checkpoints, operator
metrics, llmstream's own included), the Kafka consumer group (lag) and the dead-letter topic
(`DeadLetterTally`: dead letters by reason), refresh after refresh by an `Observer`, and turned
into one JSON-ready dict by `figures`. `jobs/observe/status.py` renders them; `RunFigures` records a
local run's last ones in its state directory (`jobs.state.snapshots.LocalRun`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
import urllib.parse
from collections import Counter, deque
from typing import Any

from jobs.clients.flink_rest import ClusterError, FlinkRest
from jobs.state.snapshots import LocalRun, StateDir
from udfs.clock import now_ms as epoch_now_ms
from udfs.config import JobConfig
from udfs.cost import pricing

log = logging.getLogger("llmstream.status")

SOURCE_PREFIX = "Source: kafka_requests"
INFERENCE_PREFIX = "inference"
VECTORIZED_OPERATOR = re.compile(r"^PythonCalc\[\d+\]\.")
"""How the vectorized lane's function shows in a vertex's metric ids (`PythonCalc[3].llmstream.requests`):
the planner names its operator, chained behind the source; its figures are read as the keyed
stage's (`inference.llmstream.requests`), so `llmstream status` and progress show either lane."""
LLMSTREAM_GROUP = "inference.llmstream."
REASON_METRIC = re.compile(r"^inference\.llmstream\.reason\.(.+)\.dead_letters$")
# A fleet endpoint's gauges (udfs/metrics.py ENDPOINT_GAUGES), its label made of [A-Za-z0-9_-].
ENDPOINT_METRIC = re.compile(r"^inference\.llmstream\.endpoint\.([A-Za-z0-9_-]+)\.(\w+)$")
ENDPOINT_WORST = ("circuit", "latency_p50_ms", "latency_p99_ms")
"""Per-endpoint figures taken as the worst subtask's; the others are summed over subtasks."""
CIRCUIT_STATES = {0: "closed", 1: "half-open", 2: "open"}
# The offset of the last record the source emitted, per partition (-1: none yet in this run).
CURRENT_OFFSET = re.compile(r"^Source__kafka_requests.*\.KafkaSourceReader\.topic\.(.+)\.partition\.(\d+)\.currentOffset$")


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


class JobMetrics:
    """One job's figures from the Flink REST API (`FlinkRest`): state, restarts, checkpoints and
    the operators' metrics summed over subtasks (latency percentiles: the slowest subtask's)."""

    def __init__(self, rest: FlinkRest, job_id: str) -> None:
        self.rest = rest
        self.job_id = job_id

    def _vertex_metrics(self, vertex_id: str) -> dict[str, dict[str, float]]:
        base = f"/jobs/{self.job_id}/vertices/{vertex_id}/subtasks/metrics"
        ids = [m["id"] for m in self.rest.rest(base) or []]
        wanted = [i for i in ids if _wanted(i)]
        if not wanted:
            return {}
        values = self.rest.rest(base + "?get=" + urllib.parse.quote(",".join(wanted), safe=","))
        return {VECTORIZED_OPERATOR.sub(INFERENCE_PREFIX + ".", m["id"]):
                {k: float(v) for k, v in m.items() if k != "id" and _number(v) is not None}
                for m in values or []}

    def _subtask_metrics(self, vertex_id: str, parallelism: int) -> list[dict[str, dict[str, float]]]:
        """Each inference subtask's own llmstream metrics (`/subtasks/<i>/metrics`), as `_vertex_metrics`
        has them (each value under sum, min, max and avg alike): what a verdict per subtask reads."""
        out: list[dict[str, dict[str, float]]] = []
        for index in range(parallelism):
            base = f"/jobs/{self.job_id}/vertices/{vertex_id}/subtasks/{index}/metrics"
            ids = [m["id"] for m in self.rest.rest(base) or []]
            wanted = [i for i in ids if _wanted(i) and _per_subtask(i)]
            values = (self.rest.rest(base + "?get=" + urllib.parse.quote(",".join(wanted), safe=","))
                      if wanted else [])
            metrics: dict[str, dict[str, float]] = {}
            for m in values or []:
                number = _number(m.get("value"))
                if number is not None:
                    key = VECTORIZED_OPERATOR.sub(INFERENCE_PREFIX + ".", m["id"])
                    metrics[key] = {"sum": number, "min": number, "max": number, "avg": number}
            out.append(metrics)
        return out

    def _taskmanagers(self) -> int | None:
        """TaskManagers registered with the job's cluster (0: none, the job cannot run)."""
        try:
            return len((self.rest.rest("/taskmanagers") or {}).get("taskmanagers") or [])
        except ClusterError:
            return None

    def collect(self) -> dict[str, Any]:
        job = self.rest.job(self.job_id)
        now = int(job.get("now") or epoch_now_ms())
        start = int(job.get("start-time") or now)
        end = int(job.get("end-time") or -1)
        out: dict[str, Any] = {
            "id": self.job_id, "name": job.get("name"), "state": job.get("state"),
            "uptime_s": round(((end if end > 0 else now) - start) / 1000, 1),
            "restarts": self.rest.num_restarts(self.job_id),
            "taskmanagers": self._taskmanagers(),
        }
        metrics: dict[str, dict[str, float]] = {}
        parallelism: dict[str, int] = {}
        for vertex in job.get("vertices", []):
            name = str(vertex.get("name", ""))
            if name.startswith((SOURCE_PREFIX, INFERENCE_PREFIX)):
                key = "source" if name.startswith(SOURCE_PREFIX) else "inference"
                parallelism[key] = int(vertex.get("parallelism", 1))
                if "PythonCalc[" in name:  # the vectorized lane, chained behind the source
                    parallelism["inference"] = parallelism[key]
                metrics.update(self._vertex_metrics(str(vertex["id"])))
                inference_here = key == "inference" or "PythonCalc[" in name
                if inference_here and parallelism.get("inference", 1) > 1:
                    with contextlib.suppress(ClusterError):
                        out["inference_subtasks"] = self._subtask_metrics(str(vertex["id"]), parallelism["inference"])
        out["metrics"] = metrics
        out["parallelism"] = parallelism
        out["checkpoints"] = self.rest.checkpoint_stats(self.job_id)
        out["now_ms"] = now
        return out


def _wanted(metric_id: str) -> bool:
    metric_id = VECTORIZED_OPERATOR.sub(INFERENCE_PREFIX + ".", metric_id)
    return (metric_id.startswith(LLMSTREAM_GROUP)
            or metric_id.endswith((".numRecordsOut", ".numRecordsOutPerSecond", ".pendingRecords",
                                   ".records-lag-max", ".currentOffset"))
            or metric_id in ("inference.numRecordsOut", "inference.numRecordsOutPerSecond"))


def _per_subtask(metric_id: str) -> bool:
    """The metrics a verdict per subtask reads: llmstream's own and the stage's records out."""
    metric_id = VECTORIZED_OPERATOR.sub(INFERENCE_PREFIX + ".", metric_id)
    return metric_id.startswith((LLMSTREAM_GROUP, "inference.numRecordsOut"))


def _sum(metrics: dict[str, dict[str, float]], metric_id: str) -> float | None:
    value = metrics.get(metric_id)
    return value.get("sum") if value else None


def _source(metrics: dict[str, dict[str, float]], suffix: str) -> float | None:
    for metric_id, value in metrics.items():
        if metric_id.startswith("Source__kafka_requests") and metric_id.endswith(suffix):
            return value.get("sum")
    return None


MIN_RATE_SPAN_S = 5.0
"""Rates from two refreshes at least this far apart: metric values move in steps (bundle ends,
the REST API's fetch interval), so closer ones would read 0/s, then twice the rate."""
RATE_WINDOW_S = 30.0


def figures(config: JobConfig, raw: dict[str, Any] | None, *, lag: dict[str, Any] | None = None,
            dead_letters: dict[str, int] | None = None, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status figures, JSON-ready, from `JobMetrics.collect()` (`raw`, None when no REST
    API answers), the consumer group (`lag`: committed and end offsets) and the dead-letter
    topic (`dead_letters`: count by reason). `previous` (the figures of an earlier refresh, 5 to
    120 s ago) turns counts into rates; without it records/s are Flink's one-minute meters and
    tokens/min the average over the job's uptime.
    """
    now = time.time()
    out: dict[str, Any] = {"job": {"name": config.name, "state": "UNKNOWN"}, "at": now}
    metrics: dict[str, dict[str, float]] = (raw or {}).get("metrics") or {}
    if raw:
        out["job"] = {k: raw.get(k) for k in ("id", "name", "state", "uptime_s", "restarts", "taskmanagers")}
    out["job"]["lane"] = config.lane  # with `lane: auto`, the one it chose

    def llm(name: str) -> float | None:
        return _sum(metrics, LLMSTREAM_GROUP + name)

    def max_of(name: str) -> float | None:
        value = metrics.get(LLMSTREAM_GROUP + name)
        return value.get("max") if value else None

    records_in = _source(metrics, ".numRecordsOut")
    in_rate = _source(metrics, ".numRecordsOutPerSecond")
    emitted = _sum(metrics, "inference.numRecordsOut")
    dead = llm("dead_lettered")
    out_rate = _sum(metrics, "inference.numRecordsOutPerSecond")
    # Flink's meters average over a minute; between two refreshes of one job the difference is fresher.
    before = (previous or {}).get("records") or {}
    span = now - float((previous or {}).get("at") or 0)
    if previous and raw and previous["job"].get("id") == raw["id"] and MIN_RATE_SPAN_S <= span <= 120:
        in_rate = _delta_rate(records_in, before.get("in"), span, in_rate)
        out_rate = _delta_rate(emitted, before.get("emitted"), span, out_rate)
    group_lag = None
    if lag is not None:
        group_lag = max(0, lag["end"] - lag["committed"])
    input_lag = _input_lag(config, metrics, lag, group_lag)
    out["input"] = {
        "lag_records": input_lag,
        "drain_s": (round(input_lag / in_rate, 1) if input_lag and in_rate else (0.0 if input_lag == 0 else None)),
        "group_committed": lag["committed"] if lag else None,
        "end_offset": lag["end"] if lag else None,
        "group_lag": group_lag,
    }
    out["records"] = {
        "in": _int(records_in), "in_per_s": _round(in_rate),
        "processed": _int(llm("records_in")),
        "results": _int(emitted - dead) if emitted is not None and dead is not None else None,
        "dead_letters": _int(dead), "out_per_s": _round(out_rate), "emitted": _int(emitted),
        "dropped": _int(llm("dropped")),
    }
    capacity = config.async_.capacity * int(((raw or {}).get("parallelism") or {}).get("inference", 1))
    out["calls"] = _calls(metrics, capacity)
    by_reason = {m.group(1): int(v.get("sum", 0)) for k, v in metrics.items() if (m := REASON_METRIC.match(k))}
    out["dead_letters"] = {"by_reason": dead_letters if dead_letters is not None else by_reason,
                           "source": "topic" if dead_letters is not None else "metrics"}
    out["endpoints"] = _endpoints(metrics)
    out["subtasks"] = _subtasks(config, (raw or {}).get("inference_subtasks") or [], previous, span,
                                same_job=bool(previous and raw and previous["job"].get("id") == raw.get("id")))
    out["checkpoint"] = _checkpoint(raw, now)
    out["cost"] = _cost(config, llm("prompt_tokens"), llm("completion_tokens"), raw, previous, now)
    if config.lane == "provider-batch":
        out["batch_lane"] = {
            "provider": config.model.provider, "records_waiting": _int(llm("batch_records_waiting")),
            "batches_open": _int(llm("batches_open")), "oldest_age_s": _int(max_of("batch_oldest_age_s")),
            "requests_submitted": _int(llm("batch_requests")),
            "stale_after_s": config.provider_batch.stale_after_s,
            # What the batch price saves of the list price (model.prices x price_factor).
            "saving": round(1.0 - config.provider_batch.price_factor, 4),
        }
    return out


def _calls(metrics: dict[str, dict[str, float]], capacity: int) -> dict[str, Any]:
    """The calls figures (`calls`) of the job, or of one subtask: counts summed over the subtasks the
    metrics cover, latency and the oldest held record the worst subtask's."""

    def llm(name: str) -> float | None:
        return _sum(metrics, LLMSTREAM_GROUP + name)

    def max_of(name: str) -> float | None:
        value = metrics.get(LLMSTREAM_GROUP + name)
        return value.get("max") if value else None

    return {
        "in_flight": _int(llm("in_flight")), "admitted": _int(llm("admitted")), "capacity": capacity,
        "concurrency_limit": _int(llm("concurrency_limit")),
        "requests": _int(llm("requests")), "retries": _int(llm("retries")), "rate_limited": _int(llm("rate_limited")),
        "invalid_answers": _int(llm("invalid_answers")),
        "held": _int(llm("held")), "held_oldest_s": _int(max_of("held_oldest_s")),
        "answered": _int(llm("latency_count")),
        "latency_p50_ms": _int(max_of("latency_p50_ms")), "latency_p99_ms": _int(max_of("latency_p99_ms")),
        "latency_mean_ms": (_round(llm("latency_sum_ms") / llm("latency_count"))  # type: ignore[operator]
                            if llm("latency_count") else None),
    }


def _subtasks(config: JobConfig, per_subtask: list[dict[str, dict[str, float]]], previous: dict[str, Any] | None,
              span: float, *, same_job: bool) -> list[dict[str, Any]]:
    """Each inference subtask's own figures (`subtasks`: records, calls, endpoints), for a verdict per
    subtask (`verdict.subtask_verdicts`); empty at one subtask, where the job's figures are its own.
    Records a second from the previous refresh's figures of the same subtask when there are some."""
    before = (previous or {}).get("subtasks") or []
    comparable = same_job and MIN_RATE_SPAN_S <= span <= 120 and len(before) == len(per_subtask)
    out = []
    for index, metrics in enumerate(per_subtask):
        emitted = _sum(metrics, "inference.numRecordsOut")
        rate = _sum(metrics, "inference.numRecordsOutPerSecond")
        if comparable:
            rate = _delta_rate(emitted, (before[index].get("records") or {}).get("emitted"), span, rate)
        out.append({"index": index,
                    "records": {"processed": _int(_sum(metrics, LLMSTREAM_GROUP + "records_in")),
                                "emitted": _int(emitted), "out_per_s": _round(rate)},
                    "calls": _calls(metrics, config.async_.capacity),
                    "endpoints": _endpoints(metrics)})
    return out


def held_of(fig: dict[str, Any] | None) -> tuple[int, int] | None:
    """(records the stage holds, seconds the oldest has been held) by these figures; None if unknown."""
    calls = (fig or {}).get("calls") or {}
    if calls.get("held") is None:
        return None
    return int(calls["held"]), int(calls.get("held_oldest_s") or 0)


def _endpoints(metrics: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """A model fleet's endpoints by label: calls in flight, limit, 429s, requests and failures summed
    over inference subtasks; circuit state and latency percentiles the worst subtask's. Empty for
    one `model.endpoint`."""
    out: dict[str, dict[str, Any]] = {}
    for metric_id, value in metrics.items():
        match = ENDPOINT_METRIC.match(metric_id)
        if match is None:
            continue
        label, name = match.groups()
        number = value.get("max" if name in ENDPOINT_WORST else "sum")
        if number is not None:
            out.setdefault(label, {})[name] = int(number)
    for figures in out.values():
        if "circuit" in figures:
            figures["circuit"] = CIRCUIT_STATES.get(figures["circuit"], str(figures["circuit"]))
    return dict(sorted(out.items()))


def _delta_rate(value: float | None, before: float | None, span: float, fallback: float | None) -> float | None:
    if value is None or before is None or value < before:
        return fallback
    return (value - before) / span


def _input_lag(config: JobConfig, metrics: dict[str, dict[str, float]], lag: dict[str, Any] | None,
               group_lag: int | None) -> int | None:
    """Records in the input not yet emitted by the source: per partition, the end offset minus the
    source's next offset (its last emitted offset + 1, or the group's committed offset before it has
    emitted any). Not the source's `pendingRecords`: that counts from the Kafka consumer's fetch
    position, and records fetched but queued in the source (thousands under backpressure) are not
    pending to it. Then `pendingRecords`, then the group's lag."""
    current: dict[str, float] = {}
    for metric_id, value in metrics.items():
        match = CURRENT_OFFSET.match(metric_id)
        if match and "sum" in value:
            current[partition_name(match.group(1), int(match.group(2)))] = value["sum"]
    partitions = (lag or {}).get("partitions") or {}
    if current and partitions:
        return int(sum(max(0, end - max(current.get(p, -1) + 1, committed))
                       for p, (committed, end) in partitions.items()))
    pending = _source(metrics, ".pendingRecords")
    return int(pending) if pending is not None else group_lag


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _checkpoint(raw: dict[str, Any] | None, now: float) -> dict[str, Any]:
    stats = (raw or {}).get("checkpoints") or {}
    counts = stats.get("counts") or {}
    latest = (stats.get("latest") or {}).get("completed") or {}
    done_ms = latest.get("latest_ack_timestamp")
    now_ms = (raw or {}).get("now_ms") or now * 1000
    return {
        "completed": counts.get("completed"), "failed": counts.get("failed"),
        "age_s": round((now_ms - done_ms) / 1000, 1) if done_ms else None,
        "duration_ms": latest.get("end_to_end_duration"),
        "size_bytes": latest.get("checkpointed_size", latest.get("state_size")),
    }


def _cost(config: JobConfig, prompt: float | None, completion: float | None, raw: dict[str, Any] | None,
          previous: dict[str, Any] | None, now: float) -> dict[str, Any]:
    if prompt is None or completion is None:
        return {"prompt_tokens": None, "completion_tokens": None, "tokens_per_min": None, "cost_per_hour": None}
    tokens = prompt + completion
    before = (previous or {}).get("cost") or {}
    if before.get("prompt_tokens") is not None and previous and now - previous["at"] >= MIN_RATE_SPAN_S and \
            tokens >= before["prompt_tokens"] + before["completion_tokens"]:
        span = now - previous["at"]
        d_prompt, d_completion = prompt - before["prompt_tokens"], completion - before["completion_tokens"]
    else:
        span = float((raw or {}).get("uptime_s") or 0)
        d_prompt, d_completion = prompt, completion
    per_min = (d_prompt + d_completion) / span * 60 if span > 0 else None
    prices = config.model.prices
    cost_per_hour = None
    if span > 0 and prices is not None:
        cost = pricing.cost(prices, d_prompt, d_completion)
        cost_per_hour = round(cost / span * 3600, 4)
    return {"prompt_tokens": int(prompt), "completion_tokens": int(completion),
            "tokens_per_min": _round(per_min), "cost_per_hour": cost_per_hour}


# ---------------------------------------------------------------------------------- sources

class DeadLetterTally:
    """Dead letters by reason, read from the dead-letter topic as a read_committed consumer sees
    them (what downstream gets), incrementally: each `read()` continues where the last stopped."""

    def __init__(self, config: JobConfig) -> None:
        from kafka import KafkaConsumer, TopicPartition
        from kafka.errors import KafkaError

        from jobs.clients.kafka_admin import connection_error

        self._topic = config.kafka.dead_letter_topic
        args = config.kafka.client_args()
        try:
            self._consumer = KafkaConsumer(**args, group_id=None, isolation_level="read_committed",
                                           enable_auto_commit=False, auto_offset_reset="earliest",
                                           client_id="llmstream-status")
        except (KafkaError, OSError) as err:
            raise connection_error(config.kafka, args, err) from None
        partitions = self._consumer.partitions_for_topic(self._topic) or set()
        self._parts = [TopicPartition(self._topic, p) for p in sorted(partitions)]
        self._consumer.assign(self._parts)
        if self._parts:
            self._consumer.seek_to_beginning(*self._parts)
        self.counts: Counter[str] = Counter()
        self.denied = False

    def read(self, timeout_s: float = 5.0) -> dict[str, int] | None:
        """Reads up to the topic's last stable offsets as of now (or until `timeout_s`); None when this
        principal may not read the topic (a job's own principal usually only writes it): the figures
        then count dead letters from the job's metrics."""
        from kafka.errors import AuthorizationError

        if not self._parts or self.denied:
            return None if self.denied else {}
        try:
            return self._read(timeout_s)
        except AuthorizationError:
            self.denied = True
            log.warning("may not read the dead-letter topic %s: dead letters are counted from the job's metrics",
                        self._topic)
            return None

    def _read(self, timeout_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        targets = self._consumer.end_offsets(self._parts)
        while time.monotonic() < deadline and any(self._consumer.position(tp) < end for tp, end in targets.items()):
            for batch in self._consumer.poll(timeout_ms=200).values():
                for record in batch:
                    try:
                        self.counts[str(json.loads(record.value)["reason"])] += 1
                    except (ValueError, KeyError, TypeError):
                        self.counts["unreadable"] += 1
        return dict(self.counts)

    def close(self) -> None:
        self._consumer.close()


def partition_name(topic: str, partition: int) -> str:
    """`topic:partition`, the key of one input partition in the figures (a topic name has no colon)."""
    return f"{topic}:{partition}"


def _group_lag(progress: Any) -> dict[str, Any] | None:
    """The group's committed and the input's end offsets, summed and per partition."""
    try:
        committed, ends = progress.committed(), progress.end_offsets()
    except Exception as err:  # noqa: BLE001 - the broker is down: shown as unknown
        log.debug("consumer group unavailable: %s", err)
        return None
    partitions = {partition_name(tp.topic, tp.partition): [int(committed.get(tp, 0)), int(end)]
                  for tp, end in ends.items()}
    return {"committed": sum(c for c, _ in partitions.values()), "end": sum(e for _, e in partitions.values()),
            "partitions": partitions}


def find_job(rest: FlinkRest, name: str, job_id: str | None = None) -> str | None:
    """`job_id` if the cluster knows it, else the newest live job called `name`, else the newest one."""
    jobs = rest.jobs()
    if job_id and any(j.get("jid") == job_id for j in jobs):
        return job_id
    named = sorted((j for j in jobs if j.get("name") == name), key=lambda j: j.get("start-time", 0), reverse=True)
    live = [j for j in named if j.get("state") not in ("FINISHED", "CANCELED", "FAILED")]
    chosen = (live or named)[:1]
    return str(chosen[0]["jid"]) if chosen else None


class Observer:
    """Collects the figures of one job, refresh after refresh (rates from the difference)."""

    def __init__(self, config: JobConfig, rest_url: str | None, *, job_id: str | None = None,
                 progress: Any = None, dead_letters: DeadLetterTally | None = None,
                 local_run: LocalRun | None = None) -> None:
        self.config = config
        self.rest = FlinkRest(rest_url) if rest_url else None
        self.job_id = job_id
        self.progress = progress
        self.dead_letters = dead_letters
        self.local_run = local_run
        self.history: deque[dict[str, Any]] = deque()

    def collect(self) -> dict[str, Any]:
        raw = None
        if self.rest is not None:
            try:
                self.job_id = find_job(self.rest, self.config.name, self.job_id)
                if self.job_id:
                    raw = JobMetrics(self.rest, self.job_id).collect()
            except ClusterError as err:
                log.debug("Flink REST API unavailable: %s", err)
        lag = _group_lag(self.progress) if self.progress is not None else None
        tally = self.dead_letters.read() if self.dead_letters is not None else None
        now = time.time()
        while self.history and now - self.history[0]["at"] > RATE_WINDOW_S:
            self.history.popleft()
        previous = self.history[0] if self.history else None
        result = figures(self.config, raw, lag=lag, dead_letters=tally, previous=previous)
        if raw is None and self.local_run is not None:
            result = _ended(result, self.local_run)
        result["live"] = raw is not None
        if self.rest is not None:
            result["job"]["rest_url"] = self.rest.rest_url
        if raw is not None:
            self.history.append(result)
        return result


def _ended(now: dict[str, Any], run: LocalRun) -> dict[str, Any]:
    """A local run whose mini cluster is gone: its last figures, with today's lag and dead letters."""
    if not run.last:
        now["job"].update(id=run.job_id, state="ENDED" if run.ended_at else "NOT RESPONDING")
        return now
    result = json.loads(json.dumps(run.last))
    result["job"]["state"] = "ENDED" if run.ended_at else "NOT RESPONDING"
    result["job"]["figures_as_of"] = run.last.get("at")
    result["at"] = now["at"]
    # The group's offsets as Kafka has them now; `lag_records` stays the source's last view, since
    # the next run resumes from the job's state, not from the group (which may lag behind it).
    result["input"].update({k: now["input"][k] for k in ("group_committed", "end_offset", "group_lag")})
    for rate in ("in_per_s", "out_per_s"):
        result["records"][rate] = 0.0
    result["calls"]["in_flight"] = result["calls"]["admitted"] = 0
    if now["dead_letters"]["source"] == "topic":
        result["dead_letters"] = now["dead_letters"]
    return result


class RunFigures:
    """The status figures of a local run, refreshed every `every_s` and recorded in its state
    directory (`LocalRun`), so `llmstream status` can still show them once the run has ended.

    Every refresh makes the mini cluster dump and parse all of the job's metrics (about 700, a
    quarter of them the Kafka clients'): the profile of bench (d) found a fifth of the JVM's samples
    there at a refresh every 2 s. Every 5 s matches the progress lines and `MIN_RATE_SPAN_S`; a
    live `llmstream status` asks the REST API itself."""

    def __init__(self, observer: Observer, local_run: LocalRun, state: StateDir, every_s: float = 5.0) -> None:
        self._observer = observer
        self._local_run = local_run
        self._state = state
        self._every_s = every_s
        self._at = 0.0
        self.last: dict[str, Any] | None = None

    def refresh(self, now: float, *, force: bool = False) -> dict[str, Any] | None:
        """The newest live figures (None before the first), collected again if `every_s` has passed."""
        if force or now - self._at >= self._every_s:
            self._at = now
            try:
                figures = self._observer.collect()
            except Exception as err:  # noqa: BLE001 - figures are best effort, the job is not
                log.debug("status figures unavailable: %s", err)
                return self.last
            if figures.get("live"):
                self.last = figures
                self._local_run.last = figures
                with contextlib.suppress(OSError):
                    self._local_run.record(self._state)
        return self.last
