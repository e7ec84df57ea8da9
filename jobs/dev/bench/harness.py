"""One approach on one scenario: fresh topics, the same input, a process of its own, measured.

Each run gets its own input, output and dead-letter topics and consumer group, so runs
never see each other's records. The approach runs in a child process (its own session,
so its whole tree can be sampled and, at the end, cleaned up): the baselines as
`python -m jobs.dev.bench.baselines`, llmstream as `llmstream run --config <generated yaml>`,
exactly what a user runs, and Flink's own SQL `ML_PREDICT` as `python -m jobs.dev.bench.ml_predict`.
Every child runs this checkout's code: its working directory and the head of its `PYTHONPATH`
are the repository root (`REPO_ROOT`), and llmstream starts as `python -m jobs.cli`, not through
an installed `llmstream` script, which may belong to another checkout or to none. Meanwhile a read_committed observer, an RSS sampler and a
simulator-stats sampler watch from this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
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
from jobs.dev import local_kafka
from jobs.dev.bench.measure import (
    CheckpointSampler,
    DeliveryTally,
    Latencies,
    Observer,
    RssSampler,
    ServerSampler,
    steady_window,
    tally_delivery,
)
from jobs.dev.bench.ml_predict import FLOORS, ML_PREDICT, SQL_JOBS
from jobs.dev.bench.profile import RecordPathProfiler
from jobs.dev.bench.scenarios import (
    PER_KEY,
    UNBATCHED,
    VECTORIZED,
    VECTORIZED_BATCH,
    VECTORIZED_FLOOR,
    Scenario,
)
from jobs.dev.bench.vectorized_floor import batch_stats
from jobs.dev.bench.workload import (
    MAX_TOKENS,
    MODEL,
    SYSTEM_PROMPT,
    InputProducer,
    PacedProducer,
)
from udfs.config import (
    CheckpointConfig,
    PythonConfig,
    config_from_dict,
    load_config,
    to_dict,
    with_overrides,
)
from udfs.errors import LLMStreamError

APPROACHES = ("sequential", "semaphore-gather", "llmstream", VECTORIZED, ML_PREDICT, VECTORIZED_FLOOR)
"""The approaches a bench runs unless told otherwise: the seed's two consumers, both lanes, Flink's own,
and the vectorized lane's floor with the model call (in the scenarios it is for, `Scenario.approaches`)."""
ALL_APPROACHES = (*APPROACHES, *FLOORS)
REPO_ROOT = Path(__file__).resolve().parents[3]
"""The checkout this file is in (jobs/dev/bench/harness.py: three folders up)."""
STOP_GRACE_S = 45.0
"""How long an approach may take to stop after SIGTERM (llmstream cancels its job) before SIGKILL."""
CATCH_UP_S = 20.0
"""How long the observer may take, after the approach exits, to read what it committed."""


class BenchError(LLMStreamError, RuntimeError):
    """A benchmark run could not be carried out; the message says which step failed."""


CAPACITY_PER_SLOT = 4
"""`async.capacity` per server slot in the bench's llmstream runs (`LlmstreamSettings.recommended`)."""


