"""Process control of the local services (jobs/dev/processes.py), on real child processes, and the
loopback port helpers they and `llmstream run` share (jobs/runtime/ports.py)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from jobs.dev.processes import terminate
from jobs.runtime import ports
from jobs.runtime.pids import pid_alive, wait_gone

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


def test_a_listening_port_is_in_use_and_a_free_one_is_not() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert ports.port_in_use(listener.getsockname()[1])
    assert not ports.port_in_use(ports.free_port())

