"""`llmstream bench --batch-lane N`: the provider-batch lane (`model.mode: batch`) measured as the
issue asks, on this machine: N records through the lane on a standalone cluster against the
simulator's batch API, with TaskManager kills and a stop-with-savepoint and resubmit (the path of
`llmstream run`'s Ctrl-C and `llmstream upgrade`) while batches are live at the provider.

What it reports (`batch-lane.md` / `.json` in `--out`): every id once? (answered, dead-lettered,
lost, duplicated, read_committed); requests submitted to the provider ÷ records (counted at the
simulator); job restarts; checkpoints completed and their duration p50/p99/max while batches were
pending, the slowest three with when they began, savepoints apart, and the largest checkpoint; the
cost at list prices and at the batch price (`cost` of each output, priced by `model.prices` ×
`provider_batch.price_factor`).

`--inject` adds the provider's bad days: 5% of batched requests fail (500), and one batch each is
expired part-way, failed in validation, deleted and cancelled (`jobs/dev/simulator/batch_faults.py`).
Then every record must still end once, as an output or a dead letter with its reason, and each
request submitted beyond the first per record must be explained: a refused request tried again, an
expired one made again, or the deleted batch made again.

Not in CI: it runs for minutes. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.bench.measure import percentile
from jobs.dev.bench.workload import InputProducer, record_id
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.simulator import spawn
from jobs.dev.simulator.batch_faults import ForcedOutcomes
from udfs.config import load_config, to_dict

PRICES = {"prompt_per_1k": 0.00015, "completion_per_1k": 0.0006}
"""List prices of a small hosted model (per 1,000 tokens), so the report can put a bill on each lane."""

INJECTED_ERROR_RATE = 0.05
"""`--inject`: the share of batched requests the simulator fails with a 500."""
INJECTED_MAX_ATTEMPTS = 3


def _checkpoints(cluster: LocalCluster, job_ids: list[str], seen: dict[tuple[str, int], dict[str, Any]],
                 stop: threading.Event) -> None:
    while not stop.is_set():
        for job_id in list(job_ids):
            with contextlib.suppress(Exception):
                for entry in cluster.checkpoint_stats(job_id).get("history") or []:
                    key = (job_id, int(entry["id"]))
                    if entry.get("status") == "COMPLETED" and key not in seen:
                        if float(entry.get("end_to_end_duration") or 0) > SLOW_CHECKPOINT_MS:
                            entry["where"] = _where(cluster, job_id, int(entry["id"]))
                        seen[key] = entry
        stop.wait(2.0)


SLOW_CHECKPOINT_MS = 1000
"""A checkpoint slower than this is looked into while Flink's history still holds it."""


def _where(cluster: LocalCluster, job_id: str, checkpoint_id: int) -> list[dict[str, Any]]:
    """Where a slow checkpoint spent its time: each task's duration and its subtasks' slowest
    start delay (the barrier's way to the task), alignment, synchronous and asynchronous parts."""
    names = {v["id"]: v["name"] for v in cluster.rest(f"/jobs/{job_id}")["vertices"]}
    details = cluster.rest(f"/jobs/{job_id}/checkpoints/details/{checkpoint_id}")
    found = []
    for vertex, task in (details.get("tasks") or {}).items():
        summary = cluster.rest(f"/jobs/{job_id}/checkpoints/details/{checkpoint_id}/subtasks/{vertex}")["summary"]
        duration = summary.get("checkpoint_duration") or {}
        found.append({"task": names.get(vertex, vertex)[:60], "ms": task.get("end_to_end_duration"),
                      "start_delay_ms": (summary.get("start_delay") or {}).get("max"),
                      "alignment_ms": ((summary.get("alignment") or {}).get("duration") or {}).get("max"),
                      "sync_ms": (duration.get("sync") or {}).get("max"),
                      "async_ms": (duration.get("async") or {}).get("max")})
    return sorted(found, key=lambda t: -float(t["ms"] or 0))


