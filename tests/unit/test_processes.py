"""Process control of the local services (jobs/dev/processes.py), on real child processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs.dev.processes import pid_alive, terminate, wait_gone

IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def test_terminate_stops_a_process_with_sigterm() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert terminate([proc.pid], timeout=30) == []
    assert not pid_alive(proc.pid)


def test_terminate_kills_what_ignores_sigterm(caplog: pytest.LogCaptureFixture) -> None:
    proc = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert terminate([proc.pid], timeout=0.5, what="stubborn") == []
    assert not pid_alive(proc.pid)
    assert f"stubborn {proc.pid} did not stop within 0.5 s; killing it" in caplog.text


def test_wait_gone_returns_what_still_runs() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_gone([proc.pid], timeout=0.2) == [proc.pid]
    finally:
        proc.kill()
    assert wait_gone([proc.pid], timeout=30) == []
