"""The local standalone cluster (`llmstream cluster`, `llmstream submit`) and the job on it.

- the CLI starts a cluster from flink-conf/, tops it up with TaskManagers, reports and stops it;
- a submitted job runs with the parallelism of its config;
- a corpus of malformed inputs, interleaved with good records, is dead-lettered record by
  record with the expected reason, without a single job restart.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from kafka import KafkaProducer

from jobs.clients import kafka_admin
from jobs.dev import local_cluster as cluster_mod
from jobs.dev import local_kafka
from jobs.dev.local_cluster import ClusterConfig, LocalCluster
from jobs.dev.simulator import SpawnedSimulator
from jobs.launch import submit as submit_mod
from jobs.launch.plan import RunOptions
from tests.support.cluster import wait_for_checkpoints
from tests.support.fault_report import FaultReport, FaultResult
from tests.support.job_setup import make_job, unique_records
from tests.support.waiting import METRICS_SETTLE_S

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------- the CLI


def test_cli_start_topup_status_stop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`llmstream cluster start|status|stop` on a fresh work dir and free ports; nothing left behind."""
    config = ClusterConfig.ephemeral(tmp_path / "flink")
    args = ["--work-dir", str(config.work_dir), "--port", str(config.rest_port),
            "--rpc-port", str(config.rpc_port)]
    local = LocalCluster(config)
    try:
        assert cluster_mod.main(["status", *args]) == 1
        assert "not running" in capsys.readouterr().out

        assert cluster_mod.main(["start", *args]) == 0
        out = capsys.readouterr().out
        assert f"web UI http://localhost:{config.rest_port}" in out
        assert "taskmanagers: 1" in out
        generated = (config.work_dir / "conf" / "config.yaml").read_text()
        assert f"rest.port: {config.rest_port}" in generated
        assert (config.work_dir / "checkpoints").as_uri() in generated
        assert (config.work_dir / "conf" / "log4j.properties").is_file()

        # `start` on a running cluster tops it up (taskmanager.sh start) instead of failing.
        assert cluster_mod.main(["start", "--taskmanagers", "2", *args]) == 0
        capsys.readouterr()
        assert cluster_mod.main(["status", *args]) == 0
        status = capsys.readouterr().out
        assert "taskmanagers: 2" in status and "slots 4/4 free" in status
        # status reads the port from the generated conf when not told
        assert cluster_mod.main(["status", "--work-dir", str(config.work_dir)]) == 0
        capsys.readouterr()

        pids = [local.jobmanager_pid(), *local.taskmanager_pids()]
        assert None not in pids and len(pids) == 3
        assert cluster_mod.main(["stop", *args]) == 0
        assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
                   for p in pids if p is not None)
        assert local.overview() is None
        assert cluster_mod.main(["status", *args]) == 1
    finally:
        local.stop()


def test_generated_conf_is_flink_conf_with_only_ports_and_paths_changed(tmp_path: Path) -> None:
    """What the tests run IS flink-conf/: the generated file differs only in the overridden keys."""
    import yaml

    local = LocalCluster(ClusterConfig.ephemeral(tmp_path / "flink"))
    local.write_conf()
    source = cluster_mod._flatten(yaml.safe_load((cluster_mod.conf_source_dir() / "config.yaml").read_text()))
    generated = cluster_mod._flatten(yaml.safe_load((local.conf_dir / "config.yaml").read_text()))
    changed = {k for k in source.keys() | generated.keys() if source.get(k) != generated.get(k)}
    assert changed <= set(local.config.overrides())
    for path in cluster_mod.conf_source_dir().iterdir():
        assert (local.conf_dir / path.name).is_file() == path.is_file(), path.name  # kubernetes/ stays out
    # flink-python and the connector load from the cluster's lib/, once, not per job (metaspace)
    libs = sorted(p.name for p in local.lib_dir.iterdir())
    assert any(n.startswith("flink-dist-") for n in libs)
    assert any(n.startswith("flink-python-") for n in libs)
    assert any(n.startswith("flink-sql-connector-kafka-") for n in libs)


# ---------------------------------------------------------------------- submit and parallelism


