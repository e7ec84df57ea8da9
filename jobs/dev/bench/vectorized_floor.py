"""The vectorized lane's floor with the model call (`vectorized-floor`): the lane's job, minus llmstream.

    python -m jobs.dev.bench.vectorized_floor --config JOB.yaml [--bounded]

The job config is the one the bench writes for `llmstream-vectorized` in the same scenario, so
everything Flink sees is the lane's: the same Kafka source table (`create_source_table`: raw key
and value, topic/partition/offset/timestamp/headers metadata) and exactly-once Kafka sink table
(`create_sink_table`, whose writable `topic` routes a row to the output or the dead-letter topic),
built by `jobs.graph.pipeline` itself, the same Flink configuration (`create_environment`: Arrow
batch = Python bundle = `vectorized.batch_size`, bundle time, checkpoints, network buffers, every
`flink:` option) and the same SQL shape around one pandas scalar function returning one row per
input row. Only the function differs: for each row, decode the JSON value, one bare HTTP call
(aiohttp on a persistent loop in a background thread, `async.capacity` calls at once, a session
kept across batches), and encode the answer. For embeddings, one call for each
`model.batch.max_size` rows, as the lane batches them. Nothing else: no retries, no cache, no
rate limits, no metrics, no validation; a call that is not a 200 makes its row a dead letter.
So llmstream's own overhead is the lane's figures over this job's, in one bench run.

Between batches the function notes how long the JVM took to hand it the next one (the time from
returning one batch's rows to being called with the next): at close it prints one line,
`vectorized-floor batches: {json}`, which the harness puts in the run's notes.

`--bounded`: stop at the input's latest offset (a backlog), through a dynamic table option on the
lane's source table. SIGTERM stops the job with a savepoint, as `llmstream run` and the bench's
`ml_predict` do; the exit status is 0 when the job finished or was stopped on request, 1 if it failed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

VECTORIZED_FLOOR = "vectorized-floor"
"""The bench's name of this approach (`jobs.dev.bench.harness`)."""
FUNCTION = "vectorized_floor"
STATS_PREFIX = "vectorized-floor batches: "
"""The start of the line the function prints at close (`batch_stats` reads it back)."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _epoch_ms(stamp: Any) -> int | None:
    """A Kafka timestamp as the Arrow batch holds it (a pandas Timestamp or NaT) in epoch ms."""
    import pandas as pd

    value = getattr(stamp, "value", None)
    return None if value is None or pd.isna(stamp) else int(value // 1_000_000)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def batch_stats(log_text: str) -> dict[str, Any] | None:
    """The function's closing line in a run's log, as a dict (None if it never closed)."""
    found = None
    for line in log_text.splitlines():
        at = line.find(STATS_PREFIX)
        if at >= 0:
            try:
                found = json.loads(line[at + len(STATS_PREFIX):])
            except ValueError:
                continue
    return found


def make_function(endpoint: str, api: str, capacity: int, inputs_per_call: int, timeout_s: float,
                  output_topic: str, dead_letter_topic: str):  # type: ignore[no-untyped-def]
    """The floor's pandas scalar function: the lane's columns in, the lane's row type out."""
    from pyflink.table import DataTypes
    from pyflink.table.udf import ScalarFunction, udf

    class Floor(ScalarFunction):
        def __init__(self) -> None:
            self.url = endpoint.rstrip("/") + ("/embeddings" if api == "embeddings" else "/chat/completions")
            self._loop: Any = None
            self._thread: threading.Thread | None = None
            self._session: Any = None
            self._left_at: float | None = None
            self._gaps_ms: list[float] = []
            self._inside_ms: list[float] = []
            self._rows = 0

        def is_deterministic(self) -> bool:
            # The planner must not call it once per projected field: each call is a batch of model calls.
            return False

        def open(self, function_context: Any) -> None:
            import asyncio

            import aiohttp

            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="vectorized-floor-calls", daemon=True)
            self._thread.start()

            async def session() -> Any:
                connector = aiohttp.TCPConnector(limit=capacity, keepalive_timeout=60)
                return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))

            self._session = asyncio.run_coroutine_threadsafe(session(), self._loop).result()

        def close(self) -> None:
            import asyncio

            gaps, inside = self._gaps_ms, self._inside_ms
            stats = {"batches": len(inside), "rows": self._rows,
                     "mean_rows": round(self._rows / max(len(inside), 1), 1),
                     "gap_ms_p50": _percentile(gaps, 0.5), "gap_ms_p90": _percentile(gaps, 0.9),
                     "gap_ms_mean": round(sum(gaps) / len(gaps), 1) if gaps else None,
                     "python_ms_p50": _percentile(inside, 0.5),
                     "python_ms_mean": round(sum(inside) / len(inside), 1) if inside else None,
                     # The JVM's turn a thousand rows, and its share of the function's wall time.
                     "gap_ms_per_1000_rows": round(1000 * sum(gaps) / self._rows, 1) if self._rows else None,
                     "gap_share": round(sum(gaps) / (sum(gaps) + sum(inside)), 3) if gaps else None}
            print(STATS_PREFIX + json.dumps({k: round(v, 1) if isinstance(v, float) else v
                                             for k, v in stats.items()}), flush=True)
            if self._loop is None:
                return
            try:
                asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                if self._thread is not None:
                    self._thread.join(10)

        def eval(self, k: Any, v: Any, topic: Any, partition: Any, offset: Any, ts: Any, headers: Any) -> Any:
            import asyncio

            import orjson
            import pandas as pd

            entered = time.perf_counter()
            if self._left_at is not None:
                self._gaps_ms.append((entered - self._left_at) * 1000)
            keys, values, stamps = k.tolist(), v.tolist(), ts.tolist()
            rows: list[tuple[str | None, str]] = []  # (id, prompt) a row; None: not a JSON record
            for value in values:
                try:
                    record = orjson.loads(value)
                    rows.append((record["id"], record["prompt"]))
                except Exception:  # noqa: BLE001 - a malformed record is a dead letter
                    rows.append((None, ""))
            answers = asyncio.run_coroutine_threadsafe(self._batch(rows), self._loop).result()
            out_v, out_topic = [], []
            for (rid, _), (answer, error, started, completed), stamp in zip(rows, answers, stamps, strict=True):
                times = {"produced": _epoch_ms(stamp), "started": started, "completed": completed}
                if error is None:
                    out_v.append(orjson.dumps({"id": rid, "output": answer, "approach": VECTORIZED_FLOOR,
                                               "timestamps": times}))
                    out_topic.append(output_topic)
                else:
                    out_v.append(orjson.dumps({"id": rid, "error": error, "timestamps": times}))
                    out_topic.append(dead_letter_topic)
            n = len(values)
            frame = pd.DataFrame({"k": pd.Series(keys, dtype=object), "v": pd.Series(out_v, dtype=object),
                                  "topic": pd.Series(out_topic, dtype=object),
                                  "headers": pd.Series([None] * n, dtype=object),
                                  "emit": pd.Series([True] * n, dtype=bool)})
            self._rows += n
            self._left_at = time.perf_counter()
            self._inside_ms.append((self._left_at - entered) * 1000)
            return frame

        async def _batch(self, rows: list[tuple[str | None, str]]) -> list[tuple[Any, str | None, int, int]]:
            """Every call of the batch by `capacity` workers, each taking the next when its last ends."""
            import asyncio

            calls = [list(range(i, min(i + inputs_per_call, len(rows)))) for i in range(0, len(rows), inputs_per_call)]
            answers: list[Any] = [None] * len(rows)
            queue = iter(calls)

            async def worker() -> None:
                for group in queue:
                    started = _now_ms()
                    bad = [i for i in group if rows[i][0] is None]
                    for i in bad:
                        answers[i] = (None, "not a JSON record with id and prompt", started, started)
                    group = [i for i in group if rows[i][0] is not None]
                    if not group:
                        continue
                    try:
                        outputs = await self._call([rows[i][1] for i in group])
                        for i, output in zip(group, outputs, strict=True):
                            answers[i] = (output, None, started, _now_ms())
                    except Exception as err:  # noqa: BLE001 - not a 200: the rows become dead letters
                        for i in group:
                            answers[i] = (None, f"{type(err).__name__}: {err}"[:300], started, _now_ms())

            await asyncio.gather(*(worker() for _ in range(min(capacity, len(calls)))))
            return answers

        async def _call(self, prompts: list[str]) -> list[Any]:
            import orjson

            from jobs.dev.bench.workload import MODEL, chat_payload

            body = (orjson.dumps({"model": MODEL, "input": prompts}) if api == "embeddings"
                    else orjson.dumps(chat_payload(prompts[0])))
            async with self._session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as response:
                raw = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {raw[:200]!r}")
            answer = orjson.loads(raw)
            if api == "embeddings":
                return [item["embedding"] for item in sorted(answer["data"], key=lambda item: item["index"])]
            return [answer["choices"][0]["message"]["content"]]

    result_type = DataTypes.ROW([
        DataTypes.FIELD("k", DataTypes.BYTES()),
        DataTypes.FIELD("v", DataTypes.BYTES()),
        DataTypes.FIELD("topic", DataTypes.STRING()),
        DataTypes.FIELD("headers", DataTypes.MAP(DataTypes.STRING(False), DataTypes.BYTES())),
        DataTypes.FIELD("emit", DataTypes.BOOLEAN()),
    ])
    return udf(Floor(), result_type=result_type, func_type="pandas")


