"""The one drive loop (`jobs/launch/driver.py`) on a fake job: what `run` and `submit --until-end` do with a
stop request, a finished backfill, a refused or late savepoint, a cancel and a failure."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from jobs.clients.flink_rest import ClusterError
from jobs.launch.driver import Backfill, JobDriver, StopRequest, drive

SAVEPOINTS = "file:///state/savepoints"


@dataclass
class Attempt:
    """A stop in progress: done after `polls` questions, then the savepoint (or the refusal)."""

    job: FakeJob
    drain: bool
    polls: int = 2
    refusal: str | None = None

    def done(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def result(self) -> str:
        if self.refusal:
            raise ClusterError(self.refusal)
        self.job.state = "FINISHED"
        return f"{SAVEPOINTS}/savepoint-1"


@dataclass
class FakeJob(JobDriver):
    """A job that refuses `refusals` stops at once ("not all tasks running"), or never stops at all."""

    refusals: int = 0
    never_stops: bool = False
    fails_after: int | None = None
    state: str = "RUNNING"
    job_id: str = "job-1"
    retry_s: float = 0.01
    stops: list[bool] = field(default_factory=list)
    cancelled: bool = False
    asked: int = 0
    history: list[str] = field(default_factory=list)
    last_failure: str = "java.lang.RuntimeException: boom"

    def status(self) -> str:
        return self.state

    def ended(self) -> bool:
        self.asked += 1
        if self.fails_after is not None and self.asked > self.fails_after:
            self.state = "FAILED"
        return self.state in ("FINISHED", "CANCELED", "FAILED")

    def final_state(self) -> str:
        return self.state

    def failure(self) -> str:
        return self.last_failure if self.state == "FAILED" else ""

    def failure_history(self) -> list[str]:
        return list(self.history)

    def trigger_stop(self, *, drain: bool, directory: str) -> Any:
        assert directory == SAVEPOINTS
        self.stops.append(drain)
        if self.refusals > 0:
            self.refusals -= 1
            raise ClusterError("not all tasks are running")
        return Attempt(self, drain, refusal="the savepoint was declined" if self.never_stops else None)

    def cancel(self) -> None:
        self.cancelled = True
        self.state = "CANCELED"


class Progress:
    """The group's progress: the targets are reached on the `reach_at`-th question."""

    def __init__(self, reach_at: int) -> None:
        self.reach_at = reach_at
        self.asked = 0

    def reached(self, targets: dict[Any, int]) -> bool:
        self.asked += 1
        return self.asked >= self.reach_at


def requested(*, savepoint: bool = False, cancel: bool = False) -> StopRequest:
    stop = StopRequest.new()
    if savepoint:
        stop.savepoint.set()
    if cancel:
        stop.cancel.set()
    return stop


def test_a_stop_request_ends_with_a_savepoint_after_refusals() -> None:
    job = FakeJob(refusals=2)
    outcome = drive(job, requested(savepoint=True), savepoints_uri=SAVEPOINTS, report=lambda line: None)
    assert outcome.state == "FINISHED" and outcome.savepoint == f"{SAVEPOINTS}/savepoint-1"
    assert job.stops == [False, False, False] and not job.cancelled   # asked again while refused
    assert outcome.stop_error == "not all tasks are running"


@pytest.fixture(autouse=True)
def _read_held_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's count read every 50 ms instead of every 2 s: the same steps, sooner."""
    import jobs.launch.driver as driver_module

    monkeypatch.setattr(driver_module, "HELD_READ_EVERY_S", 0.05)


def backfill(*, reach_at: int = 2, bound_s: float = 60.0, held: Any = None) -> Backfill:
    """A backfill whose targets are reached on the `reach_at`-th question and whose stage holds what
    `held()` says (None: not counted)."""
    return Backfill(Progress(reach_at), {"t:0": 10}, bound_s, held)  # type: ignore[arg-type, dict-item]


def test_a_finished_backfill_stops_with_a_draining_savepoint() -> None:
    job, lines = FakeJob(), []
    outcome = drive(job, StopRequest.new(), savepoints_uri=SAVEPOINTS, backfill=backfill(), report=lines.append)
    assert outcome.state == "FINISHED" and outcome.savepoint is not None and outcome.drained
    assert job.stops == [True]
    assert "llmstream: backfill input committed; stopping with a draining savepoint" in lines