def test_submit_honours_the_configured_parallelism(
        cluster: LocalCluster, paced_simulator: SpawnedSimulator, tmp_path: Path,
        kafka_broker: local_kafka.LocalBroker, capsys: pytest.CaptureFixture[str]) -> None:
    """`llmstream submit` (jobs.launch.submit.submit) against the cluster: preflight passes, the job id
    and web UI are printed, the vertices run with `parallelism.inference: 2`, records flow."""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="parallel",
                     parallelism={"default": 1, "source": 1, "inference": 2, "sink": 1})
    records = unique_records(200, "par")
    kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
    assert submit_mod.submit(str(setup.path), jobmanager=cluster.address) == 0
    out = capsys.readouterr().out
    match = re.search(r"submitted job \S+ as ([0-9a-f]{32})", out)
    assert match, out
    job_id = match.group(1)
    assert f"http://{cluster.address}/#/job/running/{job_id}/overview" in out
    cluster.wait_for_job_state(job_id, "RUNNING", timeout=180)
    parallelism = cluster.vertex_parallelism(job_id)
    # The chain holding the inference operator (not the ticks source, whose table is named after it).
    inference = [p for name, p in parallelism.items() if re.search(r"(^|-> )inference( ->|$)", name)]
    assert inference == [2], parallelism
    assert any("Source: kafka_requests" in name and p == 1 for name, p in parallelism.items()), parallelism
    got = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, expected=len(records), timeout_s=120)
    assert sorted(json.loads(r.value)["id"] for r in got) == sorted(k.decode() for k, _ in records)
    subtasks = {json.loads(r.value)["source"]["partition"] for r in got}
    assert subtasks == {0, 1}
    assert cluster.num_restarts(job_id, settle_s=METRICS_SETTLE_S) == 0
    cluster.cancel(job_id)


def test_submit_until_end_finishes_a_backfill(
        cluster: LocalCluster, paced_simulator: SpawnedSimulator, tmp_path: Path,
        kafka_broker: local_kafka.LocalBroker, capsys: pytest.CaptureFixture[str]) -> None:
    """`llmstream submit --until-end` on the cluster: the job FINISHES (stopped with a draining
    savepoint) once the records present at its start are answered and committed."""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="backfill")
    records = unique_records(300, "fill")
    kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
    assert submit_mod.submit(str(setup.path), jobmanager=cluster.address, options=RunOptions(until_end=True)) == 0
    job_id = re.findall(r"as ([0-9a-f]{32})", capsys.readouterr().out)[0]
    assert cluster.wait_for_job_state(job_id, "FINISHED", timeout=240) == "FINISHED"
    got = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, timeout_s=30)
    assert sorted(json.loads(r.value)["id"] for r in got) == sorted(k.decode() for k, _ in records)


# ---------------------------------------------------------------------- bad input


TEN_MB = 10 * 1024 * 1024


