"""`llmstream run`: the job in a local Flink mini cluster that resumes from its own state.

Every run keeps its checkpoints and savepoints in the job's state directory
(`jobs/state/snapshots.py`) and resumes from the newest one there, so output and input positions
restart together and nothing is written twice or skipped, whatever ended the last run:

- Ctrl-C or SIGTERM stops the job with a savepoint (its transactions committed), falling
  back to a cancel after `stop_timeout_s`; a second Ctrl-C cancels at once. A cancelled
  job's last checkpoint is retained.
- A run killed outright (SIGKILL, power loss) leaves its last completed checkpoint behind.
- `--until-end` (a backfill) runs until the consumer group's committed offsets reach the
  input's end offsets taken at start, then stops with a draining savepoint, which flushes
  every call still in flight into that final, committed output.
- `--fresh` ignores the state directory and starts from the group's committed offsets.

The job is driven by `jobs/launch/driver.py` (the loop `llmstream submit --until-end` shares). Progress
lines are the compact form of `llmstream status` (jobs/observe/status.py, figures from jobs/observe/figures.py):
records in and out from Flink's metrics (the group's committed offsets lag behind under backpressure, when the
source's offset commits wait for its blocked fetcher), lag, calls, latency and checkpoints;
"starting" until the job has processed a record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator

from jobs.clients.flink_cli import flink_conf_dir
from jobs.clients.flink_rest import FlinkRest
from jobs.clients.kafka_admin import GroupProgress
from jobs.graph import gate_operator as gate
from jobs.graph.pipeline import build_pipeline, create_environment
from jobs.launch.driver import (
    Backfill,
    BackfillIncomplete,
    FlinkLog,
    MiniClusterDriver,
    RunEnd,
    StopRequest,
    drive,
    stop_on_signals,
)
from jobs.launch.plan import LaunchPlan, RunOptions, prepare
from jobs.observe.figures import Observer, RunFigures, held_of
from jobs.runtime import jars
from jobs.runtime.jvm_archive import GatewayArchive
from jobs.runtime.ports import free_port, port_in_use
from jobs.runtime.python_worker_shutdown import quiet_worker_shutdown
from jobs.state.snapshots import LocalRun, StateDir, restore_refused
from udfs.config import JobConfig
from udfs.errors import ConfigError

__all__ = ["StopRequest", "check_local_ports", "exit_code", "run_job"]


def run_job(
    config: JobConfig,
    options: RunOptions | None = None,
    *,
    progress_every_s: float = 5.0,
    report: Callable[[str], None] = print,
    stop: StopRequest | None = None,
    stop_timeout_s: float = 60.0,
    drain_timeout_s: float | None = None,
    class_archive: bool = False,
) -> str:
    """Runs the job until it ends; returns FINISHED (a backfill done, or stopped with a
    savepoint), CANCELED, FAILED or `INCOMPLETE` (a backfill that ended before its records were out).
    `options` names the state directory and how to resume. `drain_timeout_s`: how long a backfill's
    end waits for the records the stage holds, then for its draining savepoint (default:
    `JobConfig.longest_record_s`). What is
    checked and decided before the JVM starts is the launch sequence `llmstream submit` shares
    (`jobs.launch.plan.prepare`), with this process's mini cluster as its site; it raises as that does.

    `class_archive` (the CLI's, which owns its process): the JVM starts from a class-data-sharing
    archive, or makes one and is shut down at the end to write it (`jobs/runtime/jvm_archive.py`), so
    nothing in this process may use PyFlink after this returns."""
    options = options or RunOptions()
    stop = stop or StopRequest.new()
    archive = GatewayArchive.find() if class_archive else None
    state_name = "FAILED"
    with contextlib.ExitStack() as held:
        site = _MiniCluster(config, held)
        for attempt in range(1 + NEW_MINI_CLUSTERS):
            plan = prepare(config, options, site, report=report)
            if config.metrics.prometheus_port is not None:
                jars.ensure("metrics")
            state_name, outcome = _run(config, options, plan, archive if attempt == 0 else None,
                                       progress_every_s=progress_every_s,
                                       report=report, stop=stop, stop_timeout_s=stop_timeout_s,
                                       drain_timeout_s=drain_timeout_s)
            if not outcome.lost_taskmanager or stop.savepoint.is_set() or stop.cancel.is_set():
                break
            if attempt == NEW_MINI_CLUSTERS:
                report(f"llmstream: the mini cluster lost its TaskManager {attempt + 1} times; stopping here: "
                       f"the same command resumes from the last checkpoint in {plan.build.state.location}")
                state_name = "FAILED"
                break
            report("llmstream: starting a new mini cluster; it resumes from the last checkpoint")
            # The same run, resumed: from the newest snapshot, whatever this one was started with.
            options = dataclasses.replace(options, fresh=False, from_savepoint=None)
    if archive is not None:
        archive.save(report)
    return state_name


NEW_MINI_CLUSTERS = 3
"""How many times `llmstream run` starts a new mini cluster after Flink stopped its TaskManager (a
task failure whose clean-up failed too, e.g. a sink transaction that could not be aborted while
the broker was unreachable): each resumes from the last checkpoint."""


class _MiniCluster:
    """The launch sequence's `jobs.launch.plan.Site` of a run in this process: its fixed ports
    must be free, and it holds the state directory (`StateDir.exclusive`) until `held` closes."""

    def __init__(self, config: JobConfig, held: contextlib.ExitStack) -> None:
        self._config = config
        self._held = held
        self._claimed = False

    def reach(self) -> None:
        if not self._claimed:  # a new mini cluster of the same run takes the ports its predecessor freed
            check_local_ports(self._config)

    def claim(self, state: StateDir) -> None:
        if not self._claimed:
            self._held.enter_context(state.exclusive())
            self._claimed = True


def check_local_ports(config: JobConfig) -> None:
    """The mini cluster's fixed ports must be free: Flink would fail with a Java traceback on a
    taken REST port and, worse, run without its Prometheus endpoint on a taken metrics port
    (it logs the bind error and goes on), so a scrape would find nothing or another process."""
    for setting, port in (("metrics.prometheus_port", config.metrics.prometheus_port),
                          ("metrics.rest_port", config.metrics.rest_port)):
        if port is not None and port_in_use(port):
            raise ConfigError(setting, f"port {port} on 127.0.0.1 is taken (another run or service holds it); "
                                       "choose a free one or leave it unset")


def _run(config: JobConfig, options: RunOptions, plan: LaunchPlan, archive: GatewayArchive | None, *,
         progress_every_s: float, report: Callable[[str], None], stop: StopRequest, stop_timeout_s: float,
         drain_timeout_s: float | None) -> tuple[str, RunEnd]:
    state, restore, targets = plan.build.state, plan.restore, plan.end_offsets
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(contextlib.closing(GroupProgress(config)))
        stack.enter_context(stop_on_signals(stop, report))
        stack.enter_context(quiet_worker_shutdown())
        rest_port = config.metrics.rest_port or free_port()
        workers = python_worker_processes(config)
        if workers:
            stack.enter_context(_environ(PYFLINK_WORKER_MODE, "process"))
            report(f"llmstream: {workers} inference subtasks, each with a Python worker process of its own")
        with flink_log_dir(state), _archive_applied(archive, state):
            env = create_environment(config, list(plan.build.jar_urls), state=state, restore_from=restore,
                                     leave_behind=plan.leave_behind is not None, local_rest_port=rest_port,
                                     python_files=plan.build.python_files)
        gate_dir = build_pipeline(env, config, cache_file=plan.build.cache_file)
        stack.callback(gate.forget, gate_dir)
        flink_log = FlinkLog.of_this_jvm()
        try:
            job_client = env.execute_async(config.name)
        except Exception as err:  # py4j's Java error: one line when it is Flink refusing the snapshot
            refused = restore_refused(err, restore, options.from_savepoint, options.state_dir)
            if refused is not None:
                raise refused from None
            raise
        local_run = LocalRun.starting(config, str(job_client.get_job_id()), rest_port)
        stack.callback(local_run.ended, state)
        local_run.record(state)
        report(f"llmstream: job {config.name} ({job_client.get_job_id()}) started in a local mini cluster; "
               f"{config.kafka.input_description()} -> {config.kafka.output_topic} | {config.kafka.dead_letter_topic}")
        report(f"llmstream: web UI and REST API at {local_run.rest_url}"
               + (f"; Prometheus metrics at {local_run.prometheus_url}" if local_run.prometheus_url else "")
               + "; `llmstream status --config FILE` shows the job")
        if targets is not None:
            ends = ", ".join(f"{tp.topic}:{tp.partition}={end}" for tp, end in sorted(targets.items()))
            report(f"llmstream: backfill: will stop once the group has committed {sum(targets.values())} "
                   f"input records (end offsets {ends})")
        observer = Observer(config, local_run.rest_url, job_id=local_run.job_id, progress=progress,
                            local_run=local_run)
        driver = MiniClusterDriver(job_client, FlinkRest(local_run.rest_url), flink_log)
        figures = RunFigures(observer, local_run, state)
        backfill = None
        if targets is not None:
            backfill = Backfill(progress, targets, drain_timeout_s or config.longest_record_s(),
                                held=lambda: held_of(figures.refresh(time.monotonic(), force=True)))
        outcome = drive(driver, stop, savepoints_uri=state.savepoints_uri, backfill=backfill, figures=figures,
                        progress_every_s=progress_every_s, stop_timeout_s=stop_timeout_s,
                        on_stop=lambda: gate.open_for_stop(gate_dir), report=report)
        state_name = _conclude(outcome, progress, state, report, backfill=targets is not None)
        if local_run.last:  # recorded as the run ends (`LocalRun.ended`), for `llmstream status`
            local_run.last["job"]["ended"] = ended_line(state_name, outcome, state)
        if outcome.state == "FAILED" and flink_log is not None:
            report(f"llmstream: Flink's log of this run: {flink_log.path}")
        state.prune()
        return state_name, outcome


PYFLINK_WORKER_MODE = "_python_worker_execution_mode"
"""PyFlink's switch (read when an environment is created) between `loopback`, its default in a
mini cluster (every Python operator runs inside this process), and `process` (each runs in a
worker process the TaskManager starts, as on a cluster)."""


def python_worker_processes(config: JobConfig) -> int:
    """How many Python worker processes `llmstream run` asks for: 0 (PyFlink's loopback default)
    with one inference subtask, else one per subtask.

    In loopback mode every subtask's Python shares this process and its GIL, so a second subtask
    adds nothing; in worker processes each has a GIL of its own (docs/performance.md, "Scale-out").
    With one subtask the two modes are alike, and loopback keeps the stage's log on this console.
    A `_python_worker_execution_mode` already set is left alone."""
    subtasks = config.parallelism.of("inference")
    if subtasks <= 1 or PYFLINK_WORKER_MODE in os.environ:
        return 0
    return subtasks


@contextlib.contextmanager
def flink_log_dir(state: StateDir) -> Iterator[None]:
    """Flink's log of a run in this process goes to the state directory's ``log/`` (a local one),
    unless FLINK_LOG_DIR says where: PyFlink's default is one file in its own package directory,
    shared by every run on the machine and truncated by each JVM that starts. And it is written with
    ``flink-conf/log4j-cli.properties`` (unless LOG4J_PROPERTIES says otherwise), not PyFlink's own,
    which lets Beam print the Python worker's environment, a model API key included. PyFlink reads
    both variables when it starts its JVM (the first run in a process), so they are set only meanwhile."""
    local = None if state.path is None or "FLINK_LOG_DIR" in os.environ else str(state.path / "log")
    log4j = flink_conf_dir() / "log4j-cli.properties"
    ours = None if "LOG4J_PROPERTIES" in os.environ or not log4j.is_file() else str(log4j)
    with _environ("FLINK_LOG_DIR", local), _environ("LOG4J_PROPERTIES", ours):
        yield


def _archive_applied(archive: GatewayArchive | None, state: StateDir) -> contextlib.AbstractContextManager[None]:
    """``JVM_ARGS`` with the class archive's options while PyFlink starts its JVM (it reads it then)."""
    if archive is None:
        return contextlib.nullcontext()
    log_file = None
    if state.path is not None:
        (state.path / "log").mkdir(parents=True, exist_ok=True)
        log_file = state.path / "log" / "jvm-class-archive.log"
    return _environ("JVM_ARGS", archive.jvm_args(os.environ.get("JVM_ARGS", ""), log_file))


@contextlib.contextmanager
def _environ(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` in this process's environment meanwhile (None: left as it is)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


INCOMPLETE = "INCOMPLETE"
"""A backfill (`--until-end`) that ended before every record present at start was out: stopped,
cancelled or cut short while the stage still held records. Its exit code is 3."""


def _conclude(outcome: RunEnd, progress: GroupProgress, state: StateDir, report: Callable[[str], None], *,
              backfill: bool = False) -> str:
    """Says how the run ended, what it left and where the next one resumes from; returns the job's
    final state (`INCOMPLETE` for a backfill that ended before its records were out)."""
    where = f"savepoint {outcome.savepoint}" if outcome.savepoint else f"the last checkpoint in {state.location}"
    if outcome.lost_taskmanager:
        report(f"llmstream: job cancelled without a TaskManager; {_left(outcome)} kept in the last checkpoint in "
               f"{state.location}")
        return outcome.state
    if outcome.state == "FAILED":
        report(f"llmstream: job failed: {outcome.cause}")
        if backfill:
            report(f"llmstream: the backfill is not finished; the same command resumes it from {where}")
        return outcome.state
    if backfill and not outcome.drained:
        report(f"llmstream: backfill not finished: {_left(outcome)} in the job's state, kept in {where}; "
               "the same command finishes them")
        return INCOMPLETE
    if outcome.state == "CANCELED":
        report(f"llmstream: job cancelled: {_left(outcome)} in the last checkpoint in {state.location}; "
               "the next run resumes from it")
        return outcome.state
    committed, end = progress.snapshot()
    done = "; every record present at start is in output or dead letters" if backfill else ""
    report(f"llmstream: job finished; committed {committed}/{end} input records{done}; the next run resumes from {where}")
    return outcome.state


def _left(outcome: RunEnd) -> str:
    """What the stage held when the job stopped, as far as it was counted."""
    if outcome.held is None:
        return "the records the stage held (not counted)"
    return f"at most {outcome.held} records" if outcome.held else "the records the stage still held"


def ended_line(state_name: str, outcome: RunEnd, state: StateDir) -> str:
    """How the run ended, for `llmstream status` once it is over."""
    if state_name == INCOMPLETE:
        return f"backfill not finished: {_left(outcome)} left in {state.location}; the same command finishes them"
    if state_name == "FAILED":
        return f"failed: {outcome.cause}"
    if state_name == "CANCELED":
        return f"cancelled: {_left(outcome)} left in the last checkpoint in {state.location}"
    return "finished" + (f" with savepoint {outcome.savepoint}" if outcome.savepoint else "")


def exit_code(state: str) -> int:
    """0 for a finished, stopped or deliberately cancelled job, 1 for a failed one, 3 for a backfill
    that ended before every record present at start was out (the same command finishes it)."""
    return {"FAILED": 1, INCOMPLETE: BackfillIncomplete.exit_code}.get(state, 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: llmstream run --config FILE")
