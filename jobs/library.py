"""llmstream's inference stage as a library call, for your own PyFlink DataStream job.

    from jobs.library import INPUT_ROW_TYPE, environment, infer, read_kafka, write_kafka

    env = environment(config)                     # checkpoints, Python bundles, jars, udfs/ shipped
    requests = read_kafka(env, config)            # DataStream of INPUT_ROW_TYPE rows
    requests = requests.filter(my_filter).map(my_enrich, output_type=INPUT_ROW_TYPE)
    answers = infer(requests, config)             # DataStream of SINK_ROW_TYPE rows
    write_kafka(answers, config)                  # exactly-once, the topic of each row decides
    env.execute(config.name)

`infer` is the app's own stage (`jobs.graph.pipeline.keyed_stage`, the one `build_pipeline` builds),
on the user's stream instead of the Kafka source table, so it keeps what the app keeps: calls in
flight in keyed state (a checkpoint never waits for a model call, a restore starts them again),
`async.capacity` as backpressure on everything upstream, per-key order (`ordering: per_key`), the
result cache, the spend budget, the fleet, rate limits and the admission gate, and exactly-once
output when the rows go to a transactional sink (`write_kafka`, or any sink that commits on
checkpoints). `read_kafka` and `write_kafka` are the app's Kafka ends. The guide, with the
example job `jobs/examples/enrich_and_infer.py`: docs/library.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pyflink.common.typeinfo import TypeInformation
from pyflink.datastream import DataStream, StreamExecutionEnvironment
from pyflink.table import StreamTableEnvironment

from jobs.graph import pyflink_private as private
from jobs.graph.pipeline import (
    HEADERS_SQL,
    SINK_TABLE,
    SOURCE_TABLE,
    UDFS_DIR,
    StageIds,
    create_environment,
    create_sink_table,
    create_source_table,
    keep_source_identity,
    keyed_stage,
    planned,
    write_rows,
)
from jobs.launch.plan import job_build, result_cache_file
from jobs.runtime import jars
from jobs.state.snapshots import StateDir
from udfs.config import JobConfig
from udfs.errors import ConfigError
from udfs.lanes.keyed import INPUT_ROW_TYPE, SINK_ROW_TYPE

__all__ = ["INPUT_ROW_TYPE", "SINK_ROW_TYPE", "check", "environment", "infer", "read_kafka", "write_kafka"]

log = logging.getLogger("llmstream.library")
T = TypeVar("T")


def environment(config: JobConfig, *, state_dir: str | None = None,
                restore_from: str | None = None) -> StreamExecutionEnvironment:
    """A stream environment set up as `llmstream run` and `submit` set up theirs: checkpointing
    (`checkpointing.*`, exactly-once mode) into the job's state directory (`state_dir`, else
    `checkpointing.directory`, else var/state/<name>), Python bundles (`python.*`), small network
    buffers, `flink.*`, the Kafka connector's jars and `udfs/` shipped to the Python workers.
    `restore_from`: a savepoint or retained checkpoint to start from (`flink run -s` does the same).
    Your job may add to it as to any environment; under `flink run` it is the cluster's."""
    build = job_build(config, StateDir.for_job(config, state_dir), jars.connector_jar_urls())
    return create_environment(config, list(build.jar_urls), state=build.state, restore_from=restore_from,
                              python_files=build.python_files)


def check(config: JobConfig) -> None:
    """What `llmstream run` checks against the broker before it starts a job (`jobs.launch.preflight`):
    raises `ConfigError` naming the setting the broker would reject; creates the topics when
    `kafka.create_topics` says so."""
    from jobs.launch import preflight

    preflight.check(config)


