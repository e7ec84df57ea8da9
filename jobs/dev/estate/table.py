"""The fault table on the estate: one scenario = fresh topics, records with unique ids, the job
submitted as a user does (``llmstream submit --jobmanager <JM host>:8081 --until-end``), one fault
injected mid-stream, then the history checker's verdict (`jobs/dev/history.py`) on what a
read_committed consumer sees.

``llmstream estate fault --table`` runs every scenario (`SCENARIOS`) and prints one row each; the
integration test runs one. The results are written to ``var/estate/fault-table.json`` too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jobs.clients import kafka_admin
from jobs.dev.estate.estate import Estate
from jobs.dev.history import Verdict, read_history
from jobs.runtime import jars

log = logging.getLogger("llmstream.estate")

__all__ = ["SCENARIOS", "Row", "Scenario", "render", "run_scenario"]

RECORDS = 4000
"""Records of one scenario: ~30 s of work at ~40 ms a call and 6 calls in flight."""
CAPACITY = 6
CHECKPOINT_INTERVAL_MS = 2000
BROKERS = ["kafka1", "kafka2", "kafka3"]


@dataclass
class Run:
    """A scenario in progress: its job's name and id, its topics, when it started."""

    estate: Estate
    name: str
    config_path: Path
    output_topic: str
    transactional_id_prefix: str = ""
    job_id: str = ""
    notes: list[str] = field(default_factory=list)


Fault = Callable[[Run], None]


@dataclass(frozen=True)
class Scenario:
    """A fault and what it does; ``sections`` change the job's config for this scenario only
    (`job_config`), e.g. a transaction timeout short enough to run out during a partition."""

    name: str
    fault: Fault
    about: str
    sections: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[Estate], dict[str, Any]] | None = None
    """Set up what the fault needs before the job starts; returns more config sections."""
    report: Callable[[Run], None] | None = None
    """Add to the notes what the job did, once the run has ended (its job still known to the REST API)."""

    def config_sections(self, estate: Estate) -> dict[str, Any]:
        sections = {name: dict(values) if isinstance(values, dict) else values for name, values in self.sections.items()}
        for name, values in (self.prepare(estate) if self.prepare else {}).items():
            if isinstance(values, dict) and isinstance(sections.get(name), dict):
                sections[name].update(values)
            else:
                sections[name] = values
        return sections


def _partition_from_brokers(seconds: float) -> Fault:
    def fault(run: Run) -> None:
        hosts = run.estate.job_hosts(run.job_id)
        run.notes.append(f"{'+'.join(hosts)} cut off from the 3 brokers for {seconds:g} s")
        with run.estate.partitioned(hosts, BROKERS):
            time.sleep(seconds)

    return fault


def _kill_taskmanager_host(run: Run) -> None:
    host = run.estate.job_hosts(run.job_id)[0]
    pids = run.estate.kill_host(host)
    run.notes.append(f"{host} killed ({len(pids)} processes), started again at once")
    run.estate.restart_host(host)


def _kill_leader(run: Run) -> None:
    host = run.estate.kill_leader(run.output_topic, 0)
    run.notes.append(f"{host} (leader of the output's partition 0) killed, back after 20 s")
    time.sleep(20)
    run.estate.restart_host(host)


def transaction_coordinator(run: Run, timeout: float = 60.0) -> int:
    """The broker coordinating most of the job's open transactions (ListTransactions on every
    broker, state Ongoing, ids starting with the job's prefix): the one whose loss hits the sink's
    transactions in flight. Waits until one is open (between checkpoints there may be none)."""
    deadline = time.monotonic() + timeout
    while True:
        counts: dict[int, int] = {}
        with contextlib.suppress(Exception), kafka_admin.admin(run.estate.bootstrap_servers, 10) as client:
            listed = client.list_transactions(state_filters=["Ongoing"])
            for broker, transactions in listed.items():
                ours = [t for t in transactions if t.transactional_id.startswith(run.transactional_id_prefix)]
                if ours:
                    counts[int(broker)] = len(ours)
        if counts:
            return max(counts, key=lambda broker: counts[broker])
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no open transaction of {run.transactional_id_prefix} within {timeout:g} s")
        time.sleep(0.2)


