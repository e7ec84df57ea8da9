"""Where a record's CPU goes between PyFlink's cheapest crossing and llmstream's keyed stage
(issue 23): the same records through Python in six shapes, with no Kafka and no model.

`llmstream bench --approaches flink-floor,pyflink-floor,llmstream` showed, in one run, Flink and
Kafka alone at ~0.11 ms of CPU a record, the same through a Python scalar function at ~0.13 ms,
and llmstream at ~1.5 ms, of which its HTTP client (measured without Flink) is ~0.4 ms. This
finds which step of the path from the first to the last costs the rest. A bounded datagen source
makes the job's input rows (`INPUT_ROW_SQL`: key, a JSON value, topic, partition, offset,
timestamp), a blackhole sink takes one row (key, value, topic) per record, and in between:

- ``scalar``: a SQL Python scalar function returns the value (the `pyflink-floor`'s crossing);
- ``map``: the table as a DataStream of `INPUT_ROW_TYPE` rows (`jobs.graph.pipeline._as_rows`), a
  Python ``map`` to the sink row, back to a table;
- ``keyed``: the rows keyed by one of 4 buckets on the JVM as the job does (`KeyByKeySelector`),
  a ``KeyedProcessFunction`` yields the sink row;
- ``keyed-state``: as ``keyed``, with a `MapState` put and remove per record (the stage keeps
  each pending record so);
- ``keyed-json``: as ``keyed-state``, with the JSON value parsed and an output JSON written;
- ``keyed-loop``: as ``keyed-json``, with the output written on an asyncio loop on a thread of
  its own (`call_soon_threadsafe`), as the stage hands each call to its call loop, and taken back
  by the next element (the last few records' rows are dropped at the end: CPU is what counts).

CPU per record is the slope between two runs of different sizes (start-up cancels out;
`tests.experiments.datagen_jobs`).

    python -m tests.experiments.python_path [--shape scalar --shape keyed ...] [--small 20000 --large 100000]
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

from tests.experiments.datagen_jobs import (
    datagen_job,
    key_sql,
    print_slopes,
    record_sql,
    sink_row_type,
    timed_execute,
    value_sql,
)

SHAPES = ("scalar", "map", "keyed", "keyed-state", "keyed-json", "keyed-loop")


def run(shape: str, records: int) -> tuple[float, float]:
    """One bounded job of `records` records in `shape`; (CPU-s, wall s) of the job alone."""
    from pyflink.common import Row, Types
    from pyflink.datastream import KeyedProcessFunction, RuntimeContext
    from pyflink.datastream.data_stream import KeyedStream
    from pyflink.datastream.state import MapStateDescriptor
    from pyflink.java_gateway import get_gateway
    from pyflink.table import DataTypes
    from pyflink.table.udf import udf

    from jobs.graph.pipeline import _as_rows
    from udfs.lanes.keyed import INPUT_ROW_TYPE

    sink_row = sink_row_type()
    pending = MapStateDescriptor("pending", Types.STRING(), Types.PICKLED_BYTE_ARRAY())

    class Echo(KeyedProcessFunction):
        def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterator[Row]:
            yield Row(value[0], value[1], "out")

    class WithState(KeyedProcessFunction):
        def open(self, runtime_context: RuntimeContext) -> None:
            self.state = runtime_context.get_map_state(pending)

        def keep(self, value: Row) -> None:
            """What the stage does with a pending record: put it in MapState, remove it when done."""
            handle = f"{value[2]}:{value[3]}:{value[4]}"
            self.state.put(handle, value[1])
            self.state.remove(handle)

        def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterator[Row]:
            self.keep(value)
            yield Row(value[0], value[1], "out")

    class WithJson(WithState):
        def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterator[Row]:
            request = json.loads(value[1])
            self.keep(value)
            yield Row(value[0], json.dumps({"id": request["id"], "output": "ok"}).encode(), "out")

    class WithLoop(WithState):
        def open(self, runtime_context: RuntimeContext) -> None:
            import asyncio
            import collections
            import threading

            super().open(runtime_context)
            self.done: collections.deque[Row] = collections.deque()
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True).start()

        def answer(self, key: bytes, request: dict[str, Any]) -> None:
            self.done.append(Row(key, json.dumps({"id": request["id"], "output": "ok"}).encode(), "out"))

        def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterator[Row]:
            request = json.loads(value[1])
            self.keep(value)
            self.loop.call_soon_threadsafe(self.answer, value[0], request)
            while self.done:
                yield self.done.popleft()

    env, t_env = datagen_job(records)
    record = record_sql("n")
    statements = t_env.create_statement_set()
    if shape == "scalar":
        t_env.create_temporary_function("echo", udf(lambda v: v, result_type=DataTypes.BYTES()))
        statements.add_insert_sql(f"INSERT INTO sink SELECT {key_sql('n')}, echo({value_sql('n')}), 'out' FROM gen")
    else:
        if shape == "map":
            rows = _as_rows(t_env, t_env.sql_query(f"SELECT {record} AS rec FROM gen"),
                            Types.ROW([INPUT_ROW_TYPE]).get_java_type_info())
            out = rows.map(lambda r: Row(r[0][0], r[0][1], "out"), output_type=sink_row)
        else:
            row_type = Types.ROW([Types.INT(), INPUT_ROW_TYPE]).get_java_type_info()
            rows = _as_rows(t_env, t_env.sql_query(f"SELECT CAST(MOD(n, 4) AS INT) AS bucket, {record} AS rec FROM gen"),
                            row_type)
            keyed = KeyedStream(rows._j_data_stream.keyBy(get_gateway().jvm.KeyByKeySelector(),
                                                          Types.ROW([Types.INT()]).get_java_type_info()),
                                INPUT_ROW_TYPE, rows)
            function = {"keyed": Echo, "keyed-state": WithState, "keyed-json": WithJson,
                        "keyed-loop": WithLoop}[shape]()
            out = keyed.process(function, output_type=sink_row)
        t_env.create_temporary_view("outs", t_env.from_data_stream(out))
        statements.add_insert_sql("INSERT INTO sink SELECT * FROM outs")
    statements.attach_as_datastream()
    return timed_execute(env, f"python path {shape} x {records}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=SHAPES, default=[])
    parser.add_argument("--small", type=int, default=20_000)
    parser.add_argument("--large", type=int, default=100_000)
    parser.add_argument("--one", nargs=2, metavar=("SHAPE", "RECORDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        cpu, wall = run(args.one[0], int(args.one[1]))
        print(json.dumps({"cpu": cpu, "wall": wall}), flush=True)
        return 0
    return print_slopes("tests.experiments.python_path", "shape", args.shape or SHAPES, args.small, args.large)

if __name__ == "__main__":
    raise SystemExit(main())
