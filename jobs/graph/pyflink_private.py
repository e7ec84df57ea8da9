"""Every use of PyFlink's private and internal API the job graph makes (`jobs/graph/pipeline.py`).

PyFlink's public Python API covers most of the graph; where it does not, the graph reaches into
the Java objects behind it (``_j_data_stream``, ``_j_stream_execution_environment``), the py4j
gateway (`get_gateway`) or PyFlink's internal operator factory. They are kept here, each with
the reason the public API does not suffice, so that a PyFlink upgrade has one module to check.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from pyflink.common import Configuration
from pyflink.datastream import DataStream, KeyedStream, StreamExecutionEnvironment
from pyflink.java_gateway import get_gateway

__all__ = ["adaptive_process", "datagen_source", "gated_keyed", "initialize_file_systems", "key_by_first_field", "keyed_stream",
           "name_transformation", "one_jvm_thread", "pipeline_jars", "python_files", "set_output_type", "settings_kept", "sources_of",
           "transformation_of", "transformations_of", "upstream_of"]


def set_output_type(stream: DataStream, java_type_info: Any) -> None:
    """Declares `stream`'s output type. `StreamTableEnvironment.to_data_stream` hands rows over
    under an ExternalTypeInfo, and the keyed Python operator accepts only a RowTypeInfo input;
    the public API has no way to restate a stream's type without another (Python) operator."""
    transformation_of(stream).setOutputType(java_type_info)


def name_transformation(stream: DataStream, name: str) -> None:
    """Names the transformation that produced `stream`: the planner's table-to-stream conversion
    has no public name setter (`DataStream.name` names an operator the Python API made)."""
    transformation_of(stream).setName(name)


def transformations_of(env: StreamExecutionEnvironment) -> list[Any]:
    """The Java transformations `env` holds (the job's sinks, once attached). PyFlink does not expose
    the list."""
    return list(env._j_stream_execution_environment.getTransformations())


def transformation_of(stream: DataStream) -> Any:
    """The Java transformation that makes `stream`."""
    return stream._j_data_stream.getTransformation()


def upstream_of(transformations: list[Any]) -> list[Any]:
    """The Java transformations upstream of `transformations`, themselves included, each once."""
    pending = list(transformations)
    seen: set[int] = set()
    found = []
    while pending:
        transformation = pending.pop()
        if transformation.getId() in seen:
            continue
        seen.add(transformation.getId())
        found.append(transformation)
        pending.extend(transformation.getInputs())
    return found


def sources_of(transformations: list[Any], source_class: str) -> list[Any]:
    """The Java `SourceTransformation`s upstream of `transformations` (themselves included) whose
    FLIP-27 source is a `source_class`. For the table planner's sources, whose name and uid no
    public API sets: since Flink 2.3 a `DataStreamScanProvider` source keeps the name and uid its
    connector gives it, where up to 2.2 the planner overwrote both with its own."""
    jvm = get_gateway().jvm
    wanted = jvm.java.lang.Class.forName(source_class, False, jvm.Thread.currentThread().getContextClassLoader())
    kind = jvm.java.lang.Class.forName("org.apache.flink.streaming.api.transformations.SourceTransformation")
    return [t for t in upstream_of(transformations) if kind.isInstance(t) and wanted.isInstance(t.getSource())]


def key_by_first_field(rows: DataStream, java_key_type: Any) -> Any:
    """`rows` keyed by their first field, on the JVM (the Java keyed stream): PyFlink's `key_by`
    puts a Python operator (and a Row round trip) in front of the key; PyFlink's own Java
    `KeyByKeySelector` takes the first field there."""
    return rows._j_data_stream.keyBy(get_gateway().jvm.KeyByKeySelector(), java_key_type)


