"""Flink's own peer: SQL `ML_PREDICT` with the `openai` model provider, in a process of its own.

    python -m jobs.dev.bench.ml_predict --bootstrap HOST:PORT --input T --output T --group G \\
        --endpoint URL [--api chat|embeddings] [--bounded] [--checkpoint-interval-ms 5000]
        [--floor flink|pyflink]

What a user who asks "why not just ML_PREDICT?" would write: a SQL-only job in a local mini
cluster, with `flink-model-openai` (pom-free set `ml-predict`) and the Kafka SQL connector in
`pipeline.jars`. A Kafka JSON source table read from the group's offsets (bounded at the
latest offset for a backlog), `CREATE TEMPORARY MODEL ... WITH ('provider'='openai', ...)`,
`ML_PREDICT(TABLE ..., MODEL m, DESCRIPTOR(prompt), MAP['async','true', ...])` and an
exactly-once Kafka sink with a transactional-id prefix. The output carries the fields the
harness reads (`id`, `output`, `timestamps.produced/started/completed`, as ISO-8601
strings): `started` is taken before the model call, `completed` after it.

Two floors, for what the model call is not: `--floor flink` (the bench's `flink-floor`) runs the
same job writing each prompt back as its output, calling nothing: what Flink and Kafka alone cost
a record, the floor under any Flink job on these topics. `--floor pyflink` (`pyflink-floor`)
passes each prompt through a Python scalar function that returns it: the cheapest crossing into
Python PyFlink has (no keys, state or timers), so the floor under any job with a Python stage.

Nothing here works around the provider's limits (5 requests in flight per host, no dead
letters, a timeout fails the job over): they are what the bench measures. SIGTERM stops
the job with a savepoint, as `llmstream run` does; the exit status is 0 when the job finished
(or was stopped on request), 1 if it failed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.dev.bench.workload import MAX_TOKENS, MODEL, SYSTEM_PROMPT
from jobs.runtime import jars

ASYNC_OPTIONS = {"async": "true", "max-concurrent-operations": "64", "output-mode": "ALLOW_UNORDERED",
                 "timeout": "3 min"}
"""ML_PREDICT's runtime options as the issue's recipe has them: async, 64 in flight in Flink's
async operator (the HTTP client still sends at most 5 per host), unordered, 3 min per row."""
ML_PREDICT = "ml-predict"
FLINK_FLOOR = "flink-floor"
PYFLINK_FLOOR = "pyflink-floor"
"""The bench's names of the three jobs this module runs (`jobs.dev.bench.harness` uses them too)."""
FLOORS = (FLINK_FLOOR, PYFLINK_FLOOR)
"""The job without the model call: what Flink and Kafka alone (source, JSON, checkpoints, the
exactly-once sink) cost a record, and that plus the cheapest crossing into Python. Opt-in bench
approaches: they call no model, so their throughput says nothing of a scenario's limit; their CPU
per record is the floor under llmstream's."""
SQL_JOBS = (ML_PREDICT, *FLOORS)
"""Every bench approach this module runs."""
API_KEY = "bench-not-a-secret"
"""The simulator checks no key unless started with one; the provider requires the option."""


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _with(options: dict[str, str]) -> str:
    return ",\n  ".join(f"{_quote(k)} = {_quote(v)}" for k, v in options.items())


