"""The TaskManager supervisor of a local standalone cluster: ``llmstream cluster start`` starts it,
``llmstream cluster stop`` stops it before the daemons, ``llmstream cluster status`` shows it.

A TaskManager process can die with the cluster still up: killed (``kill -9``, the OOM killer), or
stopped by Flink itself after a fatal task error (a Kafka writer that cannot abort its transaction,
PyFlink's "Reference count must not be negative" at a cancel). A standalone cluster then keeps its
jobs ``RESTARTING`` for want of slots until someone starts a TaskManager by hand. Like a process
supervisor (systemd's ``Restart=always``, supervisord), this small process watches the cluster's
TaskManager processes and starts a new one, with Flink's own ``taskmanager.sh start``, whenever
fewer run than the cluster was started with; the job then restores its last checkpoint on it.

- It watches processes (the pid files of the cluster's pid dir, checked against their command line),
  not the JobManager's registrations: a TaskManager that is gone is gone at once, while the
  JobManager counts a dead one until its heartbeat times out (50 s by default).
- A TaskManager that dies again soon after its restart (a crash loop: a bad setting, no memory)
  is restarted after a growing delay (1 s doubling to 60 s), and the delay is back at 1 s once a
  restarted one has lived `STABLE_S`.
- Python workers of a dead TaskManager that outlive it are killed after `ORPHAN_GRACE_S`.
- Only TaskManagers: a JobManager that dies takes its jobs with it unless the cluster is highly
  available (``--ha``, whose standby takes over). Without any JobManager process for `ALONE_S`
  the supervisor ends by itself, so a cluster killed from outside leaves no watcher behind.

Its record, ``supervisor.json`` in the cluster's work dir, says what it keeps and every restart
(``llmstream cluster status`` prints it). Run as ``python -m jobs.dev.cluster_supervisor
--work-dir W --taskmanagers N`` (`LocalCluster.start_supervisor`); its log is ``log/supervisor.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import psutil

from jobs.clients.flink_rest import ClusterError
from jobs.dev.local_cluster import (
    ClusterConfig,
    LocalCluster,
    Restart,
    SupervisorRecord,
)

log = logging.getLogger("llmstream.cluster.supervisor")

POLL_S = 1.0
STABLE_S = 60.0
MAX_DELAY_S = 60.0
ORPHAN_GRACE_S = 5.0
ALONE_S = 60.0


def _utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def next_delay(delay_s: float, since_last_start_s: float) -> float:
    """The wait before the next start: doubled (up to `MAX_DELAY_S`) when the last started
    TaskManager lived less than `STABLE_S` (a crash loop), else back to 1 s."""
    return min(MAX_DELAY_S, delay_s * 2) if since_last_start_s < STABLE_S else 1.0


class Supervisor:
    """Keeps ``wanted`` TaskManager processes of ``cluster`` running until told to stop."""

    def __init__(self, cluster: LocalCluster, wanted: int) -> None:
        self.cluster = cluster
        self.wanted = wanted
        self.record = SupervisorRecord(pid=os.getpid(), taskmanagers=wanted, started_at=_utc())
        self.stopping = False
        self._workers: dict[int, list[int]] = {}  # live TaskManager pid -> its Python workers
        self._orphans: list[tuple[float, list[int]]] = []  # (kill after, pids)
        self._delay_s = 0.5
        self._next_start = 0.0
        self._last_start = -STABLE_S

    def stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def run(self) -> int:
        self.record.write(self.cluster.work_dir)
        log.info("supervisor: keeping %d TaskManager(s) of %s running", self.wanted, self.cluster.work_dir)
        alone_since: float | None = None
        while not self.stopping:
            if not self.cluster._pids("standalonesession"):
                alone_since = alone_since or time.monotonic()
                if time.monotonic() - alone_since > ALONE_S:
                    log.warning("supervisor: no JobManager of this cluster for %g s; ending", ALONE_S)
                    return 0
            else:
                alone_since = None
                self.check()
            self._reap()
            time.sleep(POLL_S)
        log.info("supervisor: stopped")
        return 0

    def check(self) -> None:
        """One look: note TaskManagers that are gone, start one if fewer run than wanted."""
        live = self.cluster.taskmanager_pids()
        gone = [pid for pid in self._workers if pid not in live]
        for pid in gone:
            workers = [w for w in self._workers.pop(pid) if psutil.pid_exists(w)]
            log.warning("supervisor: TaskManager pid %d is gone (%d Python worker(s) left)", pid, len(workers))
            self.cluster._forget_pid("taskexecutor", pid)
            if workers:
                self._orphans.append((time.monotonic() + ORPHAN_GRACE_S, workers))
        for pid in live:
            self._workers[pid] = sorted(set(self._workers.get(pid, [])) | set(self.cluster.python_worker_pids(pid)))
        if len(live) >= self.wanted or time.monotonic() < self._next_start:
            return
        now = time.monotonic()
        self._delay_s = next_delay(self._delay_s, now - self._last_start)
        self._last_start = now
        self._next_start = now + self._delay_s
        restart = Restart(at=_utc(), gone=gone, started=None)
        try:
            self.cluster._script("taskmanager.sh", "start")
            new = [p for p in self.cluster.taskmanager_pids() if p not in live]
            restart.started = new[-1] if new else None
            if restart.started is not None:
                self._workers[restart.started] = []
            log.warning("supervisor: started TaskManager pid %s (%d of %d were running)",
                        restart.started, len(live), self.wanted)
        except (ClusterError, OSError) as err:
            restart.error = str(err).splitlines()[0][:300]
            log.error("supervisor: could not start a TaskManager: %s (next try in %g s)", restart.error, self._delay_s)
        self.record.restarts.append(restart)
        self.record.write(self.cluster.work_dir)

    def _reap(self) -> None:
        due = [pids for at, pids in self._orphans if at <= time.monotonic()]
        self._orphans = [(at, pids) for at, pids in self._orphans if at > time.monotonic()]
        for pids in due:
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()
                    log.warning("supervisor: killed Python worker %d that outlived its TaskManager", pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.cluster_supervisor", description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--taskmanagers", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    supervisor = Supervisor(LocalCluster(ClusterConfig.existing(args.work_dir)), args.taskmanagers)
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
