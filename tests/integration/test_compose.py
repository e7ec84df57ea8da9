"""docker-compose.yml and the Dockerfile, checked statically (test_containers.py runs them).

No Docker, JVM or network: it parses the file, checks every path it mounts or the Dockerfile
copies exists in the repo, that the Flink services read the same flink-conf/ the cluster tests
run (and that its checkpoint dir lands on the shared volume), that the -D overrides name real
Flink keys, that the submitter's job config passes llmstream's own config validation, and that
a plain `docker compose up` needs no image but the one the Dockerfile builds.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import yaml

from jobs.cli import build_parser
from jobs.runtime import jars
from udfs.config import config_from_dict

ROOT = jars.repo_root()
COMPOSE = ROOT / "docker-compose.yml"
FLINK_SERVICES = ("jobmanager", "taskmanager")
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}`` substitution (``$$`` stays a literal ``$``)."""
    env = env or {}
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(2) or ""), text.replace("$$", "\0")).replace("\0", "$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def _dockerfile(compose: dict[str, Any]) -> str:
    build = compose["services"]["jobmanager"]["build"]
    return (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).read_text()


API_KEY_SECRET = "/run/secrets/llmstream_api_key"
"""Where compose mounts the API key file in the containers; the host has none, so `/dev/null` (the
compose default, an empty key) stands in when the config is loaded here."""


def _job_config_text(compose: dict[str, Any]) -> str:
    return str(compose["services"]["submitter"]["environment"]["LLMSTREAM_JOB_CONFIG"])


def _loadable(raw: str) -> str:
    assert API_KEY_SECRET in raw
    return raw.replace(API_KEY_SECRET, "/dev/null")


def _env(compose: dict[str, Any], service: str) -> dict[str, str]:
    """ENV of the inline Dockerfile, overlaid by the service's environment."""
    env: dict[str, str] = {}
    text = _dockerfile(compose).replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip().startswith("ENV "):
            for item in shlex.split(line.strip()[4:]):
                key, _, value = item.partition("=")
                env[key] = value
    env.update({k: str(v) for k, v in (compose["services"][service].get("environment") or {}).items()})
    return env


def _mounts(compose: dict[str, Any], service: str) -> dict[str, str]:
    """target -> source of a service's volumes (short syntax)."""
    out = {}
    for volume in compose["services"][service].get("volumes") or []:
        source, target, *_ = str(volume).split(":")
        out[target] = source
    return out


def test_parses_and_has_every_service(compose: dict[str, Any]) -> None:
    assert {"kafka", "jobmanager", "taskmanager", "model-server", "submitter"} <= set(compose["services"])


def test_every_mounted_or_copied_path_exists(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            assert (ROOT / build["context"]).is_dir(), f"{name}: build context {build['context']}"
        for source in _mounts(compose, name).values():
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repo"
            else:
                assert source in named, f"{name} mounts undeclared volume {source}"
    for line in _dockerfile(compose).splitlines():
        if line.strip().startswith("COPY "):
            *sources, _target = line.split()[1:]
            for source in sources:
                if "[" in source:  # an optional input (the wheelhouse): may match nothing
                    continue
                assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repo"


def test_flink_services_read_the_tested_flink_conf(compose: dict[str, Any]) -> None:
    """The cluster tests generate their conf from flink-conf/; the containers mount it as is."""
    for service in (*FLINK_SERVICES, "submitter"):
        env = _env(compose, service)
        mounts = _mounts(compose, service)
        conf_dir = env["FLINK_CONF_DIR"]
        assert mounts.get(conf_dir) == "./flink-conf", f"{service}: {conf_dir} is not ./flink-conf"
        assert (ROOT / "flink-conf" / "config.yaml").is_file()
    flink_conf = yaml.safe_load((ROOT / "flink-conf" / "config.yaml").read_text())
    for key in ("execution.checkpointing.dir", "execution.checkpointing.savepoint-dir"):
        path = str(flink_conf[key]).removeprefix("file://")
        for service in FLINK_SERVICES:
            shared = [t for t, s in _mounts(compose, service).items() if s == "flink-data"]
            assert any(path.startswith(t + "/") for t in shared), f"{service}: {key} {path} not on flink-data"


def test_command_line_overrides_name_real_flink_keys(compose: dict[str, Any]) -> None:
    """-D overrides only change keys flink-conf/config.yaml sets (so a typo cannot slip through)."""
    keys = set(yaml.safe_load((ROOT / "flink-conf" / "config.yaml").read_text()))
    for service in FLINK_SERVICES:
        command = " ".join(compose["services"][service]["command"])
        overrides = re.findall(r"-D ([\w.-]+)=", command)
        assert overrides, service
        assert set(overrides) <= keys, set(overrides) - keys
        assert "start-foreground" in command and "$$FLINK_HOME/bin/" in command


def test_llmstream_commands_exist(compose: dict[str, Any]) -> None:
    """The commands parse as `llmstream` would parse them (model-server owns its arguments)."""
    server = compose["services"]["model-server"]["command"]
    assert server[:2] == ["llmstream", "model-server"]
    args = build_parser().parse_args(server[1:])
    assert args.command == "model-server" and args.host == "0.0.0.0" and args.port == 8000
    script = compose["services"]["submitter"]["command"][2]
    write, run = script.split("&&")
    submit = shlex.split(run)
    assert submit[:2] == ["exec", "llmstream"]
    args = build_parser().parse_args(submit[2:])
    assert args.command == "submit" and args.jobmanager == "jobmanager:8081"
    assert args.config in write and "LLMSTREAM_JOB_CONFIG" in write
    assert compose["services"]["kafka"]["command"][:4] == ["python", "-m", "jobs.dev.containers", "kafka"]


@pytest.mark.parametrize("env", [
    {},
    {"LLMSTREAM_MODEL_ENDPOINT": "http://ollama:11434/v1", "LLMSTREAM_MODEL": "qwen2.5:0.5b"},
    {"LLMSTREAM_MODEL_ENDPOINT": "http://vllm:8000/v1", "LLMSTREAM_MODEL": "Qwen/Qwen2.5-0.5B-Instruct"},
    {"LLMSTREAM_PARALLELISM": "2"},
])
def test_submitted_job_config_is_valid_and_the_model_is_switchable(
        compose: dict[str, Any], env: dict[str, str]) -> None:
    raw = _job_config_text(compose)
    assert "${LLMSTREAM_MODEL_ENDPOINT" in raw
    config = config_from_dict(yaml.safe_load(_loadable(interpolate(raw, env))))
    assert config.model.endpoint == env.get("LLMSTREAM_MODEL_ENDPOINT", "http://model-server:8000/v1")
    assert config.kafka.bootstrap_servers == "kafka:9092"
    assert config.model.api_key_file == "/dev/null" and API_KEY_SECRET in raw
    assert config.parallelism.default == int(env.get("LLMSTREAM_PARALLELISM", "1"))
    if "LLMSTREAM_MODEL_ENDPOINT" in env:
        host = env["LLMSTREAM_MODEL_ENDPOINT"].split("//")[1].split(":")[0]
        assert host in compose["services"], f"no service {host} for the endpoint"


def test_secrets_only_as_files_never_in_a_containers_environment(compose: dict[str, Any]) -> None:
    """`docker inspect` shows a container's environment: the API key is a compose secret (a file)."""
    text = COMPOSE.read_text()
    assert compose["secrets"]["llmstream_api_key"]["file"] == "${LLMSTREAM_API_KEY_FILE:-/dev/null}"
    for service in ("taskmanager", "submitter"):
        assert compose["services"][service]["secrets"] == ["llmstream_api_key"]
    for name, service in compose["services"].items():
        assert not any(re.search(r"(?i)key|password|token|secret", str(k)) for k in (service.get("environment") or {})), name
    assert not re.search(r"(?i)(api_key|password|secret)\s*[:=]\s*['\"]?[A-Za-z0-9]{16,}", text)


def test_broker_allows_the_jobs_transaction_timeout(compose: dict[str, Any]) -> None:
    """The kafka service is `llmstream kafka`'s broker config (jobs/dev/containers.py run_broker)."""
    from jobs.dev.local_kafka import BrokerConfig

    props = BrokerConfig().server_properties()
    config = config_from_dict(yaml.safe_load(_loadable(interpolate(_job_config_text(compose)))))
    assert config.kafka.transaction_timeout_ms <= int(props["transaction.max.timeout.ms"])
    assert props["auto.create.topics.enable"] == "false"
    assert config.kafka.bootstrap_servers == "kafka:9092"
    assert "9092" in compose["services"]["kafka"]["command"]


def test_default_services_need_only_the_image_the_dockerfile_builds(compose: dict[str, Any]) -> None:
    """`docker compose up` (no profile) pulls nothing: every default service is llmstream:local,
    built from the Dockerfile, whose base image is the BASE_IMAGE build argument."""
    default = {n: s for n, s in compose["services"].items() if not s.get("profiles")}
    assert {"kafka", "jobmanager", "taskmanager", "model-server", "submitter"} <= set(default)
    for name, service in default.items():
        assert service["image"] == "llmstream:local", name
        assert service["build"]["args"]["BASE_IMAGE"].startswith("${LLMSTREAM_BASE_IMAGE:-"), name
    assert "ARG BASE_IMAGE=" in _dockerfile(compose) and "FROM ${BASE_IMAGE}" in _dockerfile(compose)


def test_host_ports_come_from_the_environment(compose: dict[str, Any]) -> None:
    """Published ports are loopback-only and overridable, so test copies never collide."""
    for name, service in compose["services"].items():
        if service.get("profiles"):
            continue
        for port in service.get("ports") or []:
            assert port.startswith("127.0.0.1:${LLMSTREAM_"), f"{name}: {port}"
    kafka_port = "${LLMSTREAM_KAFKA_HOST_PORT:-9094}"
    assert compose["services"]["kafka"]["ports"] == [f"127.0.0.1:{kafka_port}:{kafka_port}"]
    assert kafka_port in compose["services"]["kafka"]["command"]


# ------------------------------------------------------------------ metrics: Prometheus and Grafana

GRAFANA = ROOT / "grafana"
_METRIC = re.compile(r"\bflink_[A-Za-z0-9_]+")


def _dashboards() -> list[dict[str, Any]]:
    import json

    return [json.loads(path.read_text()) for path in sorted((GRAFANA / "dashboards").glob("*.json"))]


def _queries(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_every_dashboard_query_names_a_metric_the_exporter_served() -> None:
    """grafana/served-metrics.txt is checked against a real scrape (test_observe.py); every
    PromQL query of the dashboard may only name metrics from it."""
    served = set((GRAFANA / "served-metrics.txt").read_text().split())
    assert any(name.startswith("flink_taskmanager_job_task_operator_llmstream_") for name in served)
    (dashboard,) = _dashboards()
    queries = _queries(dashboard)
    assert len(queries) >= 15
    named = {name for query in queries for name in _METRIC.findall(query)}
    assert named, "no query names a flink_ metric"
    assert named <= served, f"queries name metrics the exporter never served: {sorted(named - served)}"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for query in queries:
        for variable in re.findall(r"\$(\w+)", query):
            assert variable in variables, f"{query}: unknown variable ${variable}"
    for variable in dashboard["templating"]["list"]:
        for name in _METRIC.findall(str(variable.get("definition", ""))):
            assert name in served, name


def test_dashboard_has_a_panel_for_every_question() -> None:
    (dashboard,) = _dashboards()
    text = " ".join(_queries(dashboard))
    for needle in ("pendingRecords", "records_lag_max", "llmstream_records_in", "numRecordsOutPerSecond",
                   "llmstream_admitted", "llmstream_concurrency_limit", "llmstream_latency_p50_ms",
                   "llmstream_latency_p99_ms", "llmstream_retries", "llmstream_rate_limited", "llmstream_dead_lettered",
                   "lastCheckpointCompletedTimestamp", "lastCheckpointDuration", "lastCheckpointSize", "numRestarts",
                   "backPressuredTimeMsPerSecond", "llmstream_prompt_tokens", "llmstream_completion_tokens",
                   "llmstream_endpoint_in_flight", "llmstream_endpoint_limit", "llmstream_endpoint_circuit",
                   "llmstream_endpoint_rate_limited", "llmstream_endpoint_failures", "llmstream_endpoint_latency_p99_ms"):
        assert needle in text, needle


def test_prometheus_and_grafana_are_provisioned(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"prometheus", "grafana"} <= set(services)
    assert _mounts(compose, "prometheus")["/etc/prometheus/prometheus.yml"] == "./grafana/prometheus.yml"
    assert _mounts(compose, "grafana")["/etc/grafana/provisioning"] == "./grafana/provisioning"
    dashboards_dir = _mounts(compose, "grafana")["/var/lib/grafana/dashboards"]
    assert dashboards_dir == "./grafana/dashboards"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "llmstream.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090"
    (dashboard,) = _dashboards()
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {source["uid"]}
    # Prometheus scrapes each Flink service on the first port of the reporter's range.
    flink_conf = yaml.safe_load((ROOT / "flink-conf" / "config.yaml").read_text())
    assert flink_conf["metrics.reporter.prom.factory.class"].endswith("PrometheusReporterFactory")
    first_port = int(str(flink_conf["metrics.reporter.prom.port"]).split("-")[0])
    scrape = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    targets = []
    for job in scrape["scrape_configs"]:
        targets += [t for c in job.get("static_configs", []) for t in c["targets"]]
        targets += [f"{n}:{c['port']}" for c in job.get("dns_sd_configs", []) for n in c["names"]]
    assert sorted(targets) == sorted(f"{service}:{first_port}" for service in FLINK_SERVICES)
    assert all(t.split(":")[0] in services for t in targets)
    # The image puts the reporter jar on the Flink classpath, like jobs/dev/local_cluster.py's lib/.
    assert "pom-free/cache/metrics/*.jar" in _dockerfile(compose)
