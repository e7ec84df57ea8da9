"""Secrets by reference (`udfs/secret_refs.py`) and `kafka.properties` as kafka-python arguments
(`udfs/config/kafka_security.py`): what resolves, what is refused at load, and that no message carries a secret."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from udfs import secret_refs
from udfs.config import config_from_dict, kafka_security, load_config, to_dict
from udfs.errors import ConfigError

SECRET = "s3cr3t-canary-7f1d"


def secret_file(tmp_path: Path, text: str = SECRET + "\n", mode: int = 0o600) -> Path:
    path = tmp_path / "secret.txt"
    path.write_text(text)
    path.chmod(mode)
    return path


def base(**kafka: Any) -> dict[str, Any]:
    data = to_dict(load_config())
    data["kafka"] = {**data["kafka"], **kafka}
    return data


def test_placeholders_resolve_from_the_environment_and_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSTREAM_TEST_SECRET", SECRET)
    path = secret_file(tmp_path)
    assert secret_refs.resolve("a ${env:LLMSTREAM_TEST_SECRET} b", "k") == f"a {SECRET} b"
    assert secret_refs.resolve(f"${{file:{path}}}", "k") == SECRET   # one trailing newline dropped
    assert secret_refs.resolve("cost $${env:X} and $5", "k") == "cost ${env:X} and $5"
    assert secret_refs.has_placeholder("${env:X}") and not secret_refs.has_placeholder("$${env:X}")


@pytest.mark.parametrize(("text", "says"), [
    ("${env:LLMSTREAM_SURELY_UNSET}", "environment variable LLMSTREAM_SURELY_UNSET is not set"),
    ("${env:not valid}", "not a valid environment variable name"),
    ("${file:/nonexistent/llmstream/secret}", "secret file /nonexistent/llmstream/secret does not exist"),
    ("${vault:x}", "bad placeholder at character 0"),
    ("abc ${env:X", "bad placeholder at character 4"),
])
def test_unresolvable_placeholders_are_config_errors_naming_the_key(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        secret_refs.resolve(text, "kafka.properties.sasl.jaas.config")
    assert str(err.value).startswith("kafka.properties.sasl.jaas.config: ") and says in str(err.value)


def test_a_secret_file_others_can_read_is_warned_about_without_its_content(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = secret_file(tmp_path, mode=0o644)
    with caplog.at_level(logging.WARNING, logger="llmstream.config"):
        assert secret_refs.resolve(f"${{file:{path}}}", "model.api_key_file") == SECRET
    assert "readable by other users (mode 644)" in caplog.text and SECRET not in caplog.text


def scram(password: str) -> dict[str, str]:
    return {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                                f'username="job" password="{password}";'}


def test_scram_over_tls_becomes_kafka_python_arguments_with_the_secret_resolved(tmp_path: Path) -> None:
    path = secret_file(tmp_path)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    props = {**scram(f"${{file:{path}}}"), "ssl.truststore.type": "PEM", "ssl.truststore.location": str(ca),
             "max.request.size": "2097152"}
    assert kafka_security.client_args(props) == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "job",
        "sasl_plain_password": SECRET, "ssl_cafile": str(ca), "ssl_check_hostname": True}


def test_mutual_tls_with_a_pem_keystore_and_an_encrypted_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSTREAM_TEST_KEY_PASSWORD", SECRET)
    keystore = tmp_path / "client.pem"
    keystore.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\n")
    props = {"security.protocol": "SSL", "ssl.keystore.type": "PEM", "ssl.keystore.location": str(keystore),
             "ssl.key.password": "${env:LLMSTREAM_TEST_KEY_PASSWORD}", "ssl.endpoint.identification.algorithm": ""}
    args = kafka_security.client_args(props)
    assert args == {"security_protocol": "SSL", "ssl_certfile": str(keystore), "ssl_keyfile": str(keystore),
                    "ssl_password": SECRET, "ssl_check_hostname": False}
    assert kafka_security.secret_values(args) == [SECRET]


@pytest.mark.parametrize(("props", "key", "says"), [
    (scram("hunter2"), "kafka.properties.sasl.jaas.config", "literal secret"),
    ({"ssl.key.password": "hunter2"}, "kafka.properties.ssl.key.password", "literal secret"),
    ({**scram("${env:X}"), "sasl.mechanism": "GSSAPI"}, "kafka.properties.sasl.mechanism", "GSSAPI is not supported"),
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}, "kafka.properties.sasl.jaas.config", "required"),
    ({"security.protocol": "TLS"}, "kafka.properties.security.protocol", "must be one of"),
    ({"security.protocol": "SSL", "ssl.truststore.location": "/x/truststore.jks"},
     "kafka.properties.ssl.truststore.type", "JKS stores cannot be read"),
    ({"security.protocol": "SSL", "ssl.truststore.type": "PEM", "ssl.truststore.location": "/nonexistent/ca.pem"},
     "kafka.properties.ssl.truststore.location", "file /nonexistent/ca.pem does not exist"),
    ({"sasl.login.callback.handler.class": "com.example.Handler"},
     "kafka.properties.sasl.login.callback.handler.class", "no equivalent in the Python Kafka clients"),
])
def test_what_the_python_clients_cannot_do_is_a_config_error_naming_the_property(
        props: dict[str, str], key: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X", "x")
    with pytest.raises(ConfigError) as err:
        config_from_dict(base(properties=props))
    assert err.value.key == key and says in err.value.problem
    assert "hunter2" not in str(err.value)


def test_the_config_keeps_placeholders_so_nothing_that_prints_it_shows_a_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSTREAM_TEST_SECRET", SECRET)
    path = secret_file(tmp_path)
    data = base(properties=scram("${env:LLMSTREAM_TEST_SECRET}"))
    data["model"] = {**data["model"], "api_key_env": None, "api_key_file": str(path),
                     "headers": {"Authorization": "Bearer ${env:LLMSTREAM_TEST_SECRET}", "X-Tenant": "t1"}}
    config = config_from_dict(data)
    assert SECRET not in repr(config) and SECRET not in str(to_dict(config))
    assert config.api_key() == SECRET
    assert config.kafka.client_args()["sasl_plain_password"] == SECRET


def test_a_literal_credential_header_is_refused() -> None:
    data = base()
    data["model"] = {**data["model"], "headers": {"Authorization": "Bearer sk-live"}}
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert err.value.key == "model.headers.Authorization" and "sk-live" not in str(err.value)


@pytest.mark.parametrize(("kafka", "key", "says"), [
    ({"input_topics": ["a", "b"]}, "kafka.input_topics", "exactly one of"),
    ({"input_topic": None}, "kafka.input_topic", "exactly one of"),
    ({"input_topic": None, "input_topic_pattern": "llm-(["}, "kafka.input_topic_pattern", "not a regular expression"),
    ({"input_topic": None, "input_topic_pattern": "llm-.*"}, "kafka.output_topic", "matches kafka.input_topic_pattern"),
    ({"input_topic": None, "input_topics": ["a", "llm-results"]}, "kafka.output_topic", "must differ"),
    ({"input_topic": None, "input_topics": []}, "kafka.input_topics", "non-empty list"),
])
def test_input_topic_rules(kafka: dict[str, Any], key: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(base(**kafka))
    assert err.value.key == key and says in err.value.problem


def test_several_input_topics_and_a_pattern_describe_themselves() -> None:
    topics = config_from_dict(base(input_topic=None, input_topics=["a", "b"])).kafka
    assert topics.topics() == ["a", "b"] and topics.input_description() == "a;b"
    pattern = config_from_dict(base(input_topic=None, input_topic_pattern="req-.*")).kafka
    assert pattern.topics() == [] and pattern.input_description() == "pattern:req-.*"


def test_model_tls_verify_off_needs_allow_insecure(tmp_path: Path) -> None:
    data = base()
    data["model"] = {**data["model"], "tls": {"verify": False}}
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert err.value.key == "model.tls.verify"
    data["model"]["tls"] = {"verify": False, "allow_insecure": True}
    assert config_from_dict(data).model.tls.verify is False
    data["model"]["tls"] = {"client_cert_file": str(secret_file(tmp_path))}
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert err.value.key == "model.tls.client_key_file"


def test_the_secured_kafka_example_loads_with_its_secrets_in_files(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's secrets are references: with the files and variable in place it loads, and the
    loaded config holds no secret."""
    example = Path(__file__).resolve().parents[4] / "jobs" / "examples" / "secured-kafka.yaml"
    text = example.read_text()
    for original in ("/run/secrets/kafka-password", "/run/secrets/openai-key", "/etc/llmstream/kafka-ca.pem"):
        stand_in = tmp_path / Path(original).name
        stand_in.write_text(SECRET + "\n")
        stand_in.chmod(0o600)
        text = text.replace(original, str(stand_in))
    monkeypatch.setenv("OPENAI_ORG_ID", "org-1")
    path = tmp_path / "secured.yaml"
    path.write_text(text)
    config = load_config(path)
    assert config.kafka.client_args()["sasl_plain_password"] == SECRET and config.api_key() == SECRET
    assert SECRET not in repr(config)


