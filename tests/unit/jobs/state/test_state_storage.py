"""The state directory's file-system seam (`jobs/state/storage.py`) on a local directory, and the run
lease an object store gets instead of ``flock``. The S3 store against a real server:
tests/integration/test_s3_state.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from jobs.state import snapshots
from jobs.state.snapshots import Lease, StateDir, StateDirError
from jobs.state.storage import LocalStore, S3Settings, S3Store, is_secret_key, store_for


def test_the_local_store_lists_reads_writes_and_deletes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert store.read("job.json") is None and not store.exists("checkpoints")
    store.write("checkpoints/j/chk-1/_metadata", b"m1")
    store.write("checkpoints/j/shared/x", b"x")
    store.write("job.json", b"{}")
    assert store.read("checkpoints/j/chk-1/_metadata") == b"m1"
    assert sorted(f.key for f in store.list("checkpoints/")) == ["checkpoints/j/chk-1/_metadata", "checkpoints/j/shared/x"]
    assert [f.key for f in store.list("job")] == ["job.json"]
    store.delete("checkpoints/j/chk-1/")
    assert not (tmp_path / "checkpoints" / "j" / "chk-1").exists() and store.exists("checkpoints/j/shared/x")
    store.delete("job.json")
    assert store.read("job.json") is None


def test_the_store_is_chosen_by_scheme(tmp_path: Path) -> None:
    assert isinstance(store_for(str(tmp_path)), LocalStore)
    assert isinstance(store_for(tmp_path.as_uri()), LocalStore)
    s3 = store_for("s3a://bucket/a/b/", {"s3.endpoint": "http://127.0.0.1:9300", "s3.path.style.access": "true"})
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix, s3.uri) == ("bucket", "a/b", "s3a://bucket/a/b")
    assert s3.settings.path_style and s3.describe() == "s3a://bucket/a/b at s3.endpoint http://127.0.0.1:9300"
    assert store_for("gs://bucket/x") is None


def test_credentials_are_resolved_only_for_the_client_and_kept_out_of_flink(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S3_SECRET", "canary-7d1e")
    settings = S3Settings.from_flink({"s3.access-key": "dev", "s3.secret-key": "${env:S3_SECRET}"})
    assert settings.secret_key == "${env:S3_SECRET}"  # what the config keeps and anything can print
    assert settings.credentials() == {"aws_access_key_id": "dev", "aws_secret_access_key": "canary-7d1e"}
    assert S3Settings.from_flink({}).credentials() == {}  # the AWS standard chain
    assert is_secret_key("s3.secret-key") and is_secret_key("fs.s3a.access.key") and not is_secret_key("s3.endpoint")


def test_the_state_directory_reads_its_snapshots_through_the_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.write("checkpoints/j/chk-3/_metadata", b"m")
    store.write("checkpoints/j/chk-4/data", b"incomplete: no _metadata yet")
    store.write("savepoints/savepoint-1/_metadata", b"m")
    state = StateDir(tmp_path)
    assert sorted(s.key for s in state.snapshots()) == ["checkpoints/j/chk-3", "savepoints/savepoint-1"]
    assert {s.uri for s in state.snapshots()} == {f"{tmp_path.as_uri()}/checkpoints/j/chk-3",
                                                  f"{tmp_path.as_uri()}/savepoints/savepoint-1"}


@pytest.fixture
def quick_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "LEASE_SETTLE_S", 0.0)


@pytest.mark.usefixtures("quick_lease")
def test_a_lease_refuses_a_second_run_while_fresh_and_frees_when_released_or_stale(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    with Lease(store, "s3://b/job").held(), \
            pytest.raises(StateDirError, match=r"another llmstream run .* is using the state directory s3://b/job"), \
            Lease(store, "s3://b/job").held():
        pass
    assert store.read(snapshots.LEASE_FILE) is None  # released
    stale = {"owner": "elsewhere:1:abcd", "heartbeat": time.time() - snapshots.LEASE_TTL_S - 1}
    store.write(snapshots.LEASE_FILE, json.dumps(stale).encode())
    with Lease(store, "s3://b/job").held():  # a run killed outright: its lease expired
        assert json.loads(store.read(snapshots.LEASE_FILE) or b"{}")["owner"] != stale["owner"]


def test_the_gateway_gets_the_s3_jar_and_credentials_only_while_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`llmstream run` with state on S3: the jar and an explicit key pair reach the JVM through its
    environment (never Flink's configuration), and no class archive is dumped with that classpath."""
    from jobs.graph import pipeline
    from tests.support.configs import minimal_config

    monkeypatch.setenv("JVM_ARGS", "-Xmx1g -XX:ArchiveClassesAtExit=/tmp/gateway.jsa")
    monkeypatch.setenv("S3_SECRET", "canary-5b0c")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.delenv("HADOOP_CLASSPATH", raising=False)
    monkeypatch.setattr(pipeline.jars, "classpath", lambda name: f"/jars/{name}.jar")
    config = minimal_config(flink={"s3.endpoint": "http://127.0.0.1:9", "s3.access-key": "dev",
                                   "s3.secret-key": "${env:S3_SECRET}"})
    with pipeline._s3_on_the_gateway(config):
        assert os.environ["HADOOP_CLASSPATH"] == "/jars/s3.jar"
        assert (os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]) == ("dev", "canary-5b0c")
        assert os.environ["JVM_ARGS"] == "-Xmx1g"
    assert "AWS_SECRET_ACCESS_KEY" not in os.environ and "HADOOP_CLASSPATH" not in os.environ
    assert os.environ["JVM_ARGS"].endswith("ArchiveClassesAtExit=/tmp/gateway.jsa")


@pytest.mark.parametrize(("flink", "key", "says"), [
    ({"s3.path.style.access": "yes"}, "flink.s3.path.style.access", "is 'yes'; write true"),
    ({"fs.s3a.path.style.access": "1"}, "flink.fs.s3a.path.style.access", "is '1'; write true"),
    ({"s3.endpoint": "ftp://store:9000"}, "flink.s3.endpoint", "write http://HOST:PORT or https://"),
    ({"s3.endpoint": "http://"}, "flink.s3.endpoint", "write http://HOST:PORT"),
    ({"s3.endpoint": "http://store:90x0"}, "flink.s3.endpoint", "port is not a number"),
    ({"s3.connection.ssl.enabled": "no"}, "flink.s3.connection.ssl.enabled", "write true or false"),
])
def test_an_s3_setting_flink_would_misread_is_refused_naming_its_key(flink: dict[str, str], key: str,
                                                                     says: str) -> None:
    from udfs.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        S3Settings.from_flink(flink)
    assert err.value.key == key and says in err.value.problem and "\n" not in str(err.value)


def test_an_endpoint_without_a_scheme_is_https_unless_ssl_is_off_as_in_hadoop() -> None:
    assert S3Settings.from_flink({"s3.endpoint": "store:9000"}).endpoint == "https://store:9000"
    assert S3Settings.from_flink({"s3.endpoint": "store:9000", "s3.connection.ssl.enabled": "false"}).endpoint \
        == "http://store:9000"
    assert S3Settings.from_flink({"s3.endpoint": "http://store:9000", "s3.path.style.access": "TRUE"}) \
        == S3Settings(endpoint="http://store:9000", path_style=True)
