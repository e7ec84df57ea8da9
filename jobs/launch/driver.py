"""One job's life after submission, wherever it runs: stop it with a savepoint when asked, stop it
with a draining savepoint once a backfill's input is committed, report progress, say how it ended.

A `JobDriver` is what that loop needs of a running job: its status, a stop-with-savepoint (drain
or not), a cancel and the cause of a failure. `MiniClusterDriver` drives a local `llmstream run`
through PyFlink's `JobClient`; `RestDriver` a job on a cluster through Flink's REST API
(`jobs/clients/flink_rest.py`). `drive` is the one loop over either: `llmstream run` and
`llmstream submit --until-end` use it; `stop` and `upgrade` use `JobDriver.stop_with_savepoint`.

Flink refuses a savepoint while a task is still starting or restarting, so every stop is
retried until it is taken or its deadline passes (`SavepointStop`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from jobs.clients.flink_rest import (
    TERMINAL_STATES,
    ClusterError,
    FlinkRest,
    is_secondary,
    last_error_line,
)
from jobs.observe.status import line as status_line
from udfs.errors import LLMStreamError

if TYPE_CHECKING:
    from kafka import TopicPartition  # type: ignore[import-untyped]

    from jobs.clients.kafka_admin import GroupProgress
    from jobs.observe.figures import RunFigures

log = logging.getLogger("llmstream.run")


class BackfillIncomplete(LLMStreamError):
    """A backfill (`--until-end`) ended before every record present at start was out; the same
    command finishes it."""

    exit_code = 3


def root_cause(err: BaseException) -> str:
    """The line of an exception's report that names its root cause."""
    return last_error_line(str(err)) if str(err).strip() else type(err).__name__


class StopAttempt(Protocol):
    """One stop-with-savepoint request in progress."""

    def done(self) -> bool: ...

    def result(self) -> str:
        """The savepoint path; raises if Flink refused or failed the stop."""
        ...


class JobDriver(ABC):
    """A running job as `drive` sees it."""

    job_id: str
    retry_s: float = 0.3
    """Pause before asking again for a savepoint Flink refused."""

    @abstractmethod
    def status(self) -> str:
        """Flink's name for the job's state (RUNNING...), or "ENDED" once it cannot be asked."""

    @abstractmethod
    def ended(self) -> bool:
        """Whether the job has reached a terminal state."""

    @abstractmethod
    def final_state(self) -> str:
        """FINISHED, CANCELED or FAILED, once `ended()`."""

    @abstractmethod
    def failure(self) -> str:
        """The root cause of the job's failure, once `ended()`; '' if none is known."""

    def failure_history(self) -> list[str]:
        """The root cause of each of the job's failures so far, oldest first, while it runs; [] if it
        has none or they cannot be read. After restarts, `failure` names only the last one (often a
        consequence, such as a slot not yet freed), so `drive` keeps the first one it saw."""
        return []

    def tasks_running(self) -> bool:
        """Whether every task of the job runs (Flink refuses a savepoint before); True if unknown."""
        return True

    def taskmanagers(self) -> int | None:
        """How many TaskManagers the job's cluster has registered; None if unknown."""
        return None

    taskmanagers_return: bool = True
    """Whether a lost TaskManager can come back: on a cluster a supervisor (or a person) starts
    another; a mini cluster's one TaskManager, once Flink has stopped it, never does."""

    @abstractmethod
    def trigger_stop(self, *, drain: bool, directory: str) -> StopAttempt:
        """Ask Flink to stop the job with a savepoint into ``directory`` (raises if refused at once)."""

    @abstractmethod
    def cancel(self) -> None:
        """Cancel the job now (its last checkpoint is retained)."""

    def stop_with_savepoint(self, *, drain: bool, directory: str, timeout_s: float = 180.0) -> str:
        """Stop the job with a savepoint, retried while Flink refuses it, and wait until it has ended;
        returns the savepoint path. Raises `ClusterError` (the last refusal) at the deadline or if the
        job ends without one."""
        stop = SavepointStop(self, directory)
        stop.start(drain=drain, timeout_s=timeout_s)
        while stop.savepoint is None:
            stop.poll()
            if stop.savepoint is None and (stop.timed_out or self.ended()):
                if not stop.timed_out:  # the job ended on the savepoint: its answer may come a moment later
                    stop.settle()
                if stop.savepoint is None:
                    raise ClusterError(stop.error or (
                        f"timed out after {timeout_s:g} s waiting for the savepoint of job {self.job_id}"
                        if stop.timed_out else f"job {self.job_id} ended without a savepoint"))
            if stop.savepoint is None:
                time.sleep(0.2)
        deadline = time.monotonic() + 60
        while not self.ended():
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after 60 s waiting for job {self.job_id} to stop")
            time.sleep(0.2)
        return stop.savepoint


