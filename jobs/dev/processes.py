"""Process facts shared by the services llmstream starts (broker, Flink cluster, model servers),
on psutil rather than /proc parsing. The port helpers live on the job's side (`jobs/ports.py`,
which `llmstream run` uses too) and are re-exported here."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable

import psutil

from jobs.ports import free_port, port_in_use

__all__ = ["children", "cmdline", "free_port", "pid_alive", "port_in_use", "terminate", "wait_gone"]

log = logging.getLogger("llmstream.processes")


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie; reaps it if it is our exited child."""
    try:
        proc = psutil.Process(pid)
        if proc.status() != psutil.STATUS_ZOMBIE:
            return True
        with contextlib.suppress(psutil.Error, ChildProcessError):
            proc.wait(timeout=0)
        return False
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` (empty if it is gone), to tell our process from a reused pid."""
    try:
        return list(psutil.Process(pid).cmdline())
    except psutil.Error:
        return []


def children(pid: int) -> list[int]:
    """All descendants of ``pid`` (e.g. a TaskManager's Python workers)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def wait_gone(pids: Iterable[int], timeout: float, poll_s: float = 0.05) -> list[int]:
    """Waits up to ``timeout`` s for ``pids`` to exit; returns those still alive. A zombie counts
    as gone (`pid_alive`): a daemon's parent may never reap it."""
    deadline = time.monotonic() + timeout
    alive = [pid for pid in pids if pid_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = [pid for pid in alive if pid_alive(pid)]
    return alive


def _signal(pids: Iterable[int], kill: bool) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.kill() if kill else proc.terminate()


def terminate(pids: Iterable[int], timeout: float, what: str = "process") -> list[int]:
    """SIGTERM ``pids``, wait up to ``timeout`` s, SIGKILL the rest; returns the pids still alive
    after the SIGKILL (normally none)."""
    pids = list(pids)
    _signal(pids, kill=False)
    alive = wait_gone(pids, timeout)
    for pid in alive:
        log.warning("%s %d did not stop within %g s; killing it", what, pid, timeout)
    _signal(alive, kill=True)
    return wait_gone(alive, 10)