def test_a_backfill_waits_while_the_stage_holds_records_and_says_so() -> None:
    """Input committed, but the stage still holds calls: the job runs on (output keeps being
    committed) until the stage holds none, with a progress line that says how many and how old,
    and only then the draining savepoint."""
    counts = iter([(3, 74), (3, 75), (1, 76), (0, 0)])
    job, lines = FakeJob(), []
    stops_when_read: list[int] = []

    def held() -> tuple[int, int]:
        stops_when_read.append(len(job.stops))
        return next(counts)

    outcome = drive(job, StopRequest.new(), savepoints_uri=SAVEPOINTS, backfill=backfill(held=held),
                    progress_every_s=0.01, report=lines.append)
    assert outcome.drained and job.stops == [True]
    assert stops_when_read == [0, 0, 0, 0]  # every count read before the stop was asked for
    assert any("waiting for the 3 records the stage still holds (up to 60 s)" in line for line in lines), lines
    assert any("draining: 3 records held by the stage, longest 7" in line for line in lines), lines
    assert "llmstream: the stage holds no more records; stopping with a draining savepoint" in lines


def test_a_stage_that_holds_records_past_the_bound_is_drained_anyway() -> None:
    job, lines = FakeJob(), []
    outcome = drive(job, StopRequest.new(), savepoints_uri=SAVEPOINTS,
                    backfill=backfill(bound_s=0.3, held=lambda: (5, 9)), report=lines.append)
    assert outcome.drained and job.stops == [True] and outcome.held == 5
    assert any("still holds 5 records after 0.3 s" in line for line in lines), lines


def test_a_drain_that_does_not_end_in_time_is_not_a_finished_backfill() -> None:
    """The drain's savepoint never comes: the job is cancelled after the backfill's bound (not the
    Ctrl-C stop timeout) and the outcome says it is not drained, with what the stage held."""
    job, lines = FakeJob(never_stops=True), []
    started = time.monotonic()
    outcome = drive(job, StopRequest.new(), savepoints_uri=SAVEPOINTS, stop_timeout_s=0.1,
                    backfill=backfill(bound_s=0.6, held=lambda: (2, 1)), report=lines.append)
    assert outcome.state == "CANCELED" and not outcome.drained and outcome.held == 2
    assert time.monotonic() - started >= 1.2  # the bound waiting for the stage, then the bound for the drain
    assert any("no savepoint in time" in line for line in lines)


def test_a_backfill_stopped_by_the_user_is_not_drained() -> None:
    outcome = drive(FakeJob(), requested(savepoint=True), savepoints_uri=SAVEPOINTS,
                    backfill=backfill(reach_at=10**6), report=lambda line: None)
    assert outcome.state == "FINISHED" and outcome.savepoint is not None and not outcome.drained


def test_a_job_that_finishes_by_itself_is_drained() -> None:
    """A bounded input finishes the job by itself: its final watermark flushed every stage."""

    @dataclass
    class Bounded(FakeJob):
        def ended(self) -> bool:
            self.asked += 1
            if self.asked > 2:
                self.state = "FINISHED"
            return super().ended()

    outcome = drive(Bounded(), StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lambda line: None)
    assert outcome.state == "FINISHED" and outcome.drained and outcome.savepoint is None


def test_no_savepoint_in_time_cancels_the_job() -> None:
    job, lines = FakeJob(never_stops=True), []
    outcome = drive(job, requested(savepoint=True), savepoints_uri=SAVEPOINTS, stop_timeout_s=0.5,
                    report=lines.append)
    assert outcome.state == "CANCELED" and outcome.savepoint is None and job.cancelled
    assert outcome.stop_error == "the savepoint was declined"
    assert any("no savepoint in time; cancelling" in line for line in lines)