@dataclass(frozen=True)
class LlmstreamSettings:
    """The knobs the benchmark tunes; `recommended` derives them as the README recommends.

    Only capacity depends on the scenario. The inference stage keeps calls in flight across
    bundles and checkpoints, so the bundle and checkpoint settings are the job config's
    defaults (`udfs/config/sections.py`): the benchmark measures the default config.
    """

    capacity: int = 128
    bundle_size: int = PythonConfig.bundle_size
    bundle_time_ms: int = PythonConfig.bundle_time_ms
    bundle_target_ms: int = PythonConfig.bundle_target_ms
    checkpoint_interval_ms: int = CheckpointConfig.interval_ms
    checkpoint_timeout_ms: int = CheckpointConfig.timeout_ms
    parallelism: int = 1
    cache: int = 0
    """1: the result cache on (`cache.backend: local`, requests at temperature 0 so they are
    cacheable); 0: `cache.backend: none`. Ids are unique, so every lookup misses: what it
    measures is the cache's cost per record."""
    vectorized_batch_size: int = VECTORIZED_BATCH
    """The vectorized lane's `vectorized.batch_size` (its runs only)."""
    flink: tuple[tuple[str, str], ...] = ()
    """Flink options for the job config's `flink:` section (`--flink KEY=VALUE`), to measure a
    Flink setting without a new flag for each."""

    @classmethod
    def recommended(cls, scenario: Scenario, parallelism: int = 1) -> LlmstreamSettings:
        """capacity: four times the server's slots per subtask; everything else: the defaults.

        Capacity counts a record from admission until its answer is emitted, not only while its
        call is at the server: with 50 ms calls, twice the slots left the server 13% idle ((a):
        87% of bare aiohttp), four times kept it busy (92–93%; docs/tuning.md)."""
        slots = scenario.concurrency if scenario.limit_per_s else 64
        capacity = scenario.capacity or max(16, CAPACITY_PER_SLOT * math.ceil(slots / parallelism))
        return cls(capacity=capacity, parallelism=parallelism)

    def describe(self) -> str:
        bundle = (f"bundle {self.bundle_size} records / {self.bundle_time_ms} ms" if not self.bundle_target_ms else
                  f"bundle about {self.bundle_target_ms} ms of records (at most {self.bundle_size} / {self.bundle_time_ms} ms)")
        return (f"capacity {self.capacity}, {bundle}, "
                f"checkpoint every {self.checkpoint_interval_ms} ms (timeout {self.checkpoint_timeout_ms // 1000} s), "
                f"parallelism {self.parallelism}" + (", result cache on (temperature 0)" if self.cache else "")
                + (f", vectorized batches of {self.vectorized_batch_size}"
                   if self.vectorized_batch_size != VECTORIZED_BATCH else "")
                + "".join(f", {key}={value}" for key, value in self.flink))


@dataclass
class RunResult:
    """Everything measured for one approach on one scenario (what `latest.json` holds)."""

    scenario: str
    scenario_name: str
    approach: str
    limit_per_s: float | None
    records_in: int
    elapsed_s: float
    stopped_by: str
    exit_code: int | None
    outcome: DeliveryTally  # named so in every stored result (`report.load` reads it back)
    throughput_steady: float | None
    steady_window_s: float | None
    throughput_overall: float | None
    pct_of_limit: float | None
    e2e_ms: Latencies
    pickup_ms: Latencies
    commit_lag_ms: Latencies
    utilization: float | None
    rss_peak_mb: dict[str, float | None]
    rss_breakdown_mb: dict[str, float]
    rss_drift_mb: float | None
    rss_series: list[tuple[float, float]]
    server: dict[str, Any]
    settings: dict[str, Any] | None
    load_avg: tuple[float, float, float]
    log_file: str
    notes: list[str] = field(default_factory=list)
    checkpoints: dict[str, Any] | None = None
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    cpu_ms_per_record: float | None = None
    """CPU ms of the approach's whole process tree (llmstream: JVM and Python) per record, steady window."""
    batches: dict[str, Any] | None = None
    """`vectorized-floor` only: its Arrow batches as its function saw them (rows a batch, the gap
    between returning one batch and being handed the next, time inside Python a batch; ms)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BenchContext:
    """What every run of one benchmark invocation shares."""

    broker: local_kafka.LocalBroker
    workdir: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    """Settings given on the command line: ints by `LlmstreamSettings` field, and `flink`, a dict."""
    say: Callable[[str], None] = print
    progress_every_s: float = 5.0
    profile_dir: Path | None = None
    """`--profile`: profile each Flink run (`jobs/dev/bench/profile.py`) and write its table here."""
    smoke: bool = False
    """`--smoke`: the Flink approaches' JVMs start as `smoke_jvm_args` says (the smoke measures nothing)."""

    def settings_for(self, scenario: Scenario, approach: str = "llmstream") -> LlmstreamSettings:
        """The recommended settings for `scenario`, with any given on the command line instead.
        `UNBATCHED` runs at the capacity recommended without the scenario's batching capacity
        (one request per record needs no more)."""
        if approach == UNBATCHED:
            scenario = dataclasses.replace(scenario, capacity=None)
        recommended = LlmstreamSettings.recommended(scenario, self.overrides.get("parallelism", 1))
        given: dict[str, Any] = {name: tuple(sorted(value.items())) if name == "flink" else value
                                 for name, value in self.overrides.items()}
        return dataclasses.replace(recommended, **given)


