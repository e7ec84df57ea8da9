"""The secured local broker (`jobs/dev/secure_kafka.py`): who gets in, and what each principal may do.

The tests talk to the session's `secure_broker` as users' clients would: kafka-python with
`kafka_python_config`, the job's own translation of `kafka.properties` (`udfs/config/kafka_security.py`)
and the Java client (what Flink's Kafka ends use) with `client_properties`. Each test works on
its own uuid topics, group and transactional ids, created by admin and granted by the test.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import (
    GroupAuthorizationFailedError,
    KafkaError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailedError,
)
from kafka.structs import OffsetAndMetadata

from jobs.dev import kafka_cli
from jobs.dev.secure_kafka import (
    ADMIN,
    JOB,
    LACKING_USERS,
    SCRAM_USERS,
    UNTRUSTED_CLIENT,
    Permission,
    SecureBroker,
    SecureBrokerConfig,
    Via,
)
from jobs.runtime import jars
from tests.support.waiting import wait_until
from udfs.config import kafka_security

pytestmark = pytest.mark.integration

RECORDS = 3
TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class JobNames:
    """One test's uuid names for what a job reads, writes and commits under, and a topic never granted."""

    input: str
    output: str
    dead_letter: str
    group: str
    transactional_id_prefix: str
    ungranted: str

    def grant(self, broker: SecureBroker, principal: str, omit: Permission | None = None) -> None:
        broker.grant(principal, input_topics=[self.input], output_topic=self.output,
                     dead_letter_topic=self.dead_letter, group_id=self.group,
                     transactional_id_prefix=self.transactional_id_prefix, omit=omit)


@pytest.fixture
def names(secure_broker: SecureBroker) -> Iterator[JobNames]:
    """Fresh topics (created by admin, ``RECORDS`` records in the input), group and transactional prefix."""
    run = uuid.uuid4().hex[:10]
    made = JobNames(f"in-{run}", f"out-{run}", f"dlq-{run}", f"group-{run}", f"tx-{run}", f"other-{run}")
    topics = [made.input, made.output, made.dead_letter, made.ungranted]
    with secure_broker.admin() as admin:
        admin.create_topics({t: {"num_partitions": 1, "replication_factor": 1} for t in topics},
                            wait_for_metadata=True)
    producer = KafkaProducer(**secure_broker.kafka_python_config(ADMIN))
    try:
        for i in range(RECORDS):
            producer.send(made.input, key=b"k%d" % i, value=b"request-%d" % i).get(timeout=30)
    finally:
        producer.close()
    yield made
    with secure_broker.admin() as admin:
        admin.delete_topics(topics)


def _consumer(config: dict[str, Any], **kwargs: Any) -> KafkaConsumer:
    return KafkaConsumer(**config, isolation_level="read_committed", auto_offset_reset="earliest",
                         enable_auto_commit=False, request_timeout_ms=TIMEOUT_MS, **kwargs)


def _read(consumer: KafkaConsumer, topic: str, expected: int, timeout_s: float = 30) -> list[Any]:
    """Records of partition 0 of ``topic`` until ``expected`` arrived or ``timeout_s`` passed; raises what poll raises."""
    consumer.assign([TopicPartition(topic, 0)])
    records: list[Any] = []

    def polled() -> bool:
        if len(records) < expected:  # each poll waits up to half a second for records
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return len(records) >= expected

    wait_until(polled, timeout_s, interval=0, or_last=True)
    return records


def _committed_values(broker: SecureBroker, topic: str, expected: int) -> list[bytes]:
    consumer = _consumer(broker.kafka_python_config(ADMIN))
    try:
        records = _read(consumer, topic, expected)
        return [r.value for r in records]
    finally:
        consumer.close()


# ---------------------------------------------------------------------- the job's principal