def read_kafka(env: StreamExecutionEnvironment, config: JobConfig) -> DataStream:
    """The input topics of `config.kafka` as a DataStream of `INPUT_ROW_TYPE` rows (key, value,
    topic, partition, offset, ts, headers): the app's Kafka source (a
    consumer group, its committed offsets, earliest where there are none, committed again on every
    checkpoint; `kafka.properties` for TLS and SASL), with uids of its own (`kafka_requests_*`), so a
    savepoint finds its offsets. Headers are NULL under `kafka.forward_headers: none` (not read at all)."""
    _add_connector(env)

    def build(t_env: StreamTableEnvironment) -> DataStream:
        _stable_uids(t_env)
        with_headers = create_source_table(t_env, config)
        headers = "`headers`" if with_headers else f"CAST(NULL AS {HEADERS_SQL})"
        table = t_env.sql_query(
            f"SELECT k, v, `topic`, `partition`, `offset`, ts, {headers} AS `headers` FROM {SOURCE_TABLE}")
        stream = t_env.to_data_stream(table)
        private.set_output_type(stream, INPUT_ROW_TYPE.get_java_type_info())
        keep_source_identity([private.transformation_of(stream)])
        return stream

    return _planned(env, build)


def infer(requests: DataStream, config: JobConfig, *, uid: str = "inference",
          state_dir: str | None = None) -> DataStream:
    """The inference stage over `requests`, a DataStream of `INPUT_ROW_TYPE` rows; returns a
    DataStream of `SINK_ROW_TYPE` rows (k, v, topic, headers): a result (or a forwarded
    tombstone) on `kafka.output_topic`, a dead letter on `kafka.dead_letter_topic`, one row per
    input row (none for a tombstone under `input.tombstones: skip`).

    Each row's value follows the job's input format (the JSON record contract by default,
    `input.format`); its (topic, partition, offset) must be unique and the same when the row is
    read again after a restore: it is the row's name in the stage's state, its place in its key's
    order (`ordering: per_key`) and its `source` in the output. Kafka records keep theirs through
    filters and maps that copy them; with `ordering: per_key` a key's rows must reach the stage in
    order (no rebalance in between). The stage runs at `parallelism.inference`, keyed on the JVM
    (no Python operator in front); the rows reach it through a SQL step that the planner runs at
    `requests`' parallelism, forward-connected.

    `uid`: the stage's uid and name (its ticks and gate are named from it): a job that calls
    `infer` more than once gives each call its own. `state_dir`: the job's state directory, as
    given to `environment`, where the local result cache lives (`cache.backend: local`).

    Also turns on unaligned checkpoints in the job (`python.unaligned_checkpoints`) and ships
    `udfs/` if `environment` did not; exactly-once needs checkpointing, which `environment` turns on.
    The vectorized and provider-batch lanes (`lane: vectorized|provider-batch`, or `auto` choosing
    one) are not a library call (a `ConfigError`).
    """
    if config.lane != "keyed":
        raise ConfigError("stage", f"the {config.lane} lane ({config.lane_choice()[1]}) is the app's only; infer() "
                                   "runs the keyed stage (lane: keyed)")
    _expect_type(requests, INPUT_ROW_TYPE, "infer(requests)", "INPUT_ROW_TYPE")
    env = requests.get_execution_environment()
    if not env.get_checkpoint_config().is_checkpointing_enabled():
        log.warning("infer(): checkpointing is off in this job: a transactional sink commits nothing and the "
                    "calls in flight are not kept across a failure (environment(config) turns it on)")
    if str(UDFS_DIR) not in private.python_files(env):
        env.add_python_file(str(UDFS_DIR))
    ids = StageIds(uid)
    cache_file = result_cache_file(config, StateDir.for_job(config, state_dir))

    def build(t_env: StreamTableEnvironment) -> DataStream:
        _stable_uids(t_env)
        t_env.get_config().set("table.exec.uid.format", f"{ids.requests_view}_<transformation>")
        t_env.create_temporary_view(ids.requests_view, t_env.from_data_stream(requests))
        outgoing, _gate_dir = keyed_stage(t_env, env, config, ids.requests_view, ids=ids, cache_file=cache_file)
        _scan_uid_of_its_own(outgoing, ids.requests_view)
        return outgoing

    return _planned(env, build)