def bad_input_corpus() -> list[tuple[str, bytes | None, str]]:
    """(case, value, expected dead-letter reason): each a distinct way a record can be malformed."""
    def obj(**fields: object) -> bytes:
        return json.dumps(fields).encode()

    return [
        ("truncated_json", b'{"id": "t1", "prompt": "hel', "invalid_json"),
        ("binary", bytes(range(256)), "invalid_utf8"),
        ("invalid_utf8", b'{"id": "u8", "prompt": "caf\xc3\x28"}', "invalid_utf8"),
        ("nul_byte", b'{"id": "nul", "prompt": "a\x00b"}', "invalid_json"),
        ("tombstone", None, "null_value"),
        ("empty_value", b"", "invalid_json"),
        ("whitespace_only", b"   \n\t ", "invalid_json"),
        ("utf8_bom", b'\xef\xbb\xbf{"id": "bom", "prompt": "x"}', "invalid_json"),
        ("ten_megabytes", obj(id="big", prompt="x" * TEN_MB), "record_too_large"),
        ("deeply_nested", b'{"id": "deep", "prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         "invalid_json"),
        ("huge_integer", b'{"id": "bigint", "prompt": "x", "params": {"seed": ' + b"9" * 5000 + b"}}",
         "invalid_json"),
        ("float_overflow", b'{"id": "inf", "prompt": "x", "params": {"temperature": 1e999}}', "invalid_params"),
        ("nan", b'{"id": "nan", "prompt": "x", "params": {"temperature": NaN}}', "invalid_json"),
        ("empty_object", b"{}", "missing_field"),
        ("json_array", b'[{"id": "arr", "prompt": "x"}]', "not_an_object"),
        ("json_string", b'"just a prompt"', "not_an_object"),
        ("json_null", b"null", "not_an_object"),
        ("id_not_string", b'{"id": 42, "prompt": "x"}', "wrong_type"),
        ("prompt_not_string", obj(id="plist", prompt=["x", "y"]), "wrong_type"),
        ("empty_id", obj(id="", prompt="x"), "empty_id"),
        ("id_too_long", obj(id="i" * 600, prompt="x"), "id_too_long"),
        ("blank_prompt", obj(id="blank", prompt="   "), "empty_prompt"),
        ("oversize_prompt", obj(id="huge-prompt", prompt="p" * 100_001), "prompt_too_large"),
        ("over_context_window", obj(id="ctx", prompt="word " * 6000), "context_too_long"),
        ("unknown_param", obj(id="unk", prompt="x", params={"frobnicate": 1}), "invalid_params"),
        ("params_not_object", obj(id="pno", prompt="x", params=[1]), "invalid_params"),
        ("max_tokens_zero", obj(id="mt0", prompt="x", params={"max_tokens": 0}), "invalid_params"),
        ("wrong_param_type", obj(id="wpt", prompt="x", params={"max_tokens": "ten"}), "invalid_params"),
        ("prompt_and_messages", obj(id="both", prompt="x", messages=[{"role": "user", "content": "y"}]),
         "ambiguous_input"),
        ("no_prompt", obj(id="none"), "missing_field"),
        ("empty_messages", obj(id="em", messages=[]), "invalid_messages"),
        ("bad_role", obj(id="role", messages=[{"role": "wizard", "content": "y"}]), "invalid_messages"),
    ]


def test_bad_input_corpus_is_dead_lettered_without_restarts(
        cluster: LocalCluster, paced_simulator: SpawnedSimulator, tmp_path: Path,
        kafka_broker: local_kafka.LocalBroker, fault_report: FaultReport) -> None:
    """Malformed records of 30+ kinds between good ones: each bad one is dead-lettered once with
    its reason (matched by the Kafka key, which the dead letter keeps), each good one answered
    once, and the job never restarts."""
    started = time.monotonic()
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, paced_simulator.url, name="bad-input",
                     topic_configs={"max.message.bytes": str(12 * 1024 * 1024)},
                     input={"tombstones": "dead-letter"})  # a keyed null value is bad input here, not a delete
    corpus = bad_input_corpus()
    good = unique_records(20 * len(corpus), "good")
    producer = KafkaProducer(bootstrap_servers=setup.bootstrap, acks="all", max_request_size=12 * 1024 * 1024)
    try:
        futures = []
        for i, (case, value, _) in enumerate(corpus):
            for key, good_value in good[i * 20:(i + 1) * 20]:
                futures.append(producer.send(setup.input_topic, key=key, value=good_value))
            futures.append(producer.send(setup.input_topic, key=f"bad-{case}".encode(), value=value))
        producer.flush(60)
        for fut in futures:
            fut.get(60)
    finally:
        producer.close(10)

    job_id = cluster.submit(setup.path)
    cluster.wait_for_job_state(job_id, "RUNNING", timeout=180)
    dead = kafka_admin.consume_committed(setup.bootstrap, setup.dead_letter_topic, expected=len(corpus),
                                         timeout_s=180)
    out = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, expected=len(good), timeout_s=120)
    wait_for_checkpoints(cluster, job_id, 3)  # anything duplicated or late would show now
    dead = kafka_admin.consume_committed(setup.bootstrap, setup.dead_letter_topic, timeout_s=60)
    out = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, timeout_s=60)
    restarts = cluster.num_restarts(job_id, settle_s=METRICS_SETTLE_S)
    state = cluster.job_status(job_id)
    cluster.cancel(job_id)

    reasons = {r.key.decode(): json.loads(r.value)["reason"] for r in dead}
    expected = {f"bad-{case}": reason for case, _, reason in corpus}
    assert len(dead) == len(corpus), f"{len(dead)} dead letters for {len(corpus)} bad records"
    assert reasons == expected
    assert sorted(json.loads(r.value)["id"] for r in out) == sorted(k.decode() for k, _ in good)
    assert state == "RUNNING" and restarts == 0, cluster.failure(job_id)
    big = next(json.loads(r.value) for r in dead if r.key == b"bad-ten_megabytes")
    assert big["original"]["size"] > TEN_MB and big["original"]["truncated"] is True
    fault_report.add(FaultResult(
        scenario="f. bad-input corpus", records_in=len(corpus) + len(good), out=len(out), dead=len(dead),
        duplicates=0, lost=0, restarts=restarts, recovery_s=None, duration_s=round(time.monotonic() - started, 1),
        notes=f"{len(corpus)} kinds of malformed input among {len(good)} good records",
        extra={"dead_reasons": dict(sorted(Counter(reasons.values()).items()))}))