def test_without_cancel_on_timeout_the_refusal_is_raised_and_the_job_left_running() -> None:
    job = FakeJob(never_stops=True)
    with pytest.raises(ClusterError, match="the savepoint was declined"):
        drive(job, requested(savepoint=True), savepoints_uri=SAVEPOINTS, stop_timeout_s=0.5,
              cancel_on_timeout=False, report=lambda line: None)
    assert not job.cancelled and job.state == "RUNNING"


def test_a_second_request_cancels_at_once() -> None:
    job = FakeJob(never_stops=True)
    outcome = drive(job, requested(savepoint=True, cancel=True), savepoints_uri=SAVEPOINTS,
                    report=lambda line: None)
    assert outcome.state == "CANCELED" and job.cancelled


def test_a_job_that_fails_by_itself_says_why() -> None:
    outcome = drive(FakeJob(fails_after=2), StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lambda line: None)
    assert outcome.state == "FAILED" and outcome.cause == "java.lang.RuntimeException: boom"
    assert outcome.savepoint is None and outcome.stop_error is None


def test_after_restarts_the_first_failure_leads_the_reported_cause() -> None:
    """A revoked ACL fails the job; each restart then fails on a slot not yet freed. The job's
    result holds only that last failure; the user needs the first."""
    denied = "org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to access topics"
    no_slot = "org.apache.flink.runtime.jobmanager.scheduler.NoResourceAvailableException: Could not acquire"
    job = FakeJob(fails_after=2, history=[denied, no_slot, no_slot], last_failure=no_slot)
    outcome = drive(job, StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lambda line: None)
    assert outcome.cause == f"{denied} (then, after restarts: {no_slot})"

    same = FakeJob(fails_after=2, history=[denied, denied], last_failure=denied)
    assert drive(same, StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lambda line: None).cause == denied


def test_the_blocking_stop_returns_the_savepoint_once_the_job_ended() -> None:
    job = FakeJob(refusals=1)
    assert job.stop_with_savepoint(drain=False, directory=SAVEPOINTS, timeout_s=5) == f"{SAVEPOINTS}/savepoint-1"
    assert job.state == "FINISHED"


def test_the_reported_cause_is_the_chains_not_a_suppressed_one() -> None:
    """A failed job's report can end with a suppressed exception Java indents (the TaskExecutor
    shutting down); the cause `run` reports is the innermost "Caused by" of the chain."""
    from jobs.clients.flink_rest import last_error_line

    report = ("org.apache.flink.runtime.client.JobExecutionException: Job execution failed.\n"
              "\tat org.apache.flink.X.y(X.java:1)\n"
              "Caused by: org.apache.flink.runtime.JobException: Recovery is suppressed by NoRestartBackoffTimeStrategy\n"
              "Caused by: org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to access topics\n"
              "\tat a.b(C.java:3)\n"
              "\tSuppressed: org.apache.flink.util.FlinkExpectedException: The TaskExecutor is shutting down.\n"
              "\t\tat a.b(C.java:4)\n")
    assert last_error_line(report).startswith("org.apache.kafka.common.errors.TopicAuthorizationException")
    assert last_error_line("RuntimeError: boom") == "RuntimeError: boom"

    # The chain itself can end with the TaskExecutor shutting down (seen in CI); the authorization
    # error is then a suppressed one, and still the cause.
    shutting_down = ("org.apache.flink.runtime.client.JobExecutionException: Job execution failed.\n"
                     "Caused by: org.apache.flink.util.FlinkExpectedException: The TaskExecutor is shutting down.\n"
                     "\tSuppressed: org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized\n")
    assert last_error_line(shutting_down) == "org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized"
    only_secondary = "Caused by: org.apache.flink.util.FlinkExpectedException: The TaskExecutor is shutting down.\n"
    assert last_error_line(only_secondary).startswith("org.apache.flink.util.FlinkExpectedException")


def test_the_exception_history_names_the_cause_when_the_result_names_the_shutdown() -> None:
    denied = "org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to access topics"
    shutdown = "org.apache.flink.util.FlinkExpectedException: The TaskExecutor is shutting down."
    job = FakeJob(fails_after=2, history=[denied], last_failure=shutdown)
    assert drive(job, StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lambda line: None).cause == denied
    # and the other way round: a history that saw only the shutdown does not hide a better result
    job = FakeJob(fails_after=2, history=[shutdown], last_failure=denied)
    assert drive(job, StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lambda line: None).cause == denied