_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
_TASK_FAILURE = ("to FAILED with failure cause", "FATAL - exception in")
"""How Flink's log opens the report of a task that failed: the TaskManager's "switched from RUNNING
to FAILED with failure cause:", and "FATAL - exception in exception handler of task" when the task's
clean-up threw too (which takes the TaskManager down)."""


def logged_failures(text: str) -> list[str]:
    """The root cause of each task failure a Flink log records, oldest first (`last_error_line` of
    each report: its first line and the stack trace up to the next log record)."""
    reports: list[list[str]] = []
    report: list[str] | None = None
    for line in text.splitlines():
        if _LOG_RECORD.match(line):
            report = [line.split(" - ", 1)[-1]] if any(marker in line for marker in _TASK_FAILURE) else None
            if report is not None:
                reports.append(report)
        elif report is not None:
            report.append(line)
    return [last_error_line("\n".join(lines)) for lines in reports]


@dataclass(frozen=True)
class FlinkLog:
    """The part of a local JVM's Flink log written since ``offset`` (where a job started).

    A mini cluster's TaskManager can die of a task's failure: when the failed task's clean-up
    throws again (the Kafka sink's writer rethrows a send error on close), Flink takes that as
    fatal and stops the TaskManager before the task's own failure reaches the JobManager. The job
    then fails with "The TaskExecutor is shutting down", its exception history never hears of the
    cause, and only the log has it."""

    path: Path
    offset: int = 0
    limit: int = 32 * 1024 * 1024

    @classmethod
    def of_this_jvm(cls) -> FlinkLog | None:
        """The log the gateway JVM writes (its ``log.file``), from its current end; None if unknown."""
        with contextlib.suppress(Exception):
            from pyflink.java_gateway import get_gateway

            name = get_gateway().jvm.System.getProperty("log.file")
            if name:
                path = Path(str(name))
                return cls(path, path.stat().st_size if path.exists() else 0)
        return None

    def failures(self) -> list[str]:
        """Root causes of the task failures logged since ``offset`` (the first ``limit`` bytes)."""
        try:
            with self.path.open("rb") as log_file:
                log_file.seek(self.offset)
                text = log_file.read(self.limit).decode("utf-8", "replace")
        except OSError:
            return []
        return logged_failures(text)