def test_flink_gets_the_login_module_of_its_shaded_kafka_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector jar relocates kafka-clients: the usual module name would find no LoginModule."""
    monkeypatch.setenv("LLMSTREAM_TEST_SECRET", SECRET)
    props = {**scram("${env:LLMSTREAM_TEST_SECRET}"), "sasl.login.callback.handler.class": "org.apache.kafka.x.Handler",
             "client.id": "org.apache.kafka.is-not-a-class-here"}
    flink = kafka_security.flink_properties(props)
    assert flink["sasl.jaas.config"].startswith(
        "org.apache.flink.kafka.shaded.org.apache.kafka.common.security.scram.ScramLoginModule required")
    assert f'password="{SECRET}"' in flink["sasl.jaas.config"]
    assert flink["sasl.login.callback.handler.class"] == "org.apache.flink.kafka.shaded.org.apache.kafka.x.Handler"
    assert flink["client.id"] == props["client.id"]
    assert kafka_security.flink_properties({"sasl.jaas.config": flink["sasl.jaas.config"]}) == {
        "sasl.jaas.config": flink["sasl.jaas.config"]}   # already shaded: unchanged


def test_a_library_logging_a_resolved_secret_is_masked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With -v, kafka-python logs its admin configuration, password included: the CLI's handler masks it."""
    import io

    monkeypatch.setenv("LLMSTREAM_TEST_SECRET", SECRET)
    args = kafka_security.client_args(scram("${env:LLMSTREAM_TEST_SECRET}"))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(secret_refs.MaskSecrets())
    logger = logging.getLogger("kafka.test-masking")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        logger.debug("Starting KafkaAdminClient with configuration: %s", args)
    finally:
        logger.removeHandler(handler)
    assert SECRET not in stream.getvalue() and "sasl_plain_password': '******'" in stream.getvalue()