@dataclass(frozen=True)
class MlPredictJob:
    """The SQL of one run; pure, so it is unit-tested without a cluster."""

    bootstrap: str
    input: str
    output: str
    group: str
    endpoint: str
    """The model server's base URL, ending in /v1."""
    api: str = "chat"
    bounded: bool = True
    async_options: tuple[tuple[str, str], ...] = tuple(ASYNC_OPTIONS.items())
    kind: str = ML_PREDICT
    """`ML_PREDICT`; `FLINK_FLOOR`: no model, the prompt is the output; `PYFLINK_FLOOR`: the
    output is the prompt as the Python function `echo` returns it."""

    @property
    def predict(self) -> bool:
        return self.kind == ML_PREDICT

    def source(self) -> str:
        options = {"connector": "kafka", "topic": self.input, "properties.bootstrap.servers": self.bootstrap,
                   "properties.group.id": self.group, "scan.startup.mode": "group-offsets",
                   "properties.auto.offset.reset": "earliest", "format": "json"}
        if self.bounded:
            options["scan.bounded.mode"] = "latest-offset"
        return ("CREATE TEMPORARY TABLE src (\n  id STRING,\n  prompt STRING,\n"
                "  produced TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL\n"
                f") WITH (\n  {_with(options)}\n)")

    def picked(self) -> str:
        """The rows as they reach ML_PREDICT, stamped: `started` is taken before the call."""
        return "CREATE TEMPORARY VIEW picked AS SELECT id, prompt, produced, CURRENT_TIMESTAMP AS started FROM src"

    def model(self) -> str:
        if self.api == "embeddings":
            options = {"provider": "openai", "endpoint": self.endpoint.rstrip("/") + "/embeddings",
                       "api-key": API_KEY, "model": MODEL}
            return f"CREATE TEMPORARY MODEL m INPUT (prompt STRING) OUTPUT (output ARRAY<FLOAT>) WITH (\n  {_with(options)}\n)"
        options = {"provider": "openai", "endpoint": self.endpoint.rstrip("/") + "/chat/completions",
                   "api-key": API_KEY, "model": MODEL, "system-prompt": SYSTEM_PROMPT, "max-tokens": str(MAX_TOKENS)}
        return f"CREATE TEMPORARY MODEL m INPUT (prompt STRING) OUTPUT (output STRING) WITH (\n  {_with(options)}\n)"

    def sink(self) -> str:
        output_type = "ARRAY<FLOAT>" if self.api == "embeddings" else "STRING"
        options = {"connector": "kafka", "topic": self.output, "properties.bootstrap.servers": self.bootstrap,
                   "format": "json", "json.timestamp-format.standard": "ISO-8601",
                   "sink.delivery-guarantee": "exactly-once", "sink.transactional-id-prefix": self.group,
                   "properties.transaction.timeout.ms": "900000"}
        return (f"CREATE TEMPORARY TABLE sink (\n  id STRING,\n  output {output_type},\n  approach STRING,\n"
                "  `timestamps` ROW<produced TIMESTAMP_LTZ(3), started TIMESTAMP_LTZ(3), completed TIMESTAMP_LTZ(3)>\n"
                f") WITH (\n  {_with(options)}\n)")

    def insert(self) -> str:
        if not self.predict:
            text = "echo(prompt)" if self.kind == PYFLINK_FLOOR else "prompt"
            output = f"ARRAY[CAST(CHAR_LENGTH({text}) AS FLOAT)]" if self.api == "embeddings" else text
            return (f"INSERT INTO sink SELECT id, {output}, '{self.kind}', "
                    "ROW(produced, started, CURRENT_TIMESTAMP) FROM picked")
        runtime = ", ".join(f"{_quote(k)}, {_quote(v)}" for k, v in self.async_options)
        return ("INSERT INTO sink SELECT id, output, 'ml-predict', ROW(produced, started, CURRENT_TIMESTAMP) "
                f"FROM ML_PREDICT(TABLE picked, MODEL m, DESCRIPTOR(prompt), MAP[{runtime}])")

    def statements(self) -> list[str]:
        return [self.source(), self.picked(), *([self.model()] if self.predict else []), self.sink()]


def _echo():  # type: ignore[no-untyped-def]
    """The Python function of `--floor pyflink`: its argument back, so that all it costs is the crossing."""
    from pyflink.table import DataTypes
    from pyflink.table.udf import udf

    return udf(lambda prompt: prompt, result_type=DataTypes.STRING())