@pytest.mark.parametrize("via", ["scram", "mtls"])
def test_job_reads_writes_and_commits_exactly_what_it_was_granted(
    secure_broker: SecureBroker, names: JobNames, via: Via
) -> None:
    names.grant(secure_broker, JOB)
    job = secure_broker.kafka_python_config(JOB, via)

    consumer = _consumer(job, group_id=names.group)
    producer = KafkaProducer(**job, transactional_id=f"{names.transactional_id_prefix}-0")
    try:
        requests = _read(consumer, names.input, RECORDS)
        assert [r.value for r in requests] == [b"request-%d" % i for i in range(RECORDS)]

        producer.init_transactions()
        producer.begin_transaction()
        for record in requests[:-1]:
            producer.send(names.output, key=record.key, value=record.value.replace(b"request", b"result"))
        producer.send(names.dead_letter, key=requests[-1].key, value=b"dead-letter")
        producer.send_offsets_to_transaction(
            {TopicPartition(names.input, 0): OffsetAndMetadata(requests[-1].offset + 1, "", -1)}, names.group)
        producer.commit_transaction()

        producer.begin_transaction()
        producer.send(names.output, value=b"aborted")
        producer.flush()
        producer.abort_transaction()
    finally:
        producer.close()
        consumer.close()

    assert _committed_values(secure_broker, names.output, RECORDS - 1) == [b"result-0", b"result-1"]
    assert _committed_values(secure_broker, names.dead_letter, 1) == [b"dead-letter"]
    with secure_broker.admin() as admin:
        committed = admin.list_group_offsets({names.group: None})[names.group]
    assert committed[TopicPartition(names.input, 0)].offset == RECORDS

    with KafkaAdminClient(**job, request_timeout_ms=TIMEOUT_MS) as client:
        visible = set(client.list_topics())
        assert {names.input, names.output, names.dead_letter} <= visible and names.ungranted not in visible
        with pytest.raises(TopicAuthorizationFailedError):
            client.create_topics({f"{names.output}-new": {"num_partitions": 1, "replication_factor": 1}})
    reader = _consumer(job)
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            _read(reader, names.output, 1)
    finally:
        reader.close()


# ---------------------------------------------------------------------- one permission short


def _attempt(operation: Callable[[], object]) -> str:
    try:
        operation()
    except KafkaError as err:
        return type(err).__name__
    return "ok"


def _operations(broker: SecureBroker, user: str, names: JobNames) -> dict[str, str]:
    """Each of the job's operations tried on its own as ``user``: "ok" or the error's name."""
    config = broker.kafka_python_config(user)

    def read_input() -> None:
        consumer = _consumer(config)
        try:
            assert len(_read(consumer, names.input, RECORDS)) == RECORDS
        finally:
            consumer.close()

    def commit_group() -> None:
        consumer = _consumer(config, group_id=names.group)
        try:
            consumer.assign([TopicPartition(names.input, 0)])
            consumer.commit({TopicPartition(names.input, 0): OffsetAndMetadata(1, "", -1)})
        finally:
            consumer.close()

    def write(topic: str) -> Callable[[], None]:
        def send() -> None:
            producer = KafkaProducer(**config, max_block_ms=TIMEOUT_MS)
            try:
                producer.send(topic, value=b"x").get(timeout=30)
            finally:
                producer.close()
        return send

    def init_transactions() -> None:
        producer = KafkaProducer(**config, transactional_id=f"{names.transactional_id_prefix}-{user}",
                                 max_block_ms=TIMEOUT_MS)
        try:
            producer.init_transactions()
        finally:
            producer.close()

    return {
        "read_input": _attempt(read_input),
        "read_group": _attempt(commit_group),
        "write_output": _attempt(write(names.output)),
        "write_dead_letter": _attempt(write(names.dead_letter)),
        "transactional_id": _attempt(init_transactions),
    }


REFUSALS: dict[Permission, str] = {
    "read_input": TopicAuthorizationFailedError.__name__,
    "read_group": GroupAuthorizationFailedError.__name__,
    "write_output": TopicAuthorizationFailedError.__name__,
    "write_dead_letter": TopicAuthorizationFailedError.__name__,
    "transactional_id": TransactionalIdAuthorizationFailedError.__name__,
}


@pytest.mark.parametrize("user", sorted(LACKING_USERS))
def test_a_principal_one_permission_short_is_refused_exactly_that_operation(
    secure_broker: SecureBroker, names: JobNames, user: str
) -> None:
    missing = LACKING_USERS[user]
    names.grant(secure_broker, user, omit=missing)
    expected = {operation: "ok" for operation in REFUSALS}
    expected[missing] = REFUSALS[missing]
    if missing == "read_input":
        # Committing a group's offsets of a topic takes READ on that topic as well as on the group.
        expected["read_group"] = TopicAuthorizationFailedError.__name__
    assert _operations(secure_broker, user, names) == expected


# ---------------------------------------------------------------------- who does not get in


def _refused(caplog: pytest.LogCaptureFixture, config: dict[str, Any], reason: str, timeout_s: float = 90) -> str:
    """The line kafka-python logs matching ``reason`` when it cannot get in with ``config``.

    kafka-python retries until its bootstrap timeout and then raises a bare timeout, so the reason
    is only in its log; a loaded machine may first show a plain disconnect, so clients are tried
    until the reason shows or ``timeout_s`` passes. Getting in at all fails the test."""
    def refused_line() -> str | None:
        caplog.clear()
        with pytest.raises(KafkaTimeoutError):
            KafkaAdminClient(**config, bootstrap_timeout_ms=3000, request_timeout_ms=3000).close()
        found = re.search(f".*(?:{reason}).*", caplog.text)
        return found.group(0) if found else None

    with caplog.at_level(logging.WARNING, logger="kafka"):
        return wait_until(refused_line, timeout_s, interval=0,
                          message=lambda: f"{reason!r} in kafka-python's log:\n{caplog.text[-3000:]}")