def _kill_transaction_coordinator(run: Run) -> None:
    node = transaction_coordinator(run)
    host = run.estate.kafka.host_of(node).name
    run.estate.kill_host(host)
    run.notes.append(f"{host} (coordinator of the sink's open transactions) killed, back after 20 s")
    time.sleep(20)
    run.estate.restart_host(host)


SHORT_TRANSACTIONS: dict[str, Any] = {
    "kafka": {"transaction_timeout_ms": 60_000},
    "checkpointing": {"timeout_ms": 30_000, "max_restart_ms": 28_000},
}
"""A 60 s sink transaction timeout, the least the transaction-timeout rule allows with a checkpoint
every 2 s once the checkpoint timeout (30 s) and the restart budget (28 s) are cut to fit."""


def _model_through_proxy(estate: Estate) -> dict[str, Any]:
    """The model reached through toxiproxy on its host, so its link can be slowed or stalled."""
    estate.model_proxy.start()
    return {"model": {"endpoint": f"http://{estate.model_proxy.listen}/v1"}}


def _slow_model_link(latency_ms: int, jitter_ms: int, seconds: float) -> Fault:
    def fault(run: Run) -> None:
        run.notes.append(f"TaskManager ↔ model answers delayed {latency_ms} ± {jitter_ms} ms for {seconds:g} s")
        with run.estate.model_proxy.toxic("slow", "latency", latency=latency_ms, jitter=jitter_ms):
            time.sleep(seconds)

    return fault


def _stalled_model_link(seconds: float) -> Fault:
    def fault(run: Run) -> None:
        run.notes.append(f"TaskManager ↔ model stalled {seconds:g} s (connections open, nothing answered)")
        with run.estate.model_proxy.toxic("stall", "timeout", stream="upstream", timeout=0):
            time.sleep(seconds)

    return fault


def _state_on_objects(through_proxy: bool) -> Callable[[Estate], dict[str, Any]]:
    """The job's state (checkpoints, savepoints, its run record) in the objects host's bucket, with
    Flink's own ``s3.*`` keys, as a job on S3 is configured (docs/operations.md, "State on object
    storage"); the key pair reaches ``llmstream submit`` and the daemons through the environment.
    ``through_proxy``: the cluster reaches the store through toxiproxy (`Estate.route_objects`)."""
    def prepare(estate: Estate) -> dict[str, Any]:
        estate.route_objects(through_proxy=through_proxy)
        return {"checkpointing": {"directory": f"s3://{estate.state_bucket}/estate-{uuid.uuid4().hex[:8]}"},
                "flink": estate.objects_settings()}

    return prepare


def _slow_object_store(latency_ms: int, jitter_ms: int, seconds: float) -> Fault:
    def fault(run: Run) -> None:
        before = _checkpoint_counts(run)
        with run.estate.objects_proxy.toxic("slow", "latency", latency=latency_ms, jitter=jitter_ms):
            time.sleep(seconds)
        run.notes.append(f"cluster ↔ object store answers delayed {latency_ms} ± {jitter_ms} ms for {seconds:g} s "
                         f"(checkpoints before: {before})")

    return fault


def _object_store_down(seconds: float) -> Fault:
    def fault(run: Run) -> None:
        before = _checkpoint_counts(run)
        pids = run.estate.kill_host("objects")
        time.sleep(seconds)
        run.estate.restart_host("objects")
        run.notes.append(f"objects host killed ({len(pids)} processes) {seconds:g} s mid-run, s3proxy started again "
                         f"(checkpoints before: {before})")

    return fault


def _checkpoint_counts(run: Run) -> str:
    """Completed / failed checkpoints of the run's job and the longest one, from the REST API.
    Failures to trigger while the job's tasks start count as failed too (and never toward
    ``tolerable-failed-checkpoints``)."""
    try:
        stats = run.estate.rest.rest(f"/jobs/{run.job_id}/checkpoints")
    except Exception as exc:  # noqa: BLE001 - the JobManager may be busy; the note says so
        return f"unknown ({type(exc).__name__})"
    counts = stats.get("counts", {})
    longest = ((stats.get("summary") or {}).get("end_to_end_duration") or {}).get("max")
    return (f"{counts.get('completed', '?')} completed, {counts.get('failed', '?')} failed"
            + (f", longest {int(longest) / 1000:.0f} s" if longest else ""))


