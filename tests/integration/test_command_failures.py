"""Every expected failure of a user command is one line on stderr naming the setting, never a traceback.

Each command (`llmstream run | submit | stop | upgrade | status | plan`) runs as a user runs it,
the installed entry point in a child process with the shell's environment, against

- (a) a stopped broker: ``kafka.bootstrap_servers`` is a loopback port where nothing listens
  (the Flink side, where a command needs one, is a stub REST API that runs no job, given as
  ``--jobmanager`` or recorded as the local cluster);
- (b) no Flink cluster, with the session's broker (submit and upgrade check the broker first):
  ``--jobmanager`` where nothing listens, or none given and no local cluster (``LLMSTREAM_HOME``
  points at an empty directory, so the default work dir holds no record, or a record of a
  cluster that no longer answers);
- (c) a state directory that is a file, cannot be created, or (named by ``--state-dir`` to a
  command that continues a job) does not exist.

Exit 2 is a setting (the key or flag named on that line), 1 the work itself failing (nothing to
stop). A command that does not need the failing piece must not fail: `plan` never connects to
Kafka. The broker cases wait out the Kafka client's 30 s bootstrap, so all cases run at once.

Last, a `llmstream run` stopped with Ctrl-C ends with "job finished", exit 0 and no traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from jobs.clients import kafka_admin
from jobs.clients.cluster_address import RECORD
from jobs.dev.local_kafka import LocalBroker
from jobs.runtime.ports import free_port
from tests.conftest import SHELL_ENV
from tests.support.job_setup import JobConfigFactory, unique_records, write_config
from tests.support.waiting import wait_until
from udfs.config import load_config, to_dict, with_overrides

pytestmark = pytest.mark.integration

LLMSTREAM = Path(sys.executable).parent / "llmstream"
COMMAND_TIMEOUT_S = 240.0


# ---------------------------------------------------------------------- what each case runs


@dataclass(frozen=True)
class Case:
    """One command line ({placeholders} filled in by `places`) and what it must end with."""

    argv: str
    exit_code: int
    names: str
    home: str | None = None


CASES: dict[str, Case] = {
    # (a) a stopped broker
    "a-run": Case("run --config {config}", 2, "kafka.bootstrap_servers"),
    "a-submit": Case("submit --config {config} --jobmanager {stub}", 2, "kafka.bootstrap_servers"),
    "a-upgrade": Case("upgrade --config {config} --jobmanager {stub}", 2, "kafka.bootstrap_servers"),
    "a-status": Case("status --config {config} --jobmanager {stub}", 2, "kafka.bootstrap_servers"),
    "a-stop-needs-no-broker": Case("stop --config {config} --jobmanager {stub}", 1, "no running job called"),
    "a-status-local-cluster": Case("status --config {config}", 2, "kafka.bootstrap_servers", home="{stub_home}"),
    # (b) no Flink cluster (and a broker that answers: submit and upgrade check it first)
    "b-submit": Case("submit --config {live} --jobmanager {nobody}", 2, "--jobmanager"),
    "b-stop": Case("stop --config {live} --jobmanager {nobody}", 2, "--jobmanager"),
    "b-upgrade": Case("upgrade --config {live} --jobmanager {nobody}", 2, "--jobmanager"),
    "b-status": Case("status --config {live} --jobmanager {nobody}", 2, "--jobmanager"),
    "b-submit-no-local-cluster": Case("submit --config {live}", 2, "--jobmanager", home="{empty_home}"),
    "b-stop-no-local-cluster": Case("stop --config {live}", 2, "--jobmanager", home="{empty_home}"),
    "b-upgrade-local-cluster-gone": Case("upgrade --config {live}", 2, "--jobmanager", home="{gone_home}"),
    "b-status-local-cluster-gone": Case("status --config {live}", 2, "--jobmanager", home="{gone_home}"),
    # (c) the state directory
    "c-run-file": Case("run --config {config} --state-dir {file}", 2, "--state-dir"),
    "c-run-under-a-file": Case("run --config {config} --state-dir {file}/state", 2, "--state-dir"),
    "c-run-config-file": Case("run --config {config_state_file}", 2, "checkpointing.directory"),
    "c-submit-file": Case("submit --config {config} --state-dir {file}", 2, "--state-dir"),
    "c-stop-missing": Case("stop --config {config} --state-dir {missing}", 2, "--state-dir"),
    "c-upgrade-missing": Case("upgrade --config {config} --state-dir {missing}", 2, "--state-dir"),
    "c-status-missing": Case("status --config {config} --state-dir {missing}", 2, "--state-dir"),
    "c-status-file": Case("status --config {config} --state-dir {file}", 2, "--state-dir"),
    # plan builds the job graph and connects to nothing
    "plan-needs-no-broker": Case("plan --config {config}", 0, ""),
}


# ---------------------------------------------------------------------- a Flink REST API with no job


NO_JOB_ANSWERS: dict[str, object] = {"/overview": {"taskmanagers": 1, "slots-total": 2, "slots-available": 2},
                                     "/jobs/overview": {"jobs": []}}


class _NoJobs(BaseHTTPRequestHandler):
    """Answers what llmstream asks a cluster before it touches Kafka: it is up, and runs nothing."""

    def do_GET(self) -> None:
        answer = NO_JOB_ANSWERS.get(self.path.split("?")[0])
        body = json.dumps(answer if answer is not None else {"errors": ["Not found"]}).encode()
        self.send_response(200 if answer is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def stub_flink() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoJobs)
    thread = threading.Thread(target=server.serve_forever, name="stub-flink", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------- all cases, at once


def _places(directory: Path, stub: str, broker: str) -> dict[str, str]:
    dead_broker = f"127.0.0.1:{free_port()}"
    config = with_overrides(load_config(), kafka={"bootstrap_servers": dead_broker},
                            checkpointing={"directory": str(directory / "state")})
    (directory / "job.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    tag = uuid.uuid4().hex[:10]
    live = with_overrides(config, kafka={"bootstrap_servers": broker, "input_topic": f"cf-{tag}-in",
                                         "output_topic": f"cf-{tag}-out", "dead_letter_topic": f"cf-{tag}-dead",
                                         "group_id": f"cf-{tag}", "transactional_id_prefix": f"cf-{tag}"},
                          checkpointing={"directory": str(directory / "live-state")})
    (directory / "live.yaml").write_text(yaml.safe_dump(to_dict(live), sort_keys=False))
    k = live.kafka
    # Created here, so that preflight has nothing to say (it logs each topic it creates).
    kafka_admin.create_topics(broker, [k.topics()[0], k.output_topic, k.dead_letter_topic], partitions=2)
    a_file = directory / "a-file"
    a_file.write_text("not a directory\n")
    state_file = with_overrides(config, checkpointing={"directory": str(a_file)})
    (directory / "job-state-file.yaml").write_text(yaml.safe_dump(to_dict(state_file), sort_keys=False))
    (directory / "empty-home").mkdir()
    for home, address in (("gone-home", f"127.0.0.1:{free_port()}"), ("stub-home", stub)):
        work_dir = directory / home / "var" / "flink"  # the local cluster's default work dir
        work_dir.mkdir(parents=True)
        (work_dir / RECORD).write_text(json.dumps({"address": address, "conf_dir": str(work_dir / "conf"),
                                                   "log_dir": str(work_dir / "log")}))
    return {"config": str(directory / "job.yaml"), "live": str(directory / "live.yaml"), "config_state_file": str(directory / "job-state-file.yaml"),
            "stub": stub, "nobody": f"127.0.0.1:{free_port()}", "file": str(a_file),
            "missing": str(directory / "missing"), "empty_home": str(directory / "empty-home"),
            "gone_home": str(directory / "gone-home"), "stub_home": str(directory / "stub-home")}


@dataclass(frozen=True)
class CommandRun:
    """One command as a user ran it: its exit code, what it printed, how long it took."""

    code: int
    stdout: str
    stderr: str
    seconds: float


def _run(case: Case, places: dict[str, str]) -> CommandRun:
    env = dict(SHELL_ENV)
    if case.home is not None:
        env["LLMSTREAM_HOME"] = case.home.format(**places)
    started = time.monotonic()
    result = subprocess.run([str(LLMSTREAM), *case.argv.format(**places).split()], env=env, text=True,
                            capture_output=True, stdin=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT_S, check=False)
    return CommandRun(result.returncode, result.stdout, result.stderr, round(time.monotonic() - started, 1))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, stub_flink: str, kafka_broker: LocalBroker) -> dict[str, CommandRun]:
    places = _places(tmp_path_factory.mktemp("command-failures"), stub_flink, kafka_broker.bootstrap_servers)
    # Slowest first (the broker cases wait out the Kafka client's bootstrap timeout).
    order = sorted(CASES, key=lambda name: not name.startswith(("a-", "plan")))
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = {name: pool.submit(_run, CASES[name], places) for name in order}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_expected_failure_is_one_line_naming_the_setting(name: str, outcomes: dict[str, CommandRun]) -> None:
    case, got = CASES[name], outcomes[name]
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    seen = f"`llmstream {case.argv}` exited {got.code} after {got.seconds} s; stderr:\n{got.stderr[-3000:]}"
    assert got.code == case.exit_code, seen
    assert "Traceback" not in got.stderr, seen
    if case.exit_code == 0:
        assert json.loads(got.stdout)["nodes"], seen  # the execution plan
        return
    assert len(lines) == 1, seen
    assert lines[0].startswith("llmstream: ") and case.names in lines[0], seen


# ---------------------------------------------------------------------- a clean Ctrl-C


PROCESSING = re.compile(r"RUNNING\s+in [1-9]")
"""A progress line once the job has read records ("RUNNING   in 66 (4.8/s) | out 65 ...")."""


@pytest.mark.slow
def test_ctrl_c_stops_a_run_cleanly_without_a_traceback(job_config: JobConfigFactory, tmp_path: Path) -> None:
    """SIGINT to the run's process group (what Ctrl-C in a terminal sends) while records flow: the
    job stops with a savepoint, says so, exits 0, and stderr has no traceback (PyFlink's in-process
    Python worker reports its data channel closing mid-bundle, which is expected at a stop)."""
    config = job_config()
    assert config.kafka.input_topic is not None
    kafka_admin.produce(config.kafka.bootstrap_servers, config.kafka.input_topic, unique_records(2000, "ctrl-c"))
    path = write_config(config, tmp_path)
    out_path, err_path = tmp_path / "run.out", tmp_path / "run.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = subprocess.Popen([str(LLMSTREAM), "run", "--config", str(path), "--progress-every", "1"],
                                   stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=SHELL_ENV,
                                   start_new_session=True, text=True)
        try:
            def processing() -> bool:
                assert process.poll() is None, f"run exited {process.returncode}:\n{err_path.read_text()[-3000:]}"
                return PROCESSING.search(out_path.read_text()) is not None

            wait_until(processing, 240, message="the run to process records")
            os.killpg(process.pid, signal.SIGINT)
            code = process.wait(timeout=240)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert code == 0, f"exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    assert "SIGINT received: stopping with a savepoint" in stdout
    assert "job finished" in stdout and "resumes from savepoint" in stdout, stdout[-2000:]
    assert "Traceback" not in stderr, stderr[-5000:]