@dataclass(frozen=True)
class Topics:
    input: str
    output: str
    dead_letter: str
    group: str

    @classmethod
    def fresh(cls, scenario: Scenario, approach: str) -> Topics:
        tag = f"{scenario.key}-{approach}-{uuid.uuid4().hex[:8]}"
        return cls(f"bench-in-{tag}", f"bench-out-{tag}", f"bench-dlq-{tag}", f"bench-{tag}")


def llmstream_config(topics: Topics, bootstrap: str, endpoint: str, settings: LlmstreamSettings,
                     scenario: Scenario, state_root: Path, *, batched: bool = True,
                     per_key: bool = False, vectorized: bool = False) -> dict[str, Any]:
    """The job config for one run: the repo's defaults, these topics and the tuned settings;
    an embeddings scenario batches up to `scenario.batch_size` inputs per request if `batched`;
    `per_key`: `ordering: per_key` (the `PER_KEY` run of a keyed scenario); `vectorized`:
    `lane: vectorized` (the `VECTORIZED` run), its subtasks at `parallelism.default`."""
    model: dict[str, Any] = {"endpoint": endpoint, "model": MODEL, "system_prompt": SYSTEM_PROMPT,
                             "max_tokens": MAX_TOKENS}
    if scenario.api == "embeddings":
        model = {"endpoint": endpoint, "model": MODEL, "api": "embeddings",
                 "batch": {"max_size": scenario.batch_size if batched else 1}}
    if scenario.fleet:
        model.update(scenario.fleet_model(endpoint))
    config = with_overrides(
        load_config(),
        kafka={"bootstrap_servers": bootstrap, "input_topic": topics.input, "output_topic": topics.output,
               "dead_letter_topic": topics.dead_letter, "group_id": topics.group,
               "transactional_id_prefix": topics.group, "create_topics": False, "topic_partitions": 1},
        model=model,
        async_={"capacity": settings.capacity},
        python={"bundle_size": settings.bundle_size, "bundle_time_ms": settings.bundle_time_ms,
                "bundle_target_ms": settings.bundle_target_ms},
        checkpointing={"interval_ms": settings.checkpoint_interval_ms, "timeout_ms": settings.checkpoint_timeout_ms},
        parallelism={"default": 1, "source": 1, "inference": settings.parallelism, "sink": 1},
        cache={"backend": "local" if settings.cache else "none"},
    )
    if settings.cache:
        config = with_overrides(config, model={"temperature": 0})
    data = to_dict(config)
    data["name"] = f"llmstream-bench-{scenario.key}"
    if per_key:
        data["ordering"] = "per_key"
    if vectorized:
        data.pop("stage", None)  # the old name of `lane`: a config may give only one of them
        data["lane"] = "vectorized"
        data["vectorized"] = {"batch_size": settings.vectorized_batch_size}
        data["parallelism"] = {**data["parallelism"], "default": settings.parallelism, "inference": None}
        data["python"] = {**data["python"], "bundle_target_ms": 0}
    if settings.flink:
        data["flink"] = {**data.get("flink", {}), **dict(settings.flink)}
    # One state directory per run: every run reads fresh topics, so no state carries over.
    data["checkpointing"]["directory"] = str(state_root / topics.group)
    config_from_dict(data)  # validate the final form, name included
    return data


def is_flink(approach: str) -> bool:
    """A Flink job in a mini cluster (llmstream, ml-predict): the harness stops it at the time
    limit, and its checkpoints are sampled from the mini cluster's REST API."""
    return approach.startswith("llmstream") or approach in (*SQL_JOBS, VECTORIZED_FLOOR)


SMOKE_JIT = "-XX:TieredStopAtLevel=1"
"""The smoke's Flink JVMs compile with C1 only, as `llmstream submit`'s client JVM does
(docs/performance.md, "Job start"): a run of 100 records ends before C2's compiles of Flink's
start-up code pay back, and on the 2 loaded cores of `make test` their CPU is the run's time."""


