"""The pom-free lock file and fetcher, without Maven or the network."""
from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from jobs.runtime import jars

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def fetch() -> ModuleType:
    """``pom-free/fetch.py`` loaded by path: the folder name has a hyphen, so it cannot be imported."""
    name = "pom_free_fetch_under_test"
    spec = importlib.util.spec_from_file_location(name, REPO / "pom-free" / "fetch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_manifest_rows_are_well_formed(fetch: ModuleType) -> None:
    entries = fetch.read_manifest()
    for e in entries:
        assert re.fullmatch(r"[0-9a-f]{64}", e.sha256), e
        assert len(e.coord.split(":")) in (3, 4), e
    by_set = {s: fetch.entries_for(s, entries) for s in fetch.SETS}
    assert {"connector", "broker", "metrics", "operator-crd", "ml-predict"} <= set(by_set)
    # The model provider jar alone: its parent pom is not on Maven Central (POMLESS).
    assert [e.coord for e in by_set["ml-predict"]] == list(fetch.ROOTS["ml-predict"])
    # The CRD jar alone: it is only unzipped for its YAML, never run.
    assert [e.coord for e in by_set["operator-crd"]] == list(fetch.ROOTS["operator-crd"])
    # The reporter is Flink's own module: the same version as the installed apache-flink.
    from pyflink.version import __version__ as flink_version
    assert [e.coord for e in by_set["metrics"]] == [f"org.apache.flink:flink-metrics-prometheus:{flink_version}"]
    assert all(by_set.values())
    assert [e.coord for e in by_set["connector"]] == ["org.apache.flink:flink-sql-connector-kafka:5.0.0-2.2"]
    broker = {e.coord for e in by_set["broker"]}
    assert set(fetch.ROOTS["broker"]) <= broker
    assert not any(c.startswith("org.slf4j:slf4j-api:1.") for c in broker)
    for rows in by_set.values():
        names = [e.filename for e in rows]
        assert len(names) == len(set(names))
    assert entries == sorted(entries)


def test_read_manifest_rejects_short_hash(fetch: ModuleType, tmp_path: Path) -> None:
    bad = tmp_path / "manifest.tsv"
    bad.write_text("# c\nbroker\torg.example:x:1\tabc123\n")
    with pytest.raises(fetch.FetchError, match="64"):
        fetch.read_manifest(bad)


def test_verify_rejects_wrong_hash_and_deletes_jar(fetch: ModuleType, tmp_path: Path) -> None:
    good = fetch.Entry("broker", "org.example:good:1.0", hashlib.sha256(b"good").hexdigest())
    wrong = "0" * 64
    bad = fetch.Entry("broker", "org.example:bad:1.0:tests", wrong)
    (tmp_path / good.filename).write_bytes(b"good")
    (tmp_path / bad.filename).write_bytes(b"tampered")
    assert bad.filename == "bad-1.0-tests.jar"

    fetch.verify(tmp_path, [good])
    with pytest.raises(fetch.FetchError) as info:
        fetch.verify(tmp_path, [good, bad])
    message = str(info.value)
    assert "bad-1.0-tests.jar" in message
    assert wrong in message and hashlib.sha256(b"tampered").hexdigest() in message
    assert not (tmp_path / bad.filename).exists()
    assert (tmp_path / good.filename).exists()
    assert fetch.stale_entries(tmp_path, [good, bad]) == [bad]


def test_fetch_pom_excludes_transitive_dependencies(fetch: ModuleType) -> None:
    pom = fetch.render_pom(["g:a:1", "g:b:2:cls"], exclude_all=True)
    assert pom.count("<exclusion><groupId>*</groupId><artifactId>*</artifactId></exclusion>") == 2
    assert "<classifier>cls</classifier>" in pom


def test_jars_api_uses_cache_override(fetch: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSTREAM_JAR_CACHE", str(tmp_path))
    assert jars.jar_dir("connector") == tmp_path / "connector"
    with pytest.raises(RuntimeError, match="ensure"):
        jars.classpath("broker")
    with pytest.raises(ValueError):
        jars.jar_dir("nope")

    for set_name in fetch.SETS:
        (tmp_path / set_name).mkdir()
        for e in fetch.entries_for(set_name, fetch.read_manifest()):
            (tmp_path / set_name / e.filename).write_bytes(b"")
    (tmp_path / "broker" / "stray.jar").write_bytes(b"")
    cp = jars.classpath("broker").split(":")
    assert len(cp) == len(fetch.entries_for("broker", fetch.read_manifest()))
    assert all(p.startswith(str(tmp_path / "broker")) for p in cp)
    assert not any(p.endswith("stray.jar") for p in cp)
    (url,) = jars.connector_jar_urls()
    assert url.startswith("file://") and url.endswith("flink-sql-connector-kafka-5.0.0-2.2.jar")


def test_repo_root_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert jars.repo_root() == REPO
    monkeypatch.setenv("LLMSTREAM_HOME", str(tmp_path))
    assert jars.repo_root() == tmp_path
    with pytest.raises(RuntimeError, match="LLMSTREAM_HOME"):
        jars.jar_dir("broker")


def test_the_gate_jar_without_javac_is_one_line_naming_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budgeted job needs the admission gate's jar; where it is not built and no JDK is found,
    `llmstream run`/`submit` stop before any JVM starts with one line saying what to do."""
    from jobs.graph import gate_operator as gate

    monkeypatch.setenv("LLMSTREAM_JAR_CACHE", str(tmp_path / "cache"))  # nothing built there
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no java, no javac
    with pytest.raises(gate.GateBuildError) as err:
        gate.ensure()
    message = str(err.value)
    assert message.startswith("budget: ") and "javac" in message and "\n" not in message
    assert gate.jar_path().parent == tmp_path / "cache" / "gate"


def test_a_fleet_gets_the_gate_only_where_it_can_be_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget needs the gate; a fleet takes it when checkpoints are unaligned and the jar is
    built or buildable here, and otherwise runs as before (a checkpoint then waits for a
    cooldown) instead of refusing to start on a machine with a JRE only."""
    import dataclasses

    from jobs.graph import gate_operator as gate
    from tests.support.configs import job_config
    from udfs.config import BudgetConfig, EndpointConfig, RateLimitConfig

    monkeypatch.setenv("LLMSTREAM_JAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no javac
    single = job_config("http://127.0.0.1:9/v1")
    fleet = dataclasses.replace(single, model=dataclasses.replace(
        single.model, endpoint=None, endpoints=[EndpointConfig(url="http://127.0.0.1:9/v1")]))
    aligned = dataclasses.replace(fleet, python=dataclasses.replace(fleet.python, unaligned_checkpoints=False))
    budgeted = dataclasses.replace(single, budget=BudgetConfig(max_tokens_per_hour=1000.0))
    limited = dataclasses.replace(single, rate_limit=RateLimitConfig(requests_per_minute=60.0))
    assert gate.gate_setting(single) is None
    assert gate.gate_setting(fleet) is None  # nothing to build it with
    assert gate.gate_setting(limited) is None
    assert gate.gate_setting(budgeted) == "budget"  # and `ensure_for` says what is missing
    with pytest.raises(gate.GateBuildError, match="^budget: "):
        gate.ensure_for(budgeted)
    adaptive = dataclasses.replace(single, python=dataclasses.replace(single.python, bundle_target_ms=250))
    assert gate.gate_setting(adaptive) is None  # adaptive bundles need the jar, not the gate
    with pytest.raises(gate.GateBuildError, match="^python.bundle_target_ms: "):
        gate.ensure_for(adaptive)
    gate.ensure_for(single)  # a job with neither needs no jar
    gate.jar_path().parent.mkdir(parents=True)
    gate.jar_path().touch()  # built before (`make jars`, the image)
    assert gate.gate_setting(fleet) == "model.endpoints"
    assert gate.gate_setting(limited) == "rate_limit"
    assert gate.gate_setting(aligned) is None  # an aligned barrier would wait behind a closed gate