ENVIRONMENT_PRINTERS = {
    # Beam's runner of the Python workers: the worker's environment (the TaskManager's variables)
    # at INFO each time a worker closes and at WARN when a job is cancelled mid-bundle.
    "org.apache.beam.runners.fnexecution.control.DefaultJobBundleFactory": ("ERROR", "FATAL", "OFF"),
    # `flink run -py`'s start of the job script (`llmstream submit`, the image's submitter): the
    # submitting shell's environment at INFO (found by tests/integration/test_hostile_mix.py).
    "org.apache.flink.client.python.PythonEnvUtils": ("WARN", "ERROR", "FATAL", "OFF"),
}


@pytest.mark.parametrize("logger", sorted(ENVIRONMENT_PRINTERS))
@pytest.mark.parametrize("name", ["log4j.properties", "log4j-console.properties", "log4j-cli.properties"])
def test_no_flink_log_config_lets_flink_or_beam_print_an_environment(name: str, logger: str) -> None:
    """Two loggers print a whole process environment, every variable with its value (a key given by
    `model.api_key_env` among them). The canary hunts (test_security, test_hostile_mix) cover the
    local run's and the standalone cluster's configs; the image's is only covered here."""
    from jobs.clients.flink_cli import flink_conf_dir

    settings = dict(line.split("=", 1) for line in (flink_conf_dir() / name).read_text().splitlines()
                    if "=" in line and not line.lstrip().startswith("#"))
    settings = {k.strip(): v.strip() for k, v in settings.items()}
    loggers = {v: k.rsplit(".", 1)[0] for k, v in settings.items() if k.endswith(".name")}
    prefix = loggers.get(logger)
    assert prefix is not None, f"{name} does not configure the logger {logger}"
    assert settings[f"{prefix}.level"] in ENVIRONMENT_PRINTERS[logger], f"{name}: {settings[f'{prefix}.level']}"
