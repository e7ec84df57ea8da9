"""What the CPU experiments on PyFlink's Python path share (`crossing_batch`, `python_path`): a
bounded datagen job that makes the job's input rows, its CPU measured around `execute`, and the
CPU per record as the slope between two sizes, each run in a fresh process.

The slope cancels the JVM's and the job's start-up: ``(cpu(N2) - cpu(N1)) / (N2 - N1)``, CPU of
the run's process (PyFlink's loopback Python worker runs in it) and its child JVM, from /proc.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

import psutil

from jobs.dev.bench.measure import process_tree

BLACKHOLE = "'connector'='blackhole'"


def tree_cpu() -> float:
    """CPU seconds of this process and its children (the JVM) so far."""
    total = 0.0
    for proc in process_tree(psutil.Process(os.getpid())):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def value_sql(offset: str) -> str:
    """A request's JSON value (BYTES) numbered by the SQL expression `offset`."""
    return (f"CAST(CONCAT('{{\"id\": \"r-', CAST({offset} AS STRING), "
            "'\", \"prompt\": \"Summarise the following text in one line: lorem ipsum dolor sit amet\"}') AS BYTES)")


def key_sql(offset: str) -> str:
    return f"CAST(CONCAT('key-', CAST({offset} AS STRING)) AS BYTES)"


def record_sql(offset: str) -> str:
    """One input row as the job's source table makes it (`INPUT_ROW_SQL`)."""
    from jobs.graph.pipeline import INPUT_ROW_SQL

    return (f"CAST(ROW({key_sql(offset)}, {value_sql(offset)}, 'in', 0, {offset}, "
            f"CURRENT_TIMESTAMP, CAST(NULL AS MAP<STRING, BYTES>)) AS {INPUT_ROW_SQL})")


def sink_row_type() -> Any:
    """The sink's row (key, JSON value, topic) as a PyFlink type."""
    from pyflink.common import Types

    bytes_type = Types.PRIMITIVE_ARRAY(Types.BYTE())
    return Types.ROW_NAMED(["k", "v", "topic"], [bytes_type, bytes_type, Types.STRING()])


def datagen_job(elements: int, sink: str = BLACKHOLE) -> tuple[Any, Any]:
    """(env, t_env) at parallelism 1 with the job's default bundles (100 elements, 1 s), a table
    `gen` of `n` = 0 .. elements - 1 and a table `sink (k, v, topic)` with the `sink` options."""
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.table import StreamTableEnvironment

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    t_env = StreamTableEnvironment.create(env)
    t_env.get_config().set("python.fn-execution.bundle.size", "100")
    t_env.get_config().set("python.fn-execution.bundle.time", "1000")
    t_env.execute_sql(
        "CREATE TEMPORARY TABLE gen (n BIGINT) WITH ('connector'='datagen', 'fields.n.kind'='sequence', "
        f"'fields.n.start'='0', 'fields.n.end'='{elements - 1}')")
    t_env.execute_sql(f"CREATE TEMPORARY TABLE sink (k BYTES, v BYTES, `topic` STRING) WITH ({sink})")
    return env, t_env


def timed_execute(env: Any, name: str) -> tuple[float, float]:
    """Runs the job; (CPU-s, wall s) of the run alone, after the environment is up."""
    cpu0, wall0 = tree_cpu(), time.monotonic()
    env.execute(name)
    return tree_cpu() - cpu0, time.monotonic() - wall0


def print_slopes(module: str, label: str, cases: Iterable[str], small: int, large: int) -> int:
    """For each case, `python -m module --one CASE N` at both sizes in a fresh process (it prints
    {"cpu": .., "wall": ..}); prints a Markdown row of CPU µs a record and the large run's rate.
    Returns 1 (with the failed run's output on stderr) if a run fails."""
    print(f"| {label} | CPU µs / record (slope) | records/s (large run) |")
    print("|---|---|---|")
    for case in cases:
        figures: list[dict[str, float]] = []
        for records in (small, large):
            done = subprocess.run([sys.executable, "-m", module, "--one", case, str(records)],
                                  capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
                return 1
            figures.append(json.loads(lines[-1]))
        slope = (figures[1]["cpu"] - figures[0]["cpu"]) / (large - small) * 1e6
        print(f"| {case} | {slope:.0f} | {large / figures[1]['wall']:.0f} |", flush=True)
    return 0