class MiniClusterDriver(JobDriver):
    """A job in this process's mini cluster, through PyFlink's `JobClient`."""

    def __init__(self, job_client: Any, rest: FlinkRest | None = None, log: FlinkLog | None = None) -> None:
        self._client = job_client
        self._result = job_client.get_job_execution_result()
        self.job_id = str(job_client.get_job_id())
        self._error: BaseException | None = None
        self._rest = rest
        """The mini cluster's REST API, for `failure_history` (its job result holds the last failure only)."""
        self._log = log
        """The JVM's log, for a failure only it records (`FlinkLog`)."""

    def status(self) -> str:
        try:
            return str(self._client.get_job_status().result()).split(".")[-1]
        except Exception:  # noqa: BLE001 - the mini cluster is gone: the job has ended
            return "ENDED"

    def ended(self) -> bool:
        try:
            return bool(self._result.done())
        except Exception:  # noqa: BLE001 - the gateway (and with it the mini cluster) is gone: the job has ended
            return True

    def final_state(self) -> str:
        try:
            self._result.result()
        except Exception as err:  # noqa: BLE001 - a failed (or cancelled) job's result raises
            self._error = err
            return "FAILED"
        return "FINISHED"

    def failure(self) -> str:
        """The job result's root cause; when that only follows a failure (the TaskManager shutting
        down), the first primary task failure in the log, which is the one that ended the job."""
        if self.final_state() == "FINISHED" or self._error is None:
            return ""
        cause = root_cause(self._error)
        if is_secondary(cause) and self._log is not None:
            logged = [line for line in self._log.failures() if not is_secondary(line)]
            return logged[0] if logged else cause
        return cause

    def failure_history(self) -> list[str]:
        return [last_error_line(trace) for trace in self._rest.failures(self.job_id)] if self._rest else []

    def tasks_running(self) -> bool:
        return _all_running(self._rest, self.job_id) if self._rest else True

    taskmanagers_return = False

    def taskmanagers(self) -> int | None:
        return _taskmanagers(self._rest) if self._rest else None

    def trigger_stop(self, *, drain: bool, directory: str) -> StopAttempt:
        """`JobClient.stop_with_savepoint` in the Flink 2 signature, which wants a format type: PyFlink's
        wrapper calls the 2-argument form Flink 2 no longer has."""
        from pyflink.common.completable_future import CompletableFuture
        from pyflink.java_gateway import get_gateway

        canonical = get_gateway().jvm.org.apache.flink.core.execution.SavepointFormatType.CANONICAL
        j_client = self._client._j_job_client
        future: StopAttempt = CompletableFuture(j_client.stopWithSavepoint(drain, directory, canonical), str)
        return future

    def cancel(self) -> None:
        with contextlib.suppress(Exception):
            self._client.cancel()


class _RestStop:
    def __init__(self, rest: FlinkRest, job_id: str, trigger: str) -> None:
        self._rest, self._job_id, self._trigger = rest, job_id, trigger
        self._location: str | None = None
        self._error: ClusterError | None = None

    def done(self) -> bool:
        if self._location is None and self._error is None:
            try:
                self._location = self._rest.stop_savepoint(self._job_id, self._trigger)
            except ClusterError as err:
                self._error = err
        return self._location is not None or self._error is not None

    def result(self) -> str:
        if self._error is not None:
            raise self._error
        if self._location is None:
            raise ClusterError(f"the savepoint of job {self._job_id} is not done yet")
        return self._location


class RestDriver(JobDriver):
    """A job on a Flink cluster, through its REST API."""

    retry_s = 1.0

    def __init__(self, rest: FlinkRest, job_id: str) -> None:
        self._rest = rest
        self.job_id = job_id

    def status(self) -> str:
        return self._rest.job_status(self.job_id)

    def ended(self) -> bool:
        return self.status() in TERMINAL_STATES

    def final_state(self) -> str:
        return self.status()

    def failure(self) -> str:
        return last_error_line(self._rest.failure(self.job_id))

    def failure_history(self) -> list[str]:
        return [last_error_line(trace) for trace in self._rest.failures(self.job_id)]

    def tasks_running(self) -> bool:
        return _all_running(self._rest, self.job_id)

    def taskmanagers(self) -> int | None:
        return _taskmanagers(self._rest)

    def trigger_stop(self, *, drain: bool, directory: str) -> StopAttempt:
        return _RestStop(self._rest, self.job_id, self._rest.trigger_stop(self.job_id, directory, drain=drain))

    def cancel(self) -> None:
        with contextlib.suppress(ClusterError):
            self._rest.rest(f"/jobs/{self.job_id}?mode=cancel", method="PATCH")


def _all_running(rest: FlinkRest, job_id: str) -> bool:
    """Whether every vertex of the job is RUNNING (or already FINISHED), by its REST API."""
    try:
        vertices = rest.job(job_id).get("vertices") or []
    except ClusterError:
        return False
    return bool(vertices) and all(v.get("status") in ("RUNNING", "FINISHED") for v in vertices)


def _taskmanagers(rest: FlinkRest) -> int | None:
    try:
        return len((rest.rest("/taskmanagers") or {}).get("taskmanagers") or [])
    except ClusterError:
        return None


NO_TASKMANAGER_S = 20.0
"""How long a job may have no TaskManager at all before `drive` says so (and, in a mini cluster,
whose TaskManager never comes back, cancels it: its restarts would fail forever)."""