def _report_checkpoints(run: Run) -> None:
    run.notes.append(f"checkpoints at the end: {_checkpoint_counts(run)}")


def _kill_jobmanager_host(run: Run) -> None:
    run.estate.kill_host("jm")
    run.notes.append("jm killed (no HA: the job is gone), started again, the job resubmitted")
    run.estate.restart_host("jm")


def _no_fault(run: Run) -> None:
    run.notes.append("no fault")


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("baseline", _no_fault, "no fault: what the estate does undisturbed"),
    Scenario("partition-60", _partition_from_brokers(60), "the job's TaskManager host ↔ every broker, 60 s"),
    Scenario("partition-200", _partition_from_brokers(200), "the job's TaskManager host ↔ every broker, 200 s"),
    Scenario("partition-past-tx-timeout", _partition_from_brokers(150),
             "the job's TaskManager host ↔ every broker, 150 s, with a 60 s transaction timeout",
             sections=SHORT_TRANSACTIONS),
    Scenario("tm-host-kill", _kill_taskmanager_host, "the job's TaskManager host killed (SIGKILL to all), restarted"),
    Scenario("leader-kill", _kill_leader, "the broker host leading the output partition killed, back after 20 s"),
    Scenario("coordinator-kill", _kill_transaction_coordinator,
             "the broker host coordinating the sink's open transactions killed, back after 20 s"),
    Scenario("model-slow-link", _slow_model_link(500, 250, 60),
             "TaskManager ↔ model through toxiproxy: answers 500 ± 250 ms late for 60 s", prepare=_model_through_proxy),
    Scenario("model-stalled-link", _stalled_model_link(60),
             "TaskManager ↔ model through toxiproxy: stalled 60 s (a toxiproxy timeout toxic)",
             prepare=_model_through_proxy),
    Scenario("jm-host-kill", _kill_jobmanager_host, "the JobManager host killed, restarted, the job resubmitted"),
    Scenario("object-store-down", _object_store_down(60),
             "state on S3 (s3proxy on the objects host): the objects host killed 60 s mid-run, then started again",
             prepare=_state_on_objects(False), report=_report_checkpoints),
    Scenario("object-store-down-20s-checkpoint-timeout", _object_store_down(60),
             "as object-store-down, with checkpointing.timeout_ms 20000: a checkpoint expires during the outage",
             sections={"checkpointing": {"timeout_ms": 20_000}}, prepare=_state_on_objects(False),
             report=_report_checkpoints),
    Scenario("object-store-slow", _slow_object_store(500, 250, 60),
             "state on S3 through toxiproxy on the objects host: its answers 500 ± 250 ms late for 60 s",
             prepare=_state_on_objects(True), report=_report_checkpoints),
)}


@dataclass
class Row:
    """One scenario's result, as the table shows it."""

    scenario: str
    records_in: int
    out: int
    dead: int
    duplicates: int
    lost: int
    restarts: int | None
    exit_code: int | None
    seconds: float
    calls_per_record: float | None
    notes: str
    verdict: str
    resumed_s: float | None = None
    """Seconds from the fault's end (healed, host restarted) until committed output grew again."""
    order_violations: int | None = None
    """Per-key order violations; None when the job did not ask for ``ordering: per_key``."""

    @classmethod
    def of(cls, name: str, verdict: Verdict, *, restarts: int | None, exit_code: int | None, seconds: float,
           notes: str, resumed_s: float | None = None) -> Row:
        return cls(name, verdict.records_in, verdict.out, verdict.dead, verdict.duplicates, verdict.lost, restarts,
                   exit_code, round(seconds, 1), None if verdict.calls_per_record is None
                   else round(verdict.calls_per_record, 3), notes, "ok" if verdict.ok else "; ".join(verdict.problems()),
                   None if resumed_s is None else round(resumed_s, 1),
                   verdict.order_violations if verdict.ordering == "per_key" else None)


