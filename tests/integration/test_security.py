"""llmstream against a secured Kafka (`secure_broker`: TLS, SASL/SCRAM-SHA-512, mutual TLS, ACLs).

What a user sees: a job run (`llmstream run`) and a cluster submission (`llmstream submit`) over
SCRAM and over mutual TLS write every id exactly once, read back by a read_committed consumer on
the same secured listener; each misconfiguration ends `llmstream run` at preflight in seconds
with exit 2 and one line naming the setting; and a canary password and API key used for a whole
`-v` run appear nowhere llmstream writes or serves: its output and logs, `llmstream plan` and
`llmstream status --json`, the state directory, Flink's REST configuration, the records.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from jobs import cli
from jobs.clients import kafka_admin
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.secure_kafka import JOB, LACKING_USERS, WRONG_HOST, SecureBroker, job_acls
from jobs.launch import submit as submit_mod
from jobs.launch.plan import RunOptions
from jobs.runtime.jvm_archive import DIR_ENV
from tests.conftest import SHELL_ENV
from tests.support.job_setup import unique_records, write_config
from tests.support.secured import Names, Secured, files_under, grep_secret, rest_pages
from udfs.config import JobConfig, with_overrides

pytestmark = pytest.mark.integration

REPORT = Path(__file__).resolve().parents[2] / "var" / "security-report.md"
PREFLIGHT_BOUND_S = 30.0


def _traced(records: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """Each record with a W3C traceparent header of its own."""
    return [(k, v, [("traceparent", f"00-{uuid.uuid4().hex}-{'1' * 16}-01".encode())]) for k, v in records]


def _produce(broker: SecureBroker, names: Names, n: int, prefix: str) -> list[str]:
    """``n`` requests spread over both input topics, each with a traceparent, and one malformed record."""
    admin = broker.kafka_python_config("admin")
    records = unique_records(n, prefix)
    traced = _traced(records)
    kafka_admin.produce(admin, names.inputs[0], traced[: n // 2])
    kafka_admin.produce(admin, names.inputs[1], traced[n // 2:])
    kafka_admin.produce(admin, names.inputs[1], [(b"bad", b"{not json")])
    return [k.decode() for k, _ in records]


def _exactly_once(broker: SecureBroker, names: Names, ids: list[str]) -> list[Any]:
    """Every id once in the output and the malformed record in the dead letters, read over the
    SASL_SSL listener by a read_committed consumer (the admin: the job may only write there)."""
    reader = broker.kafka_python_config("admin")
    out = kafka_admin.consume_committed(reader, names.output, expected=len(ids), timeout_s=60)
    dead = kafka_admin.consume_committed(reader, names.dead_letter, expected=1, timeout_s=60)
    seen = Counter(json.loads(m.value)["id"] for m in out)
    assert set(seen) == set(ids) and max(seen.values()) == 1, f"{len(seen)} of {len(ids)} ids, duplicates " \
        f"{[i for i, c in seen.items() if c > 1][:5]}"
    assert [json.loads(m.value)["reason"] for m in dead] == ["invalid_json"]
    topics = Counter(json.loads(m.value)["source"]["topic"] for m in out)
    assert set(topics) == set(names.inputs)
    assert all(dict(m.headers).get("traceparent", b"").startswith(b"00-") for m in out)
    return [*out, *dead]


class RestWatcher(threading.Thread):
    """Keeps what Flink's REST API serves about the job while it runs: its configuration, the
    JobManager's, the job graph and the exceptions."""

    def __init__(self, rest_url: Callable[[], str | None]) -> None:
        super().__init__(daemon=True)
        self._rest_url = rest_url
        self.pages: dict[str, bytes] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.5):
            base = self._rest_url()
            if not base:
                continue
            try:
                jobs = requests.get(f"{base}/jobs", timeout=2).json().get("jobs", [])
                paths = ["/jobmanager/config", "/taskmanagers"]
                for job in jobs:
                    paths += [f"/jobs/{job['id']}", f"/jobs/{job['id']}/config", f"/jobs/{job['id']}/exceptions",
                              f"/jobs/{job['id']}/plan"]
                for path in paths:
                    self.pages[path] = requests.get(base + path, timeout=2).content
            except (requests.RequestException, ValueError):
                continue

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def test_submit_over_mutual_tls_with_a_pattern_every_id_once(
        secured: Secured, secure_broker: SecureBroker, cluster: LocalCluster, tmp_path: Path) -> None:
    """`llmstream submit --until-end` to the standalone cluster over mutual TLS, reading the inputs by
    pattern: every id once; the key password appears in none of the cluster's REST pages or logs."""
    config, names = secured(via="mtls")
    config = with_overrides(config, kafka={"input_topics": None, "input_topic_pattern": f"sec-{names.tag}-in-.*"})
    path = write_config(config, tmp_path)
    ids = _produce(secure_broker, names, 200, "mtls")
    assert submit_mod.submit(str(path), jobmanager=cluster.address, options=RunOptions(until_end=True)) == 0
    records = _exactly_once(secure_broker, names, ids)
    key_password_file = Path(secure_broker.client_properties(JOB, "mtls")["ssl.key.password"][len("${file:"):-1])
    key_password = key_password_file.read_text().strip()
    places = {**rest_pages(cluster.rest_url), **files_under(cluster.log_dir), "records": b"\n".join(m.value for m in records)}
    assert not grep_secret(key_password, places), f"the key password leaked into: {grep_secret(key_password, places)}"