class SavepointStop:
    """One stop-with-savepoint of a job, driven poll by poll: asked again while Flink refuses it
    (a task still starting), until it is taken or its deadline passes."""

    def __init__(self, driver: JobDriver, directory: str) -> None:
        self._driver = driver
        self._directory = directory
        self._attempt: StopAttempt | None = None
        self._next_try = 0.0
        self._deadline = 0.0
        self._drain = False
        self.cancelled = False
        self.savepoint: str | None = None
        self.error: str | None = None
        """Why Flink refused the last attempt."""

    @property
    def started(self) -> bool:
        return self._deadline > 0

    @property
    def timed_out(self) -> bool:
        return self.started and self.savepoint is None and not self.cancelled and time.monotonic() > self._deadline

    def start(self, *, drain: bool, timeout_s: float) -> None:
        self._drain = drain
        self._deadline = time.monotonic() + timeout_s

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._driver.cancel()

    def poll(self) -> None:
        if not self.started or self.cancelled or self.savepoint is not None:
            return
        if self._attempt is not None and self._attempt.done():
            try:
                self.savepoint = str(self._attempt.result())
                return
            except Exception as err:  # noqa: BLE001 - e.g. "not all tasks running": try again
                self.error = str(err) if isinstance(err, ClusterError) else root_cause(err)
                log.debug("stop-with-savepoint refused, retrying: %s", root_cause(err))
                self._attempt = None
                self._next_try = time.monotonic() + self._driver.retry_s
        if self._attempt is None and not self.timed_out and time.monotonic() >= self._next_try:
            try:
                self._attempt = self._driver.trigger_stop(drain=self._drain, directory=self._directory)
            except Exception as err:  # noqa: BLE001 - refused at once: try again
                self.error = str(err) if isinstance(err, ClusterError) else root_cause(err)
                log.debug("stop-with-savepoint refused, retrying: %s", root_cause(err))
                self._next_try = time.monotonic() + self._driver.retry_s

    def settle(self, timeout_s: float = 5.0) -> None:
        """After the job has ended: wait briefly for the answer to the stop in progress, if any."""
        deadline = time.monotonic() + timeout_s
        while self._attempt is not None and self.savepoint is None and not self.cancelled:
            if self._attempt.done():
                try:
                    self.savepoint = str(self._attempt.result())
                except Exception as err:  # noqa: BLE001 - the job ended without it
                    self.error = str(err) if isinstance(err, ClusterError) else root_cause(err)
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)


@dataclass
class StopRequest:
    """What the user (or a finished backfill) asked for: a savepoint first, a cancel if pressed."""

    savepoint: threading.Event
    cancel: threading.Event

    @classmethod
    def new(cls) -> StopRequest:
        return cls(threading.Event(), threading.Event())


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest, report: Callable[[str], None]) -> Iterator[None]:
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


@dataclass(frozen=True)
class RunEnd:
    """How a driven job ended."""

    state: str
    """FINISHED (by itself, or stopped with a savepoint), CANCELED (by this loop) or FAILED."""
    savepoint: str | None
    """The savepoint it stopped with, if any."""
    cause: str
    """Why it failed ('' unless FAILED, or ended otherwise than asked)."""
    stop_error: str | None
    """Why Flink refused the last stop-with-savepoint attempt, if a stop was asked and refused."""
    drained: bool = False
    """It ended with nothing left in flight: it finished by itself (a bounded input), or stopped with
    a draining savepoint, whose final watermark makes every stage wait for every record it holds
    before the savepoint is taken. A stop without a drain, a cancel or a failure leaves what the
    stage held in the last snapshot, for the next run."""
    held: int | None = None
    """Records the stage held at the last count before the job ended (None: never counted)."""
    lost_taskmanager: bool = False
    """Cancelled because its mini cluster's TaskManager was gone (Flink stops it after a task's
    clean-up fails too): its last checkpoint is retained; a new mini cluster resumes from it."""


Held = Callable[[], "tuple[int, int] | None"]
"""Reads what the stage holds: (records, seconds the oldest has been held), or None when unknown."""