# Shortened from a mini cluster's log (CI, 2026-12-02): the writer's send error fails the task, its
# clean-up rethrows it, and the TaskManager stops before the JobManager hears of the task's failure.
MINI_CLUSTER_LOG = """\
2026-12-02 01:00:17,361 INFO  org.apache.flink.runtime.executiongraph.ExecutionGraph       [] - Job llmstream-inference switched from state CREATED to RUNNING.
2026-12-02 01:00:35,041 WARN  org.apache.flink.runtime.taskmanager.Task                    [] - inference -> kafka_results[9]: Writer (1/1)#0 (5b5c_94cf_0_0) switched from RUNNING to FAILED with failure cause:
java.io.IOException: One or more Kafka Producer send requests have encountered exception
\tat org.apache.flink.connector.kafka.sink.KafkaWriter.checkAsyncException(KafkaWriter.java:297) ~[blob_p:5.0.0-2.2]
Caused by: org.apache.flink.util.FlinkRuntimeException: Failed to send data to Kafka sec-out-1@-1
\tat org.apache.flink.connector.kafka.sink.KafkaWriter$WriterCallback.decorateException(KafkaWriter.java:368)
\t... 1 more
Caused by: org.apache.flink.kafka.shaded.org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to access topics: [sec-out]
2026-12-02 01:00:35,161 ERROR org.apache.beam.runners.fnexecution.control.FnApiControlClient [] - FnApiControlClient closed, clearing outstanding requests
2026-12-02 01:00:35,582 ERROR org.apache.flink.runtime.taskmanager.Task                    [] - FATAL - exception in exception handler of task inference (1/1)#0.
java.io.IOException: One or more Kafka Producer send requests have encountered exception
Caused by: org.apache.flink.kafka.shaded.org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to access topics: [sec-out]
2026-12-02 01:00:35,650 WARN  org.apache.flink.runtime.taskmanager.Task                    [] - Source: inference_ticks[4] (1/1)#0 (5b5c_e58f_0_0) switched from RUNNING to FAILED with failure cause:
org.apache.flink.util.FlinkException: Disconnect from JobManager responsible for 293a.
Caused by: org.apache.flink.util.FlinkExpectedException: The TaskExecutor is shutting down.
\tat org.apache.flink.runtime.taskexecutor.TaskExecutor.onStop(TaskExecutor.java:523) ~[flink-dist-2.2.1.jar:2.2.1]
2026-12-02 01:00:35,824 INFO  org.apache.flink.runtime.executiongraph.ExecutionGraph       [] - Job llmstream-inference switched from state FAILING to FAILED.
"""
DENIED_OUT = ("org.apache.flink.kafka.shaded.org.apache.kafka.common.errors.TopicAuthorizationException: "
              "Not authorized to access topics: [sec-out]")


def test_the_log_names_each_task_failure_by_its_root_cause() -> None:
    from jobs.launch.driver import logged_failures

    assert logged_failures(MINI_CLUSTER_LOG) == [
        DENIED_OUT, DENIED_OUT, "org.apache.flink.util.FlinkExpectedException: The TaskExecutor is shutting down."]
    assert logged_failures("2026-12-02 01:00:17,361 INFO  x [] - nothing failed\n") == []


