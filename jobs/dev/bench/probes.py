"""Ceilings of the parts of llmstream's hot path, each alone against the same simulator.

    python -m jobs.dev.bench.probes http|client --endpoint URL [--seconds S] [--concurrency N]

`http` is bare aiohttp posting the benchmark's request back to back; `client` is the
per-record Python work of the job without Flink: decode the Kafka value, `InferenceClient.
complete` (slots, rate limiter, retry, metrics, aiohttp), encode the output record. Set
against scenario (d)'s end-to-end rate they show where an instant model's time goes.
Each prints one JSON line: requests, seconds, rate, concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp

from jobs.dev.bench.workload import (
    MAX_TOKENS,
    MODEL,
    SYSTEM_PROMPT,
    chat_payload,
    request_record,
)

PROBES = ("http", "client")


async def _drive(call: Callable[[int], Awaitable[object]], seconds: float, concurrency: int) -> dict[str, float]:
    done = 0
    deadline = time.monotonic() + seconds

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
    return {"requests": done, "seconds": round(elapsed, 2), "rate": round(done / elapsed, 1),
            "concurrency": concurrency}


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

    config = with_overrides(load_config(), model={"endpoint": endpoint, "model": MODEL,
                                                  "system_prompt": SYSTEM_PROMPT, "max_tokens": MAX_TOKENS},
                            async_={"capacity": concurrency})
    client = InferenceClient(config, cache_file=result_cache_file(config, StateDir.for_job(config)))

    async def call(seq: int) -> object:
        key, value = request_record(seq)
        request = decode(key, value, SourceRef("probe", 0, seq, int(time.time() * 1000)), config.limits)
        return result_value(request, await client.complete(request))

    try:
        return await _drive(call, seconds, concurrency)
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.probes", description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=PROBES)
    parser.add_argument("--endpoint", required=True, help="the model server's base URL, ending in /v1")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    run = http_ceiling if args.probe == "http" else client_ceiling
    print(json.dumps(asyncio.run(run(args.endpoint, args.seconds, args.concurrency))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