HELD_READ_EVERY_S = 2.0
"""How often a backfill's drain asks how many records the stage still holds."""


class Backfill:
    """The end of a backfill (``--until-end``), phase by phase: until the group has committed the
    input present at start (`targets`), the job runs; then it keeps running, checkpoints and all,
    while the stage still holds records, for at most `bound_s` (`JobConfig.longest_record_s`: what
    one record may take); then it is stopped with a draining savepoint, which waits for what is
    left, again for at most `bound_s`. Waiting before the stop keeps output flowing and the
    savepoint short; the drain is what makes the end complete."""

    def __init__(self, progress: GroupProgress, targets: dict[TopicPartition, int], bound_s: float,
                 held: Held | None) -> None:
        self._progress = progress
        self._targets = targets
        self.bound_s = bound_s
        self._held = held
        self.committed_at: float | None = None
        self._last_check = 0.0
        self.last_held: tuple[int, int] | None = None

    def read_held(self) -> tuple[int, int] | None:
        if self._held is not None:
            with contextlib.suppress(Exception):
                self.last_held = self._held()
        return self.last_held

    def ready_to_drain(self, now: float, report: Callable[[str], None], job: JobDriver) -> bool:
        """Whether to stop with a draining savepoint now; says why when it starts waiting and stopping.
        Not before every task of the job runs: a resumed backfill whose input was committed by the
        run before must not spend its bound on the job's start, which Flink's refusals would."""
        if now - self._last_check < (0.5 if self.committed_at is None else HELD_READ_EVERY_S):
            return False
        self._last_check = now
        if self.committed_at is None:
            with contextlib.suppress(Exception):
                if self._progress.reached(self._targets) and job.tasks_running():
                    self.committed_at = now
            if self.committed_at is None:
                return False
            held = self.read_held()
            if held is None or held[0] == 0:
                report("llmstream: backfill input committed; stopping with a draining savepoint")
                return True
            report(f"llmstream: backfill input committed; waiting for the {held[0]} records the stage still "
                   f"holds (up to {self.bound_s:g} s) before the draining savepoint")
            return False
        held = self.read_held()
        if held is None or held[0] == 0:
            report("llmstream: the stage holds no more records; stopping with a draining savepoint")
            return True
        if now - self.committed_at >= self.bound_s:
            report(f"llmstream: the stage still holds {held[0]} records after {self.bound_s:g} s; stopping with a "
                   f"draining savepoint, which waits for them up to {self.bound_s:g} s more")
            return True
        return False

    def waiting_line(self, now: float) -> str | None:
        """The progress line while the stage's last records are waited for."""
        if self.committed_at is None or self.last_held is None:
            return None
        count, oldest_s = self.last_held
        return (f"draining: {count} records held by the stage, longest {oldest_s} s "
                f"({now - self.committed_at:.0f} of up to {self.bound_s:g} s)")