def test_when_the_job_result_names_only_the_shutdown_the_log_names_the_cause(tmp_path: Any) -> None:
    """The TaskManager died of the failed task's clean-up before the JobManager heard of the task's
    failure: the job's result and its exception history name only the shutdown; the log, read from
    where this job started, names the authorization error."""
    from jobs.launch.driver import FlinkLog, MiniClusterDriver

    class FailedResult:
        def done(self) -> bool:
            return True

        def result(self) -> None:
            raise RuntimeError("org.apache.flink.runtime.client.JobExecutionException: Job execution failed.\n"
                               "Caused by: org.apache.flink.util.FlinkExpectedException: The TaskExecutor is "
                               "shutting down.\n")

    class Client:
        def get_job_execution_result(self) -> FailedResult:
            return FailedResult()

        def get_job_id(self) -> str:
            return "293a"

    earlier = "2026-12-02 00:59:00,000 WARN  Task [] - old (1/1) switched from RUNNING to FAILED with failure cause:\n" \
              "java.lang.RuntimeException: an earlier job's failure\n"
    log = tmp_path / "flink.log"
    log.write_text(earlier + MINI_CLUSTER_LOG)
    driver = MiniClusterDriver(Client(), log=FlinkLog(log, offset=len(earlier)))
    assert driver.failure() == DENIED_OUT
    assert drive(driver, StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lambda line: None).cause == DENIED_OUT
    # without the log (or with nothing in it) the shutdown is all there is to say
    assert MiniClusterDriver(Client()).failure().endswith("The TaskExecutor is shutting down.")
    assert MiniClusterDriver(Client(), log=FlinkLog(tmp_path / "absent.log")).failure().endswith("shutting down.")


def test_a_settled_restart_count_asks_again_after_the_metric_store_caught_up(monkeypatch: Any) -> None:
    """Flink's REST API answers job metrics from a store it refreshes only when asked: the first
    answer can be the old value. `settle_s` asks a second time and keeps the larger count."""
    from jobs.clients.flink_rest import FlinkRest

    answers = iter(["0", "4"])
    asked: list[str] = []

    def rest(self: FlinkRest, path: str, **_: Any) -> list[dict[str, str]]:
        asked.append(path)
        return [{"id": "numRestarts", "value": next(answers)}]

    monkeypatch.setattr(FlinkRest, "rest", rest)
    monkeypatch.setattr("jobs.clients.flink_rest.time.sleep", lambda s: None)
    assert FlinkRest("http://127.0.0.1:1").num_restarts("j", settle_s=2.0) == 4
    assert asked == ["/jobs/j/metrics?get=numRestarts"] * 2
    answers = iter(["3"])
    assert FlinkRest("http://127.0.0.1:1").num_restarts("j") == 3


def test_a_long_trace_keeps_its_root_cause_once_frames_are_left_out() -> None:
    """The exception history's traces are cut to `TRACE_CHARS`: a Kafka send failure's authorization
    error came after ~30 long frames and was cut off (run under load reported "Failed to send data");
    without the frames the whole chain fits."""
    from jobs.clients.flink_rest import TRACE_CHARS, last_error_line, without_frames

    frame = "\tat org.apache.flink.kafka.shaded.org.apache.kafka.clients.producer.internals.Sender.failBatch(Sender.java:843) ~[blob_p-7bf2:5.0.0-2.2]\n"
    trace = ("java.io.IOException: One or more Kafka Producer send requests have encountered exception\n" + frame * 15
             + "Caused by: org.apache.flink.util.FlinkRuntimeException: Failed to send data to Kafka out-0@-1\n" + frame * 25
             + "\t... 1 more\n"
             + "Caused by: org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to access topics: [out]\n")
    assert "TopicAuthorization" not in last_error_line(trace[:TRACE_CHARS])
    kept = without_frames(trace)
    assert len(kept) < TRACE_CHARS and "\tat " not in kept and "... 1 more" not in kept
    assert last_error_line(kept[:TRACE_CHARS]).startswith("org.apache.kafka.common.errors.TopicAuthorizationException")
    suppressed = "x.Y: top\n\tSuppressed: a.B: inner\n\t\tat a.b(C.java:4)\n"
    assert without_frames(suppressed) == "x.Y: top\n\tSuppressed: a.B: inner"


def test_a_gateway_gone_mid_watch_ends_the_drive_without_a_traceback() -> None:
    """A stop that arrives while the job restarts, and the JVM behind PyFlink's gateway going away
    meanwhile: asking the job's result whether it is done raises, which means the job has ended;
    the drive says so instead of raising out of `llmstream run`."""
    from jobs.launch.driver import MiniClusterDriver

    class GoneResult:
        def done(self) -> bool:
            raise ConnectionRefusedError("the gateway is gone")

        def result(self) -> None:
            raise ConnectionRefusedError("the gateway is gone")

    class Client:
        def get_job_execution_result(self) -> GoneResult:
            return GoneResult()

        def get_job_id(self) -> str:
            return "9a1c"

        def get_job_status(self) -> None:
            raise ConnectionRefusedError("the gateway is gone")

    outcome = drive(MiniClusterDriver(Client()), StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lambda line: None)
    assert outcome.state != "RUNNING"


