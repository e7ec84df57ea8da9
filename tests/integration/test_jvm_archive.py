"""`llmstream run`'s class-data-sharing archive (jobs/runtime/jvm_archive.py), as a user meets it.

The first run with no archive says it saves one at its end and leaves exactly one file (no
half-written dump); the next run's JVM maps it (its CDS log, in the state directory, says so)
and both runs' records arrive exactly once. A torn archive is refused before any JVM maps it
(a JVM given a truncated archive dies of SIGBUS): the check throws it away and asks for a new dump.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.clients import kafka_admin
from jobs.dev.local_kafka import LocalBroker
from jobs.runtime.jvm_archive import (
    DIR_ENV,
    GatewayArchive,
)
from tests.conftest import SHELL_ENV
from tests.support.committed import check_exactly_once, final_tally
from tests.support.job_setup import SpawnSimulator, make_job, unique_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SAVING = "saving the JVM's loaded classes"


def _run(config: Path, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "--config", str(config), "--until-end",
                           "--progress-every", "5"], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return output


def _archive_of_a_new_run(env: dict[str, str]) -> GatewayArchive | None:
    """The archive a new `llmstream run` with `env` finds, asked in a new process as the run is.
    This test process may not find the same: PyFlink's launcher reads `os.environ` (FLINK_HOME,
    JAVA_HOME, PATH), which earlier tests on this worker may have changed (CI found None in it
    twice, where the runs beside it had found and used the archive)."""
    probe = ("import json\n"
             "from jobs.runtime.jvm_archive import GatewayArchive\n"
             "a = GatewayArchive.find()\n"
             "print(json.dumps(a and [str(a.directory), a.java, a.classpath]))")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                          check=False, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return None if found is None else GatewayArchive(Path(found[0]), found[1], found[2])


def test_the_first_run_saves_a_class_archive_and_the_next_run_maps_it(
        kafka_broker: LocalBroker, spawn_simulator: SpawnSimulator, tmp_path: Path) -> None:
    sim = spawn_simulator(["--latency", "fixed:5"])
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name="jsa")
    archives = tmp_path / "jvm"
    env = {**SHELL_ENV, DIR_ENV: str(archives)}
    env.pop("JVM_ARGS", None)
    env.pop("LLMSTREAM_JVM_ARCHIVE", None)
    records = unique_records(40, "jsa")

    kafka_admin.produce(setup.bootstrap, setup.input_topic, records[:20])
    first = _run(setup.path, env)
    assert SAVING in first and "llmstream: saved " in first, first[-2000:]
    saved = sorted(archives.iterdir())
    assert [p.suffix for p in saved] == [".jsa"], saved  # no dump left behind

    kafka_admin.produce(setup.bootstrap, setup.input_topic, records[20:])
    second = _run(setup.path, env)
    assert SAVING not in second, second[-2000:]
    cds_log = (Path(setup.config.checkpointing.directory) / "log" / "jvm-class-archive.log").read_text()
    assert f"Opened archive {saved[0]}" in cds_log and "Mapped dynamic region" in cds_log, cds_log[-2000:]
    check_exactly_once(final_tally(setup, [k.decode() for k, _ in records]))

    # A torn archive (a disk filled, a copy cut short) is refused, and the next run makes a new one.
    archive = _archive_of_a_new_run(env)
    assert archive is not None and archive.path == saved[0], (archive and archive.path, saved)
    assert archive.usable(archive.path)
    with open(archive.path, "r+b") as torn:
        torn.truncate(archive.path.stat().st_size * 3 // 4)
    crash_reports = set(Path.cwd().glob("hs_err_pid*.log"))
    assert not archive.usable(archive.path)
    assert set(Path.cwd().glob("hs_err_pid*.log")) == crash_reports, \
        "the check's JVM crash report must not land in the working directory"
    options = archive.jvm_options()
    assert not archive.path.exists(), "a torn archive must not stay to crash a later JVM"
    assert options[0] == f"-XX:ArchiveClassesAtExit={archive.pending}", options


def test_no_archive_when_turned_off_or_when_jvm_args_name_one(tmp_path: Path) -> None:
    # The environment the tests started with, as the run above uses: this process's own may carry
    # what earlier tests on this worker left in it.
    base = {**SHELL_ENV, DIR_ENV: str(tmp_path)}
    base.pop("JVM_ARGS", None)
    base.pop("LLMSTREAM_JVM_ARCHIVE", None)
    assert GatewayArchive.find({**base, "LLMSTREAM_JVM_ARCHIVE": "off"}) is None
    assert GatewayArchive.find({**base, "JVM_ARGS": "-Xshare:off"}) is None
    assert GatewayArchive.find({**base, "JVM_ARGS": "-XX:SharedArchiveFile=/x.jsa"}) is None
    archive = _archive_of_a_new_run(base)
    assert archive is not None and archive.path.parent == tmp_path
    assert archive.jvm_options()[0].startswith("-XX:ArchiveClassesAtExit="), archive.jvm_options()  # none yet: dump one