def smoke_jvm_args(approach: str) -> str:
    """`JVM_ARGS` for a Flink approach's JVM in the smoke: `SMOKE_JIT`, and for the jobs started
    without `llmstream run` (`SQL_JOBS`, `VECTORIZED_FLOOR`) the class archive `llmstream run`
    keeps for this JVM and classpath (`jobs/runtime/jvm_archive.py`), if there is one that loads:
    each of them otherwise loads and verifies Flink's classes from the jars again. Only mapped,
    never made here: making one is `llmstream run`'s (it shuts its JVM down to write it), and an
    archive of another classpath the JVM ignores."""
    from jobs.runtime.jvm_archive import GatewayArchive

    options = [*os.environ.get("JVM_ARGS", "").split(), SMOKE_JIT]
    if approach in (*SQL_JOBS, VECTORIZED_FLOOR):
        archive = GatewayArchive.find(child_environment())
        if archive is not None and archive.path.exists() and archive.usable(archive.path):
            options += [f"-XX:SharedArchiveFile={archive.path}", "-Xlog:cds*=off"]
    return " ".join(options)


def child_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: this checkout first on `PYTHONPATH`, and
    `LLMSTREAM_HOME` (where `jobs.runtime.jars` finds `pom-free/`) pointing at it."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["LLMSTREAM_HOME"] = str(REPO_ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _llmstream_command() -> list[str]:
    """`llmstream` from this checkout: the module, not whatever script the venv has installed."""
    return [sys.executable, "-m", "jobs.cli"]


def approach_command(approach: str, topics: Topics, ctx: BenchContext, endpoint: str, scenario: Scenario,
                     records: int, max_seconds: float, config_dir: Path) -> list[str]:
    bootstrap = ctx.broker.bootstrap_servers
    if approach == VECTORIZED_FLOOR:
        # The lane's own job config (its topics, batch and bundle, capacity, checkpoints, `--flink`):
        # only the function differs (`jobs/dev/bench/vectorized_floor.py`).
        config_file = config_dir / f"{topics.group}.yaml"
        config_file.write_text(yaml.safe_dump(
            llmstream_config(topics, bootstrap, endpoint, ctx.settings_for(scenario, VECTORIZED), scenario,
                             config_dir / "state", vectorized=True),
            sort_keys=False))
        command = [sys.executable, "-m", "jobs.dev.bench.vectorized_floor", "--config", str(config_file)]
        return command if scenario.overload_factor else [*command, "--bounded"]
    if approach.startswith("llmstream"):
        config_file = config_dir / f"{topics.group}.yaml"
        config_file.write_text(yaml.safe_dump(
            llmstream_config(topics, bootstrap, endpoint, ctx.settings_for(scenario, approach), scenario,
                             config_dir / "state",
                             batched=approach != UNBATCHED, per_key=approach == PER_KEY,
                             vectorized=approach == VECTORIZED),
            sort_keys=False))
        command = [*_llmstream_command(), "run", "--config", str(config_file), "--progress-every", "5"]
        return command if scenario.overload_factor else [*command, "--until-end"]
    if approach in SQL_JOBS:
        interval = ctx.overrides.get("checkpoint_interval_ms", CheckpointConfig.interval_ms)
        command = [sys.executable, "-m", "jobs.dev.bench.ml_predict", "--bootstrap", bootstrap,
                   "--input", topics.input, "--output", topics.output, "--group", topics.group,
                   "--endpoint", endpoint, "--api", scenario.api, "--checkpoint-interval-ms", str(interval)]
        if approach in FLOORS:
            command += ["--floor", approach.removesuffix("-floor")]
        return command if scenario.overload_factor else [*command, "--bounded"]
    return [sys.executable, "-m", "jobs.dev.bench.baselines", approach, "--bootstrap", bootstrap,
            "--input", topics.input, "--output", topics.output, "--dead-letter", topics.dead_letter,
            "--group", topics.group, "--endpoint", endpoint, "--records", str(records),
            "--max-seconds", f"{max_seconds:g}"]


