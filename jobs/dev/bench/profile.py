"""`llmstream bench --profile`: where a record's CPU goes, per stage of its path.

While a Flink approach runs steadily (from 15% of its records answered), two samplers watch it
for `window_s`:

- py-spy (PyPI) on the approach's Python processes: the job's driver, which in a local mini cluster
  also runs the Python stage (PyFlink's loopback workers), and any Python child;
- Java Flight Recorder on its JVM (`jcmd JFR.start`, profile settings), read back with `jfr print`.

Each sampled stack is put in one stage by the first rule, in order, that one of its frames
matches (so a JSON parse inside `decode` is decode's, a socket write inside the client is the
client's). A stage's CPU per record is the process's CPU time over the window, times the stage's
share of that process's samples, over the records answered in the window. Samplers see threads
that run code; time in GC or the kernel outside a sampled stack is in the process total and
spread over the stages by their shares.

Writes, next to the bench results: `profile-<scenario>-<approach>.md` (the table),
`…-python.svg` and `…-jvm.svg` (flame graphs drawn here from the collapsed stacks; py-spy's own
SVG needs a second recording, and JFR has none).
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from jobs.dev.bench.measure import process_tree

log = logging.getLogger("llmstream.bench")

PYTHON_STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("decode (JSON/Avro in, request)", ("udfs/records/decode.py", "udfs/inference/prompts.py")),
    ("encode (result record)", ("udfs/records/encode.py",)),
    ("client (HTTP, retries, limits)", ("udfs/inference/client.py", "udfs/inference/transport.py", "udfs/inference/responses.py",
                                        "udfs/inference/batching.py", "udfs/inference/fleet.py", "udfs/inference/ratelimit.py", "udfs/inference/retry.py",
                                        "udfs/cost/cache.py", "udfs/cost/budget.py", "aiohttp/", "yarl/", "multidict/")),
    ("keyed state (PyFlink state over Beam)", ("pyflink/fn_execution/state_impl", "pyflink/fn_execution/internal_state",
                                               "apache_beam/runners/worker/sdk_worker.py:_StateRequest",
                                               "apache_beam/runners/worker/bundle_processor.py:_StateBackedIterable")),
    ("stage (admission, timers, emit)", ("udfs/lanes/keyed.py", "udfs/lanes/inflight.py", "udfs/lanes/ordering.py",
                                         "udfs/records/__init__.py", "udfs/metrics.py", "udfs/records/dead_letter.py")),
    ("Beam crossing (gRPC, coders)", ("apache_beam/", "grpc/", "pyflink/fn_execution/", "google/protobuf/",
                                      "pyflink/common/", "cloudpickle")),
    ("call loop (asyncio)", ("asyncio/", "selectors.py")),
    ("py4j driver and run loop", ("py4j/", "jobs/")),
]
JVM_STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("Kafka source (fetch, records)", ("org.apache.kafka.clients.consumer", "org.apache.flink.connector.kafka.source",
                                       "org.apache.flink.connector.base.source")),
    ("Kafka sink (produce, transactions)", ("org.apache.kafka.clients.producer", "org.apache.flink.connector.kafka.sink",
                                            "org.apache.flink.connector.base.sink")),
    ("Kafka client (network, protocol)", ("org.apache.kafka.",)),
    ("table to stream (SQL rows, key)", ("org.apache.flink.table.", "org.codehaus.janino", "StreamExecCalc",
                                         "SourceConversion", "KeyedStream")),
    ("Python crossing (Beam, gRPC, coders)", ("org.apache.flink.python", "org.apache.flink.streaming.api.runners.python",
                                              "org.apache.flink.streaming.api.operators.python",
                                              "org.apache.flink.fnexecution", "org.apache.beam", "io.grpc",
                                              ".grpc.", "io.netty", ".netty.")),
    ("checkpoints and state", ("org.apache.flink.runtime.checkpoint", "org.apache.flink.runtime.state",
                               "org.apache.flink.state.")),
    ("serialization (Flink types)", ("org.apache.flink.api.common.typeutils", "org.apache.flink.api.java.typeutils",
                                     "org.apache.flink.core.memory")),
    ("task runtime (network, mailbox)", ("org.apache.flink.runtime.io.", "org.apache.flink.streaming.runtime.",
                                         "org.apache.flink.runtime.taskmanager", "org.apache.flink.streaming.api.")),
    ("RPC and metrics (Pekko, REST)", ("org.apache.pekko", "org.apache.flink.runtime.rpc", "org.apache.flink.runtime.rest",
                                       "org.apache.flink.runtime.metrics", "org.apache.flink.metrics")),
]
OTHER = "other"


def classify(frames: Iterable[str], rules: list[tuple[str, tuple[str, ...]]]) -> str:
    """The stage of a stack: the first rule one of whose patterns is in one of its frames."""
    frames = list(frames)
    for stage, patterns in rules:
        if any(pattern in frame for frame in frames for pattern in patterns):
            return stage
    return OTHER


def parse_collapsed(text: str) -> Counter[tuple[str, ...]]:
    """Collapsed stacks ("root;...;leaf count" lines, py-spy's raw format) as a Counter."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def jfr_stacks(recording: Path, jfr_tool: str) -> Counter[tuple[str, ...]]:
    """The execution samples of a JFR recording as collapsed stacks (root first)."""
    proc = subprocess.run([jfr_tool, "print", "--json", "--stack-depth", "64", "--events", "jdk.ExecutionSample",
                           str(recording)], capture_output=True, text=True, timeout=300, check=True)
    stacks: Counter[tuple[str, ...]] = Counter()
    for event in json.loads(proc.stdout).get("recording", {}).get("events", []):
        frames = ((event.get("values") or {}).get("stackTrace") or {}).get("frames") or []
        names = []
        for frame in frames:
            method = frame.get("method") or {}
            owner = ((method.get("type") or {}).get("name") or "?").replace("/", ".")  # JFR's internal form
            names.append(f"{owner}.{method.get('name', '?')}")
        if names:
            stacks[tuple(reversed(names))] += 1
    return stacks


@dataclass
class ProcessProfile:
    """One process's samples over the window, put in stages, and its CPU time over the window."""

    name: str
    cpu_s: float
    stacks: Counter[tuple[str, ...]]
    rules: list[tuple[str, tuple[str, ...]]]
    stages: Counter[str] = field(init=False)

    def __post_init__(self) -> None:
        self.stages = Counter()
        for stack, count in self.stacks.items():
            self.stages[classify(stack, self.rules)] += count

    def per_record_us(self, records: int) -> dict[str, float]:
        total = sum(self.stages.values())
        if not total or records <= 0:
            return {}
        return {stage: self.cpu_s * n / total / records * 1e6 for stage, n in self.stages.most_common()}


@dataclass
class ProfileResult:
    label: str
    window_s: float
    records: int
    processes: list[ProcessProfile]
    files: dict[str, str]

    def table(self) -> str:
        lines = [f"### {self.label}: CPU µs per record, by stage", "",
                 (f"{self.records:,} records answered in {self.window_s:.1f} s of profile "
                  f"({self.records / self.window_s:,.0f}/s)."), "",
                 "| process | stage | share of its samples | µs / record |", "|---|---|---|---|"]
        grand = 0.0
        for proc in self.processes:
            total = sum(proc.stages.values()) or 1
            per = proc.per_record_us(self.records)
            for stage, n in proc.stages.most_common():
                lines.append(f"| {proc.name} | {stage} | {100 * n / total:.1f}% | {per.get(stage, 0):.0f} |")
            cpu_per = proc.cpu_s / self.records * 1e6 if self.records else 0.0
            grand += cpu_per
            lines.append(f"| **{proc.name}** | **all ({sum(proc.stages.values()):,} samples, "
                         f"{proc.cpu_s:.1f} CPU-s)** | 100% | **{cpu_per:.0f}** |")
        lines += [f"| **all** | | | **{grand:.0f}** |", ""]
        lines += [f"- {what}: `{name}`" for what, name in self.files.items()]
        return "\n".join(lines) + "\n"


def flame_svg(stacks: Counter[tuple[str, ...]], title: str, width: int = 1600, row: int = 16) -> str:
    """A flame graph (root at the bottom) of collapsed stacks, with each frame's samples in its tooltip."""
    tree: dict[str, Any] = {"n": 0, "kids": {}}
    for stack, count in stacks.items():
        node = tree
        node["n"] += count
        for frame in stack:
            node = node["kids"].setdefault(frame, {"n": 0, "kids": {}})
            node["n"] += count
    total = tree["n"] or 1
    depth_of: list[int] = [0]

    def depth(node: dict[str, Any], d: int) -> None:
        depth_of[0] = max(depth_of[0], d)
        for kid in node["kids"].values():
            depth(kid, d + 1)

    depth(tree, 0)
    height = (depth_of[0] + 2) * row + 30
    rects: list[str] = []

    def draw(node: dict[str, Any], name: str, x: float, d: int) -> None:
        w = node["n"] / total * width
        if w < 0.3:
            return
        y = height - (d + 1) * row
        hue = 20 + (hash(name.split("(")[0]) % 40)
        label = html.escape(name)
        text = html.escape(name[: int(w / 7)]) if w > 30 else ""
        rects.append(f'<g><title>{label} ({node["n"]:,} samples, {100 * node["n"] / total:.1f}%)</title>'
                     f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" fill="hsl({hue},80%,60%)"/>'
                     f'<text x="{x + 2:.1f}" y="{y + row - 4}" font-size="11">{text}</text></g>')
        kx = x
        for kid_name, kid in sorted(node["kids"].items()):
            draw(kid, kid_name, kx, d + 1)
            kx += kid["n"] / total * width

    x = 0.0
    for name, kid in sorted(tree["kids"].items()):
        draw(kid, name, x, 0)
        x += kid["n"] / total * width
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace">'
            f'<text x="4" y="16" font-size="14">{html.escape(title)} ({total:,} samples)</text>'
            + "".join(rects) + "</svg>\n")


