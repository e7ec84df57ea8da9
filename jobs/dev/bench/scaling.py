"""Does `llmstream scale --auto` scale by the model's headroom? Two cases on a standalone cluster with
the adaptive scheduler, input growing the whole run:

- ``model-bound``: the simulator answers 429 above 4 calls at once (fixed 100 ms: 40/s), the job
  may keep 16 in flight. The lag grows, the AIMD limit falls: the verdict is model-bound and the
  policy should scale up 0 times.
- ``pipeline-bound``: the simulator takes any number of calls (fixed 100 ms), the job keeps 4 in
  flight a subtask (40/s each). The lag grows while the model shows no strain: the policy should
  scale up.

    python -m jobs.dev.bench.scaling [--case model-bound|pipeline-bound|both] [--seconds 240]

Each case starts its own broker, simulator and cluster in a temporary directory, submits the job
with `llmstream submit`, runs `llmstream scale --auto --min 1 --max 3` beside it and prints, per
case, the scale-ups, the verdicts it saw and the parallelism at the end (docs/tuning.md, "Scaling").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jobs.clients import kafka_admin
from jobs.dev import simulator
from jobs.dev.bench.harness import child_environment
from jobs.dev.bench.workload import InputProducer
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.local_kafka import BrokerConfig, LocalBroker
from udfs.config import config_from_dict, load_config, to_dict, with_overrides

ADAPTIVE = {"jobmanager.scheduler": "adaptive", "taskmanager.numberOfTaskSlots": 4,
            "jobmanager.adaptive-scheduler.executing.cooldown-after-rescaling": "5 s"}


@dataclass(frozen=True)
class Case:
    key: str
    simulator_args: tuple[str, ...]
    capacity: int
    start_per_s: float
    end_per_s: float
    expect: str


CASES = {
    "model-bound": Case("model-bound", ("--latency", "fixed:100", "--concurrency", "4", "--reject-over-limit"),
                        capacity=16, start_per_s=20, end_per_s=120, expect="0 scale-ups"),
    "pipeline-bound": Case("pipeline-bound", ("--latency", "fixed:100"), capacity=4, start_per_s=20,
                           end_per_s=100, expect="scale-ups"),
}


class Ramp(threading.Thread):
    """Input at a rate growing linearly from `start` to `end` records a second over `seconds`, then
    `hold_s` more at `end`."""

    def __init__(self, producer: InputProducer, start: float, end: float, seconds: float, hold_s: float = 0.0) -> None:
        super().__init__(daemon=True, name="scaling-ramp")
        self.producer, self.start_rate, self.end_rate, self.seconds = producer, start, end, seconds
        self.hold_s = hold_s
        self._halt = threading.Event()
        self._began: float | None = None

    def due(self, t: float) -> int:
        """Records due `t` seconds after the start."""
        ramp = min(t, self.seconds)
        count = self.start_rate * ramp + (self.end_rate - self.start_rate) * ramp * ramp / (2 * self.seconds)
        return int(count + self.end_rate * max(0.0, min(t, self.seconds + self.hold_s) - self.seconds))

    def rate_now(self) -> float:
        """The input rate now, records a second."""
        if self._began is None:
            return self.start_rate
        t = time.monotonic() - self._began
        if t >= self.seconds:
            return self.end_rate if t <= self.seconds + self.hold_s else 0.0
        return self.start_rate + (self.end_rate - self.start_rate) * t / self.seconds

    def run(self) -> None:
        self._began = began = time.monotonic()
        while not self._halt.wait(0.1):
            t = time.monotonic() - began
            due = self.due(t)
            if due > self.producer.produced:
                self.producer.send(due - self.producer.produced)
            if t >= self.seconds + self.hold_s:
                break
        self.producer.settle()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=60)


@dataclass
class CaseResult:
    """What `llmstream scale --auto` did in one case: its scale-ups and -downs, the inference
    vertex's parallelism at the end, how often it saw each kind of verdict, the records produced
    and its decision lines."""

    case: str
    scale_ups: int = 0
    scale_downs: int = 0
    final_parallelism: int = 1
    verdicts: dict[str, int] = field(default_factory=dict)
    produced: int = 0
    lines: list[str] = field(default_factory=list)


def job_config_data(work: Path, bootstrap: str, tag: str, *, model: dict[str, Any], capacity: int,
                    inference: int = 1, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The validated job config (as a dict) for `tag`: topics named after it, `model` keys, `capacity`
    calls in flight a subtask, `inference` subtasks (`parallelism.inference`, whose buckets the keyed
    lane spreads records over), checkpoints every 2 s into `work`; `extra`: more sections, as
    `with_overrides` takes them."""
    topics = {"input_topic": f"{tag}-in", "output_topic": f"{tag}-out", "dead_letter_topic": f"{tag}-dead"}
    config = with_overrides(
        load_config(),
        kafka={"bootstrap_servers": bootstrap, **topics, "group_id": f"{tag}-group",
               "transactional_id_prefix": f"{tag}-tx", "create_topics": False, "topic_partitions": 2},
        model=model, async_={"capacity": capacity}, parallelism={"inference": inference},
        checkpointing={"interval_ms": 2000, "directory": str(work / "state" / tag)},
        **(extra or {}),
    )
    data = to_dict(config)
    data["name"] = f"llmstream-{tag}"
    config_from_dict(data)
    return data