def test_a_wrong_password_is_an_authentication_failure(
    secure_broker: SecureBroker, caplog: pytest.LogCaptureFixture
) -> None:
    config = {**secure_broker.kafka_python_config(JOB), "sasl_plain_password": "not-the-password"}
    logged = _refused(caplog, config, "SaslAuthenticationFailedError")
    assert "invalid credentials with SASL mechanism SCRAM-SHA-512" in logged


def test_a_client_trusting_another_ca_fails_tls(secure_broker: SecureBroker, caplog: pytest.LogCaptureFixture) -> None:
    vias: tuple[Via, ...] = ("scram", "mtls")
    for via in vias:
        config = {**secure_broker.kafka_python_config(JOB, via), "ssl_cafile": str(secure_broker.other_ca_file)}
        assert "unable to get local issuer certificate" in _refused(caplog, config, "CERTIFICATE_VERIFY_FAILED"), via


def test_a_certificate_for_another_host_fails_hostname_verification(
    secure_broker: SecureBroker, caplog: pytest.LogCaptureFixture
) -> None:
    config = {**secure_broker.kafka_python_config(JOB, "mtls"),
              "bootstrap_servers": secure_broker.wrong_host_bootstrap_servers}
    assert "IP address mismatch" in _refused(caplog, config, "CERTIFICATE_VERIFY_FAILED")


def test_the_mtls_listener_refuses_no_certificate_and_a_certificate_from_another_ca(
    secure_broker: SecureBroker, caplog: pytest.LogCaptureFixture
) -> None:
    mtls = secure_broker.kafka_python_config(JOB, "mtls")
    # The broker's TLS alert about the client's certificate (measured: bad_certificate without one,
    # certificate_unknown for one from another CA; TLS 1.3 stacks may say certificate_required / unknown_ca).
    alert = r"ALERT_(BAD_CERTIFICATE|CERTIFICATE_REQUIRED|CERTIFICATE_UNKNOWN|UNKNOWN_CA)"
    no_cert = {k: v for k, v in mtls.items() if k not in ("ssl_certfile", "ssl_keyfile", "ssl_password")}
    _refused(caplog, no_cert, alert)
    forged = secure_broker.files.client(UNTRUSTED_CLIENT)
    other = {**mtls, "ssl_certfile": str(forged.certificate), "ssl_keyfile": str(forged.key),
             "ssl_password": forged.password_file.read_text()}
    _refused(caplog, other, alert)


# ---------------------------------------------------------------------- what users are handed


@pytest.mark.parametrize("via", ["scram", "mtls"])
def test_client_properties_through_the_jobs_own_translation_connect_as_the_job(
    secure_broker: SecureBroker, names: JobNames, via: Via
) -> None:
    names.grant(secure_broker, JOB)
    properties = secure_broker.client_properties(JOB, via)
    assert all(secret not in json.dumps(properties) for secret in _secrets(secure_broker))
    args = kafka_security.client_args(properties)
    bootstrap = secure_broker.bootstrap_servers if via == "scram" else secure_broker.ssl_bootstrap_servers
    with KafkaAdminClient(bootstrap_servers=bootstrap, **args, request_timeout_ms=TIMEOUT_MS) as client:
        visible = client.list_topics()
    assert names.input in visible and names.ungranted not in visible


_JAVA_PROBE = """
import java.io.FileInputStream;
import java.util.Properties;
import java.util.concurrent.ExecutionException;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/** For each properties file: list the topics as its principal, then produce one record to args[0]. */
public class Probe {
    public static void main(String[] args) throws Exception {
        for (int i = 1; i < args.length; i++) {
            Properties props = new Properties();
            try (FileInputStream in = new FileInputStream(args[i])) { props.load(in); }
            props.put("default.api.timeout.ms", "30000");
            props.put("max.block.ms", "30000");
            String name = args[i].replaceAll(".*/", "");
            try (Admin admin = Admin.create(props)) {
                String topics = String.join(",", new java.util.TreeSet<>(admin.listTopics().names().get()));
                try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(
                        props, new ByteArraySerializer(), new ByteArraySerializer())) {
                    producer.send(new ProducerRecord<>(args[0], name.getBytes())).get();
                }
                System.out.println("RESULT " + name + " OK " + topics);
            } catch (ExecutionException e) {
                System.out.println("RESULT " + name + " ERROR " + e.getCause().getClass().getSimpleName());
            }
        }
    }
}
"""