LACKING_KEYS = {"read_input": "kafka.input_topics", "read_group": "kafka.group_id",
                "write_output": "kafka.output_topic", "write_dead_letter": "kafka.dead_letter_topic",
                "transactional_id": "kafka.transactional_id_prefix"}
MISCONFIGURATIONS = [
    # (case, how to break the job's kafka config, the key named, words the message has)
    ("wrong password", "wrong_password", "kafka.properties.sasl.jaas.config", "wrong password or unknown user"),
    ("broker certificate from an unknown CA", "other_ca", "kafka.properties.ssl.truststore.location",
     "not signed by a CA"),
    ("broker certificate for another host", "wrong_host", "kafka.bootstrap_servers", "does not name that host"),
    ("no client certificate on the mutual-TLS listener", "no_client_cert", "kafka.properties.ssl.keystore.location",
     "refused this client's certificate"),
    ("PLAINTEXT to the TLS listener", "plaintext", "kafka.properties.security.protocol", "does not speak PLAINTEXT"),
    *[(f"principal lacks {omit}", user, LACKING_KEYS[omit], f"principal User:{user} may not")
      for user, omit in LACKING_USERS.items()],
]


def _broken(case: str, secured: Secured, broker: SecureBroker, tmp_path: Path) -> JobConfig:
    if case in LACKING_USERS:
        return secured(user=case, omit=LACKING_USERS[case])[0]
    if case == "no_client_cert":
        config, _ = secured(via="mtls")
        props = {k: v for k, v in config.kafka.properties.items() if not k.startswith(("ssl.keystore", "ssl.key."))}
        return with_overrides(config, kafka={"properties": props})
    config, _ = secured()
    props = dict(config.kafka.properties)
    if case == "wrong_password":
        wrong = tmp_path / "wrong-password"
        wrong.write_text("not-the-password\n")
        wrong.chmod(0o600)
        props["sasl.jaas.config"] = props["sasl.jaas.config"].replace(str(broker.password_file(JOB)), str(wrong))
    elif case == "other_ca":
        props["ssl.truststore.location"] = str(broker.other_ca_file)
    elif case == "wrong_host":
        return with_overrides(config, kafka={"bootstrap_servers": broker.wrong_host_bootstrap_servers})
    elif case == "plaintext":
        props = {}
    return with_overrides(config, kafka={"properties": props})


@pytest.fixture(scope="module")
def report_rows() -> Iterator[list[str]]:
    rows: list[str] = []
    yield rows
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("| misconfiguration | exit | seconds | what `llmstream run` says |\n|---|---|---|---|\n"
                      + "\n".join(rows) + "\n")


@pytest.mark.parametrize(("label", "case", "key", "words"), MISCONFIGURATIONS, ids=[m[0] for m in MISCONFIGURATIONS])
def test_a_misconfiguration_ends_run_at_preflight_naming_the_setting(
        label: str, case: str, key: str, words: str, secured: Secured, secure_broker: SecureBroker,
        tmp_path: Path, capsys: pytest.CaptureFixture[str], report_rows: list[str]) -> None:
    config = _broken(case, secured, secure_broker, tmp_path)
    path = write_config(config, tmp_path)
    started = time.monotonic()
    code = cli.main(["run", "--config", str(path)])
    took = time.monotonic() - started
    err = capsys.readouterr().err.strip()
    report_rows.append(f"| {label} | {code} | {took:.1f} | `{err}` |")
    assert code == 2, err
    assert err.startswith(f"llmstream: config error: {key}: ") and words in err, err
    assert "\n" not in err and "Traceback" not in err
    assert took < PREFLIGHT_BOUND_S
    assert WRONG_HOST not in err or case == "wrong_host"