def test_a_job_that_ends_before_its_savepoint_is_reported_still_returns_the_savepoint() -> None:
    """Seen on the standalone cluster: the job reached FINISHED on its savepoint before the REST
    trigger's answer came; `upgrade` then raised 'timed out after 180 s' 1.6 s after asking."""

    @dataclass
    class EndsFirst(FakeJob):
        def trigger_stop(self, *, drain: bool, directory: str) -> Any:
            attempt = super().trigger_stop(drain=drain, directory=directory)
            self.state = "FINISHED"
            return attempt

    assert EndsFirst().stop_with_savepoint(drain=False, directory=SAVEPOINTS, timeout_s=30) == f"{SAVEPOINTS}/savepoint-1"


class CountedFigures:
    """`RunFigures` as `drive` uses it: which refreshes were forced, and how many stops had begun then."""

    def __init__(self, job: FakeJob) -> None:
        self.job = job
        self.forced: list[int] = []

    def refresh(self, now: float, *, force: bool = False) -> None:
        if force:
            self.forced.append(len(self.job.stops))


@pytest.mark.parametrize("until_end", [False, True])
def test_the_figures_are_taken_once_more_as_a_stop_begins(until_end: bool) -> None:
    """An ended run's `llmstream status` shows the last figures recorded: without a refresh as the
    stop begins they could be a second or more older than the job's last counts."""
    job = FakeJob()
    figures = CountedFigures(job)
    stop = StopRequest.new() if until_end else requested(savepoint=True)
    backfill_end = backfill
    outcome = drive(job, stop, savepoints_uri=SAVEPOINTS, backfill=backfill_end() if until_end else None,
                    figures=figures, progress_every_s=0, report=lambda line: None)  # type: ignore[arg-type]
    assert outcome.state == "FINISHED"
    assert figures.forced == [0]  # once, before the stop was asked for


def test_how_a_run_ends_is_its_exit_code_and_one_line_that_says_what_it_left(tmp_path: Any) -> None:
    """`llmstream run`'s conclusion: a backfill is done (exit 0) only when drained; stopped, cancelled
    or cut short it is INCOMPLETE (exit 3) and says how many records the state keeps, where, and that
    the same command finishes them; a plain run stopped by the user exits 0 and says what it left."""
    from jobs.launch.driver import RunEnd
    from jobs.launch.run import INCOMPLETE, _conclude, exit_code
    from jobs.state.snapshots import StateDir

    class Committed:
        def snapshot(self) -> tuple[int, int]:
            return 718, 718

    state = StateDir(tmp_path)

    def concluded(outcome: RunEnd, *, until_end: bool) -> tuple[str, int, str]:
        said: list[str] = []
        name = _conclude(outcome, Committed(), state, said.append, backfill=until_end)  # type: ignore[arg-type]
        return name, exit_code(name), " ".join(said)

    done = RunEnd("FINISHED", "file:///s/savepoint-1", "", None, drained=True, held=0)
    name, code, said = concluded(done, until_end=True)
    assert (name, code) == ("FINISHED", 0)
    assert "committed 718/718 input records; every record present at start is in output or dead letters" in said

    cut = RunEnd("CANCELED", None, "", "timed out", drained=False, held=9)
    name, code, said = concluded(cut, until_end=True)
    assert (name, code) == (INCOMPLETE, 3)
    assert "backfill not finished: at most 9 records in the job's state" in said
    assert f"the last checkpoint in {state.location}" in said and "the same command finishes them" in said

    stopped = RunEnd("FINISHED", "file:///s/savepoint-2", "", None, drained=False, held=4)
    name, code, said = concluded(stopped, until_end=True)
    assert (name, code) == (INCOMPLETE, 3) and "savepoint file:///s/savepoint-2" in said

    failed = RunEnd("FAILED", None, "java.lang.RuntimeException: boom", None)
    name, code, said = concluded(failed, until_end=True)
    assert (name, code) == ("FAILED", 1) and "the same command resumes it from the last checkpoint" in said

    name, code, said = concluded(cut, until_end=False)
    assert (name, code) == ("CANCELED", 0) and "at most 9 records in the last checkpoint" in said
    name, code, said = concluded(stopped, until_end=False)
    assert (name, code) == ("FINISHED", 0) and "resumes from savepoint file:///s/savepoint-2" in said