JFR_SETTINGS = """<?xml version="1.0" encoding="UTF-8"?>
<configuration version="2.0" label="llmstream bench" description="Java execution samples every 2 ms">
  <event name="jdk.ExecutionSample"><setting name="enabled">true</setting><setting name="period">2 ms</setting></event>
</configuration>
"""
"""Only execution samples, five times as often as JFR's `profile` settings take them (every 10 ms, and
only of threads running Java): at that rate a 10 s window of a mini cluster gives too few samples
for a table (docs/performance.md, "Where a record's CPU goes")."""


def _tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def jdk_tool(java: psutil.Process, name: str) -> str | None:
    """`jcmd` or `jfr` of the JDK the profiled JVM runs on (beside its `java`), else the PATH's: a
    JDK's jcmd attaches to its own version's JVMs, and the machine may have several (17 and 25 here)."""
    with contextlib.suppress(psutil.Error, OSError):
        here = Path(java.exe()).resolve().parent / name
        if here.exists():
            return str(here)
    return shutil.which(name)


class RecordPathProfiler(threading.Thread):
    """Profiles the approach under `root_pid` once `answered()` reaches `start_at`, for `window_s`."""

    def __init__(self, root_pid: int, answered: Callable[[], int], start_at: int, out_dir: Path, work_dir: Path,
                 label: str, say: Callable[[str], None], window_s: float = 10.0) -> None:
        super().__init__(name="bench-profile", daemon=True)
        self.root_pid, self.answered, self.start_at = root_pid, answered, start_at
        self.out_dir, self.work_dir, self.label, self.say, self.window_s = out_dir, work_dir, label, say, window_s
        self.result: ProfileResult | None = None
        self.error: str | None = None
        self._ended = threading.Event()

    def stop(self) -> None:
        self._ended.set()

    def run(self) -> None:
        try:
            self._profile()
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
            log.warning("profile of %s failed", self.label, exc_info=True)

    def _profile(self) -> None:
        while self.answered() < self.start_at:
            if self._ended.wait(0.25):
                self.error = f"the run ended before {self.start_at:,} records were answered"
                return
        tree = process_tree(psutil.Process(self.root_pid))
        pythons = [p for p in tree if "python" in p.name()]
        javas = [p for p in tree if p.name() == "java"]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"profile-{self.label}"
        raw = self.work_dir / f"profile-{self.label}"  # the recordings: megabytes, left with the work dir
        py_spy = _tool("py-spy")
        jcmds = {p.pid: jdk_tool(p, "jcmd") for p in javas}
        jfr = jdk_tool(javas[0], "jfr") if javas else None
        if py_spy is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy)")
        cpu_before = {p.pid: sum(p.cpu_times()[:2]) for p in pythons + javas}
        seen_before, started = self.answered(), time.monotonic()
        spies = [subprocess.Popen([py_spy, "record", "-p", str(p.pid), "-d", f"{self.window_s:g}", "-r", "200",
                                   "--nonblocking", "--format", "raw", "-o", f"{raw}-python-{p.pid}.txt"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for p in pythons]
        recordings: dict[int, Path] = {}
        if javas and (jfr is None or None in jcmds.values()):
            self.say(f"[{self.label}] profile: no jcmd/jfr beside its java nor on PATH; the JVM is not profiled")
            javas = []
        settings = Path(f"{raw}.jfc")
        settings.write_text(JFR_SETTINGS)
        for p in javas:
            recordings[p.pid] = Path(f"{raw}-jvm-{p.pid}.jfr")
            subprocess.run([str(jcmds[p.pid]), str(p.pid), "JFR.start", f"name=bench-{self.label}", f"settings={settings}"],
                           capture_output=True, timeout=60, check=True)
        self._ended.wait(self.window_s)
        for p in javas:
            subprocess.run([str(jcmds[p.pid]), str(p.pid), "JFR.stop", f"name=bench-{self.label}",
                            f"filename={recordings[p.pid]}"], capture_output=True, timeout=120, check=True)
        window = time.monotonic() - started
        records = self.answered() - seen_before
        cpu = {}
        for p in pythons + javas:
            with contextlib.suppress(psutil.Error):
                cpu[p.pid] = sum(p.cpu_times()[:2]) - cpu_before[p.pid]
        for spy in spies:
            _, err = spy.communicate(timeout=self.window_s + 60)
            if spy.returncode:
                raise RuntimeError(f"py-spy failed: {err.strip()[-300:]}")
        processes: list[ProcessProfile] = []
        files: dict[str, str] = {}
        python_stacks: Counter[tuple[str, ...]] = Counter()
        for p in pythons:
            stacks = parse_collapsed(Path(f"{raw}-python-{p.pid}.txt").read_text())
            python_stacks.update(stacks)
            processes.append(ProcessProfile(f"python {p.pid}", cpu.get(p.pid, 0.0), stacks, PYTHON_STAGES))
        jvm_stacks: Counter[tuple[str, ...]] = Counter()
        for pid, recording in recordings.items():
            stacks = jfr_stacks(recording, str(jfr))
            jvm_stacks.update(stacks)
            processes.append(ProcessProfile(f"JVM {pid}", cpu.get(pid, 0.0), stacks, JVM_STAGES))
        for kind, stacks in (("python", python_stacks), ("jvm", jvm_stacks)):
            if stacks:
                path = Path(f"{stem}-{kind}.svg")
                path.write_text(flame_svg(stacks, f"{self.label}: {kind}"))
                files[f"{kind} flame graph"] = path.name
        self.result = ProfileResult(self.label, window, records, processes, files)
        table = Path(f"{stem}.md")
        table.write_text(self.result.table())
        self.say(f"[{self.label}] profile: {records:,} records in {window:.1f} s; table in {table}")
