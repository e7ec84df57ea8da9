"""`llmstream demo` end to end, as a user runs it: its own broker, simulator and job."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import SHELL_ENV

pytestmark = pytest.mark.integration


def test_demo_answers_or_dead_letters_every_record_and_cleans_up() -> None:
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "demo", "--records", "60"], check=False,
                          capture_output=True, text=True, timeout=300, env=SHELL_ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = re.search(r"in (\d+), out (\d+), dead-lettered (\d+), missing (\d+)", done.stdout)
    assert summary, done.stdout[-2000:]
    records, out, dead, missing = map(int, summary.groups())
    assert records == 60
    assert dead == 2
    assert (out, missing) == (58, 0)
    assert "model-server SIMULATOR" in done.stdout
    assert done.stdout.rstrip().endswith("llmstream demo: shut down")
