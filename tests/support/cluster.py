"""The shared standalone cluster between and during the integration tests: `heal` brings it back
to a clean state before a test, `wait_for_checkpoints` waits for checkpoints the REST API reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from jobs.clients.flink_rest import TERMINAL_STATES, FlinkRest
from jobs.dev.local_cluster import LocalCluster
from tests.support.waiting import wait_until


def heal(cluster: LocalCluster, taskmanagers: int = 1, timeout: float = 180) -> None:
    """Bring the shared cluster back to a clean state: no jobs running, ``taskmanagers`` registered."""
    for job in cluster.jobs():
        if job["state"] not in ("FINISHED", "CANCELED", "FAILED"):
            with contextlib.suppress(Exception):
                cluster.cancel(job["jid"], timeout=60)
    cluster.reap_orphans(grace_s=5)
    cluster.start(taskmanagers=taskmanagers, timeout=timeout)

    def settled() -> bool:
        # A TaskManager can die just after the previous test's job was cancelled: Flink's Python
        # runner sometimes fails its clean-up ("Reference count must not be negative") and that is
        # fatal to the TaskManager. It leaves the JobManager at once and exits seconds later; a
        # check that only compared the two counts passed with none left. Start a new one then.
        if len(cluster.taskmanager_pids()) < taskmanagers:
            cluster.start(taskmanagers=taskmanagers, timeout=timeout)
        ov = cluster.overview() or {}
        return bool(ov.get("taskmanagers") == len(cluster.taskmanager_pids()) >= taskmanagers
                    and ov.get("slots-available") == ov.get("slots-total"))

    wait_until(settled, timeout, interval=1,
               message=lambda: f"the cluster to settle: {cluster.overview()}, TaskManager pids "
                               f"{cluster.taskmanager_pids()}")


def not_failed(cluster: FlinkRest, job_id: str) -> Callable[[], None]:
    """A `CommittedReader.wait_for` check: fails the wait at once, with Flink's reason, if the job
    FAILED (a wait for output from a dead job would otherwise sit out its whole timeout)."""
    def check() -> None:
        assert cluster.job_status(job_id) != "FAILED", f"job {job_id} FAILED: {cluster.failure(job_id)}"

    return check


def wait_for_checkpoints(cluster: FlinkRest, job_id: str, n: int = 3, timeout: float = 240) -> int:
    """Until ``n`` more checkpoints of ``job_id`` completed, counted from the call, as the REST API
    reports them: what the job had written is then committed, and anything late or duplicated would
    show. Returns the number seen, early if the job stopped running (no checkpoint will come)."""
    start = cluster.completed_checkpoints(job_id)

    def more() -> tuple[int] | None:  # a tuple: 0 more is an answer too, when the job stopped
        done = cluster.completed_checkpoints(job_id) - start
        return (done,) if done >= n or cluster.job_status(job_id) in TERMINAL_STATES else None

    (done,) = wait_until(more, timeout, interval=0.5,
                         message=lambda: f"{n} more checkpoints of job {job_id} "
                                         f"({cluster.completed_checkpoints(job_id) - start} completed)")
    return done