def test_a_drain_waits_as_long_as_one_record_may_take() -> None:
    """The bound follows from the config: the longest Retry-After pause, the record deadline once for
    the call and once for each user function; a provider batch adds its collection's wait and the
    provider's completion window."""
    from tests.support.configs import minimal_config
    from udfs.config import with_overrides

    config = minimal_config()
    assert config.longest_record_s() == 60 + 120
    shaped = with_overrides(config, async_={"record_deadline_s": 30}, retry={"max_retry_after_s": 5},
                            model={"preprocess": "m:f"}, output={"postprocess": "m:g"})
    assert shaped.longest_record_s() == 5 + 30 * 3
    batch = with_overrides(config, model={"mode": "batch"}, provider_batch={"max_wait_s": 10})
    assert batch.longest_record_s() == 60 + 120 + 10 + 24 * 3600


def test_a_stop_that_never_completes_says_the_job_is_still_running(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Any) -> None:
    """`llmstream stop` and `upgrade`: a savepoint Flink keeps declining is not a stop; the error says
    the job runs on, unchanged, and where its checkpoints are."""
    from jobs.launch import submit
    from jobs.state.snapshots import StateDir

    class DecliningRest:
        def trigger_stop(self, job_id: str, directory: str, *, drain: bool) -> str:
            return "trigger-1"

        def stop_savepoint(self, job_id: str, trigger: str) -> str:
            raise ClusterError("the savepoint was declined")

        def job_status(self, job_id: str) -> str:
            return "RUNNING"

    monkeypatch.setattr(submit, "STOP_TIMEOUT_S", 0.3)
    state = StateDir(tmp_path)
    with pytest.raises(ClusterError) as err:
        submit._stop_when_running(DecliningRest(), "job-9", state, drain=False)  # type: ignore[arg-type]
    assert "the savepoint was declined" in str(err.value)
    assert f"job job-9 is still running, unchanged (its checkpoints go on in {state.location})" in str(err.value)


@pytest.mark.parametrize("come_back", [False, True])
def test_a_job_with_no_taskmanager_left_is_said_so_and_in_a_mini_cluster_cancelled(
        monkeypatch: pytest.MonkeyPatch, come_back: bool) -> None:
    """The 200 s broker partition: Flink stopped a mini cluster's only TaskManager, and the job
    restarted forever ("Could not acquire the minimum required resources"). Now `drive` says so
    after `NO_TASKMANAGER_S` and, where no TaskManager can come back, cancels the job (its last
    checkpoint is kept; `llmstream run` starts a new mini cluster from it). On a cluster it says so
    and waits."""
    import jobs.launch.driver as driver_module

    monkeypatch.setattr(driver_module, "NO_TASKMANAGER_S", 0.0)

    @dataclass
    class Orphaned(FakeJob):
        taskmanagers_return: bool = come_back

        def taskmanagers(self) -> int | None:
            if self.come_back_after is not None and self.asked > self.come_back_after:
                self.state = "FINISHED"  # a cluster: a TaskManager came back, the job ran to its end
            return 0

        come_back_after: int | None = 12 if come_back else None

    denied = "org.apache.kafka.common.errors.TimeoutException: Timeout expired after 60000ms while awaiting EndTxn(false)"
    job, lines = Orphaned(state="RESTARTING", history=[denied]), []
    outcome = drive(job, StopRequest.new(), savepoints_uri=SAVEPOINTS, report=lines.append)
    said = [line for line in lines if "no TaskManager has been registered" in line]
    assert said and denied in said[0], lines
    if come_back:
        assert "the job waits for one" in said[0] and not job.cancelled and not outcome.lost_taskmanager
    else:
        assert "cancelling the job" in said[0] and job.cancelled
        assert outcome.state == "CANCELED" and outcome.lost_taskmanager