class ApproachProcess:
    """The approach's process, in its own session so that its whole tree can be ended."""

    def __init__(self, command: list[str], log_file: Path, extra_env: dict[str, str] | None = None) -> None:
        env = child_environment() | (extra_env or {})
        self.log_file = log_file
        with log_file.open("wb") as out:
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (llmstream cancels its job, a baseline flushes and commits), then SIGKILL."""
        if self.running():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def reap_group(self) -> None:
        """Ends whatever is left of the session this process led (e.g. an orphaned worker)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def _committed(bootstrap: str, group: str, topic: str) -> int:
    try:
        return sum(kafka_admin.committed_offsets(bootstrap, group, topic).values())
    except Exception:  # noqa: BLE001 - a group that never committed has no offsets
        return 0


def _wait_idle(stats: Callable[[], dict[str, Any]], timeout_s: float = 30.0) -> None:
    """Waits until the simulator has nothing in flight or queued (left over from a stopped run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            current = stats()
            if not current.get("in_flight") and not current.get("queued"):
                return
        time.sleep(0.5)


def run_approach(ctx: BenchContext, simulator: Any, scenario: Scenario, approach: str,
                 records: int, max_seconds: float) -> RunResult:
    """Runs `approach` on `scenario` and measures it; see the module docstring."""
    bootstrap = ctx.broker.bootstrap_servers
    label = f"[{scenario.key}/{approach}]"
    topics = Topics.fresh(scenario, approach)
    kafka_admin.create_topics(bootstrap, [topics.input, topics.output, topics.dead_letter], partitions=1)
    producer = InputProducer(bootstrap, topics.input, keys=scenario.keys)
    overload = scenario.overload_rate_per_s
    if overload is None:
        ctx.say(f"{label} producing {records:,} input records ...")
        producer.preload(records)
    run_seconds = scenario.overload_seconds if overload is not None else max_seconds

    _wait_idle(simulator.stats)
    simulator.reset_stats()
    observer = Observer(bootstrap, topics.output, topics.dead_letter)
    rss = RssSampler()
    rss.watch("broker", ctx.broker.pid())
    rss.watch("simulator", simulator.process.pid)
    server = ServerSampler(simulator.stats)
    for thread in (observer, rss, server):
        thread.start()

    log_file = ctx.workdir / f"{topics.group}.log"
    command = approach_command(approach, topics, ctx, simulator.url, scenario,
                               records if overload is None else 0, run_seconds, ctx.workdir)
    load_before = os.getloadavg()
    started = time.monotonic()
    started_ms = time.time() * 1000
    # PyFlink's local JVM logs to one file inside site-packages that every local job on the
    # machine truncates; ml-predict's and the floor's go next to the run log instead (kept with --keep).
    extra_env = ({"FLINK_LOG_DIR": str(ctx.workdir / f"{topics.group}-flink-log")}
                 if approach in (*SQL_JOBS, VECTORIZED_FLOOR) else {})
    if ctx.smoke and is_flink(approach):
        extra_env["JVM_ARGS"] = smoke_jvm_args(approach)
    proc = ApproachProcess(command, log_file, extra_env)
    rss.watch("approach", proc.pid)
    checkpoints = CheckpointSampler(proc.pid) if is_flink(approach) else None
    if checkpoints is not None:
        checkpoints.start()
    profiler = None
    if ctx.profile_dir is not None and is_flink(approach):
        profiler = RecordPathProfiler(proc.pid, lambda: observer.seen, max(100, records * 15 // 100), ctx.profile_dir,
                                      ctx.workdir, f"{scenario.key}-{approach}", ctx.say)
        profiler.start()
    paced = None
    if overload is not None:
        paced = PacedProducer(producer, overload, scenario.overload_seconds)
        paced.start()
        ctx.say(f"{label} started (pid {proc.pid}); producing {overload:,.0f} records/s for "
                f"{scenario.overload_seconds:g} s")
    else:
        ctx.say(f"{label} started (pid {proc.pid}); at most {max_seconds:g} s or {records:,} records")

    stopped_by = "finished"
    last_report, last_seen = started, 0
    try:
        while proc.running():
            elapsed = time.monotonic() - started
            if paced is not None and paced.finished.is_set():
                stopped_by = f"overload window ended ({scenario.overload_seconds:g} s)"
                break
            # Baselines stop themselves at max_seconds; Flink jobs are stopped (cancelled) here.
            if paced is None and elapsed >= max_seconds + (0 if is_flink(approach) else 10):
                stopped_by = f"time limit ({max_seconds:g} s)"
                break
            if time.monotonic() - last_report >= ctx.progress_every_s:
                seen = observer.seen
                target = producer.produced if paced is not None else records
                rate = (seen - last_seen) / (time.monotonic() - last_report)
                ctx.say(f"{label} {elapsed:5.0f}s  visible {seen:,}/{target:,}  ({rate:,.0f}/s lately)")
                last_report, last_seen = time.monotonic(), seen
            time.sleep(0.25)
        else:
            if proc.process.returncode:
                stopped_by = f"exited with code {proc.process.returncode}"
            elif paced is not None:
                stopped_by = f"overload window ended ({scenario.overload_seconds:g} s)"
            elif observer.seen < records and not is_flink(approach):
                stopped_by = f"time limit ({max_seconds:g} s)"
        proc.stop()
        if paced is not None:
            paced.stop()
            paced.join(30)
            if paced.error is not None:
                raise BenchError(f"input producer failed: {paced.error}") from paced.error
        elapsed = time.monotonic() - started
        _catch_up(observer, bootstrap, topics)
    finally:
        proc.stop(5)
        proc.reap_group()
        samplers: list[Any] = [observer, rss, server, *([checkpoints] if checkpoints else []),
                               *([profiler] if profiler else [])]
        for thread in samplers:
            thread.stop()
        server.sample()
        for thread in samplers:
            thread.join(180 if thread is profiler else 10)
        producer.close()

    committed = _committed(bootstrap, topics.group, topics.input)
    result = _summarise(ctx, scenario, approach, producer, observer, rss, server, committed,
                        started_ms, elapsed, stopped_by, proc, load_before)
    result.checkpoints = checkpoints.summary() if checkpoints is not None else None
    if profiler is not None:
        result.notes.append(f"profile: {profiler.error or 'profile-' + profiler.label + '.md'}")
    if approach == VECTORIZED_FLOOR:
        result.batches = batch_stats(proc.tail(10_000))
        if result.batches:
            b = result.batches
            result.notes.append(f"{b['batches']:,} Arrow batches of {b['mean_rows']:g} rows on average; between "
                                f"batches (the JVM's turn) p50 {b['gap_ms_p50']} ms, mean {b['gap_ms_mean']} ms, "
                                f"{b.get('gap_ms_per_1000_rows')} ms a 1,000 rows, {b.get('gap_share')} of the "
                                f"function's wall time; in Python p50 {b['python_ms_p50']} ms a batch")
    if proc.process.returncode not in (0, None) or result.outcome.seen == 0:
        ctx.say(f"{label} exit code {proc.process.returncode}, {result.outcome.seen} results; "
                f"last lines of {log_file}:\n{proc.tail()}")
    with contextlib.suppress(Exception):
        kafka_admin.delete_topics(bootstrap, [topics.input, topics.output, topics.dead_letter])
    return result


def _catch_up(observer: Observer, bootstrap: str, topics: Topics) -> None:
    """Waits until the observer has read everything committed to the output topics."""
    deadline = time.monotonic() + CATCH_UP_S
    while time.monotonic() < deadline:
        try:
            ends = {t: sum(kafka_admin.end_offsets(bootstrap, t, committed_only=True).values())
                    for t in (topics.output, topics.dead_letter)}
        except Exception:  # noqa: BLE001 - ask again
            ends = {}
        if ends and observer.caught_up(ends):
            return
        time.sleep(0.3)


def _summarise(ctx: BenchContext, scenario: Scenario, approach: str, producer: InputProducer,
               observer: Observer, rss: RssSampler, server: ServerSampler, committed: int,
               started_ms: float, elapsed: float, stopped_by: str, proc: ApproachProcess,
               load_before: tuple[float, float, float]) -> RunResult:
    delivery = tally_delivery(producer.offsets, observer, committed)
    seen = [s for s in observer.snapshot()[0].values() if not s.dead]
    completions = [s.completed_ms if s.completed_ms is not None else s.visible_ms for s in seen]
    window = steady_window(completions)
    limit = scenario.limit_per_s
    e2e = [s.visible_ms - s.produced_ms for s in seen if s.produced_ms is not None]
    pickup = [s.visible_ms - s.started_ms for s in seen if s.started_ms is not None]
    lag = [s.visible_ms - s.completed_ms for s in seen if s.completed_ms is not None]
    utilization = None
    if window is not None and limit is not None:
        mean = server.mean_in_flight(window.start_ms, window.end_ms)
        utilization = None if mean is None else mean / scenario.concurrency
    overall = None
    if completions:
        span = (max(completions) - started_ms) / 1000
        overall = len(completions) / span if span > 0 else None
    steady = window.rate if window else None
    load_after = os.getloadavg()
    notes = []
    if load_before[0] > 1.0 or load_after[0] > 3.0:
        notes.append(f"machine load {load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores)")
    series = [(round((t - started_ms) / 1000, 1), round(v.get("approach", 0) / 2**20, 1))
              for t, v in rss.series if "approach" in v]
    return RunResult(
        scenario=scenario.key,
        scenario_name=scenario.name,
        approach=approach,
        limit_per_s=limit,
        records_in=producer.produced,
        elapsed_s=round(elapsed, 1),
        stopped_by=stopped_by,
        exit_code=proc.process.returncode,
        outcome=delivery,
        throughput_steady=steady,
        steady_window_s=window.seconds if window else None,
        throughput_overall=overall,
        pct_of_limit=(100 * steady / limit) if steady and limit and approach not in FLOORS else None,
        e2e_ms=Latencies.of(e2e),
        pickup_ms=Latencies.of(pickup),
        commit_lag_ms=Latencies.of(lag),
        utilization=utilization,
        rss_peak_mb={role: rss.peak_mb(role) for role in ("approach", "broker", "simulator")}
        | {"total": rss.peak_total_mb()},
        rss_breakdown_mb={k: round(v / 2**20, 1) for k, v in sorted(rss.peak_breakdown.items())},
        rss_drift_mb=rss.drift_mb("approach"),
        rss_series=series[:: max(1, len(series) // 240)],
        server={k: server.last.get(k) for k in ("served", "max_in_flight", "max_queued", "rejected", "errors")},
        settings=(asdict(ctx.settings_for(scenario, VECTORIZED if approach == VECTORIZED_FLOOR else approach))
                  if approach.startswith("llmstream") or approach == VECTORIZED_FLOOR else None),
        load_avg=(round(load_after[0], 2), round(load_after[1], 2), round(load_after[2], 2)),
        log_file=str(proc.log_file),
        notes=notes,
        cpu_seconds=rss.cpu_seconds(),
        cpu_ms_per_record=rss.cpu_ms_per_record(window.start_ms, window.end_ms, window.count) if window else None,
    )


def probe(kind: str, endpoint: str, seconds: float = 5.0, concurrency: int = 64) -> dict[str, Any] | None:
    """One of `jobs.dev.bench.probes` (http, client) against `endpoint`, in a process of its own."""
    import json

    command = [sys.executable, "-m", "jobs.dev.bench.probes", kind, "--endpoint", endpoint,
               "--seconds", f"{seconds:g}", "--concurrency", str(concurrency)]
    env = child_environment()
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=seconds + 60, check=True)
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def wait_for_quiet(threshold: float, max_wait_s: float, say: Callable[[str], None]) -> float:
    """Waits (at most `max_wait_s`) for the 1-minute load average to drop below `threshold`."""
    deadline = time.monotonic() + max_wait_s
    load = os.getloadavg()[0]
    while load >= threshold and time.monotonic() < deadline:
        say(f"bench: load average {load:.2f} >= {threshold:g}; waiting for the machine to quieten ...")
        time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))
        load = os.getloadavg()[0]
    return load