@pytest.mark.slow
def test_revoked_credentials_fail_the_job_visibly_the_next_run_resumes_once_and_the_secrets_appear_nowhere(
        secured: Secured, secure_broker: SecureBroker, tmp_path: Path) -> None:
    """Over SASL_SSL/SCRAM with two input topics, the password in a file, the API key in an environment
    variable (`model.api_key_env`, which reaches the Python worker's environment, and Beam would print
    that) and a header's value in a file, each record with its traceparent.

    WRITE on the output topic revoked while `llmstream run` runs: the job fails (no restart strategy)
    and `run` exits non-zero saying why; granted again, the next run (`llmstream -v run --until-end`)
    resumes from the retained checkpoint and every id is written exactly once. Then the canary hunt
    over both runs: their output, `plan`, `status --json`, the config, the records and headers,
    Flink's REST pages while they ran, the state directory and the class archive the -v run made.
    (One set-up and job for the two claims, which were two tests each paying a run's start and end.)

    Without restarts, to keep it short: the cause `run` reports comes from Flink's exception history
    (`jobs/launch/driver.py`), which names the authorization error also when the job's own result ends
    with "The TaskExecutor is shutting down" (seen in CI) or, after restarts, with a slot not freed."""
    api_key = f"sk-canary-{uuid.uuid4().hex}"
    header_secret = f"hdr-canary-{uuid.uuid4().hex}"
    header_file = tmp_path / "header-secret"
    header_file.write_text(header_secret + "\n")
    header_file.chmod(0o600)
    password = secure_broker.password_file(JOB).read_text().strip()
    config, names = secured(model={"api_key_env": "LLMSTREAM_CANARY_API_KEY", "api_key_file": None,
                                   "headers": {"X-Api-Key": f"${{file:{header_file}}}"}},
                            flink={"restart-strategy.type": "none"})
    path = write_config(config, tmp_path)
    state_dir = Path(str(config.checkpointing.directory))

    def rest_url() -> str | None:
        try:
            return str(json.loads((state_dir / "run.json").read_text())["rest_url"])
        except (OSError, ValueError, KeyError):
            return None

    with_key = {**SHELL_ENV, "LLMSTREAM_CANARY_API_KEY": api_key}
    watcher = RestWatcher(rest_url)
    watcher.start()
    archives = tmp_path / "jvm"  # the -v run makes its JVM's class archive, a file llmstream writes too
    try:
        first = _produce(secure_broker, names, 200, "before")
        admin = secure_broker.kafka_python_config("admin")
        run = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", "--config", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=with_key)
        try:
            committed = kafka_admin.consume_committed(admin, names.output, expected=len(first), timeout_s=300)
            assert len(committed) >= len(first), f"{len(committed)} of {len(first)} results before the revocation"
            write_output = [acl for acl in job_acls(
                JOB, input_topics=names.inputs, output_topic=names.output, dead_letter_topic=names.dead_letter,
                group_id=names.kafka()["group_id"], transactional_id_prefix=names.kafka()["transactional_id_prefix"])
                if acl.resource_pattern.resource_name == names.output and acl.operation.name == "WRITE"]
            with kafka_admin.admin(admin) as client:
                client.delete_acls(write_output)
            revoked_at = time.monotonic()
            second = unique_records(100, "after")
            kafka_admin.produce(admin, names.inputs[0], _traced(second))
            out, err = run.communicate(timeout=300)
            failed_after = time.monotonic() - revoked_at
        finally:
            if run.poll() is None:
                run.kill()
                run.wait(timeout=30)
        said = out + err
        assert run.returncode != 0
        assert b"authoriz" in said.lower(), said.decode()[-3000:]
        assert b"Traceback" not in said
        secure_broker.grant(JOB, input_topics=names.inputs, output_topic=names.output,
                            dead_letter_topic=names.dead_letter, group_id=names.kafka()["group_id"],
                            transactional_id_prefix=names.kafka()["transactional_id_prefix"])
        again = subprocess.run([sys.executable, "-m", "jobs.cli", "-v", "run", "--config", str(path), "--until-end"],
                               capture_output=True, timeout=900, env={**with_key, DIR_ENV: str(archives)}, check=False)
    finally:
        watcher.stop()
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert b"resuming from" in again.stdout + again.stderr
    ids = first + [k.decode() for k, _ in second]
    records = _exactly_once(secure_broker, names, ids)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    (REPORT.parent / "security-revocation.txt").write_text(
        f"WRITE on the output topic revoked: llmstream run exited {run.returncode} {failed_after:.1f} s later, "
        f"saying: {[line for line in said.decode().splitlines() if 'authoriz' in line.lower()][:1]}; "
        "after the grant, the next run resumed and wrote every id once\n")

    plan = subprocess.run([sys.executable, "-m", "jobs.cli", "-v", "plan", "--config", str(path)],
                          capture_output=True, timeout=300, env=with_key, check=False)
    status = subprocess.run([sys.executable, "-m", "jobs.cli", "-v", "status", "--json", "--config", str(path)],
                            capture_output=True, timeout=300, env=with_key, check=False)
    assert status.returncode == 0, status.stderr.decode()[-2000:]
    figures = json.loads(status.stdout)
    assert figures["input"]["group_committed"] == len(ids) + 1   # lag against the secured broker: none left
    assert figures["input"]["end_offset"] == len(ids) + 1
    assert any(b"/jobs/" in k.encode() for k in watcher.pages), "the REST API was never read while the job ran"

    places = {"failed run's output": said, "run stdout": again.stdout, "run stderr (-v)": again.stderr,
              "plan": plan.stdout + plan.stderr, "status --json": status.stdout + status.stderr,
              "config file": path.read_bytes(),
              "records and headers": b"\n".join(m.value + repr(m.headers).encode() for m in records),
              **{f"REST {p}": page for p, page in watcher.pages.items()},
              **files_under(state_dir), **files_under(archives)}
    assert any(name.endswith(".jsa") for name in files_under(archives)), "the run saved no class archive"
    for secret in (password, api_key, header_secret):
        assert not grep_secret(secret, places), f"a secret leaked into: {grep_secret(secret, places)}"