def gated_keyed(j_keyed: Any, operator_class: str, operator_args: tuple[Any, ...], *, name: str, uid: str,
                parallelism: int, java_key_type: Any) -> Any:
    """The Java keyed stream `j_keyed` through a forwarding Java operator (`operator_class` made with
    `operator_args`), keyed again as it was (`reinterpretAsKeyedStream`, so no shuffle and the operator
    chains into the next task). Python cannot make a Java operator, and `reinterpretAsKeyedStream`
    has no Python counterpart."""
    jvm = get_gateway().jvm
    operator = getattr(jvm, operator_class)(*operator_args)
    forwarded = j_keyed.transform(name, j_keyed.getType(), operator)
    forwarded.uid(uid).setParallelism(parallelism)
    return jvm.org.apache.flink.streaming.api.datastream.DataStreamUtils.reinterpretAsKeyedStream(
        forwarded, jvm.KeyByKeySelector(), java_key_type)


def keyed_stream(j_keyed: Any, row_type: Any, origin: DataStream) -> KeyedStream:
    """The Python `KeyedStream` over a Java keyed stream made here (`key_by_first_field`,
    `gated_keyed`): its constructor takes the Java object, which the public API never hands out."""
    return KeyedStream(j_keyed, row_type, origin)


def datagen_source(env: StreamExecutionEnvironment, generator_class: str, slots: list[int], *,
                   java_row_type: Any, name: str, uid: str) -> DataStream:
    """A FLIP-27 `DataGeneratorSource` of `generator_class` (a Java `GeneratorFunction` made from
    `slots`) at `len(slots)` rows a second, with parallelism 1. PyFlink has no Python wrapper of
    `DataGeneratorSource`, and a Java generator needs a Java int array made through the gateway."""
    gateway = get_gateway()
    jvm = gateway.jvm
    j_slots = gateway.new_array(jvm.int, len(slots))
    for i, key in enumerate(slots):
        j_slots[i] = key
    source = jvm.org.apache.flink.connector.datagen.source.DataGeneratorSource(
        getattr(jvm, generator_class)(j_slots), jvm.Long.MAX_VALUE,
        jvm.org.apache.flink.api.connector.source.util.ratelimit.RateLimiterStrategy.perSecond(float(len(slots))),
        java_row_type)
    j_stream = env._j_stream_execution_environment.fromSource(
        source, jvm.org.apache.flink.api.common.eventtime.WatermarkStrategy.noWatermarks(), name)
    j_stream.uid(uid).setParallelism(1)
    return DataStream(j_stream)


def adaptive_process(keyed: KeyedStream, function: Any, output_type: Any, wrapper_class: str,
                     *wrapper_args: Any) -> DataStream:
    """`keyed.process(function, output_type)` with PyFlink's keyed Python operator wrapped by the
    Java operator `wrapper_class` (``of(operator, *wrapper_args)``). `KeyedStream.process` builds
    and adds its operator in one step; only PyFlink's internal `_get_one_input_stream_operator`
    hands out the operator it would add, with every setting PyFlink gives it."""
    from pyflink.datastream import data_stream as pyflink_data_stream
    from pyflink.fn_execution import flink_fn_execution_pb2

    made, j_output_type = pyflink_data_stream._get_one_input_stream_operator(
        keyed, function, flink_fn_execution_pb2.UserDefinedDataStreamFunction.KEYED_PROCESS, output_type)
    wrapped = getattr(get_gateway().jvm, wrapper_class).of(made, *wrapper_args)
    return DataStream(keyed._j_data_stream.transform("KEYED PROCESS", j_output_type, wrapped))



def _environment_config(env: StreamExecutionEnvironment) -> Any:
    """`env`'s configuration, where PyFlink's own `add_jars` and `add_python_file` read and write
    (`PythonConfigUtil.getEnvironmentConfig`); PyFlink has no getter for it."""
    return get_gateway().jvm.org.apache.flink.python.util.PythonConfigUtil.getEnvironmentConfig(
        env._j_stream_execution_environment)


def _environment_setting(env: StreamExecutionEnvironment, key: str) -> str | None:
    value = _environment_config(env).getString(key, None)
    return None if value is None else str(value)