def job_config(work: Path, bootstrap: str, tag: str, *, model: dict[str, Any], capacity: int,
               inference: int = 1, extra: dict[str, Any] | None = None) -> Path:
    """`job_config_data` written to `work`/<tag>.yaml, its three topics created (2 partitions)."""
    data = job_config_data(work, bootstrap, tag, model=model, capacity=capacity, inference=inference, extra=extra)
    kafka = data["kafka"]
    kafka_admin.create_topics(bootstrap, [kafka["input_topic"], kafka["output_topic"], kafka["dead_letter_topic"]],
                              partitions=2)
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _config(work: Path, bootstrap: str, endpoint: str, case: Case) -> Path:
    return job_config(work, bootstrap, f"scaling-{case.key}-{int(time.time())}", model={"endpoint": endpoint},
                      capacity=case.capacity)


def run_case(case: Case, seconds: float, say: Any = print) -> CaseResult:
    result = CaseResult(case.key)
    env = child_environment()
    llmstream = [sys.executable, "-m", "jobs.cli"]
    with tempfile.TemporaryDirectory(prefix=f"llmstream-scaling-{case.key}-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        broker = LocalBroker(BrokerConfig.ephemeral(work / "kafka", heap="512m"))
        broker.start(timeout=180)
        stack.callback(broker.stop)
        sim = simulator.spawn(list(case.simulator_args))
        stack.callback(sim.stop)
        cluster = LocalCluster(ClusterConfig.ephemeral(work / "flink", settings=ADAPTIVE))
        cluster.start(taskmanagers=1, timeout=180)
        stack.callback(cluster.stop)
        path = _config(work, broker.bootstrap_servers, sim.url, case)
        say(f"[{case.key}] submitting")
        subprocess.run([*llmstream, "submit", "--config", str(path), "--jobmanager", cluster.address], env=env,
                       check=True, capture_output=True, text=True, timeout=600)
        [job] = cluster.live_jobs(yaml.safe_load(path.read_text())["name"])
        cluster.wait_for_job_state(str(job["jid"]), "RUNNING", timeout=300)
        producer = InputProducer(broker.bootstrap_servers, yaml.safe_load(path.read_text())["kafka"]["input_topic"])
        stack.callback(producer.close)
        ramp = Ramp(producer, case.start_per_s, case.end_per_s, seconds)
        auto = subprocess.Popen([*llmstream, "scale", "--config", str(path), "--jobmanager", cluster.address,
                                 "--auto", "--min", "1", "--max", "3", "--cooldown", "30", "--every", "10"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=_read, args=(auto, result, say, case.key), daemon=True)
        reader.start()
        ramp.start()
        say(f"[{case.key}] input from {case.start_per_s:g} to {case.end_per_s:g}/s over {seconds:g} s")
        ramp.join(timeout=seconds + 120)
        auto.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            auto.wait(timeout=30)
        if auto.poll() is None:
            auto.kill()
        reader.join(timeout=10)
        result.produced = producer.produced
        result.final_parallelism = next(p for name, p in cluster.vertex_parallelism(str(job["jid"])).items()
                                        if name.startswith("inference"))
        cluster.cancel(str(job["jid"]))
    return result


@dataclass(frozen=True)
class AutoLine:
    """One decision line of `llmstream scale --auto`: the subtasks it saw, the verdict's kind and
    the new count it chose (None: hold)."""

    current: int
    kind: str
    target: int | None


def parse_auto_line(line: str) -> AutoLine | None:
    """`llmstream: 1 subtasks: more subtasks would help: ...; -> 3 (...)` as an `AutoLine`; None for
    any other line (the start banner, an `apply` progress line)."""
    body = line.rstrip().removeprefix("llmstream: ")
    head, _, rest = body.partition(" subtasks: ")
    if not head.isdigit() or not rest:
        return None
    kind = ("model-bound" if "the model is the limit" in rest else "input-bound" if "input is the limit" in rest
            else "pipeline-bound" if ": yes" in rest else "unknown")
    # The decision is "; -> N (why)" or "; hold (why)", and a hold's why may quote an earlier "2 -> 3".
    change = re.search(r"; -> (\d+) \(", rest)
    target = int(change.group(1)) if change else None
    return AutoLine(int(head), kind, target)


def _read(process: subprocess.Popen[str], result: CaseResult, say: Any, key: str) -> None:
    assert process.stdout is not None
    for raw in process.stdout:
        line = raw.rstrip()
        if not line.startswith("llmstream: ") or "deprecated" in line:
            continue
        result.lines.append(line)
        say(f"[{key}] {line}")
        parsed = parse_auto_line(line)
        if parsed is None:
            continue
        result.verdicts[parsed.kind] = result.verdicts.get(parsed.kind, 0) + 1
        if parsed.target is not None:
            if parsed.target > parsed.current:
                result.scale_ups += 1
            else:
                result.scale_downs += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=[*CASES, "both"], default="both")
    parser.add_argument("--seconds", type=float, default=240.0, help="how long the input grows (default 240)")
    args = parser.parse_args(argv)
    cases = list(CASES.values()) if args.case == "both" else [CASES[args.case]]
    results = [run_case(case, args.seconds) for case in cases]
    print("\n| case | expected | scale-ups | scale-downs | inference subtasks at the end | verdict lines | records in |")
    print("|---|---|---|---|---|---|---|")
    for case, result in zip(cases, results, strict=True):
        print(f"| {case.key} | {case.expect} | {result.scale_ups} | {result.scale_downs} | {result.final_parallelism} | "
              f"{json.dumps(result.verdicts)} | {result.produced:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
