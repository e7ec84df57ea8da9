"""Scenarios on the standalone cluster, as the fault and cost tests run them: records with unique
ids into the input topic, a committed reader on the output and dead-letter topics, the job
submitted; then the test injects its fault and `Run.finish` counts what a consumer saw. And
`LocalRun`: ``llmstream run`` started as a user starts it, for the tests that stop and rerun it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jobs.clients import kafka_admin
from jobs.dev.local_cluster import LocalCluster
from tests.conftest import SHELL_ENV
from tests.support.cluster import not_failed, wait_for_checkpoints
from tests.support.committed import CommittedReader, Tally, final_tally
from tests.support.job_setup import JobSetup, unique_records
from tests.support.waiting import METRICS_SETTLE_S

RECORDS = 5000
"""Records of one scenario: ~40 s of work at the fault tests' pace, so a fault lands mid-stream."""


def total_restarts(cluster: LocalCluster, job_ids: list[str]) -> int:
    """Restarts of every job a scenario submitted, each read after the metric store has settled."""
    return sum(restarts_by_job(cluster, job_ids).values())


def restarts_by_job(cluster: LocalCluster, job_ids: list[str]) -> dict[str, int]:
    """Each job's restarts, read after the metric store has settled (`FlinkRest.restarts_of`: one
    `METRICS_SETTLE_S` for all of a scenario's jobs)."""
    return cluster.restarts_of(job_ids, settle_s=METRICS_SETTLE_S)


@dataclass
class Run:
    """One scenario in progress: its job(s), the records sent and the committed reader."""

    cluster: LocalCluster
    setup: JobSetup
    ids: list[str]
    reader: CommittedReader
    job_ids: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def job_id(self) -> str:
        return self.job_ids[-1]

    def submit(self, savepoint: str | None = None) -> str:
        job_id = self.cluster.submit(self.setup.path, savepoint=savepoint)
        self.job_ids.append(job_id)
        self.cluster.wait_for_job_state(job_id, "RUNNING", timeout=180)
        return job_id

    def not_failed(self) -> None:
        not_failed(self.cluster, self.job_id)()

    def wait_mid_stream(self, fraction: float = 0.15, timeout: float = 120) -> None:
        """Until a fraction of the ids is committed, so the fault lands mid-stream."""
        assert self.reader.wait_for(int(len(self.ids) * fraction), timeout, check=self.not_failed), (
            f"only {self.reader.unique_ids()} of {len(self.ids)} committed before the fault")
        assert self.reader.unique_ids() < len(self.ids), "the stream finished before the fault"

    def restarts(self) -> int:
        return total_restarts(self.cluster, self.job_ids)

    def finish(self, timeout: float = 300) -> Tally:
        """Wait for every id, give late duplicates three more checkpoints to appear, then count independently."""
        done = self.reader.wait_for(len(self.ids), timeout, check=self.not_failed)
        wait_for_checkpoints(self.cluster, self.job_id, 3)
        self.reader.stop()
        result = final_tally(self.setup, self.ids)
        assert done, f"not every id arrived within {timeout} s: {result}"
        return result


def start_records(cluster: LocalCluster, setup: JobSetup, records: list[tuple[bytes, bytes]]) -> Run:
    """``records`` (key = id) into the input topic, the reader started, the job submitted and RUNNING."""
    kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
    reader = CommittedReader(setup.bootstrap, [setup.output_topic, setup.dead_letter_topic])
    reader.start()
    run = Run(cluster, setup, [k.decode() for k, _ in records], reader)
    run.submit()
    return run


def start_run(cluster: LocalCluster, setup: JobSetup, prefix: str, n: int = RECORDS) -> Run:
    """`start_records` with ``n`` valid requests whose ids are ``<prefix>-<i>``."""
    return start_records(cluster, setup, unique_records(n, prefix))


class LocalRun:
    """``llmstream run`` as a user starts it, in its own process group (the JVM included).

    ``command`` is the ``llmstream`` to run (default: this checkout's, ``python -m jobs.cli``), e.g.
    an earlier release's (`tests.support.release_build`), with its ``env`` and ``cwd``."""

    def __init__(self, config_path: Path, log_path: Path, *extra: str, env: dict[str, str] | None = None,
                 command: list[str] | None = None, cwd: Path | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in wait()
        llmstream = command or [sys.executable, "-m", "jobs.cli"]
        self.process = subprocess.Popen(
            [*llmstream, "run", "--config", str(config_path), "--progress-every", "2", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env if command else {**SHELL_ENV, **(env or {})}, cwd=cwd, start_new_session=True, text=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def still_running(self) -> None:
        """A `CommittedReader.wait_for` check: fails the wait at once, with the run's output, if the
        command ended (a wait for its output would otherwise sit out its whole timeout)."""
        assert self.process.poll() is None, f"llmstream run ended:\n{self.output()[-3000:]}"

    def signal_group(self, sig: int) -> None:
        """What Ctrl-C in a terminal does (SIGINT to the foreground group) or kill -9 of the group."""
        os.killpg(self.process.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill_if_running(self) -> None:
        """kill -9 of the group if the run is still there: a test that failed mid-run leaves no JVM behind."""
        if self.process.poll() is None:
            self.signal_group(signal.SIGKILL)
            self.wait(timeout=60)
