"""Process facts shared by the services llmstream starts (broker, Flink cluster, model servers),
on psutil rather than /proc parsing. The port and pid helpers live on the job's side
(`jobs/runtime/ports.py`, `jobs/runtime/pids.py`), since `llmstream run` needs them too: import them
from there."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from pathlib import Path

import psutil

from jobs.runtime.pids import wait_gone

log = logging.getLogger("llmstream.processes")


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


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a service's log, for the error that says it did not start."""
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name})"