@contextlib.contextmanager
def settings_kept(env: StreamExecutionEnvironment, keys: tuple[str, ...]) -> Iterator[None]:
    """`keys` of `env`'s configuration, and its default parallelism, as they were before the block.
    A table environment writes its own settings into its stream environment's configuration each
    time it translates a query (Flink's `PlannerBase.beforeTranslation`: `configure` with the table
    config, then the default parallelism from `table.exec.resource.default-parallelism`), where every
    table environment made afterwards reads them as defaults; PyFlink has no way to take them back."""
    config = _environment_config(env)
    before = {key: config.getString(key, None) for key in keys}
    parallelism = env.get_parallelism()
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                config.removeKey(key)
            else:
                config.setString(key, value)
        env.set_parallelism(parallelism)


def pipeline_jars(env: StreamExecutionEnvironment) -> list[str]:
    """The jar URLs in `env`'s `pipeline.jars` (what `add_jars` adds to)."""
    from pyflink.common import Configuration

    value = _environment_setting(env, "pipeline.jars")
    return [str(jar) for jar in Configuration.parse_list_value(value)] if value else []


def python_files(env: StreamExecutionEnvironment) -> list[str]:
    """The files and directories `env` ships to its Python workers (`python.files`, what
    `add_python_file` adds to)."""
    value = _environment_setting(env, "python.files")
    delimiter = str(get_gateway().jvm.PythonDependencyUtils.FILE_DELIMITER)
    return [item for item in value.split(delimiter) if item] if value else []


class _Pin:
    """The Py4J connection a Python thread keeps while it is pinned, and whether a call is on it."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.busy = False


_pins: dict[int, _Pin] = {}


def _pinnable(client: Any) -> None:
    """Wraps `client`'s pool (once) so that a pinned thread's calls take its own connection.
    A call made while that connection is busy (Py4J's finaliser deleting a Java object in the
    middle of another call) and every unpinned thread's call use the pool as before."""
    if getattr(client, "_llmstream_pinnable", False):
        return
    pooled_get, pooled_give = client._get_connection, client._give_back_connection

    def get() -> Any:
        pin = _pins.get(threading.get_ident())
        if pin is not None and not pin.busy:
            pin.busy = True
            return pin.connection
        return pooled_get()

    def give_back(connection: Any) -> None:
        pin = _pins.get(threading.get_ident())
        if pin is not None and connection is pin.connection:
            pin.busy = False
        else:
            pooled_give(connection)

    client._get_connection = get
    client._give_back_connection = give_back
    client._llmstream_pinnable = True


@contextlib.contextmanager
def one_jvm_thread(env: StreamExecutionEnvironment) -> Iterator[None]:
    """Every call this Python thread makes to the JVM inside the block runs on one JVM thread,
    whose context class loader holds `env`'s `pipeline.jars`.

    Py4J serves each pooled connection on its own JVM thread and hands a Python thread whichever
    connection came back last, so once another thread of the process has called the JVM (a test
    run's helpers, a progress reporter, Py4J's finaliser) consecutive calls can land on different
    JVM threads. The table planner cannot take that: its table environment finds connectors
    through the context class loader of the thread that made it ("Could not find any factory for
    identifier 'kafka'"), and Calcite keeps its metadata provider in a ThreadLocal set on that
    thread (FLINK-23020: `NullPointerException: metadataHandlerProvider`)."""
    from pyflink.util.java_utils import add_jars_to_context_class_loader

    client = get_gateway()._gateway_client
    me = threading.get_ident()
    if me in _pins:  # already pinned further up
        yield
        return
    _pinnable(client)
    _pins[me] = pin = _Pin(client._get_connection())  # not pinned yet: a pooled connection
    try:
        add_jars_to_context_class_loader(pipeline_jars(env))
        yield
    finally:
        del _pins[me]
        if not pin.busy:  # a connection Py4J closed on an error is not given back
            client._give_back_connection(pin.connection)


def initialize_file_systems(conf: Configuration) -> None:
    """Flink's ``FileSystem.initialize`` in the gateway JVM with ``conf``: the file systems on its
    classpath (S3) then take their settings (``s3.endpoint``...) from the job's configuration, which
    a mini cluster does not hand them itself."""
    get_gateway().jvm.org.apache.flink.core.fs.FileSystem.initialize(conf._j_configuration, None)
