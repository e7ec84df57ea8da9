"""`llmstream run`: the job in a local Flink mini cluster that resumes from its own state.

Every run keeps its checkpoints and savepoints in the job's state directory
(`jobs/state.py`) and resumes from the newest one there, so output and input positions
restart together and nothing is written twice or skipped, whatever ended the last run:

- Ctrl-C or SIGTERM stops the job with a savepoint (its transactions committed), falling
  back to a cancel after `stop_timeout_s`; a second Ctrl-C cancels at once. A cancelled
  job's last checkpoint is retained.
- A run killed outright (SIGKILL, power loss) leaves its last completed checkpoint behind.
- `--until-end` (a backfill) runs until the consumer group's committed offsets reach the
  input's end offsets taken at start, then stops with a draining savepoint, which flushes
  every call still in flight into that final, committed output.
- `--fresh` ignores the state directory and starts from the group's committed offsets.

Progress lines are the compact form of `llmstream status` (jobs/status.py): records in and out
from Flink's metrics (the group's committed offsets lag behind under backpressure, when the
source's offset commits wait for its blocked fetcher), lag, calls, latency and checkpoints;
"starting" until the job has processed a record.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from kafka import TopicPartition  # type: ignore[import-untyped]

from jobs import jars, preflight
from jobs.flink_rest import last_error_line
from jobs.kafka_admin import GroupProgress
from jobs.pipeline import RunOptions, build_pipeline, create_environment
from jobs.ports import free_port
from jobs.python_worker_shutdown import quiet_worker_shutdown
from jobs.state import StateDir, check_identity, resume_point
from jobs.state_location import checked_state_dir
from jobs.status import LocalRun, Observer
from jobs.status import line as status_line
from udfs.cache import resolve_cache_location
from udfs.config import JobConfig

log = logging.getLogger("llmstream.run")

def _status(job_client: Any) -> str:
    """The job's state, or "ENDED" once a mini cluster has shut down after the job."""
    try:
        return str(job_client.get_job_status().result()).split(".")[-1]
    except Exception:  # noqa: BLE001 - the mini cluster is gone: the job has ended
        return "ENDED"


@dataclass
class StopRequest:
    """What the user (or a finished backfill) asked for: a savepoint first, a cancel if pressed."""

    savepoint: threading.Event
    cancel: threading.Event

    @classmethod
    def new(cls) -> StopRequest:
        return cls(threading.Event(), threading.Event())