def test_a_run_whose_mini_cluster_lost_its_taskmanager_starts_a_new_one_from_the_last_checkpoint(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """`llmstream run`: a job cancelled for want of a TaskManager is started again in a new mini
    cluster, from the newest snapshot (not `--fresh` or the first run's `--from-savepoint` again),
    holding the state directory once; after `NEW_MINI_CLUSTERS` losses it ends FAILED, saying that
    the same command resumes."""
    from types import SimpleNamespace

    from jobs.launch import run
    from jobs.launch.driver import RunEnd
    from jobs.launch.plan import RunOptions
    from jobs.state.snapshots import StateDir

    lost = RunEnd("CANCELED", None, "", None, lost_taskmanager=True, held=3)
    finished = RunEnd("FINISHED", None, "", None, drained=True)
    prepared: list[RunOptions] = []
    claims: list[str] = []

    def prepare(config: Any, options: RunOptions, site: Any, *, report: Any) -> Any:
        prepared.append(options)
        site.claim(SimpleNamespace(exclusive=lambda: _claimed(claims)))
        return SimpleNamespace(build=SimpleNamespace(state=StateDir(tmp_path)))

    def _claimed(claims: list[str]) -> Any:
        import contextlib

        claims.append("claimed")
        return contextlib.nullcontext()

    outcomes = iter([lost, finished])
    monkeypatch.setattr(run, "prepare", prepare)
    monkeypatch.setattr(run, "_run", lambda *args, **kwargs: ("FINISHED" if (o := next(outcomes)).drained
                                                               else "CANCELED", o))
    said: list[str] = []
    state = run.run_job(SimpleNamespace(metrics=SimpleNamespace(prometheus_port=None)),  # type: ignore[arg-type]
                        RunOptions(until_end=True, fresh=True, from_savepoint="file:///old"), report=said.append)
    assert state == "FINISHED" and claims == ["claimed"]
    assert [(o.fresh, o.from_savepoint, o.until_end) for o in prepared] == [(True, "file:///old", True),
                                                                             (False, None, True)]
    assert "llmstream: starting a new mini cluster; it resumes from the last checkpoint" in said

    always_lost = iter([lost] * (run.NEW_MINI_CLUSTERS + 1))
    monkeypatch.setattr(run, "_run", lambda *args, **kwargs: ("CANCELED", next(always_lost)))
    said.clear()
    state = run.run_job(SimpleNamespace(metrics=SimpleNamespace(prometheus_port=None)),  # type: ignore[arg-type]
                        RunOptions(), report=said.append)
    assert state == "FAILED" and run.exit_code(state) == 1
    assert any(f"lost its TaskManager {run.NEW_MINI_CLUSTERS + 1} times" in line and "the same command resumes"
               in line for line in said), said


def test_restarts_of_many_jobs_settle_once_for_all_of_them(monkeypatch: Any) -> None:
    """Every job is asked once, then all again after one `settle_s`: one sleep, the larger count kept."""
    from jobs.clients.flink_rest import FlinkRest

    answers = {"a": iter(["1", "0"]), "b": iter(["0", "2"])}
    asked: list[str] = []
    slept: list[float] = []

    def rest(self: FlinkRest, path: str, **_: Any) -> list[dict[str, str]]:
        asked.append(path)
        return [{"id": "numRestarts", "value": next(answers[path.split("/")[2]])}]

    monkeypatch.setattr(FlinkRest, "rest", rest)
    monkeypatch.setattr("jobs.clients.flink_rest.time.sleep", slept.append)
    assert FlinkRest("http://127.0.0.1:1").restarts_of(["a", "b"], settle_s=2.0) == {"a": 1, "b": 2}
    assert slept == [2.0]
    assert asked == [f"/jobs/{j}/metrics?get=numRestarts" for j in ("a", "b", "a", "b")]
    assert FlinkRest("http://127.0.0.1:1").restarts_of([], settle_s=2.0) == {} and slept == [2.0]
