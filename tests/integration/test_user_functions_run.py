"""Your own Python around the model on real parts: the ticket-triage example module
(jobs/examples/user_functions/triage.py) found where the user runs `llmstream run` and shipped to
the mini cluster's Python workers, in both lanes, and shipped by `llmstream submit` to the
standalone cluster's TaskManagers; a module that is not there is one line at start.

The module is copied to a directory that is on no one's path but the launch's (the command's
working directory, or `python.path`), so a worker that has it got it from the job.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from jobs.launch import submit as submit_mod
from jobs.launch.plan import RunOptions
from tests.conftest import SHELL_ENV
from tests.support.job_setup import LATER_LANE, LLMSTREAM, JobSetup, make_job

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "jobs" / "examples" / "user_functions" / "triage.py"
FUNCTIONS = {"preprocess": "triage:build_request", "skipped": "drop"}


def _tickets(n: int) -> list[tuple[bytes, bytes]]:
    """`n` tickets: every fifth closed (no call, dropped), every seventh without a subject (the
    example's build_request raises KeyError: a dead letter), the rest answered."""
    out = []
    for i in range(n):
        ticket: dict[str, Any] = {"ticket_id": i, "tier": "pro" if i % 2 else "free", "body": f"Ticket body {i}",
                                  "status": "closed" if i % 5 == 0 else "open"}
        if i % 7 != 3:
            ticket["subject"] = f"Subject {i}"
        out.append((f"t-{i}".encode(), json.dumps(ticket).encode()))
    return out


def _expected(n: int) -> tuple[set[int], set[int]]:
    answered = {i for i in range(n) if i % 5 != 0 and i % 7 != 3}
    failed = {i for i in range(n) if i % 5 != 0 and i % 7 == 3}
    return answered, failed


def _check(setup: JobSetup, n: int) -> None:
    answered, failed = _expected(n)
    out = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, expected=len(answered), timeout_s=60)
    bodies = [json.loads(r.value) for r in out]
    assert Counter(b["ticket_id"] for b in bodies) == Counter(answered)  # once each, closed ones dropped
    assert all(set(b) == {"ticket_id", "label", "confidence"} for b in bodies), bodies[:3]
    letters = [json.loads(r.value) for r in kafka_admin.consume_committed(
        setup.bootstrap, setup.dead_letter_topic, expected=len(failed), timeout_s=60)]
    assert sorted(json.loads(d["original"]["value"])["ticket_id"] for d in letters) == sorted(failed)
    assert {d["reason"] for d in letters} == {"user_function_error"}
    assert all("model.preprocess triage:build_request raised KeyError: 'subject'" in d["error"] for d in letters)


@pytest.mark.parametrize("stage", ["keyed", pytest.param("vectorized", marks=LATER_LANE)])
def test_run_finds_the_module_where_it_runs_and_ships_it_to_the_workers(
        stage: str, tmp_path: Path, kafka_broker: local_kafka.LocalBroker, fast_simulator: SpawnedSimulator) -> None:
    """The module reaches the workers by the job's files, whichever lane runs it; what the functions
    do to a record in each lane is the lane contract's (tests/unit/udfs/lanes/test_lane_contract.py),
    so `make test` ships it in the keyed lane and the full fault run in the vectorized lane too."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLE, work / "triage.py")
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, fast_simulator.url, name=f"user-fns-{stage}",
                     stage=stage, model=FUNCTIONS, output={"postprocess": "triage:to_output"})
    kafka_admin.produce(setup.bootstrap, setup.input_topic, _tickets(120))
    done = subprocess.run([str(LLMSTREAM), "run", "--config", str(setup.path), "--until-end"], cwd=work,
                          env=SHELL_ENV, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    _check(setup, 120)


def test_submit_ships_the_module_on_python_path_to_the_cluster(
        cluster: LocalCluster, tmp_path: Path, kafka_broker: local_kafka.LocalBroker,
        fast_simulator: SpawnedSimulator, capsys: pytest.CaptureFixture[str]) -> None:
    code = tmp_path / "team-code"
    code.mkdir()
    shutil.copy(EXAMPLE, code / "triage.py")
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, fast_simulator.url, name="user-fns-cluster",
                     model=FUNCTIONS, output={"postprocess": "triage:to_output"}, python={"path": [str(code)]})
    kafka_admin.produce(setup.bootstrap, setup.input_topic, _tickets(60))
    assert submit_mod.submit(str(setup.path), jobmanager=cluster.address, options=RunOptions(until_end=True)) == 0
    job_id = re.findall(r"as ([0-9a-f]{32})", capsys.readouterr().out)[0]
    assert cluster.wait_for_job_state(job_id, "FINISHED", timeout=300) == "FINISHED"
    _check(setup, 60)


def test_a_module_that_is_not_there_is_one_line_at_start(
        tmp_path: Path, kafka_broker: local_kafka.LocalBroker, fast_simulator: SpawnedSimulator) -> None:
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, fast_simulator.url, name="user-fns-missing",
                     model={"preprocess": "ticketing.triage:build_request"})
    done = subprocess.run([str(LLMSTREAM), "run", "--config", str(setup.path)], cwd=tmp_path, env=SHELL_ENV,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("llmstream: config error: model.preprocess: no module named 'ticketing' "
                                   "(looked in the current directory, python.path and the installed packages)")