def drive(driver: JobDriver, stop: StopRequest, *, savepoints_uri: str, backfill: Backfill | None = None,
          figures: RunFigures | None = None, progress_every_s: float = 0.0, stop_timeout_s: float = 60.0,
          cancel_on_timeout: bool = True, on_stop: Callable[[], None] | None = None,
          report: Callable[[str], None] = print) -> RunEnd:
    """Watches the job until it ends.

    ``stop.savepoint`` set: stop with a savepoint; ``stop.cancel`` set: cancel. With ``backfill``
    the job is stopped with a draining savepoint once its input is committed and its records are out
    (`Backfill`), the stop waiting up to the backfill's bound rather than ``stop_timeout_s``. A stop
    without a savepoint in time cancels the job, or with ``cancel_on_timeout`` false raises a
    `ClusterError` (the job left running). Every ``progress_every_s`` (0: never) a progress line:
    the compact status (``figures``), or "starting" until there are figures. ``on_stop`` is called
    once, as a stop with a savepoint starts (`jobs.graph.gate_operator.open_for_stop`).
    """
    stopper = SavepointStop(driver, savepoints_uri)
    started, last_report, last_failures = time.monotonic(), 0.0, 0.0
    failures: list[str] = []
    draining = lost_taskmanager = False
    no_taskmanager_since: float | None = None
    timeout_s = stop_timeout_s
    while not driver.ended():
        now = time.monotonic()
        if now - last_failures >= 2.0:
            last_failures = now
            failures = driver.failure_history() or failures
            if driver.taskmanagers() == 0:
                no_taskmanager_since = no_taskmanager_since or now
                if now - no_taskmanager_since >= NO_TASKMANAGER_S and not lost_taskmanager:
                    lost_taskmanager = True
                    cause = _first_and_last(failures, "")
                    report(f"llmstream: no TaskManager has been registered for {NO_TASKMANAGER_S:g} s"
                           + (f" (the first failure: {cause})" if cause else "")
                           + ("; the job waits for one" if driver.taskmanagers_return else
                              "; Flink stopped the mini cluster's only TaskManager: cancelling the job"))
                    if not driver.taskmanagers_return:
                        stopper.cancel()
            else:
                no_taskmanager_since = None
                lost_taskmanager = False
        if stop.cancel.is_set():
            stopper.cancel()
        elif stop.savepoint.is_set() and not stopper.started:
            _final_figures(figures, now)
            if on_stop is not None:
                on_stop()
            stopper.start(drain=False, timeout_s=stop_timeout_s)
        elif backfill is not None and not stopper.started and backfill.ready_to_drain(now, report, driver):
            _final_figures(figures, now)
            if on_stop is not None:
                on_stop()
            draining = True
            timeout_s = backfill.bound_s
            stopper.start(drain=True, timeout_s=timeout_s)
        stopper.poll()
        if stopper.timed_out:
            if not cancel_on_timeout:
                raise ClusterError(stopper.error or f"timed out after {timeout_s:g} s waiting for the "
                                                     f"savepoint of job {driver.job_id}")
            report("llmstream: no savepoint in time; cancelling (the next run resumes from the last checkpoint)")
            stopper.cancel()
        due = bool(progress_every_s) and now - last_report >= progress_every_s
        latest = figures.refresh(now, force=due) if figures is not None else None
        if due:
            last_report = now
            waiting = backfill.waiting_line(now) if backfill is not None and not stopper.started else None
            if waiting is not None:
                report(f"llmstream: {now - started:6.0f}s  {waiting}")
            elif latest is not None:
                report(f"llmstream: {now - started:6.0f}s  {status_line(latest)}")
            else:
                report(f"llmstream: {now - started:6.0f}s  {driver.status():<9} starting")
        time.sleep(0.2)
    stopper.settle()
    state = driver.final_state()
    if state != "FINISHED" and stopper.cancelled:
        state = "CANCELED"
    cause = ""
    if state != "FINISHED":
        failures = driver.failure_history() or failures  # one more look: a mini cluster's API may still answer
        cause = _first_and_last(failures, driver.failure())
    drained = state == "FINISHED" and (draining or not stopper.started)
    held = backfill.last_held[0] if backfill is not None and backfill.last_held is not None else None
    return RunEnd(state=state, savepoint=stopper.savepoint, cause=cause,
                   stop_error=stopper.error if stopper.started else None, drained=drained, held=held,
                   lost_taskmanager=lost_taskmanager and not driver.taskmanagers_return and state == "CANCELED")


def _final_figures(figures: RunFigures | None, now: float) -> None:
    """The figures once more as a stop begins, while the job still answers: after it ends,
    `llmstream status` shows the last figures recorded, which the regular refresh (every
    `progress_every_s`) may have taken a second or more before the last records were counted."""
    if figures is not None:
        figures.refresh(now, force=True)


def _first_and_last(seen: list[str], last: str) -> str:
    """The cause to report. Flink's exception history (`seen`, oldest first) records the failure that
    failed the job; the job's result holds the last attempt's exception, which after restarts is often
    a consequence (a revoked ACL first, then "could not acquire the minimum required resources" on each
    restart), and in a mini cluster can be the TaskExecutor shutting down. So the first failure seen
    leads, followed by the last when restarts came between."""
    first = seen[0] if seen else ""
    if not first or (is_secondary(first) and last and not is_secondary(last)):
        return last or first
    if len(seen) > 1 and last and last != first:
        return f"{first} (then, after restarts: {last})"
    return first