def job_config(estate: Estate, tag: str, **sections: Any) -> dict[str, Any]:
    """The default job (jobs/inference.yaml) on the estate: its brokers, model server and shared
    state directory, fresh topics (2 partitions, replication 3, created here), a checkpoint every 2 s."""
    from udfs.config import config_from_dict, load_config, to_dict

    data = to_dict(load_config())
    data["name"] = f"llmstream-estate-{tag}"
    data["kafka"].update(bootstrap_servers=estate.bootstrap_servers, input_topic=f"{tag}-in",
                         output_topic=f"{tag}-out", dead_letter_topic=f"{tag}-dead", group_id=f"{tag}-group",
                         transactional_id_prefix=f"{tag}-tx", create_topics=False, topic_partitions=2)
    data["model"]["endpoint"] = estate.model.url
    data["async"]["capacity"] = CAPACITY
    data["checkpointing"]["interval_ms"] = CHECKPOINT_INTERVAL_MS
    data["checkpointing"]["directory"] = str(estate.state_root / tag)
    for section, values in sections.items():
        data[section] = {**(data.get(section) or {}), **values} if isinstance(values, dict) else values
    config_from_dict(data)  # refuse a bad config here, not in the submit
    kafka = data["kafka"]
    estate.kafka.create_topics([kafka["input_topic"], kafka["output_topic"], kafka["dead_letter_topic"]],
                               partitions=2)
    return data


def unique_records(n: int, prefix: str) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(n):
        rid = f"{prefix}-{i:06d}"
        out.append((rid.encode(), json.dumps({"id": rid, "prompt": f"Summarise item {i} in one line.",
                                              "params": {"max_tokens": 16}}).encode()))
    return out


def committed_count(bootstrap: str, topic: str) -> int:
    """About how many records of ``topic`` a read_committed reader sees (the last stable offsets
    summed, transaction markers included); -1 while the brokers do not answer."""
    try:
        return sum(kafka_admin.end_offsets(bootstrap, topic, committed_only=True, timeout_s=10).values())
    except Exception:  # noqa: BLE001 - a broker may be down on purpose
        return -1