def insert_sql(bounded: bool, with_headers: bool) -> str:
    """The lane's statement (`jobs.graph.pipeline.vectorized_lane`) with the floor's function, and
    with `--bounded` the source bounded at the latest offset through a dynamic table option."""
    from jobs.graph.pipeline import HEADERS_SQL, SINK_TABLE, SOURCE_TABLE

    arrow_headers = "MAP<STRING NOT NULL, BYTES>"
    headers = f"CAST(`headers` AS {arrow_headers})" if with_headers else f"CAST(NULL AS {arrow_headers})"
    hint = " /*+ OPTIONS('scan.bounded.mode'='latest-offset') */" if bounded else ""
    return (f"INSERT INTO {SINK_TABLE}\n"
            f"SELECT r.k, r.v, r.`topic`, CAST(r.`headers` AS {HEADERS_SQL}) FROM (\n"
            f"  SELECT {FUNCTION}(k, v, `topic`, `partition`, `offset`, ts, {headers}) AS r "
            f"FROM {SOURCE_TABLE}{hint}\n) WHERE r.emit")


def run(args: argparse.Namespace) -> int:
    from jobs.dev.bench.ml_predict import _stop
    from jobs.graph.pipeline import (
        create_environment,
        create_sink_table,
        create_source_table,
        planned,
    )
    from jobs.runtime import jars
    from udfs.config import load_config

    config = load_config(args.config)
    model = config.model
    env = create_environment(config, jars.connector_jar_urls(), local_rest_port=0)
    function = make_function(model.endpoint or "", model.api, config.async_.capacity,
                             model.batch.max_size if model.api == "embeddings" else 1,
                             config.async_.record_deadline_s, config.kafka.output_topic,
                             config.kafka.dead_letter_topic)

    def build(t_env: Any) -> None:
        with_headers = create_source_table(t_env, config)
        create_sink_table(t_env, config)
        t_env.create_temporary_function(FUNCTION, function)
        t_env.get_config().set("table.exec.uid.generation", "DISABLED")
        statements = t_env.create_statement_set()
        statements.add_insert_sql(insert_sql(args.bounded, with_headers))
        statements.attach_as_datastream()

    planned(env, build)
    client = env.execute_async(f"{VECTORIZED_FLOOR}-bench")
    stop, done = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            client.get_job_execution_result().result()
        except Exception as err:  # noqa: BLE001 - reported below; the job failed or was cancelled
            failure.append(err)
        finally:
            done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    threading.Thread(target=wait, name="vectorized-floor-wait", daemon=True).start()
    while not stop.is_set() and not done.is_set():
        stop.wait(0.5)
    if stop.is_set() and not done.is_set():
        how = _stop(client)
        print(f"{VECTORIZED_FLOOR}: job {how} on request after {time.monotonic() - started:.1f} s", flush=True)
        return 0
    if failure:
        print(f"{VECTORIZED_FLOOR}: job failed after {time.monotonic() - started:.1f} s: "
              f"{str(failure[0]).splitlines()[0][:300]}", flush=True)
        return 1
    print(f"{VECTORIZED_FLOOR}: job finished after {time.monotonic() - started:.1f} s", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.vectorized_floor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the job config the bench writes for llmstream-vectorized")
    parser.add_argument("--bounded", action="store_true", help="stop at the input's latest offset (a backlog)")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
