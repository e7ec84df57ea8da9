"""The job graph: Kafka → inference stage (decode, bounded calls kept in keyed state) → exactly-once Kafka.

This module only wires stages from the config; the stages live in `udfs/`. The Kafka ends
are Flink's Kafka table connector (the DataStream `KafkaSource`/`KafkaSink` underneath),
because only the table connector hands Python the record key, its topic, partition, offset
and headers, and writes a key, headers and a per-record topic (output or dead letter)
through one exactly-once sink.

Headers travel as the connector's `headers` metadata, a `MAP<STRING, BYTES>` both ways: it
holds one value per name (a name repeated in the input keeps its last value) and its order
is the connector's hash map's, not the record's. `kafka.forward_headers` picks which reach
the output (`udfs/records/__init__.py`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pyflink.common import Configuration, Types
from pyflink.datastream import (
    CheckpointingMode,
    DataStream,
    KeyedProcessFunction,
    KeyedStream,
    StreamExecutionEnvironment,
)
from pyflink.table import StreamTableEnvironment, Table

from jobs.graph import gate_operator as gate
from jobs.graph import key_groups
from jobs.graph import pyflink_private as private
from jobs.runtime import jars
from jobs.state.snapshots import StateDir
from jobs.state.storage import S3Settings, S3Store, is_secret_key
from udfs.config import ADAPTIVE_MIN_BUNDLE, JobConfig, kafka_security
from udfs.lanes.keyed import INPUT_ROW_TYPE, SINK_ROW_TYPE, InferenceStage
from udfs.lanes.ordering import HASH_HEX_DIGITS
from udfs.lanes.provider_batch.lane import BatchStage

SOURCE_TABLE = "kafka_requests"
SINK_TABLE = "kafka_results"
SOURCE_UID = f"{SOURCE_TABLE}_source"
"""The Kafka source's uid, which the job's snapshots hold its offsets under (Flink 2.2's planner named it so)."""
SOURCE_UID_FROM_CONNECTOR = f"{SOURCE_TABLE}_kafka"
"""The uid Flink 2.3's planner leaves the Kafka source: the connector's `DataStreamScanProvider` names it `kafka`."""
UDFS_DIR = Path(__file__).resolve().parents[2] / "udfs"


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _with(options: dict[str, str]) -> str:
    return ",\n  ".join(f"{_quote(k)} = {_quote(v)}" for k, v in options.items())


def source_options(config: JobConfig) -> dict[str, str]:
    """Kafka source: the consumer group's committed offsets, earliest where there are none,
    when no state is restored; offsets are committed to the group when a checkpoint completes.
    New partitions, and with a pattern new topics, are found every `kafka.discovery_interval_ms`
    and read from their earliest offset.

    Never bounded: a restored source keeps the stopping offsets its splits were created
    with, so a bounded backfill resumed from an unbounded run's state would never end (and
    the reverse would stop early). Backfills end by a draining stop-with-savepoint instead.
    """
    kafka = config.kafka
    out = {
        "connector": "kafka",
        **({"topic-pattern": kafka.input_topic_pattern} if kafka.input_topic_pattern is not None
           else {"topic": ";".join(kafka.topics())}),
        "properties.bootstrap.servers": kafka.bootstrap_servers,
        "properties.group.id": kafka.group_id,
        "scan.startup.mode": "group-offsets",
        "properties.auto.offset.reset": "earliest",
        "properties.commit.offsets.on.checkpoint": "true",
        "key.format": "raw",
        "key.fields": "k",
        "value.format": "raw",
        "value.fields-include": "EXCEPT_KEY",
        "scan.parallelism": str(config.parallelism.of("source")),
        "scan.topic-partition-discovery.interval": f"{kafka.discovery_interval_ms} ms",
    }
    out.update(_client_properties(config))
    return out


def _client_properties(config: JobConfig) -> dict[str, str]:
    """`kafka.properties` as table options (`udfs/config/kafka_security.py`: secrets resolved, Kafka class names
    relocated into the connector's shaded package): they go into the job graph's Kafka clients, which
    mask password-typed values in their own logs, and never into Flink's configuration."""
    return {f"properties.{k}": v for k, v in kafka_security.flink_properties(config.kafka.properties).items()}


def sink_options(config: JobConfig) -> dict[str, str]:
    """Kafka sink: exactly-once transactions, committed on checkpoint, one sink for both topics."""
    kafka = config.kafka
    out = {
        "connector": "kafka",
        "topic": f"{kafka.output_topic};{kafka.dead_letter_topic}",
        "properties.bootstrap.servers": kafka.bootstrap_servers,
        "sink.delivery-guarantee": "exactly-once",
        "sink.transactional-id-prefix": kafka.transactional_id_prefix,
        "properties.transaction.timeout.ms": str(kafka.transaction_timeout_ms),
        "key.format": "raw",
        "key.fields": "k",
        "value.format": "raw",
        "value.fields-include": "EXCEPT_KEY",
        "sink.parallelism": str(config.parallelism.of("sink")),
    }
    out.update(_client_properties(config))
    return out


# Savepoints are always aligned: a stop-with-savepoint (Ctrl-C, `llmstream stop`, upgrades)
# waits until the barrier has passed every record already in the network buffers in front of
# the inference stage, and under a backlog those hold thousands of requests, every one a call.
# 4 KB buffers with buffer debloating (about a second of records in flight) stop it in seconds
# (docs/operations.md, "Fault tolerance"). The mini cluster takes these from the job; a standalone
# cluster from flink-conf/config.yaml, which sets the same.
SMALL_NETWORK_BUFFERS = {
    "taskmanager.memory.segment-size": "4kb",
    "taskmanager.network.memory.buffer-debloat.enabled": "true",
}


PROMETHEUS_REPORTER_FACTORY = "org.apache.flink.metrics.prometheus.PrometheusReporterFactory"


def local_cluster_options(config: JobConfig, rest_port: int) -> tuple[dict[str, str], list[str]]:
    """Flink options and extra jar URLs of a local mini cluster: its REST API on `rest_port`
    (loopback only) and, with `metrics.prometheus_port`, Flink's Prometheus reporter.

    A mini cluster builds its metric reporters from the job's configuration and finds the
    reporter factory through the jars in `pipeline.jars` (measured: the endpoint serves
    JobManager, TaskManager and operator metrics, llmstream's included). A standalone
    cluster's REST port and reporters are its own (flink-conf/config.yaml), never the job's.
    """
    options = {"rest.bind-address": "127.0.0.1", "rest.address": "127.0.0.1",
               "rest.bind-port": str(rest_port), "rest.port": str(rest_port),
               # The REST API's metric values are at most this old (default 10 s): `llmstream status`.
               "metrics.fetcher.update-interval": "1000"}
    urls: list[str] = []
    if config.metrics.prometheus_port is not None:
        options["metrics.reporter.prom.factory.class"] = PROMETHEUS_REPORTER_FACTORY
        options["metrics.reporter.prom.port"] = str(config.metrics.prometheus_port)
        urls = [p.as_uri() for p in jars.jars("metrics")]
    return options, urls


def flink_configuration(config: JobConfig, jar_urls: list[str], *, state: StateDir | None = None,
                        restore_from: str | None = None, leave_behind: bool = False,
                        local_rest_port: int | None = None) -> Configuration:
    """Settings that must be in place before the environment exists.

    `state` is the job's state directory: checkpoints are retained there on cancellation
    (and survive a killed process), savepoints go there, and the next run resumes from the
    newest (`jobs/state/snapshots.py`). `restore_from` is the snapshot this run restores; `leave_behind`:
    state it holds for operators this job lacks is dropped (`jobs.graph.gate_operator.left_behind`).
    `local_rest_port` is given for a local mini cluster only (`local_cluster_options`).
    """
    conf = Configuration()
    if local_rest_port is not None:
        options, extra_urls = local_cluster_options(config, local_rest_port)
        jar_urls = [*jar_urls, *extra_urls]
        for key, value in options.items():
            conf.set_string(key, value)
    conf.set_string("python.executable", sys.executable)
    conf.set_string("python.client.executable", sys.executable)
    if config.lane == "vectorized":  # the bundle is one Arrow batch: a checkpoint waits for about one
        conf.set_string("python.fn-execution.arrow.batch.size", str(config.vectorized.batch_size))
        conf.set_string("python.fn-execution.bundle.size", str(config.vectorized.batch_size))
    else:
        conf.set_string("python.fn-execution.bundle.size", str(config.python.bundle_size))
    conf.set_string("python.fn-execution.bundle.time", str(config.python.bundle_time_ms))
    conf.set_string("pipeline.name", config.name)
    # Stable uids for the table source and sink too, so savepoints restore after a change of
    # parallelism or config (the DataStream operators set theirs in `build_pipeline`).
    conf.set_string("table.exec.uid.generation", "ALWAYS")
    conf.set_string("execution.checkpointing.tolerable-failed-checkpoints",
                    str(config.checkpointing.tolerable_failed_checkpoints))
    if jar_urls:
        conf.set_string("pipeline.jars", ";".join(jar_urls))
    for key, value in SMALL_NETWORK_BUFFERS.items():
        conf.set_string(key, value)
    for key, value in config.flink.items():
        if not is_secret_key(key):  # credentials reach Flink through the environment (`_s3_on_the_gateway`)
            conf.set_string(key, value)
    if state is not None:
        conf.set_string("execution.checkpointing.storage", "filesystem")
        conf.set_string("execution.checkpointing.dir", state.checkpoints_uri)
        conf.set_string("execution.checkpointing.savepoint-dir", state.savepoints_uri)
        conf.set_string("execution.checkpointing.externalized-checkpoint-retention", "RETAIN_ON_CANCELLATION")
        conf.set_string("execution.checkpointing.num-retained", "2")
    if restore_from:
        conf.set_string("execution.state-recovery.path", restore_from)
        if leave_behind:
            conf.set_string("execution.state-recovery.ignore-unclaimed-state", "true")
    return conf


def create_environment(config: JobConfig, jar_urls: list[str], *, state: StateDir | None = None,
                       restore_from: str | None = None, leave_behind: bool = False,
                       local_rest_port: int | None = None,
                       python_files: Sequence[str] = ()) -> StreamExecutionEnvironment:
    """A stream environment configured for this job (mini cluster or cluster client), shipping
    `udfs/` and `python_files` (the user functions' modules, `jobs.launch.plan.user_modules`).

    A mini cluster (`local_rest_port`) whose state is on S3 gets Flink's S3 file system on its
    classpath and initialized with the job's configuration (`_s3_on_the_gateway`)."""
    s3 = local_rest_port is not None and state is not None and isinstance(state.store, S3Store)
    with _s3_on_the_gateway(config) if s3 else contextlib.nullcontext():
        conf = flink_configuration(config, jar_urls, state=state, restore_from=restore_from,
                                   leave_behind=leave_behind, local_rest_port=local_rest_port)
        if s3:
            private.initialize_file_systems(conf)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(config.parallelism.default)
    checkpoints = config.checkpointing
    env.enable_checkpointing(checkpoints.interval_ms, CheckpointingMode.EXACTLY_ONCE)
    checkpoint_config = env.get_checkpoint_config()
    checkpoint_config.set_checkpoint_timeout(checkpoints.timeout_ms)
    checkpoint_config.set_min_pause_between_checkpoints(checkpoints.min_pause_ms)
    env.add_python_file(str(UDFS_DIR))
    for path in python_files:
        env.add_python_file(path)
    return env


@contextlib.contextmanager
def _s3_on_the_gateway(config: JobConfig) -> Iterator[None]:
    """While PyFlink starts its JVM (the first `Configuration` in a process): Flink's S3 file system
    (pom-free set ``s3``) on its classpath, through ``HADOOP_CLASSPATH``, which PyFlink's launcher
    appends to it (a mini cluster reads no plugins folder), and an explicit ``s3.access-key``/
    ``s3.secret-key`` as ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, which S3A's default
    credential chain reads: never in Flink's configuration, which its REST API shows.

    The JVM must then be given the job's configuration with ``FileSystem.initialize`` before the
    job runs: without it the S3 client never learns ``s3.endpoint`` and the first checkpoint hangs
    (measured, docs/operations.md "State on object storage")."""
    credentials = S3Settings.from_flink(config.flink).credentials()
    wanted = {"HADOOP_CLASSPATH": os.pathsep.join(
        [jars.classpath("s3"), *([os.environ["HADOOP_CLASSPATH"]] if os.environ.get("HADOOP_CLASSPATH") else [])])}
    jvm_args = os.environ.get("JVM_ARGS", "").split()
    if any(arg.startswith("-XX:ArchiveClassesAtExit=") for arg in jvm_args):
        # A class archive is keyed by the plain classpath (jobs/runtime/jvm_archive.py): one dumped with
        # the S3 jar appended would not load in the runs it is for. Mapping an existing one is fine.
        wanted["JVM_ARGS"] = " ".join(arg for arg in jvm_args if not arg.startswith("-XX:ArchiveClassesAtExit="))
    if credentials:
        wanted.update(AWS_ACCESS_KEY_ID=credentials["aws_access_key_id"],
                      AWS_SECRET_ACCESS_KEY=credentials["aws_secret_access_key"])
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


BUCKETS_PER_SUBTASK = 4
"""Keys of the inference stage per subtask: its keyed state and timers need keys, nothing else does."""


def bucket_keys(parallelism: int, max_parallelism: int | None = None) -> list[int]:
    """`BUCKETS_PER_SUBTASK` key values for each inference subtask, chosen (with Flink's own
    key-group assignment) so that every subtask gets the same number of buckets."""
    max_p = max_parallelism or key_groups.default_max_parallelism(parallelism)
    chosen: dict[int, list[int]] = {i: [] for i in range(parallelism)}
    candidate = 0
    while any(len(keys) < BUCKETS_PER_SUBTASK for keys in chosen.values()):
        index = key_groups.subtask(candidate, max_p, parallelism)
        if len(chosen[index]) < BUCKETS_PER_SUBTASK:
            chosen[index].append(candidate)
        candidate += 1
    return sorted(key for keys in chosen.values() for key in keys)


RESCALE_RANGE = 16
"""Parallelisms (1..16, and any up to the current one) whose bucket keys a job also ticks: state
restored from a job with another parallelism holds requests under that job's keys."""


def tick_keys(parallelism: int, max_parallelism: int | None = None) -> tuple[list[int], list[int]]:
    """(this job's bucket keys, the other keys of parallelisms 1..max(`RESCALE_RANGE`, current)).

    After a rescale the pending requests of a bucket key the new job no longer uses (scaling
    2 -> 1 drops keys 4, 5, 6 and 8) are in state on whichever subtask owns that key's group,
    and only an element of that key starts them again: those keys get ticks too, fewer.
    The `ordering: per_key` buckets are among the others too, so a switch of `ordering` strands
    nothing either.
    """
    own = bucket_keys(parallelism, max_parallelism)
    others: set[int] = set(per_key_bucket_keys(parallelism, max_parallelism))
    for other in range(1, max(RESCALE_RANGE, parallelism) + 1):
        others.update(bucket_keys(other, max_parallelism))
    return own, sorted(others - set(own))


KEY_GROUP_STRIDE = 4
"""`ordering: per_key` has a bucket in every fourth key group: 32 buckets at the default max
parallelism of 128, enough to spread keys over any parallelism up to 32 and few enough that
the stage's per-bucket timers stay cheap."""


def per_key_bucket_keys(parallelism: int, max_parallelism: int | None = None) -> list[int]:
    """The bucket key values of `ordering: per_key`: one integer in each of the key groups
    0, `KEY_GROUP_STRIDE`, 2 x `KEY_GROUP_STRIDE`, ... (Flink's own key-group assignment).

    Unlike the offset buckets (`bucket_keys`) they depend only on the max parallelism, which a
    restore cannot change either: a Kafka key keeps its bucket, and its pending records their
    place in line, across restarts and rescaling, and each subtask owns the buckets of its
    key-group range."""
    max_p = max_parallelism or key_groups.default_max_parallelism(parallelism)
    wanted = set(range(0, max_p, KEY_GROUP_STRIDE))
    found: dict[int, int] = {}
    candidate = 0
    while len(found) < len(wanted):
        group = key_groups.key_group(candidate, max_p)
        if group in wanted and group not in found:
            found[group] = candidate
        candidate += 1
    return [found[group] for group in sorted(found)]


def key_hash_sql(column: str) -> str:
    """SQL for `udfs.lanes.ordering.key_hash` of a BYTES column: the first `HASH_HEX_DIGITS` hex digits
    of the MD5 of its bytes read as ISO-8859-1, as an INT (NULL for a NULL key). Flink SQL has no
    public hash of a byte string (HASH_CODE is internal) nor a hex-to-number function, hence the
    digits one by one; MD5 is the same in every JVM, so a key keeps its bucket across restarts."""
    digest = f"MD5(DECODE({column}, 'ISO-8859-1'))"
    return " + ".join(
        f"(POSITION(SUBSTRING({digest} FROM {i + 1} FOR 1) IN '0123456789abcdef') - 1) * {16 ** (HASH_HEX_DIGITS - 1 - i)}"
        for i in range(HASH_HEX_DIGITS))


TICKS_TABLE = "inference_ticks"
TICKS_PER_BUCKET_PER_S = 8
PER_KEY_TICKS_PER_BUCKET_PER_S = 2
"""`ordering: per_key` has 32 buckets on one subtask (at parallelism 1), not 4: fewer ticks each."""
OTHER_TICKS_PER_BUCKET_PER_S = 1
"""Empty elements per bucket and second (random buckets: each bucket gets one within a second but
for e^-8 of the seconds) that wake the inference stage when no input comes:
after a restore, the stage starts again what its state holds on the first element (or timer)
of each bucket, and a restored job whose input is already consumed would otherwise get none
(restored processing-time timers did not reach the Python function, measured)."""
HEADERS_SQL = "MAP<STRING, BYTES>"
"""The Kafka connector's `headers` metadata type, read and written (measured: what 5.0.0-2.2 accepts)."""
INPUT_ROW_SQL = ("ROW<k BYTES, v BYTES, `topic` STRING, `partition` INT, `offset` BIGINT, "
                 f"ts TIMESTAMP_LTZ(3), `headers` {HEADERS_SQL}>")
"""`udfs.lanes.keyed.INPUT_ROW_TYPE` in SQL."""


@dataclass(frozen=True)
class StageIds:
    """The names and uids of one inference stage's operators, made from the stage's uid: the
    app's stage is `inference` (its ticks table `inference_ticks`, gated ticks
    `inference-ticks-gated`, gate `admission-gate`, as every savepoint of the app has them); a
    job that calls `jobs.library.infer` more than once gives each call a uid of its own."""

    uid: str = "inference"

    @property
    def ticks_table(self) -> str:
        return f"{self.uid}_ticks"

    @property
    def gated_ticks_uid(self) -> str:
        return f"{self.uid}-ticks-gated"

    @property
    def gate_uid(self) -> str:
        return GATE_UID if self.uid == "inference" else f"{self.uid}-{GATE_UID}"

    @property
    def requests_view(self) -> str:
        """The view of a user's stream of input rows (`jobs.library.infer`); the app reads its source table."""
        return f"{self.uid}_requests"


def _as_rows(t_env: StreamTableEnvironment, table: Table, row_type: Any) -> DataStream:
    """`table` as a DataStream of `row_type`: the keyed Python operator accepts only a RowTypeInfo
    input, and the table hands over the same Row objects under an ExternalTypeInfo."""
    stream = t_env.to_data_stream(table)
    private.set_output_type(stream, row_type)
    return stream


def bucket_sql(ordering: str, keys: list[int]) -> str:
    """The bucket of an input row in SQL: its offset modulo the number of `keys` (`ordering: none`:
    spread evenly, no meaning), or a hash of its Kafka key (`per_key`: a key's records meet in one
    bucket, in order; a record without a key goes by its partition), mapped to the key values."""
    index = (f"MOD(COALESCE({key_hash_sql('k')}, `partition`), {len(keys)})" if ordering == "per_key"
             else f"MOD(`offset`, {len(keys)})")
    cases = " ".join(f"WHEN {i} THEN {key}" for i, key in enumerate(keys))
    return f"CASE {index} {cases} END"


def keyed_requests(t_env: StreamTableEnvironment, env: StreamExecutionEnvironment, parallelism: int, *,
                   with_headers: bool = True, ordering: str = "none", gate_dir: str | None = None,
                   source: str = SOURCE_TABLE, ids: StageIds | None = None,
                   publish_durable: bool = False) -> KeyedStream:
    """The input rows of the table `source` (columns k, v, topic, partition, offset, ts and, with
    `with_headers`, headers: the Kafka source table, or a user's stream as a view, `jobs.library.infer`)
    keyed by bucket, with the bucket computed in SQL (`bucket_sql`) and the key
    taken on the JVM: PyFlink's `key_by` would put another Python operator (and a Row round trip)
    in front. A tick (bucket, NULL) reaches every bucket about `TICKS_PER_BUCKET_PER_S` times a
    second (`PER_KEY_TICKS_PER_BUCKET_PER_S` under `ordering: per_key`), and the buckets of other
    parallelisms and of the other `ordering` (`tick_keys`) about once a second. Without
    `with_headers` the rows carry NULL headers and the source does not read them
    (`kafka.forward_headers: none`). With `gate_dir` the keyed rows pass the admission gate
    (`admission_gate`) on their way to the stage. `ids`: the names and uids of this stage's
    operators (`StageIds`; the app's by default)."""
    ids = ids or StageIds()
    max_p = env.get_max_parallelism() if env.get_max_parallelism() > 0 else None
    keys, other_keys = tick_keys(parallelism, max_p)
    rate = TICKS_PER_BUCKET_PER_S
    if ordering == "per_key":
        offset_keys = keys
        keys = per_key_bucket_keys(parallelism, max_p)
        other_keys = sorted((set(other_keys) | set(offset_keys)) - set(keys))
        rate = PER_KEY_TICKS_PER_BUCKET_PER_S
    # Tick slots: each own key `rate` times, each other key OTHER_TICKS_PER_BUCKET_PER_S.
    slots = keys * rate + other_keys * OTHER_TICKS_PER_BUCKET_PER_S
    # An array indexed by slot, not a CASE: the planner is slow over a CASE of a branch per slot
    # (docs/performance.md, "Job start").
    tick_slots = "ARRAY[" + ", ".join(str(key) for key in slots) + "]"
    t_env.execute_sql(
        f"CREATE TEMPORARY TABLE {ids.ticks_table} (n BIGINT) WITH (\n  " + _with({
            "connector": "datagen",
            "rows-per-second": str(len(slots)),
            # random, not sequence: a sequence generator keeps its whole remaining range in state
            "fields.n.kind": "random",
            "fields.n.min": "0",
            "fields.n.max": "1000000",
        }) + "\n)")
    row_type = Types.ROW([Types.INT(), INPUT_ROW_TYPE]).get_java_type_info()
    headers = "`headers`" if with_headers else f"CAST(NULL AS {HEADERS_SQL})"
    requests = _as_rows(t_env, t_env.sql_query(
        f"SELECT {bucket_sql(ordering, keys)} AS bucket,\n"
        f"  CAST(ROW(k, v, `topic`, `partition`, `offset`, ts, {headers}) AS {INPUT_ROW_SQL}) AS rec\n"
        f"FROM {source}"),
        row_type)
    if gate_dir is not None:
        ticks = gated_ticks(env, slots, row_type, uid=ids.gated_ticks_uid)
    else:
        config = t_env.get_config()
        uid_format = config.get("table.exec.uid.format", f"{SOURCE_TABLE}_<transformation>")
        config.set("table.exec.uid.format", f"{ids.ticks_table}_<transformation>")
        ticks = _as_rows(t_env, t_env.sql_query(
            f"SELECT {tick_slots}[CAST(MOD(n, {len(slots)}) AS INT) + 1] AS bucket, CAST(NULL AS {INPUT_ROW_SQL}) AS rec\n"
            f"FROM {ids.ticks_table}"), row_type)
        private.name_transformation(ticks, "ticks: TableToDataStream")
        config.set("table.exec.uid.format", uid_format)
    rows = requests.union(ticks)
    key_type = Types.ROW([Types.INT()]).get_java_type_info()
    j_keyed = private.key_by_first_field(rows, key_type)
    if gate_dir is not None:
        j_keyed = admission_gate(j_keyed, gate_dir, parallelism, key_type, uid=ids.gate_uid,
                                 publish_durable=publish_durable)
    return private.keyed_stream(j_keyed, INPUT_ROW_TYPE, rows)


GATE_UID = "admission-gate"


def gated_ticks(env: StreamExecutionEnvironment, slots: list[int], row_type: Any,
                uid: str = gate.TICKS_UID) -> DataStream:
    """The ticks of a gated job (`pom-free/gate/Ticks.java`): the same slots, one after another, at
    the same rate, from Flink's FLIP-27 `DataGeneratorSource` instead of the SQL datagen source,
    whose legacy source thread would hold every checkpoint while a closed gate back-pressures it.
    Adds the gate's jar to the job (`jobs/graph/gate_operator.py` builds it)."""
    env.add_jars(gate.ensure().as_uri())
    return private.datagen_source(env, gate.TICKS_CLASS, slots, java_row_type=row_type, name="ticks", uid=uid)


def admission_gate(j_keyed: Any, gate_dir: str, parallelism: int, key_type: Any, uid: str = GATE_UID, *,
                   publish_durable: bool = False) -> Any:
    """`j_keyed` through the admission gate (`pom-free/gate/AdmissionGate.java`, `udfs/lanes/admission.py`),
    keyed again as it was: the gate only forwards, so its output keeps the keyBy's partitioning
    (`reinterpretAsKeyedStream`) and the gate is chained into the stage's task. The gate's jar is
    in the job already (`gated_ticks`). `publish_durable`: the gate writes which checkpoint completed
    (the provider-batch lane's stage reads it; other stages leave the directory empty at their end)."""
    return private.gated_keyed(j_keyed, gate.GATE_CLASS,
                               (gate_dir, gate.CHECK_MS, gate.IDLE_SLEEP_MS, publish_durable),
                               name="inference admission gate", uid=uid, parallelism=parallelism,
                               java_key_type=key_type)


def inference(env: StreamExecutionEnvironment, keyed: KeyedStream, stage: KeyedProcessFunction,
              bundle_target_ms: int) -> DataStream:
    """`keyed.process(stage)`; with `bundle_target_ms` > 0 PyFlink's operator is swapped for
    `pom-free/gate/AdaptiveBundles.java` (its subclass whose bundle size follows throughput),
    made from it, so every other setting is PyFlink's. Adds the gate's jar to the job."""
    if not bundle_target_ms:
        return keyed.process(stage, output_type=SINK_ROW_TYPE)
    env.add_jars(gate.ensure("python.bundle_target_ms").as_uri())
    return private.adaptive_process(keyed, stage, SINK_ROW_TYPE, gate.ADAPTIVE_BUNDLES_CLASS,
                                    bundle_target_ms, ADAPTIVE_MIN_BUNDLE)


T = TypeVar("T")


def planned(env: StreamExecutionEnvironment, build: Callable[[StreamTableEnvironment], T]) -> T:
    """`build(t_env)` on a new table environment of `env`, every planner call on one JVM thread
    (`pyflink_private.one_jvm_thread`: the planner finds connectors, and Calcite its metadata, only
    on the thread that made the table environment)."""
    with private.one_jvm_thread(env):
        return build(StreamTableEnvironment.create(env))


def build_pipeline(env: StreamExecutionEnvironment, config: JobConfig, *, cache_file: str | None = None) -> str | None:
    """Adds the whole job to `env`; `env.execute()` then runs it and `get_execution_plan()` shows it.
    `cache_file`: the local result cache's file, as the launch decided it (`jobs.launch.plan.JobBuild`);
    a graph built only to be shown needs none. Returns the admission gate's directory when the job
    has one (`jobs.graph.gate_operator.open_for_stop`).

    The same steps as a user's own job that calls the stage (`jobs.library`): the source table
    (`create_source_table`), the stage (`keyed_stage`), the sink (`write_rows`)."""
    return planned(env, lambda t_env: _build_pipeline(env, t_env, config, cache_file))


def _build_pipeline(env: StreamExecutionEnvironment, t_env: StreamTableEnvironment, config: JobConfig,
                    cache_file: str | None) -> str | None:
    with_headers = create_source_table(t_env, config)
    create_sink_table(t_env, config)
    gate_dir = None
    if config.lane == "vectorized":
        vectorized_lane(t_env, config, with_headers, cache_file)
    else:
        outgoing, gate_dir = keyed_stage(t_env, env, config, SOURCE_TABLE, cache_file=cache_file)
        write_rows(t_env, outgoing)
    keep_source_identity(private.transformations_of(env))
    return gate_dir


def create_source_table(t_env: StreamTableEnvironment, config: JobConfig) -> bool:
    """Declares the Kafka source table (`SOURCE_TABLE`, `source_options`) in `t_env`, whose uid format
    is then the source's (`kafka_requests_<transformation>`). Returns whether it reads the records'
    headers (`kafka.forward_headers` is not `none`)."""
    # The planner names its operators' uids from a process-wide counter (`<id>_...`), so a job
    # built twice, or after a change elsewhere in the graph, would not find its state again.
    # Each Kafka end gets fixed uids instead; the DataStream operators set their own.
    t_env.get_config().set("table.exec.uid.format", f"{SOURCE_TABLE}_<transformation>")
    # Without forwarded headers the source does not read them at all (the planner keeps a
    # declared metadata column in the scan even when the query only selects NULL in its place).
    with_headers = config.kafka.forward_headers != "none"
    t_env.execute_sql(
        f"CREATE TEMPORARY TABLE {SOURCE_TABLE} (\n"
        "  k BYTES, v BYTES,\n"
        "  `topic` STRING METADATA VIRTUAL, `partition` INT METADATA VIRTUAL,\n"
        "  `offset` BIGINT METADATA VIRTUAL, ts TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL"
        + (f",\n  `headers` {HEADERS_SQL} METADATA VIRTUAL" if with_headers else "")
        + f"\n) WITH (\n  {_with(source_options(config))}\n)"
    )
    return with_headers


def create_sink_table(t_env: StreamTableEnvironment, config: JobConfig) -> None:
    """Declares the exactly-once Kafka sink table (`SINK_TABLE`, `sink_options`) in `t_env`."""
    t_env.execute_sql(
        f"CREATE TEMPORARY TABLE {SINK_TABLE} (k BYTES, v BYTES, `topic` STRING METADATA, `headers` {HEADERS_SQL} METADATA)\n"
        f"WITH (\n  {_with(sink_options(config))}\n)"
    )


def keyed_stage(t_env: StreamTableEnvironment, env: StreamExecutionEnvironment, config: JobConfig, source: str, *,
                ids: StageIds | None = None, cache_file: str | None = None) -> tuple[DataStream, str | None]:
    """The keyed inference stage over the input rows of the table `source` (`keyed_requests`): its
    `SINK_ROW_TYPE` rows, results and dead letters alike, and the admission gate's directory when
    the config needs the gate (a spend budget, a fleet, a rate limit: `jobs/graph/gate_operator.py`),
    else None. Turns on unaligned checkpoints in `env` when `python.unaligned_checkpoints` says so."""
    ids = ids or StageIds()
    inference_parallelism = config.parallelism.of("inference")
    if config.python.unaligned_checkpoints:
        env.get_checkpoint_config().enable_unaligned_checkpoints()
    # A spend budget pauses the stage for up to a window, a fleet with every endpoint down for a
    # cooldown: the gate keeps checkpoints going meanwhile (`jobs/graph/gate_operator.py`).
    gate_dir = gate.job_directory() if gate.gated(config) else None
    keyed = keyed_requests(t_env, env, inference_parallelism, with_headers=config.kafka.forward_headers != "none",
                           ordering=config.ordering, gate_dir=gate_dir, source=source, ids=ids,
                           publish_durable=config.lane == "provider-batch")
    stage: KeyedProcessFunction = (BatchStage(config, cache_file=cache_file, gate_dir=gate_dir)
                                   if config.lane == "provider-batch"
                                   else InferenceStage(config, gate_dir=gate_dir, cache_file=cache_file))
    outgoing = (
        inference(env, keyed, stage, config.python.bundle_target_ms)
        .name(ids.uid).uid(ids.uid).set_parallelism(inference_parallelism)
    )
    return outgoing, gate_dir


def write_rows(t_env: StreamTableEnvironment, rows: DataStream, *, uid_prefix: str = SINK_TABLE) -> None:
    """`rows` (`SINK_ROW_TYPE`) into the Kafka sink table declared in `t_env` (`create_sink_table`),
    each to its own topic, in transactions committed when a checkpoint completes; the sink's
    operators' uids are `<uid_prefix>_<transformation>`."""
    t_env.get_config().set("table.exec.uid.format", f"{uid_prefix}_<transformation>")
    statements = t_env.create_statement_set()
    statements.add_insert(SINK_TABLE, t_env.from_data_stream(rows))
    statements.attach_as_datastream()


KAFKA_SOURCE_CLASS = "org.apache.flink.connector.kafka.source.KafkaSource"


def keep_source_identity(transformations: list[Any]) -> None:
    """The Kafka source keeps the uid and name Flink up to 2.2 gave it. Flink 2.3's planner keeps
    the Kafka connector's own instead (uid `kafka_requests_kafka`, name `KafkaSource-default_catalog.
    default_database.kafka_requests`), so it would refuse to restore a savepoint of 2.2 ("Cannot map
    checkpoint/savepoint state for operator ... to the new program": the source's offsets are under
    `kafka_requests_source`), and `llmstream status` and the Grafana dashboard, which find the
    source's figures by its name, would find none. A source without a uid (the vectorized lane's,
    whose operators carry Flink's graph hashes) keeps none. `transformations`: the Java
    transformations the source is upstream of (`pyflink_private.transformations_of`)."""
    for source in private.sources_of(transformations, KAFKA_SOURCE_CLASS):
        source.setName(SOURCE_TABLE)
        if source.getUid() == SOURCE_UID_FROM_CONNECTOR:
            source.setUid(SOURCE_UID)


VECTORIZED_FUNCTION = "llmstream_infer"


def vectorized_lane(t_env: StreamTableEnvironment, config: JobConfig, with_headers: bool,
                    cache_file: str | None = None) -> None:
    """`stage: vectorized`: the source table through one Arrow-batched Python function
    (`udfs/lanes/vectorized.py`) into the same exactly-once sink, in SQL; no keyed state, ticks
    or gate. The function returns one row per input row; a skipped tombstone's row is filtered."""
    from udfs.lanes.vectorized import vectorized_function

    t_env.create_temporary_function(VECTORIZED_FUNCTION, vectorized_function(config, cache_file))
    # Arrow maps need non-null keys: the headers cross as MAP<STRING NOT NULL, BYTES> both ways.
    arrow_headers = "MAP<STRING NOT NULL, BYTES>"
    headers = f"CAST(`headers` AS {arrow_headers})" if with_headers else f"CAST(NULL AS {arrow_headers})"
    # One SQL statement plans the whole lane, and two of its operators are calcs, so a uid format of
    # "<name>_<transformation>" would repeat itself. Flink's own operator ids (hashes of the graph's
    # shape, the same for the same config) take their place: a savepoint of this lane restores into it.
    t_env.get_config().set("table.exec.uid.generation", "DISABLED")
    statements = t_env.create_statement_set()
    statements.add_insert_sql(
        f"INSERT INTO {SINK_TABLE}\n"
        f"SELECT r.k, r.v, r.`topic`, CAST(r.`headers` AS {HEADERS_SQL}) FROM (\n"
        f"  SELECT {VECTORIZED_FUNCTION}(k, v, `topic`, `partition`, `offset`, ts, {headers}) AS r FROM {SOURCE_TABLE}\n"
        ") WHERE r.emit")
    statements.attach_as_datastream()
