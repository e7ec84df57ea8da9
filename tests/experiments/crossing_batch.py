"""What batching the JVM <-> Python crossing would save: CPU per record of the whole process tree
when each crossing element carries one record or a batch of B records (issue 23, item 3).

The profile (docs/performance.md, "Where a record's CPU goes") put ~40% of both sides' CPU in
the Beam crossing, a cost per element. This measures the ceiling of carrying several records per
element, with no Kafka and no model: a bounded datagen source makes the same records as the job's
source table (`INPUT_ROW_SQL`: key, a JSON value, topic, partition, offset, timestamp), keyed by
one of 4 buckets on the JVM as the job does (`KeyByKeySelector`), and a `KeyedProcessFunction`
does per record what the stage does apart from the call: parse the JSON value, put the record in
`MapState` and remove it, and emit one sink row (key, JSON value, topic). With ``--batch 1`` each
element is one record and each output element one row; with ``--batch B`` the JVM builds each
element as an ARRAY of B records (SQL), the function loops over them and emits one ARRAY of B sink
rows, which the JVM unnests (SQL ``CROSS JOIN UNNEST``) before a blackhole sink.

CPU per record is the slope between two runs of different sizes (the job's start-up cancels
out; `tests.experiments.datagen_jobs`).

    python -m tests.experiments.crossing_batch --batch 1 --batch 8 --batch 32 [--small 40000 --large 200000]
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

from tests.experiments.datagen_jobs import (
    datagen_job,
    print_slopes,
    record_sql,
    sink_row_type,
    timed_execute,
)


def run(batch: int, records: int, verify_dir: str | None = None) -> tuple[float, float]:
    """Runs one bounded job of `records` records in elements of `batch`; returns (CPU-s, wall s) of
    the job alone (measured around `execute`, after the environment is up). With `verify_dir` the
    sink writes CSV files there instead of discarding (to count what came out)."""
    from pyflink.common import Row, Types
    from pyflink.datastream import KeyedProcessFunction, RuntimeContext
    from pyflink.datastream.data_stream import KeyedStream
    from pyflink.datastream.state import MapStateDescriptor
    from pyflink.java_gateway import get_gateway

    from jobs.graph.pipeline import _as_rows
    from udfs.lanes.keyed import INPUT_ROW_TYPE

    sink_row = sink_row_type()
    pending = MapStateDescriptor("pending", Types.STRING(), Types.PICKLED_BYTE_ARRAY())

    def handle(state: Any, rec: Row) -> Row:
        request = json.loads(rec[1])
        handle_key = f"{rec[2]}:{rec[3]}:{rec[4]}"
        state.put(handle_key, rec[1])
        state.remove(handle_key)
        out = json.dumps({"id": request["id"], "output": "ok", "model": "probe"}).encode()
        return Row(rec[0], out, "out")

    class One(KeyedProcessFunction):
        def open(self, runtime_context: RuntimeContext) -> None:
            self.state = runtime_context.get_map_state(pending)

        def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterator[Row]:
            yield handle(self.state, value)

    class Many(One):
        def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterator[Row]:
            yield Row([handle(self.state, rec) for rec in value])

    elements = records // batch
    env, t_env = (datagen_job(elements, f"'connector'='filesystem', 'path'='{verify_dir}', 'format'='csv'")
                  if verify_dir else datagen_job(elements))
    gateway = get_gateway()
    key_type = Types.ROW([Types.INT()]).get_java_type_info()
    if batch == 1:
        row_type = Types.ROW([Types.INT(), INPUT_ROW_TYPE]).get_java_type_info()
        rows = _as_rows(t_env, t_env.sql_query(f"SELECT CAST(MOD(n, 4) AS INT) AS bucket, {record_sql('n')} AS rec FROM gen"),
                        row_type)
        keyed = KeyedStream(rows._j_data_stream.keyBy(gateway.jvm.KeyByKeySelector(), key_type), INPUT_ROW_TYPE, rows)
        out = keyed.process(One(), output_type=sink_row)
        t_env.create_temporary_view("outs", t_env.from_data_stream(out))
        insert = "INSERT INTO sink SELECT * FROM outs"
    else:
        batch_type = Types.OBJECT_ARRAY(INPUT_ROW_TYPE)
        row_type = Types.ROW([Types.INT(), batch_type]).get_java_type_info()
        members = ", ".join(record_sql(f"n * {batch} + {i}") for i in range(batch))
        rows = _as_rows(t_env, t_env.sql_query(f"SELECT CAST(MOD(n, 4) AS INT) AS bucket, ARRAY[{members}] AS recs FROM gen"),
                        row_type)
        keyed = KeyedStream(rows._j_data_stream.keyBy(gateway.jvm.KeyByKeySelector(), key_type), batch_type, rows)
        out = keyed.process(Many(), output_type=Types.ROW_NAMED(["outs"], [Types.OBJECT_ARRAY(sink_row)]))
        t_env.create_temporary_view("batches", t_env.from_data_stream(out))
        insert = "INSERT INTO sink SELECT r.k, r.v, r.`topic` FROM batches CROSS JOIN UNNEST(batches.outs) AS r(k, v, `topic`)"
    statements = t_env.create_statement_set()
    statements.add_insert_sql(insert)
    statements.attach_as_datastream()
    return timed_execute(env, f"crossing batch {batch} x {elements}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, action="append", default=[])
    parser.add_argument("--small", type=int, default=40_000)
    parser.add_argument("--large", type=int, default=200_000)
    parser.add_argument("--one", nargs=2, metavar=("BATCH", "RECORDS"), type=int,
                        help=argparse.SUPPRESS)  # one run in a fresh process
    parser.add_argument("--verify", metavar="DIR", help="with --one: write the output as CSV to DIR")
    args = parser.parse_args(argv)
    if args.one:
        cpu, wall = run(*args.one, verify_dir=args.verify)
        print(json.dumps({"cpu": cpu, "wall": wall}), flush=True)
        return 0
    if not args.batch:
        parser.error("give --batch B at least once")
    return print_slopes("tests.experiments.crossing_batch", "records per element", map(str, args.batch),
                        args.small, args.large)

if __name__ == "__main__":
    raise SystemExit(main())