def _resolved(properties: dict[str, str]) -> dict[str, str]:
    """``${file:PATH}`` replaced by the file's content, as the job's config loader does."""
    def read(match: re.Match[str]) -> str:
        return Path(match.group(1)).read_text().removesuffix("\n")
    return {k: re.sub(r"\$\{file:([^}]+)\}", read, v) for k, v in properties.items()}


def test_the_java_client_connects_with_client_properties(
    secure_broker: SecureBroker, names: JobNames, tmp_path: Path
) -> None:
    names.grant(secure_broker, JOB)
    wrong = secure_broker.client_properties(JOB, "scram")
    wrong["sasl.jaas.config"] = re.sub(r'password="[^"]*"', 'password="wrong"', wrong["sasl.jaas.config"])
    files = []
    for name, bootstrap, properties in (
        ("scram", secure_broker.bootstrap_servers, _resolved(secure_broker.client_properties(JOB, "scram"))),
        ("mtls", secure_broker.ssl_bootstrap_servers, _resolved(secure_broker.client_properties(JOB, "mtls"))),
        ("wrong-password", secure_broker.bootstrap_servers, wrong),
    ):
        path = tmp_path / name
        path.write_text("".join(f"{k}={v}\n" for k, v in {"bootstrap.servers": bootstrap, **properties}.items()))
        files.append(str(path))
    source = tmp_path / "Probe.java"
    source.write_text(_JAVA_PROBE)
    proc = subprocess.run(["java", "-cp", jars.classpath("broker"), str(source), names.output, *files],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    assert results.keys() == {"scram", "mtls", "wrong-password"}, proc.stdout
    for via in ("scram", "mtls"):
        status, topics = results[via].split(" ", 1)
        assert status == "OK", results
        assert {names.input, names.output, names.dead_letter} <= set(topics.split(",")), via
        assert names.ungranted not in topics.split(","), via
    assert results["wrong-password"] == "ERROR SaslAuthenticationException"
    assert sorted(_committed_values(secure_broker, names.output, 2)) == [b"mtls", b"scram"]


def _secrets(broker: SecureBroker) -> list[str]:
    return [path.read_text() for path in sorted(broker.files.secrets_dir.iterdir())]


def test_no_secret_in_logs_config_or_command_line(secure_broker: SecureBroker) -> None:
    found = _secrets(secure_broker)
    assert len(found) >= len(SCRAM_USERS) and all(len(s) >= 20 for s in found)
    for path in secure_broker.files.secrets_dir.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert secure_broker.files.secrets_dir.stat().st_mode & 0o777 == 0o700
    pid = secure_broker.pid()
    assert pid is not None
    exposed = [
        secure_broker.properties_file.read_text(),
        Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"),
        *(path.read_text(errors="replace") for path in secure_broker.log_file.parent.iterdir()),
    ]
    assert not [s for s in found if any(s in text for text in exposed)]


@pytest.mark.slow
def test_cli_start_secure_prints_client_properties_but_no_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = SecureBrokerConfig.ephemeral(tmp_path / "kafka-secure", heap="256m")
    argv = ["--secure", "--port", str(config.port), "--ssl-port", str(config.ssl_port),
            "--controller-port", str(config.controller_port), "--wrong-host-port", str(config.wrong_host_port),
            "--data-dir", str(config.data_dir), "--heap", "256m"]
    broker = SecureBroker(config)
    try:
        assert kafka_cli.main(["start", *argv, "--timeout", "180"]) == 0
        out, err = capsys.readouterr()
        passwords = _secrets(broker)
        assert passwords and not [p for p in passwords if p in out or p in err]

        first, snippet = out.split("\n", 1)
        assert f"bootstrap {broker.bootstrap_servers}" in first
        assert yaml.safe_load(snippet) == {"kafka": {"bootstrap_servers": broker.bootstrap_servers,
                                                     "properties": broker.client_properties(JOB, "scram")}}
        assert f"password=\"${{file:{broker.password_file(JOB)}}}\"" in snippet
        assert "ssl.key.password: ${file:" in snippet  # the mutual-TLS alternative, commented out

        assert kafka_cli.main(["status", *argv, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["ready"] and status["ssl_bootstrap"] == broker.ssl_bootstrap_servers
        assert kafka_cli.main(["stop", *argv]) == 0
        assert kafka_cli.main(["status", *argv]) == 1
    finally:
        broker.stop()