def _environment(checkpoint_interval_ms: int, job: MlPredictJob):  # type: ignore[no-untyped-def]
    from pyflink.table import EnvironmentSettings, TableEnvironment

    env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    conf = env.get_config()
    urls = [p.as_uri() for p in (*jars.jars("connector"), *(jars.jars("ml-predict") if job.predict else ()))]
    for key, value in {
        "pipeline.jars": ";".join(urls),
        "pipeline.name": f"{job.kind}-bench",
        "parallelism.default": "1",
        "execution.checkpointing.interval": f"{checkpoint_interval_ms} ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        # Loopback only, on a free port; the harness finds it under this process.
        "rest.bind-address": "127.0.0.1", "rest.address": "127.0.0.1", "rest.bind-port": "0",
    }.items():
        conf.set(key, value)
    return env


def run(args: argparse.Namespace) -> int:
    options = {**ASYNC_OPTIONS, "timeout": args.timeout}
    kind = {None: ML_PREDICT, "flink": FLINK_FLOOR, "pyflink": PYFLINK_FLOOR}[args.floor]
    job = MlPredictJob(args.bootstrap, args.input, args.output, args.group, args.endpoint, args.api, args.bounded,
                       tuple(options.items()), kind)
    env = _environment(args.checkpoint_interval_ms, job)
    if kind == PYFLINK_FLOOR:
        env.create_temporary_function("echo", _echo())
    for statement in job.statements():
        env.execute_sql(statement)
    result = env.execute_sql(job.insert())
    client = result.get_job_client()
    stop, done = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            result.wait()
        except Exception as err:  # noqa: BLE001 - reported below; the job failed or was cancelled
            failure.append(err)
        finally:
            done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    threading.Thread(target=wait, name="ml-predict-wait", daemon=True).start()
    while not stop.is_set() and not done.is_set():
        stop.wait(0.5)
    if stop.is_set() and not done.is_set():
        how = _stop(client)
        print(f"{kind}: job {how} on request after {time.monotonic() - started:.1f} s", flush=True)
        return 0
    if failure:
        print(f"{kind}: job failed after {time.monotonic() - started:.1f} s: "
              f"{str(failure[0]).splitlines()[0][:300]}", flush=True)
        return 1
    print(f"{kind}: job finished after {time.monotonic() - started:.1f} s", flush=True)
    return 0


def _stop(client) -> str:  # type: ignore[no-untyped-def]
    """Stop with a savepoint, as `llmstream run` does on SIGTERM, so the sink commits what the
    source's committed offsets already claim (a plain cancel between the source's offset commit
    and the sink's transaction commit leaves answers in a transaction only a restore commits, which
    the bench counts as lost: docs/performance.md, "Flink's own ML_PREDICT"); cancel if the
    savepoint fails."""
    from pyflink.java_gateway import get_gateway

    canonical = get_gateway().jvm.org.apache.flink.core.execution.SavepointFormatType.CANONICAL
    directory = Path(tempfile.mkdtemp(prefix="ml-predict-savepoint-")).as_uri()
    try:
        client._j_job_client.stopWithSavepoint(False, directory, canonical).get()
        return "stopped with a savepoint"
    except Exception:  # noqa: BLE001 - the fallback below says what happened
        client.cancel().result()
        return "cancelled (the savepoint failed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.ml_predict", description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--group", required=True, help="consumer group and transactional-id prefix")
    parser.add_argument("--endpoint", required=True, help="the model server's base URL, ending in /v1")
    parser.add_argument("--api", choices=("chat", "embeddings"), default="chat")
    parser.add_argument("--bounded", action="store_true", help="stop at the input's latest offset (a backlog)")
    parser.add_argument("--checkpoint-interval-ms", type=int, default=5000)
    parser.add_argument("--timeout", default=ASYNC_OPTIONS["timeout"], help="ML_PREDICT's per-row timeout")
    parser.add_argument("--floor", choices=("flink", "pyflink"), default=None,
                        help="no model: write each prompt back, on the JVM (flink) or through a Python "
                             "function (pyflink)")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
