"""Whether a process still runs, and waiting for processes to end, on psutil. On the job's side
because `llmstream run` waits for its own JVM to exit (`jobs/runtime/jvm_archive.py`); the local services
(`jobs/dev/`) import them from here too."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

import psutil

__all__ = ["pid_alive", "wait_gone"]


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


def wait_gone(pids: Iterable[int], timeout: float, poll_s: float = 0.05) -> list[int]:
    """Waits up to ``timeout`` s for ``pids`` to exit; returns those still alive. A zombie counts
    as gone (`pid_alive`): a daemon's parent may never reap it."""
    deadline = time.monotonic() + timeout
    alive = [pid for pid in pids if pid_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = [pid for pid in alive if pid_alive(pid)]
    return alive