def submit(config_path: Path, estate: Estate, log_path: Path, *, until_end: bool = True) -> subprocess.Popen[bytes]:
    """``llmstream submit [--until-end]`` as a user runs it, in its own process group."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYFLINK_", "_PYFLINK"))}
    env.update(estate.objects.credentials_env())  # for a job whose state is on the objects host
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "jobs.cli", "submit", "--config", str(config_path), "--jobmanager",
             estate.jobmanager_address, *(["--until-end"] if until_end else [])],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            cwd=jars.repo_root(), env=env)


def wait_for(check: Callable[[], bool], timeout: float, interval: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


def _output_resumed(bootstrap: str, topic: str, process: subprocess.Popen[bytes], timeout: float = 600.0) -> float | None:
    """Seconds from now (a fault just ended) until a read_committed reader sees more output than
    now; None if the run ended first with nothing more to commit, or not within ``timeout``."""
    ended = time.monotonic()
    level = committed_count(bootstrap, topic)
    while time.monotonic() - ended < timeout:
        now = committed_count(bootstrap, topic)
        if level >= 0 and now > level:
            return time.monotonic() - ended
        level = now if level < 0 else level
        if process.poll() is not None:
            return None
        time.sleep(0.5)
    return None


def run_scenario(estate: Estate, scenario: Scenario, *, records: int = RECORDS, timeout: float = 900.0,
                 fraction: float = 0.2) -> tuple[Row, Verdict]:
    """One scenario start to end; the row and the history checker's verdict. The estate is made
    whole first (every host's services running, no partition): an earlier fault may have cost a
    TaskManager (Flink stops one whose writer cannot abort its transaction, see the table)."""
    estate.network.heal_all()
    estate.start()
    tag = f"{scenario.name}-{uuid.uuid4().hex[:6]}"
    directory = estate.work_dir / "runs"
    directory.mkdir(parents=True, exist_ok=True)
    data = job_config(estate, tag, **scenario.config_sections(estate))
    config_path = directory / f"{tag}.yaml"
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    bootstrap = estate.bootstrap_servers
    batch = unique_records(records, tag)
    kafka_admin.produce(bootstrap, data["kafka"]["input_topic"], batch)
    estate.model.configure("/stats/reset", {})
    run = Run(estate, data["name"], config_path, data["kafka"]["output_topic"],
              data["kafka"]["transactional_id_prefix"])
    started = time.monotonic()
    log_path = directory / f"{tag}.log"
    process = submit(config_path, estate, log_path)
    code: int | None = None
    resumed_s: float | None = None
    try:
        def live() -> bool:
            jobs = estate.rest.live_jobs(run.name)
            run.job_id = str(jobs[0]["jid"]) if jobs else run.job_id
            return bool(run.job_id) and estate.rest.job_status(run.job_id) == "RUNNING"

        if not wait_for(lambda: live() or process.poll() is not None, 240):
            raise TimeoutError(f"{scenario.name}: the job was not RUNNING within 240 s (log {log_path})")
        if not run.job_id:
            code = process.wait()
            last = log_path.read_text(errors="replace").strip().splitlines()[-1:]
            run.notes.append(f"submit exited {code} before the job ran, no fault injected: {' '.join(last)}")
        else:
            mid = wait_for(lambda: committed_count(bootstrap, run.output_topic) >= records * fraction
                        or process.poll() is not None, 300)
            if process.poll() is not None or not mid:
                run.notes.append("the fault came late: the run had ended or not reached mid-stream")
            scenario.fault(run)
        if scenario.name == "jm-host-kill":
            # The JobManager took the job with it; the submit's wait fails, so the user submits again.
            process.wait(timeout=120)
            process = submit(config_path, estate, log_path)
        if run.job_id:
            resumed_s = _output_resumed(bootstrap, run.output_topic, process)
        remaining = max(30.0, timeout - (time.monotonic() - started))
        try:
            code = process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            run.notes.append(f"submit --until-end had not ended after {timeout:g} s")
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        if scenario.report and run.job_id:
            scenario.report(run)
        for job in estate.rest.live_jobs(run.name) if estate.rest.overview() else []:
            estate.rest.cancel(str(job["jid"]))
    seconds = time.monotonic() - started
    gone = [name for name, daemon in estate.taskmanagers.items() if not daemon.pids()]
    if gone:
        run.notes.append(f"TaskManager process gone afterwards on {', '.join(gone)}")
    served = estate.model.calls()
    restarts = estate.rest.num_restarts(run.job_id, settle_s=3) if run.job_id else None
    verdict = read_history(bootstrap, run.output_topic, data["kafka"]["dead_letter_topic"],
                           model_calls=served).check([k.decode() for k, _ in batch])
    row = Row.of(scenario.name, verdict, restarts=restarts, exit_code=code, seconds=seconds,
                 notes="; ".join(run.notes), resumed_s=resumed_s)
    log.info("estate: %s: %s", scenario.name, verdict.summary())
    return row, verdict


def render(rows: list[Row]) -> str:
    lines = [("| scenario | in | out | dead | dup | lost | order violations | restarts | output resumed (s after the "
              "fault) | submit exit | s | calls/record | verdict | notes |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        calls = "-" if r.calls_per_record is None else f"{r.calls_per_record:.3f}"
        resumed = "-" if r.resumed_s is None else f"{r.resumed_s:.0f}"
        lines.append(f"| {r.scenario} | {r.records_in} | {r.out} | {r.dead} | {r.duplicates} | {r.lost} "
                     f"| {'-' if r.order_violations is None else r.order_violations} | {'-' if r.restarts is None else r.restarts} | {resumed} "
                     f"| {'-' if r.exit_code is None else r.exit_code} "
                     f"| {r.seconds:.0f} | {calls} | {r.verdict} | {r.notes} |")
    return "\n".join(lines)


def save(rows: list[Row], path: Path) -> None:
    """Add the rows to the JSON results at ``path`` (a scenario's newest row replaces its older one)."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    for row in rows:
        data[row.scenario] = {**asdict(row), "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