@contextlib.contextmanager
def _stop_on_signals(stop: StopRequest, report: Callable[[str], None]) -> Iterator[None]:
    """First SIGINT/SIGTERM: stop with a savepoint. Second: cancel now. Handlers restored after."""
    def request_stop(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.savepoint.is_set():
            report(f"llmstream: {name} again: cancelling now (the next run resumes from the last checkpoint)")
            stop.cancel.set()
        else:
            report(f"llmstream: {name} received: stopping with a savepoint (again to cancel at once)")
            stop.savepoint.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Stopper:
    """Drives one stop-with-savepoint of a mini-cluster job: retried while the job is still
    starting (Flink refuses a savepoint before every task runs), then a cancel at the deadline."""

    def __init__(self, job_client: Any, savepoints_uri: str) -> None:
        self._job_client = job_client
        self._savepoints_uri = savepoints_uri
        self._future: Any = None
        self._deadline = 0.0
        self._drain = False
        self.cancelled = False
        self.savepoint: str | None = None

    @property
    def started(self) -> bool:
        return self._deadline > 0

    def start(self, *, drain: bool, timeout_s: float) -> None:
        self._drain = drain
        self._deadline = time.monotonic() + timeout_s

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            with contextlib.suppress(Exception):
                self._job_client.cancel()

    def poll(self, report: Callable[[str], None]) -> None:
        if not self.started or self.cancelled:
            return
        if self._future is not None and self._future.done():
            try:
                self.savepoint = str(self._future.result())
                return
            except Exception as err:  # noqa: BLE001 - e.g. "not all tasks running": try again
                log.debug("stop-with-savepoint refused, retrying: %s", _root_cause(err))
                self._future = None
        if time.monotonic() > self._deadline:
            report("llmstream: no savepoint in time; cancelling (the next run resumes from the last checkpoint)")
            self.cancel()
        elif self._future is None:
            self._future = _stop_with_savepoint(self._job_client, self._drain, self._savepoints_uri)
            time.sleep(0.3)


def _stop_with_savepoint(job_client: Any, drain: bool, directory: str) -> Any:
    """`JobClient.stop_with_savepoint`, in the Flink 2 signature (which wants a format type)."""
    from pyflink.common.completable_future import CompletableFuture
    from pyflink.java_gateway import get_gateway

    canonical = get_gateway().jvm.org.apache.flink.core.execution.SavepointFormatType.CANONICAL
    # PyFlink's wrapper calls the 2-argument form, which Flink 2 no longer has.
    j_client = job_client._j_job_client
    return CompletableFuture(j_client.stopWithSavepoint(drain, directory, canonical), str)


def run_job(
    config: JobConfig,
    options: RunOptions | None = None,
    *,
    progress_every_s: float = 5.0,
    report: Callable[[str], None] = print,
    stop: StopRequest | None = None,
    stop_timeout_s: float = 60.0,
) -> str:
    """Runs the job until it ends; returns FINISHED (a backfill done, or stopped with a
    savepoint), CANCELED or FAILED. `options` names the state directory and how to resume."""
    options = options or RunOptions()
    stop = stop or StopRequest.new()
    state = checked_state_dir(config, options.state_dir, create=True)
    # The local result cache lives beside the job's snapshots (the workers get this path pickled).
    config = resolve_cache_location(config, state.path)
    preflight.check(config)
    jars.ensure("connector")
    if config.metrics.prometheus_port is not None:
        jars.ensure("metrics")
    with contextlib.ExitStack() as stack:
        stack.enter_context(state.exclusive())
        check_identity(state, config, fresh=options.fresh)
        restore, how = resume_point(state, fresh=options.fresh, explicit=options.from_savepoint)
        report(f"llmstream: {how}")  # before the JVM starts: a run killed while it starts has said so
        progress = stack.enter_context(contextlib.closing(GroupProgress(config)))
        stack.enter_context(_stop_on_signals(stop, report))
        stack.enter_context(quiet_worker_shutdown())
        targets = progress.end_offsets() if options.until_end else None
        rest_port = config.metrics.rest_port or free_port()
        env = create_environment(config, jars.connector_jar_urls(), state=state, restore_from=restore,
                                 local_rest_port=rest_port)
        build_pipeline(env, config)
        job_client = env.execute_async(config.name)
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
        state_name = _watch(job_client, progress, stop, targets, state, progress_every_s, stop_timeout_s, report,
                            _Figures(observer, local_run, state))
        state.prune()
        return state_name


class _Figures:
    """The status figures of this run (`jobs/status.py`), refreshed every `every_s` and recorded
    in the state directory, so `llmstream status` can still show them once the run has ended."""

    def __init__(self, observer: Observer, local_run: LocalRun, state: StateDir, every_s: float = 2.0) -> None:
        self._observer = observer
        self._local_run = local_run
        self._state = state
        self._every_s = every_s
        self._at = 0.0
        self.last: dict[str, Any] | None = None

    def refresh(self, now: float, *, force: bool = False) -> dict[str, Any] | None:
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


def _watch(job_client: Any, progress: GroupProgress, stop: StopRequest, targets: dict[TopicPartition, int] | None,
           state: StateDir, progress_every_s: float, stop_timeout_s: float, report: Callable[[str], None],
           figures: _Figures | None = None) -> str:
    result = job_client.get_job_execution_result()
    stopper = _Stopper(job_client, state.savepoints_uri)
    started, last_report, last_check = time.monotonic(), 0.0, 0.0
    while not result.done():
        now = time.monotonic()
        if stop.cancel.is_set():
            stopper.cancel()
        elif stop.savepoint.is_set() and not stopper.started:
            stopper.start(drain=False, timeout_s=stop_timeout_s)
        elif targets is not None and not stopper.started and now - last_check >= 0.5:
            last_check = now
            with contextlib.suppress(Exception):
                if progress.reached(targets):
                    report("llmstream: backfill input committed; stopping with a draining savepoint")
                    stopper.start(drain=True, timeout_s=stop_timeout_s)
        stopper.poll(report)
        due = bool(progress_every_s) and now - last_report >= progress_every_s
        latest = figures.refresh(now, force=due) if figures is not None else None
        if due:
            last_report = now
            if latest is not None:
                report(f"llmstream: {now - started:6.0f}s  {status_line(latest)}")
            else:
                report(f"llmstream: {now - started:6.0f}s  {_status(job_client):<9} starting")
        time.sleep(0.2)
    try:
        result.result()
    except Exception as err:  # noqa: BLE001 - reported, then returned as the state
        if stopper.cancelled:
            report(f"llmstream: job cancelled; the next run resumes from the last checkpoint in {state.location}")
            return "CANCELED"
        report(f"llmstream: job failed: {_root_cause(err)}")
        return "FAILED"
    stopper.poll(report)
    committed, end = progress.snapshot()
    where = f"savepoint {stopper.savepoint}" if stopper.savepoint else f"the state in {state.location}"
    report(f"llmstream: job finished; committed {committed}/{end} input records; the next run resumes from {where}")
    return "FINISHED"


def _root_cause(err: BaseException) -> str:
    return last_error_line(str(err)) if str(err).strip() else type(err).__name__


def exit_code(state: str) -> int:
    """0 for a finished, stopped or deliberately cancelled job, 1 for a failed one."""
    return 1 if state == "FAILED" else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: llmstream run --config FILE")
