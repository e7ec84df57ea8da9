"""flink-conf/kubernetes/ checked against the Flink Kubernetes Operator's own CRD schema.

The schema is the ``flinkdeployments.flink.apache.org`` CRD YAML inside the operator's API jar
(``org.apache.flink:flink-kubernetes-operator-api``, pom-free set ``operator-crd``), validated with
``jsonschema``. Two adjustments, both stated where they are made:

- Kubernetes rejects fields a structural schema does not declare (kubectl's default strict field
  validation); JSON Schema allows them unless ``additionalProperties`` is false, so every declared
  object without ``x-kubernetes-preserve-unknown-fields`` gets ``additionalProperties: false``.
- Maven Central serves this machine operator-api 1.10.0 at the newest, whose ``flinkVersion`` enum
  stops at ``v1_20``; ``v2_0``..``v2_2`` were added by operator 1.11-1.13 (upstream
  ``FlinkVersion.java``), and the image runs Flink 2.3, so ``v2_3`` too (which operator release adds
  it cannot be checked from here). Only those four values are added.
"""

from __future__ import annotations

import copy
import zipfile
from typing import Any

import jsonschema
import pytest
import yaml

from jobs.runtime import jars
from udfs.config import config_from_dict

ROOT = jars.repo_root()
K8S = ROOT / "flink-conf" / "kubernetes"
CRD_ENTRY = "META-INF/fabric8/flinkdeployments.flink.apache.org-v1.yml"
NEWER_FLINK_VERSIONS = ("v2_0", "v2_1", "v2_2", "v2_3")


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    jars.ensure("operator-crd")
    (jar,) = jars.jars("operator-crd")
    with zipfile.ZipFile(jar) as archive:
        crd = yaml.safe_load(archive.read(CRD_ENTRY))
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["spec"]["names"]["kind"] == "FlinkDeployment" and crd["spec"]["group"] == "flink.apache.org"
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    assert version["name"] == "v1beta1"
    root = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    # Every object has these; the API server checks them, the CRD schema leaves them out.
    root["properties"].update({"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                               "metadata": {"type": "object"}})
    schema: dict[str, Any] = _strict(root)
    enum = schema["properties"]["spec"]["properties"]["flinkVersion"]["enum"]
    assert "v1_20" in enum
    enum += [v for v in NEWER_FLINK_VERSIONS if v not in enum]
    return schema


def _documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def _deployment() -> dict[str, Any]:
    (deployment,) = [d for d in _documents("flinkdeployment.yaml") if d["kind"] == "FlinkDeployment"]
    return deployment


def _job_config() -> dict[str, Any]:
    (configmap,) = _documents("configmap.yaml")
    data: dict[str, Any] = yaml.safe_load(configmap["data"]["inference.yaml"])
    return data


def _errors(schema: dict[str, Any], document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_flinkdeployment_validates_against_the_operators_crd(crd_schema: dict[str, Any]) -> None:
    deployment = _deployment()
    assert deployment["apiVersion"] == "flink.apache.org/v1beta1"
    assert _errors(crd_schema, deployment) == []


@pytest.mark.parametrize("breakage", ["unknown field", "wrong enum", "wrong type"])
def test_a_broken_copy_fails_validation(crd_schema: dict[str, Any], breakage: str) -> None:
    broken = copy.deepcopy(_deployment())
    job = broken["spec"]["job"]
    if breakage == "unknown field":
        job["upgradeMod"] = job.pop("upgradeMode")
    elif breakage == "wrong enum":
        job["upgradeMode"] = "last-checkpoint"
    else:
        job["parallelism"] = "two"
    errors = _errors(crd_schema, broken)
    assert errors, f"{breakage}: the broken copy validated"
    assert all(e.startswith("spec/job") for e in errors), errors


def test_deployment_runs_the_configmaps_job_in_application_mode() -> None:
    deployment, config = _deployment(), _job_config()
    spec = deployment["spec"]
    job = spec["job"]
    assert spec["mode"] == "native" and job["upgradeMode"] == "last-state" and job["state"] == "running"
    assert job["entryClass"] == "org.apache.flink.client.python.PythonDriver"
    assert job["jarURI"].startswith("local:///") and "flink-python-" in job["jarURI"]
    args = job["args"]
    assert args[args.index("-py") + 1] == "/llmstream/jobs/inference_job.py"
    assert (ROOT / "jobs" / "inference_job.py").is_file()
    # The job config the JobManager reads is the ConfigMap's, and it is a valid llmstream config.
    parsed = config_from_dict(config)
    mounts = {m["name"]: m["mountPath"] for m in spec["podTemplate"]["spec"]["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["podTemplate"]["spec"]["volumes"]}
    assert args[args.index("--config") + 1] == f"{mounts['job-config']}/inference.yaml"
    assert volumes["job-config"]["configMap"]["name"] == _documents("configmap.yaml")[0]["metadata"]["name"]
    # Parallelism from the job config; the job's state, checkpoints, savepoints and HA data on S3,
    # with its endpoint in the configuration and its credentials from a Secret, never inline.
    assert job["parallelism"] == parsed.parallelism.default
    state_dir = args[args.index("--state-dir") + 1]
    assert state_dir == parsed.checkpointing.directory
    flink = spec["flinkConfiguration"]
    for key in ("execution.checkpointing.dir", "execution.checkpointing.savepoint-dir", "high-availability.storageDir"):
        assert flink[key].startswith("s3://"), key
    assert state_dir.startswith("s3://") and flink["s3.endpoint"].startswith("http")
    assert not any("secret" in key or "access.key" in key for key in flink), "credentials belong in a Secret"
    env = {e["name"]: e for e in spec["podTemplate"]["spec"]["containers"][0]["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"], name
    (pvc,) = [d for d in _documents("flinkdeployment.yaml") if d["kind"] == "PersistentVolumeClaim"]
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert flink["high-availability.type"] == "kubernetes", "last-state upgrades need HA metadata"
    # The same image and interpreter the Dockerfile builds.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert flink["python.executable"].startswith("/opt/llmstream/venv/") and "VIRTUAL_ENV=/opt/llmstream/venv" in dockerfile
    # The operator's Flink version and the flink-python jar PythonDriver runs are the image's Flink.
    from pyflink.version import __version__ as flink_version
    major, minor = flink_version.split(".")[:2]
    assert spec["flinkVersion"] == f"v{major}_{minor}"
    assert job["jarURI"].endswith(f"/pyflink/opt/flink-python-{flink_version}.jar"), job["jarURI"]
