"""The result cache in front of the model, with single-flight: identical requests in flight at
once in one subtask share one call.

The first request for a key (the leader) looks it up in the cache (`udfs/cost/cache.py`) and, on
a miss, calls the model and stores the answer before returning it; the others wait for the
leader and take its stored answer, or call the model themselves if the leader failed (their
own attempts and retries then decide). A stored answer is what `stored_answer` keeps of a
completion; `cached_completion` makes it a record's completion again: no attempt, nothing paid.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from udfs.clock import now_ms
from udfs.cost.cache import ResultCache
from udfs.metrics import InferenceMetrics
from udfs.records import Completion

Stored = dict[str, Any]


def stored_answer(completion: Completion) -> Stored:
    """What the cache keeps of an answer (never the record's id, timings or attempts)."""
    return {"output": completion.output, "model": completion.model, "finish_reason": completion.finish_reason,
            "prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens}


def cached_completion(stored: Stored, *, model: str, endpoint: str, priced: bool, looked_up: float) -> Completion:
    """A stored answer as a record's completion: 0 attempts, cost 0 when the job prices answers,
    latency since `looked_up` (a `time.perf_counter()`); `model` is the one asked for, used when
    the stored answer does not name one."""
    now = now_ms()
    return Completion(
        output=stored["output"], model=str(stored.get("model") or model), finish_reason=stored.get("finish_reason"),
        prompt_tokens=int(stored.get("prompt_tokens") or 0),
        completion_tokens=int(stored.get("completion_tokens") or 0),
        latency_ms=(time.perf_counter() - looked_up) * 1000, attempts=0, endpoint=endpoint, started_ms=now,
        completed_ms=now, cost=0.0 if priced else None, cached=True)


class SingleFlightCache:
    """`answer(key, call, from_stored)` through `cache`, counting `cache_hits` / `cache_misses`
    (a follower served by its leader is a hit). Use from one event loop."""

    def __init__(self, cache: ResultCache, metrics: InferenceMetrics) -> None:
        self.cache = cache
        self._metrics = metrics
        self._leaders: dict[str, asyncio.Future[Stored | None]] = {}

    async def answer(self, key: str, call: Callable[[], Awaitable[Completion]],
                     from_stored: Callable[[Stored], Completion],
                     store_key: Callable[[Completion], str] | None = None) -> Completion:
        """The stored answer for `key` as `from_stored` makes it, else `call()`'s, stored under
        `store_key(completion)` (default `key`): a fleet's fallback model answers under its own
        key, so its answer is never served as the primary model's. Followers share the leader's
        answer only when it was stored under `key`."""
        leader = self._leaders.get(key)
        if leader is not None:
            shared = await asyncio.shield(leader)
            if shared is not None:
                self._metrics.cache_hits.inc()
                return from_stored(shared)
            return await call()
        future: asyncio.Future[Stored | None] = asyncio.get_running_loop().create_future()
        self._leaders[key] = future
        stored: Stored | None = None
        try:
            stored = await self.cache.get(key)
            if stored is not None:
                self._metrics.cache_hits.inc()
                return from_stored(stored)
            self._metrics.cache_misses.inc()
            completion = await call()
            answer = stored_answer(completion)
            answer_key = store_key(completion) if store_key is not None else key
            await self.cache.put(answer_key, answer)
            if answer_key == key:
                stored = answer
            return completion
        finally:
            del self._leaders[key]
            future.set_result(stored)

    async def close(self) -> None:
        await self.cache.close()