def _scan_uid_of_its_own(stream: DataStream, view: str) -> None:
    """The scan of the user's stream (`DataStreamToTable`) keeps the uid Flink 2.2's planner gave
    it, `<view>_source`. Flink 2.3's gives it the uid of the conversion back to a stream,
    `<view>_external-datastream`, and Flink refuses a job with two operators of one uid ("Hash
    collision on user-specified ID")."""
    taken = f"{view}_external-datastream"
    for transformation in private.upstream_of([private.transformation_of(stream)]):
        if transformation.getUid() == taken and transformation.getName() == "DataStreamToTable":
            transformation.setUid(f"{view}_source")


def write_kafka(rows: DataStream, config: JobConfig, *, uid: str = SINK_TABLE) -> None:
    """`rows` (`SINK_ROW_TYPE`) to Kafka through the app's sink: exactly-once (transactions under
    `kafka.transactional_id_prefix`, committed when a checkpoint completes, so a read_committed
    consumer sees each row once), each row to its own topic with its key and headers.
    `uid`: the prefix of the sink's uids (`<uid>_sink`): another for a second sink in one job
    (with its own `kafka.transactional_id_prefix`)."""
    _expect_type(rows, SINK_ROW_TYPE, "write_kafka(rows)", "SINK_ROW_TYPE")
    env = rows.get_execution_environment()
    _add_connector(env)

    def build(t_env: StreamTableEnvironment) -> None:
        _stable_uids(t_env)
        create_sink_table(t_env, config)
        write_rows(t_env, rows, uid_prefix=uid)

    _planned(env, build)


TABLE_SETTINGS = ("table.exec.uid.format", "table.exec.uid.generation")
"""The table settings the library's steps set: none of them stays in the user's environment."""


def _planned(env: StreamExecutionEnvironment, build: Callable[[StreamTableEnvironment], T]) -> T:
    """`planned(env, build)`, leaving the user's environment as it was (its default parallelism and
    `TABLE_SETTINGS`, which the planner copies into it: `pyflink_private.settings_kept`): a table
    query of the user's own after it must not take, say, the sink's uid format."""
    with private.settings_kept(env, TABLE_SETTINGS):
        return planned(env, build)


def _stable_uids(t_env: StreamTableEnvironment) -> None:
    """Uids on the planner's operators too (`environment` sets this job-wide; a user's own
    environment may not), so that a savepoint finds the Kafka ends' and the ticks' state."""
    t_env.get_config().set("table.exec.uid.generation", "ALWAYS")


def _add_connector(env: StreamExecutionEnvironment) -> None:
    """The Kafka connector's jars in `env`'s `pipeline.jars`, unless there already."""
    present = set(private.pipeline_jars(env))
    missing = [url for url in jars.connector_jar_urls() if url not in present
               and Path(url).name not in {Path(p).name for p in present}]
    if missing:
        env.add_jars(*missing)


def _expect_type(stream: DataStream, expected: TypeInformation, what: str, name: str) -> None:
    """A `TypeError` naming the expected row type, and how to give it, unless `stream` carries it."""
    actual = stream.get_type()
    if actual == expected:
        return
    wanted, got = _fields(expected), _fields(actual)
    if got is not None and [n for n, _ in got] == [n for n, _ in wanted or []]:
        found = "; ".join(f"{n} is {t}, not {e}" for (n, t), (_, e) in zip(got, wanted or [], strict=True) if t != e)
    else:
        found = f"ROW<{', '.join(n for n, _ in got)}>" if got is not None else str(actual)
    raise TypeError(f"{what}: expected a DataStream of jobs.library.{name} rows "
                    f"(ROW<{', '.join(n for n, _ in wanted or [])}>), got {found}; "
                    f"give your last operator output_type={name}")


def _fields(type_info: TypeInformation) -> list[tuple[str, str]] | None:
    names = getattr(type_info, "get_field_names", None)
    types = getattr(type_info, "get_field_types", None)
    if names is None or types is None:
        return None
    return [(str(n), str(t)) for n, t in zip(names(), types(), strict=True)]
