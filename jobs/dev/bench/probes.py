"""Ceilings of the parts of llmstream's hot path, each alone against the same simulator.

    python -m jobs.dev.bench.probes http|client|lane|floor --endpoint URL [--seconds S] [--concurrency N]
        [--batch-size N] [--api chat|embeddings]

`http` is bare aiohttp posting the benchmark's request back to back; `client` is the
per-record Python work of the job without Flink: decode the Kafka value, `InferenceClient.
complete` (slots, rate limiter, retry, metrics, aiohttp), encode the output record; `lane` is
the vectorized lane's Python work without Flink: `VectorizedInference.eval` over batches of
`--batch-size` rows shaped as the Arrow batch gives them (read the rows, decode, every call of
the batch at once on the call loop, at most `--concurrency` in flight, the output columns);
`floor` is the same batches through the bench's `vectorized-floor` function
(`jobs/dev/bench/vectorized_floor.py`: one bare aiohttp call a row, or a `model.batch.max_size`
of rows with embeddings), so `lane` ÷ `floor`, both started at once, is llmstream's own Python.
Set against scenario (d)'s or (e)'s end-to-end rate they show where the time goes: what is
left is Flink's (the crossing, the Kafka ends, checkpoints). `--api embeddings` asks for
embeddings, `lane` in micro-batches of `EMBEDDINGS_BATCH` inputs as scenario (e) does.
Each prints one JSON line: requests (records), seconds, rate, concurrency, and the probe
process's CPU µs a record (the simulator is another process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from jobs.dev.bench.workload import (
    MAX_TOKENS,
    MODEL,
    SYSTEM_PROMPT,
    chat_payload,
    request_record,
)

PROBES = ("http", "client", "lane", "floor")
EMBEDDINGS_BATCH = 128
"""`model.batch.max_size` of the `lane` probe with `--api embeddings`: scenario (e)'s."""


def _cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


async def _drive(call: Callable[[int], Awaitable[object]], seconds: float, concurrency: int) -> dict[str, float]:
    done = 0
    deadline = time.monotonic() + seconds
    cpu = _cpu_s()

    async def loop(worker: int) -> None:
        nonlocal done
        seq = worker
        while time.monotonic() < deadline:
            await call(seq)
            done += 1
            seq += concurrency

    started = time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    elapsed = time.monotonic() - started
    return _figures(done, elapsed, concurrency, _cpu_s() - cpu)


def _figures(done: int, elapsed: float, concurrency: int, cpu_s: float) -> dict[str, float]:
    return {"requests": done, "seconds": round(elapsed, 2), "rate": round(done / elapsed, 1),
            "concurrency": concurrency, "cpu_us_per_record": round(cpu_s / max(done, 1) * 1e6, 1)}


async def http_ceiling(endpoint: str, seconds: float, concurrency: int) -> dict[str, float]:
    url = endpoint.rstrip("/") + "/chat/completions"
    payload = chat_payload("How fast can one asyncio process call an instant model?")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def call(_seq: int) -> object:
            async with session.post(url, json=payload) as response:
                return await response.json()

        return await _drive(call, seconds, concurrency)


async def client_ceiling(endpoint: str, seconds: float, concurrency: int) -> dict[str, float]:
    from jobs.launch.plan import result_cache_file
    from jobs.state.snapshots import StateDir
    from udfs.config import load_config, with_overrides
    from udfs.inference.client import InferenceClient
    from udfs.records import SourceRef
    from udfs.records.decode import decode
    from udfs.records.encode import result_value

    config = with_overrides(load_config(), model=_model(endpoint), async_={"capacity": concurrency})
    client = InferenceClient(config, cache_file=result_cache_file(config, StateDir.for_job(config)))

    async def call(seq: int) -> object:
        key, value = request_record(seq)
        request = decode(key, value, SourceRef("probe", 0, seq, int(time.time() * 1000)), config.limits)
        return result_value(request, await client.complete(request))

    try:
        return await _drive(call, seconds, concurrency)
    finally:
        await client.close()


def lane_ceiling(endpoint: str, seconds: float, concurrency: int, batch_size: int = 1000,
                 api: str = "chat", floor: bool = False) -> dict[str, Any]:
    """Batches of `batch_size` rows through the vectorized lane's function (`floor`: the bench's
    `vectorized-floor` function), back to back, for `seconds` (the first batch, which opens the
    connections, is not counted)."""
    import pandas as pd

    from jobs.dev.bench.vectorized_floor import make_function
    from udfs.config import load_config, with_overrides
    from udfs.lanes.vectorized import VectorizedInference

    model = {**_model(endpoint), "api": api}
    if api == "embeddings":
        model["batch"] = {"max_size": EMBEDDINGS_BATCH}
    config = with_overrides(load_config(), model=model, async_={"capacity": concurrency}, lane="vectorized",
                            vectorized={"batch_size": batch_size}, cache={"backend": "none"})
    function: Any = VectorizedInference(config)
    if floor:
        function = make_function(endpoint, api, concurrency, EMBEDDINGS_BATCH if api == "embeddings" else 1,
                                 config.async_.request_timeout_s, config.kafka.output_topic,
                                 config.kafka.dead_letter_topic)._func
    function.open(_NoMetrics())

    def batch(first: int) -> tuple[pd.Series, ...]:
        keys, values = zip(*(request_record(seq) for seq in range(first, first + batch_size)), strict=True)
        stamp = pd.Timestamp(time.time(), unit="s")
        return (pd.Series(keys, dtype=object), pd.Series(values, dtype=object), pd.Series(["probe"] * batch_size),
                pd.Series([0] * batch_size), pd.Series(range(first, first + batch_size)),
                pd.Series([stamp] * batch_size), pd.Series([None] * batch_size, dtype=object))

    try:
        function.eval(*batch(0))
        done, started, cpu = 0, time.monotonic(), _cpu_s()
        while time.monotonic() < started + seconds:
            rows = batch(batch_size + done)  # made before the clock of its batch, as Flink hands it over
            out = function.eval(*rows)
            if int(out["emit"].sum()) != batch_size or (out["topic"] == config.kafka.dead_letter_topic).any():
                raise RuntimeError("the lane probe's batch did not come back answered")
            done += batch_size
        found: dict[str, Any] = {"probe": "floor" if floor else "lane", "batch_size": batch_size}
        return {**found, **_figures(done, time.monotonic() - started, concurrency, _cpu_s() - cpu)}
    finally:
        function.close()


def _model(endpoint: str) -> dict[str, Any]:
    """The `model` section of the llmstream probes: the request the benchmark's baselines send."""
    return {"endpoint": endpoint, "model": MODEL, "system_prompt": SYSTEM_PROMPT, "max_tokens": MAX_TOKENS}


class _NoMetrics:
    """The `FunctionContext` of a function run outside Flink: no metric group."""

    def get_metric_group(self) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.probes", description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=PROBES)
    parser.add_argument("--endpoint", required=True, help="the model server's base URL, ending in /v1")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1000, help="lane, floor: rows a batch (default %(default)s)")
    parser.add_argument("--api", choices=("chat", "embeddings"), default="chat", help="lane, floor: what to ask for")
    args = parser.parse_args(argv)
    if args.probe in ("lane", "floor"):
        found = lane_ceiling(args.endpoint, args.seconds, args.concurrency, args.batch_size, args.api,
                             floor=args.probe == "floor")
    else:
        run = http_ceiling if args.probe == "http" else client_ceiling
        found = asyncio.run(run(args.endpoint, args.seconds, args.concurrency))
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