def _checkpoint_figures(seen: dict[tuple[str, int], dict[str, Any]], job_ids: list[str],
                        started_wall_ms: float, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Checkpoints and savepoints apart (a stop-with-savepoint waits for the job to stop, which is
    not what a running job's checkpoint costs), the slowest checkpoints with when they began, and
    the figures again without the first checkpoint after each restore (`events`: the job, by its
    place in `job_ids`, and when the kill or the stop began), which waits for the job to start."""
    def row(key: tuple[str, int], e: dict[str, Any]) -> dict[str, Any]:
        return {"job": job_ids.index(key[0]) + 1, "id": key[1], "type": e.get("checkpoint_type"),
                "at_s": round((float(e.get("trigger_timestamp") or 0) - started_wall_ms) / 1000, 1),
                "ms": float(e["end_to_end_duration"]),
                "bytes": int(e.get("checkpointed_size") or e.get("state_size") or 0), "where": e.get("where")}
    rows = [row(k, e) for k, e in seen.items() if e.get("end_to_end_duration") is not None]
    checkpoints = [r for r in rows if "SAVEPOINT" not in str(r["type"]).upper()]
    durations = sorted(r["ms"] for r in checkpoints)
    firsts = []
    for event in events:
        after = [r for r in checkpoints if r["job"] == event["job"] and r["at_s"] >= event["began_s"]]
        if after:
            firsts.append(min(after, key=lambda r: r["at_s"]))
    steady = sorted(r["ms"] for r in checkpoints if r not in firsts)
    return {"seen": len(durations), "p50_ms": percentile(durations, 50), "p99_ms": percentile(durations, 99),
            "max_ms": durations[-1] if durations else None,
            "after_restore_ms": [r["ms"] for r in firsts],
            "without_first_after_restore": {"seen": len(steady), "p99_ms": percentile(steady, 99),
                                            "max_ms": steady[-1] if steady else None},
            "largest_bytes": max((r["bytes"] for r in rows), default=None),
            "slowest": sorted(checkpoints, key=lambda r: -r["ms"])[:3],
            "savepoints": [r for r in rows if r not in checkpoints]}


def measure(records: int, batch_size: int, delay: str, kills: int, workdir: Path, *, inject: bool = False,
            say: Any = print) -> dict[str, Any]:
    result: dict[str, Any] = {"records": records, "batch_size": batch_size, "batch_delay_s": delay, "kills": kills,
                              "inject": inject}
    with contextlib.ExitStack() as stack:
        broker = local_kafka.LocalBroker(local_kafka.BrokerConfig.ephemeral(workdir / "kafka", heap="512m"))
        broker.start(timeout=120)
        stack.callback(broker.stop)
        sim = spawn(["--latency", "fixed:5", "--concurrency", "256", "--batch-delay-s", delay,
                     "--batch-validating-s", "1", "--batch-finalizing-s", "2", "--stats-interval-s", "0",
                     *(("--batch-error-rate", str(INJECTED_ERROR_RATE), "--batch-error-status", "500")
                       if inject else ())])
        stack.callback(sim.stop)
        cluster = LocalCluster(ClusterConfig.ephemeral(workdir / "flink"))
        cluster.start(taskmanagers=1, timeout=180)
        stack.callback(cluster.stop)
        tag = uuid.uuid4().hex[:8]
        topics = {part: f"batchlane-{part}-{tag}" for part in ("in", "out", "dlq")}
        kafka_admin.create_topics(broker.bootstrap_servers, list(topics.values()), partitions=2)
        data = to_dict(load_config())
        data["name"] = "llmstream-batch-lane"
        data["kafka"].update(bootstrap_servers=broker.bootstrap_servers, input_topic=topics["in"],
                             output_topic=topics["out"], dead_letter_topic=topics["dlq"], group_id=f"bl-{tag}",
                             transactional_id_prefix=f"bl-{tag}", create_topics=False)
        data["model"].update(endpoint=sim.url, model="llmstream-sim", mode="batch", prices=PRICES, max_tokens=64)
        data["provider_batch"] = {"max_requests": batch_size, "max_wait_s": 10, "poll_initial_s": 2, "poll_max_s": 10}
        data["checkpointing"].update(interval_ms=5000, directory=str(workdir / "state"))
        if inject:  # fewer tries than the default 10, so that some refused records end as dead letters
            data["retry"]["max_attempts"] = INJECTED_MAX_ATTEMPTS
        path = workdir / "batch-lane.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        producer = InputProducer(broker.bootstrap_servers, topics["in"], delivery_timeout_s=600)
        stack.callback(producer.close)
        producer.preload(records, timeout_s=600)
        say(f"batch lane: {records:,} records in {topics['in']}; cluster {cluster.rest_url}; simulator {sim.url}")

        job_ids = [cluster.submit(path)]
        cluster.wait_for_job_state(job_ids[-1], "RUNNING", timeout=180)
        seen: dict[tuple[str, int], dict[str, Any]] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=_checkpoints, args=(cluster, job_ids, seen, stop), daemon=True)
        sampler.start()
        started = time.monotonic()
        started_wall_ms = time.time() * 1000
        forced = ForcedOutcomes(sim).start() if inject else None
        if forced is not None:
            stack.callback(forced.stop)

        def batches() -> dict[str, Any]:
            return sim.stats()["batches"]["openai"]  # type: ignore[no-any-return]

        def until(what: str, condition: Any, timeout: float = 900) -> None:
            deadline = time.monotonic() + timeout
            while not condition():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} not within {timeout:.0f} s")
                time.sleep(1)

        events = []
        for k in range(kills):
            target = k + 1
            until(f"{target} batch(es) created", lambda t=target: int(batches()["batches_created"]) >= t)
            say(f"batch lane: {time.monotonic() - started:5.0f}s  TaskManager SIGKILL with "
                f"{batches()['batches_by_status']} at the provider")
            began_s = round(time.monotonic() - started, 1)
            cluster.kill_taskmanager()
            cluster.add_taskmanager(timeout=180)
            cluster.reap_orphans(grace_s=5)
            cluster.wait_for_job_state(job_ids[-1], "RUNNING", timeout=300)
            events.append({"began_s": began_s, "at_s": round(time.monotonic() - started, 1),
                           "kind": "taskmanager-kill", "job": len(job_ids)})
        until("a batch answered", lambda: int(batches()["batches_completed"]) >= 1)
        say(f"batch lane: {time.monotonic() - started:5.0f}s  stop with a savepoint and resubmit, "
            f"{batches()['batches_by_status']} at the provider")
        began_s = round(time.monotonic() - started, 1)
        savepoint = cluster.stop_with_savepoint(job_ids[-1], str(workdir / "savepoints"), timeout=300)
        job_ids.append(cluster.submit(path, savepoint=savepoint))
        cluster.wait_for_job_state(job_ids[-1], "RUNNING", timeout=180)
        events.append({"began_s": began_s, "at_s": round(time.monotonic() - started, 1),
                       "kind": "stop-with-savepoint, resubmit", "job": len(job_ids)})

        out: list[dict[str, Any]] = []
        dead: list[dict[str, Any]] = []
        wanted = {record_id(i) for i in range(records)}

        def read() -> set[str]:
            """What is new on both topics (read_committed, from where the last read stopped), and
            the ids seen so far. End offsets would not do: each transaction adds a marker."""
            for topic, into in (("out", out), ("dlq", dead)):
                into.extend(json.loads(m.value) for m in kafka_admin.consume_committed(
                    broker.bootstrap_servers, topics[topic], timeout_s=60, group_id=f"bl-read-{tag}"))
            return {str(b["id"]) for b in out} | {str(d.get("id")) for d in dead}
        until("every id answered", lambda: wanted <= read(), timeout=1800)
        result["seconds"] = round(time.monotonic() - started, 1)
        time.sleep(12)  # two more checkpoints: a late duplicate would show
        read()
        stop.set()
        sampler.join(10)

        ids = [b["id"] for b in out] + [d.get("id") for d in dead]
        stats = batches()
        batch_cost = sum(float(b.get("cost") or 0.0) for b in out)
        result.update({
            "events": events, "answered": len(out), "dead_lettered": len(dead),
            "dead_letter_reasons": sorted({str(d.get("reason")) for d in dead}),
            "lost": len(wanted - set(ids)), "duplicates": len(ids) - len(set(ids)),
            "requests_submitted": int(stats["requests_submitted"]),
            "submitted_per_record": round(int(stats["requests_submitted"]) / records, 4),
            "batches_created": int(stats["batches_created"]),
            "restarts": sum(cluster.num_restarts(j, settle_s=3.0) for j in job_ids),
            "checkpoints": _checkpoint_figures(seen, job_ids, started_wall_ms, events),
            "cost": {"batch": round(batch_cost, 6), "list_price": round(batch_cost / 0.5, 6)},
        })
        if forced is not None:
            result["injected"] = forced.accounting(stats, [str(d.get("reason")) for d in dead], records)
        with contextlib.suppress(Exception):
            cluster.cancel(job_ids[-1], timeout=60)
    return result


def render(result: dict[str, Any], command: str) -> str:
    c = result["checkpoints"]
    reasons = ", ".join(r for r in result["dead_letter_reasons"] if r) or "none"
    events = ", ".join(f"{e['kind']} at {e['at_s']} s" for e in result["events"])
    largest = f"; the largest {c['largest_bytes']:,} bytes" if c["largest_bytes"] is not None else ""
    lines = [
        "# The provider-batch lane, measured", "", f"`{command}`", "",
        (f"- {result['records']:,} records, batches of at most {result['batch_size']:,}, the simulator's batches "
         f"taking {result['batch_delay_s']} s; {result['seconds']} s from submit to the last id"),
        f"- events while batches were live: {events}",
        (f"- answered {result['answered']:,}, dead-lettered {result['dead_lettered']:,} ({reasons}), "
         f"lost {result['lost']}, duplicated {result['duplicates']}; job restarts {result['restarts']}"),
        (f"- requests submitted to the provider: {result['requests_submitted']:,} in {result['batches_created']} "
         f"batches = **{result['submitted_per_record']:.4f} per record**"),
        (f"- checkpoints while batches were pending: {c['seen']} completed, p50 / p99 / max "
         f"{c['p50_ms']} / {c['p99_ms']} / {c['max_ms']} ms{largest}"),
    ]
    rest = c.get("without_first_after_restore")
    if rest:
        lines.append(f"  - the first checkpoint after each restore: {', '.join(f'{ms:.0f}' for ms in c['after_restore_ms'])} "
                     f"ms; the other {rest['seen']}: p99 / max {rest['p99_ms']} / {rest['max_ms']} ms")
    for slow in c.get("slowest", []):
        lines.append(f"  - checkpoint {slow['id']} of run {slow['job']}: {slow['ms']:.0f} ms, begun at "
                     f"{slow['at_s']} s, {slow['bytes']:,} bytes")
        for task in (slow.get("where") or [])[:2]:
            lines.append(f"    - {task['task']}: {task['ms']} ms (the slowest subtask's start delay "
                         f"{task['start_delay_ms']}, alignment {task['alignment_ms']}, sync {task['sync_ms']}, "
                         f"async {task['async_ms']} ms)")
    for sp in c.get("savepoints", []):
        lines.append(f"  - savepoint {sp['id']} of run {sp['job']} ({sp['type']}): {sp['ms']:.0f} ms at {sp['at_s']} s")
    lines.append(f"- cost of the answers: {result['cost']['batch']:.4f} at the batch price, "
                 f"{result['cost']['list_price']:.4f} at list prices (the realtime lane's price for the same tokens)")
    inj = result.get("injected")
    if inj:
        forced = ", ".join(f"{f['action']} ({f['answered']:,} of {f['requests']:,} answered)" for f in inj["forced"])
        by_reason = ", ".join(f"{r} {n:,}" for r, n in sorted(inj["dead_letter_reasons"].items())) or "none"
        lines += [
            (f"- injected: {INJECTED_ERROR_RATE:.0%} of batched requests refused (500), and forced {forced}"
             f"{'' if inj['all_forced'] else ' (not every action found a batch)'}"),
            f"- dead letters by reason: {by_reason}",
            (f"- requests beyond one a record: {inj['extra_requests']:,}; explained {inj['explained']:,} "
             f"({inj['requests_errored']:,} refused less those dead-lettered, {inj['requests_expired']:,} expired "
             f"unanswered less those dead-lettered, the deleted batch made again less its refusals): "
             f"**unexplained {inj['unexplained']:,}**"),
        ]
    lines.append("")
    return "\n".join(lines)


def targets(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The issue's targets for the lane, each (text, met, detail). Requests ÷ records is a target only
    without `--inject`: with it, the extra requests are to be explained, not absent."""
    c = result["checkpoints"]
    p99 = c["p99_ms"]
    found = [("checkpoints p99 <= 1 s while batches are pending", p99 is not None and p99 <= 1000,
              f"p99 {p99} ms of {c['seen']}")]
    once = result["lost"] == 0 and result["duplicates"] == 0
    found.append(("every id once", once, f"lost {result['lost']}, duplicated {result['duplicates']}"))
    inj = result.get("injected")
    if inj:
        found.append(("every request beyond one a record explained", inj["unexplained"] == 0 and inj["all_forced"],
                      f"unexplained {inj['unexplained']}, every outcome forced: {inj['all_forced']}"))
    else:
        found.append(("requests submitted / records = 1.000", result["submitted_per_record"] == 1.0,
                      f"{result['submitted_per_record']:.4f}"))
    return found


def run(records: int, batch_size: int, delay: str, kills: int, inject: bool, out: Path, command: str,
        say: Any = print) -> int:
    """`llmstream bench --batch-lane N`: measure, write batch-lane.md/json to ``out``, print the
    report and the targets; 0 when every id ended once."""
    with tempfile.TemporaryDirectory(prefix="llmstream-batch-lane-") as scratch:
        result = measure(records, batch_size, delay, kills, Path(scratch), inject=inject, say=say)
    result["targets"] = [{"text": t, "met": met, "detail": d} for t, met, d in targets(result)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch-lane.json").write_text(json.dumps(result, indent=2))
    text = render(result, command) + "".join(
        f"\ntarget (batch lane) {t['text']}: {'met' if t['met'] else 'NOT met'} — {t['detail']}"
        for t in result["targets"])
    (out / "batch-lane.md").write_text(text + "\n")
    say(text)
    return 0 if result["lost"] == 0 and result["duplicates"] == 0 else 1
