"""`python -m jobs.dev.bench.batch_lane`: the provider-batch lane (`model.mode: batch`) measured as the
issue asks, on this machine: N records through the lane on a standalone cluster against the
simulator's batch API, with TaskManager kills and a stop-with-savepoint and resubmit (the path of
`llmstream run`'s Ctrl-C and `llmstream upgrade`) while batches are live at the provider.

What it reports (`batch-lane.md` / `.json` in `--out`): every id once? (answered, dead-lettered,
lost, duplicated, read_committed); requests submitted to the provider ÷ records (counted at the
simulator); job restarts; checkpoints completed and their duration p50/p99/max while batches were
pending, and the largest checkpoint; the cost at list prices and at the batch price (`cost` of each
output, priced by `model.prices` × `provider_batch.price_factor`).

Not in CI: it runs for minutes. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
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
from udfs.config import load_config, to_dict

PRICES = {"prompt_per_1k": 0.00015, "completion_per_1k": 0.0006}
"""List prices of a small hosted model (per 1,000 tokens), so the report can put a bill on each lane."""


def _checkpoints(cluster: LocalCluster, job_ids: list[str], seen: dict[tuple[str, int], dict[str, Any]],
                 stop: threading.Event) -> None:
    while not stop.is_set():
        for job_id in list(job_ids):
            with contextlib.suppress(Exception):
                for entry in cluster.checkpoint_stats(job_id).get("history") or []:
                    if entry.get("status") == "COMPLETED":
                        seen[(job_id, int(entry["id"]))] = entry
        stop.wait(2.0)


def measure(records: int, batch_size: int, delay: str, kills: int, workdir: Path,
            say: Any = print) -> dict[str, Any]:
    result: dict[str, Any] = {"records": records, "batch_size": batch_size, "batch_delay_s": delay, "kills": kills}
    with contextlib.ExitStack() as stack:
        broker = local_kafka.LocalBroker(local_kafka.BrokerConfig.ephemeral(workdir / "kafka", heap="512m"))
        broker.start(timeout=120)
        stack.callback(broker.stop)
        sim = spawn(["--latency", "fixed:5", "--concurrency", "256", "--batch-delay-s", delay,
                     "--batch-validating-s", "1", "--batch-finalizing-s", "2", "--stats-interval-s", "0"])
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
            cluster.kill_taskmanager()
            cluster.add_taskmanager(timeout=180)
            cluster.reap_orphans(grace_s=5)
            cluster.wait_for_job_state(job_ids[-1], "RUNNING", timeout=300)
            events.append({"at_s": round(time.monotonic() - started, 1), "kind": "taskmanager-kill"})
        until("a batch answered", lambda: int(batches()["batches_completed"]) >= 1)
        say(f"batch lane: {time.monotonic() - started:5.0f}s  stop with a savepoint and resubmit, "
            f"{batches()['batches_by_status']} at the provider")
        savepoint = cluster.stop_with_savepoint(job_ids[-1], str(workdir / "savepoints"), timeout=300)
        job_ids.append(cluster.submit(path, savepoint=savepoint))
        cluster.wait_for_job_state(job_ids[-1], "RUNNING", timeout=180)
        events.append({"at_s": round(time.monotonic() - started, 1), "kind": "stop-with-savepoint, resubmit"})

        def committed() -> int:
            """Records committed to both topics, from their end offsets (each transaction adds a
            marker, so this is an upper bound: the count below reads the records themselves)."""
            ends = [kafka_admin.end_offsets(broker.bootstrap_servers, topics[t]) for t in ("out", "dlq")]
            return sum(sum(end.values()) for end in ends)
        until("every id answered", lambda: committed() >= records, timeout=1800)
        result["seconds"] = round(time.monotonic() - started, 1)
        time.sleep(12)  # two more checkpoints: a late duplicate would show
        stop.set()
        sampler.join(10)

        out = [json.loads(m.value) for m in kafka_admin.consume_committed(broker.bootstrap_servers, topics["out"],
                                                                          timeout_s=600)]
        dead = [json.loads(m.value) for m in kafka_admin.consume_committed(broker.bootstrap_servers, topics["dlq"],
                                                                           timeout_s=30)]
        ids = [b["id"] for b in out] + [d.get("id") for d in dead]
        wanted = {record_id(i) for i in range(records)}
        durations = sorted(float(e["end_to_end_duration"]) for e in seen.values()
                           if e.get("end_to_end_duration") is not None)
        sizes = [int(e.get("checkpointed_size") or e.get("state_size") or 0) for e in seen.values()]
        stats = batches()
        batch_cost = sum(float(b.get("cost") or 0.0) for b in out)
        result.update({
            "events": events, "answered": len(out), "dead_lettered": len(dead),
            "dead_letter_reasons": sorted({d.get("reason") for d in dead}),
            "lost": len(wanted - set(ids)), "duplicates": len(ids) - len(set(ids)),
            "requests_submitted": int(stats["requests_submitted"]),
            "submitted_per_record": round(int(stats["requests_submitted"]) / records, 4),
            "batches_created": int(stats["batches_created"]),
            "restarts": sum(cluster.num_restarts(j, settle_s=3.0) for j in job_ids),
            "checkpoints": {"seen": len(durations), "p50_ms": percentile(durations, 50),
                            "p99_ms": percentile(durations, 99), "max_ms": durations[-1] if durations else None,
                            "largest_bytes": max(sizes, default=None)},
            "cost": {"batch": round(batch_cost, 6), "list_price": round(batch_cost / 0.5, 6)},
        })
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
        (f"- cost of the answers: {result['cost']['batch']:.4f} at the batch price, "
         f"{result['cost']['list_price']:.4f} at list prices (the realtime lane's price for the same tokens)"),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=10_000)
    parser.add_argument("--batch-delay-s", default="10:120")
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    command = "python -m jobs.dev.bench.batch_lane " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="llmstream-batch-lane-") as scratch:
        result = measure(args.records, args.batch_size, args.batch_delay_s, args.kills, Path(scratch))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch-lane.json").write_text(json.dumps(result, indent=2))
    text = render(result, command)
    (args.out / "batch-lane.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
