"""Micro-batched embeddings (issue 13): batch forming, splitting a rejected batch, usage shares,
the config keys, and the client's batch path over real HTTP against a small aiohttp server.

No JVM. Waits have generous guards; the only timing assertion is a lower bound (a partial
batch is not sent before `max_wait`), which a slow machine cannot break.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web

from jobs.dev.simulator import ThreadedSimulator, embedding_vector
from tests.support.fake_flink import Harness, KeyedState
from tests.support.waiting import wait_until
from udfs.config import JobConfig, config_from_dict
from udfs.errors import ConfigError, PermanentError, RetryableError
from udfs.inference.batching import (
    Batcher,
    chunks,
    is_rejection,
    share_usage,
    split_on_rejection,
)
from udfs.inference.client import InferenceClient
from udfs.records import Completion, Request, SourceRef

T = TypeVar("T")


def run(make: Callable[[], Awaitable[T]], timeout: float = 60.0) -> T:
    async def guarded() -> T:
        return await asyncio.wait_for(make(), timeout)

    return asyncio.run(guarded())


class Recorder:
    """A batch sender that records each batch and answers item -> item * 10 (or an error)."""

    def __init__(self, fail: set[int] | None = None) -> None:
        self.batches: list[list[int]] = []
        self.sent_at: list[float] = []
        self.fail = fail or set()

    async def __call__(self, items: list[int]) -> Sequence[int | BaseException]:
        self.batches.append(list(items))
        self.sent_at.append(time.monotonic())
        await asyncio.sleep(0)
        return [ValueError(f"item {i}") if i in self.fail else i * 10 for i in items]


# ------------------------------------------------------------------ batch forming


def test_a_full_batch_is_sent_at_once_without_waiting_for_max_wait() -> None:
    send = Recorder()

    async def go() -> list[int]:
        batcher: Batcher[int, int] = Batcher(send, max_size=4, max_wait_s=3600)
        return await asyncio.gather(*(batcher.submit(i) for i in range(8)))

    assert run(go, timeout=30) == [i * 10 for i in range(8)]
    assert send.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_partial_batch_waits_max_wait_then_goes() -> None:
    send = Recorder()

    async def go() -> tuple[list[int], float]:
        batcher: Batcher[int, int] = Batcher(send, max_size=100, max_wait_s=0.2)
        started = time.monotonic()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(3)))
        return results, started

    results, started = run(go)
    assert results == [0, 10, 20]
    assert send.batches == [[0, 1, 2]]
    assert send.sent_at[0] - started >= 0.19


def test_max_wait_zero_batches_what_arrives_in_one_loop_turn() -> None:
    send = Recorder()

    async def go() -> None:
        batcher: Batcher[int, int] = Batcher(send, max_size=100, max_wait_s=0)
        await asyncio.gather(*(batcher.submit(i) for i in range(5)))
        await batcher.submit(5)

    run(go)
    assert send.batches == [[0, 1, 2, 3, 4], [5]]


def test_items_of_different_groups_never_share_a_batch() -> None:
    send = Recorder()

    async def go() -> None:
        batcher: Batcher[int, int] = Batcher(send, max_size=3, max_wait_s=0.01)
        await asyncio.gather(*(batcher.submit(i, group=i % 2) for i in range(6)))

    run(go)
    assert sorted(send.batches) == [[0, 2, 4], [1, 3, 5]]


def test_a_whole_batch_is_cut_by_group_in_order_into_as_few_requests_as_max_size_allows() -> None:
    bodies = [{"model": "a", "input": "0"}, {"model": "b", "input": "1"}, {"model": "a", "input": "2"},
              {"model": "a", "input": "3"}, {"model": "a", "input": "4"}]
    assert chunks(bodies, 3) == [[0, 2, 3], [4], [1]]
    assert chunks(bodies[:1], 3) == [[0]] and chunks([], 3) == []


def test_each_item_gets_its_own_outcome_and_a_failed_send_fails_the_whole_batch() -> None:
    async def go() -> tuple[list[Any], list[Any]]:
        batcher: Batcher[int, int] = Batcher(Recorder(fail={2}), max_size=4, max_wait_s=0.01)
        mixed = await asyncio.gather(*(batcher.submit(i) for i in range(4)), return_exceptions=True)

        async def broken(items: list[int]) -> Sequence[int]:
            raise RetryableError("HTTP 503: down", status=503)

        failing: Batcher[int, int] = Batcher(broken, max_size=4, max_wait_s=0.01)
        whole = await asyncio.gather(*(failing.submit(i) for i in range(3)), return_exceptions=True)
        return mixed, whole

    mixed, whole = run(go)
    assert mixed[:2] == [0, 10] and mixed[3] == 30 and isinstance(mixed[2], ValueError)
    assert all(isinstance(err, RetryableError) and err.status == 503 for err in whole)


def test_close_cancels_waiting_items() -> None:
    async def go() -> bool:
        batcher: Batcher[int, int] = Batcher(Recorder(), max_size=10, max_wait_s=3600)
        waiting = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0)
        assert batcher.waiting == 1
        await batcher.close()
        await asyncio.wait([waiting])
        return waiting.cancelled()

    assert run(go)


# ------------------------------------------------------------------ splitting a rejected batch


def test_a_rejected_batch_is_retried_item_by_item_so_only_the_bad_item_fails() -> None:
    singles: list[int] = []

    async def send_batch(items: list[int]) -> Sequence[int]:
        if 3 in items:
            raise PermanentError("HTTP 400: input 3 is invalid", status=400)
        return [i * 10 for i in items]

    async def send_one(item: int) -> int:
        singles.append(item)
        return (await send_batch([item]))[0]

    async def go() -> list[Any]:
        batcher: Batcher[int, int] = Batcher(split_on_rejection(send_batch, send_one), max_size=5, max_wait_s=1)
        return await asyncio.gather(*(batcher.submit(i) for i in range(5)), return_exceptions=True)

    results = run(go)
    assert results[:3] == [0, 10, 20] and results[4] == 40
    assert isinstance(results[3], PermanentError) and results[3].status == 400
    assert sorted(singles) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("error", [
    RetryableError("HTTP 503: busy", status=503, attempts=10),
    PermanentError("unexpected embeddings response shape", status=200),
    PermanentError("invalid URL: x"),
])
def test_a_batch_that_fails_otherwise_is_not_split(error: Exception) -> None:
    singles: list[int] = []

    async def send_batch(items: list[int]) -> Sequence[int]:
        raise error

    async def send_one(item: int) -> int:
        singles.append(item)
        return item

    send = split_on_rejection(send_batch, send_one)
    outcomes = run(lambda: send([1, 2, 3]))  # type: ignore[arg-type,return-value]
    assert list(outcomes) == [error] * 3 and singles == []
    assert not is_rejection(error)


# ------------------------------------------------------------------ usage shares


@pytest.mark.parametrize(("total", "weights"), [(10, [1, 1, 1]), (7, [5, 1, 1]), (0, [3, 4]), (100, [0, 0]),
                                                 (1001, [13, 7, 9, 250, 1])])
def test_usage_shares_add_up_and_follow_the_weights(total: int, weights: list[int]) -> None:
    shares = share_usage(total, weights)
    assert sum(shares) == total and len(shares) == len(weights)
    for share, weight in zip(shares, weights, strict=True):
        expected = total * weight / sum(weights) if sum(weights) else total / len(weights)
        assert abs(share - expected) < 1


# ------------------------------------------------------------------ config


def job_config(endpoint: str, *, model: dict[str, Any] | None = None, capacity: int = 64) -> JobConfig:
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": endpoint, "model": "emb", "api": "embeddings", **(model or {})},
        "async": {"capacity": capacity, "request_timeout_s": 5.0, "record_deadline_s": 20.0},
        "retry": {"max_attempts": 4, "initial_backoff_s": 0.001, "max_backoff_s": 0.005},
    })


@pytest.mark.parametrize(("model", "capacity", "problem"), [
    ({"api": "chat", "batch": {"max_size": 8}}, 64, "model.batch.max_size: batching needs model.api: embeddings"),
    ({"batch": {"max_size": 128}}, 64, "model.batch.max_size: 128 is over async.capacity (64)"),
    ({"batch": {"max_size": 0}}, 64, "model.batch.max_size: must be > 0"),
    ({"batch": {"max_wait_ms": -1}}, 64, "model.batch.max_wait_ms: must be >= 0"),
    ({"batch": {"max_size": "big"}}, 64, "model.batch.max_size: expected an integer"),
    ({"batch": {"size": 8}}, 64, "model.batch.size: unknown key"),
])
def test_batch_config_errors_name_the_key(model: dict[str, Any], capacity: int, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        job_config("http://127.0.0.1:9/v1", model=model, capacity=capacity)
    assert str(caught.value).startswith(problem)


def test_batching_is_off_by_default() -> None:
    config = job_config("http://127.0.0.1:9/v1")
    assert config.model.batch.max_size == 1
    assert InferenceClient(config)._batcher is None


# ------------------------------------------------------------------ the client's batch path over HTTP


def vector_of(text: str) -> list[float]:
    return [b / 255 for b in hashlib.sha256(text.encode()).digest()[:4]]


class EmbeddingsServer:
    """Answers lists of inputs with a vector per input (in reverse `index` order, to check the
    client sorts), 400 for a batch holding "BAD", 500 on the first `fail_first` requests."""

    def __init__(self, fail_first: int = 0) -> None:
        self.inputs: list[list[str]] = []
        self.fail_first = fail_first

    async def handle(self, req: web.Request) -> web.Response:
        body = await req.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        self.inputs.append(inputs)
        if len(self.inputs) <= self.fail_first:
            return web.json_response({"error": {"message": "overloaded"}}, status=500)
        if any("BAD" in text for text in inputs):
            return web.json_response({"error": {"message": "input is invalid"}}, status=400)
        data = [{"object": "embedding", "index": i, "embedding": vector_of(text)} for i, text in enumerate(inputs)]
        tokens = sum(len(text) for text in inputs)
        return web.json_response({"object": "list", "data": data[::-1], "model": body["model"],
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def embedding_request(n: int, text: str) -> Request:
    return Request(id=f"r-{n}", key=f"k{n}".encode(), source=SourceRef("in", 0, n), prompt=text,
                   fields={"id": f"r-{n}", "prompt": text})


ENTRIES = ("one by one", "whole")
"""How `complete_all` hands its records to the client: each on its own (`complete`, the keyed lane:
the `Batcher` groups them) or all at once (`complete_many`, the vectorized lane's Arrow batch: cut
into batch requests at once)."""


async def complete_all(server: EmbeddingsServer, texts: list[str], model: dict[str, Any], entry: str = "one by one",
                       capacity: int = 64) -> tuple[list[Completion | BaseException], InferenceClient]:
    app = web.Application()
    app.add_routes([web.post("/v1/embeddings", server.handle)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    try:
        config = job_config(url, model={"prices": {"prompt_per_1k": 1.0}, **model}, capacity=capacity)
        requests = [embedding_request(n, text) for n, text in enumerate(texts)]
        async with InferenceClient(config) as client:
            if entry == "whole":
                return list(await client.complete_many(requests)), client  # type: ignore[arg-type]
            results = await asyncio.gather(*(client.complete(r) for r in requests), return_exceptions=True)
        return results, client
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("entry", ENTRIES)
def test_each_record_gets_the_vector_of_its_own_input_and_its_share_of_the_usage(entry: str) -> None:
    server = EmbeddingsServer()
    texts = [f"text number {n}" + "x" * n for n in range(20)]
    results, client = run(lambda: complete_all(server, texts, {"batch": {"max_size": 8, "max_wait_ms": 50}}, entry))
    assert sorted(len(batch) for batch in server.inputs) == [4, 8, 8]
    for text, result in zip(texts, results, strict=True):
        assert isinstance(result, Completion)
        assert result.output == vector_of(text)
        assert result.attempts == 1 and result.completion_tokens == 0
        assert result.cost == pytest.approx(result.prompt_tokens / 1000)
    assert sum(r.prompt_tokens for r in results if isinstance(r, Completion)) == sum(len(t) for t in texts)
    first, last = results[0], results[19]
    assert isinstance(first, Completion) and isinstance(last, Completion)
    assert last.prompt_tokens > first.prompt_tokens  # a longer input carries a larger share
    assert client.metrics.snapshot()["requests"] == 3


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_bad_input_inside_a_batch_fails_alone_and_a_failed_batch_is_retried_as_a_batch(entry: str) -> None:
    server = EmbeddingsServer(fail_first=1)
    texts = [f"input {n}" for n in range(6)]
    texts[2] = "a BAD input"
    results, client = run(lambda: complete_all(server, texts, {"batch": {"max_size": 6, "max_wait_ms": 1000}}, entry))
    # 1: the batch, 500; 2: the same batch again, 400; then the six inputs one by one.
    assert server.inputs[0] == server.inputs[1] == texts
    assert sorted(map(tuple, server.inputs[2:])) == sorted((t,) for t in texts)
    bad = results[2]
    assert isinstance(bad, PermanentError) and bad.status == 400 and bad.reason == "inference_rejected"
    for n, result in enumerate(results):
        if n != 2:
            assert isinstance(result, Completion) and result.output == vector_of(texts[n])
    snapshot = client.metrics.snapshot()
    assert snapshot["requests"] == 8 and snapshot["retries"] == 1


def test_a_whole_batch_goes_as_few_requests_at_once_within_capacity_without_waiting_for_max_wait() -> None:
    """`complete_many` (the vectorized lane): 20 records in batches of 4 are five requests sent at
    once, no record waiting `max_wait_ms` (an hour here) for a batch to fill, and never more than
    capacity // max_size (2) in flight: capacity counts records."""

    class Slow(EmbeddingsServer):
        def __init__(self) -> None:
            super().__init__()
            self.in_flight = self.most = 0

        async def handle(self, req: web.Request) -> web.Response:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            try:
                await asyncio.sleep(0.05)
                return await super().handle(req)
            finally:
                self.in_flight -= 1

    server = Slow()
    texts = [f"input {n}" for n in range(18)]
    results, client = run(lambda: complete_all(server, texts, {"batch": {"max_size": 4, "max_wait_ms": 3_600_000}},
                                               "whole", capacity=8), timeout=30)
    assert sorted(len(batch) for batch in server.inputs) == [2, 4, 4, 4, 4]
    assert server.most == 2
    assert [r.output for r in results if isinstance(r, Completion)] == [vector_of(t) for t in texts]
    assert client.metrics.snapshot()["requests"] == 5


def test_without_batching_each_record_is_one_request() -> None:
    server = EmbeddingsServer()
    texts = [f"input {n}" for n in range(5)]
    results, _ = run(lambda: complete_all(server, texts, {}))
    assert [len(batch) for batch in server.inputs] == [1] * 5
    assert [r.output for r in results if isinstance(r, Completion)] == [vector_of(t) for t in texts]


# ------------------------------------------------------------------ against the simulator


def test_the_simulator_embeds_a_batch_with_per_input_latency_and_refuses_long_inputs(
        make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(latency="fixed:20", per_input_ms=5.0, max_input_tokens=50)
    texts = [f"sentence {n}" for n in range(8)]

    async def go() -> tuple[float, list[Completion | BaseException]]:
        config = job_config(sim.url, model={"batch": {"max_size": 8, "max_wait_ms": 1000}})
        async with InferenceClient(config) as client:
            started = time.monotonic()
            batch = await asyncio.gather(*(client.complete(embedding_request(n, t)) for n, t in enumerate(texts)))
            took = time.monotonic() - started
            mixed = await asyncio.gather(*(client.complete(embedding_request(n, t)) for n, t in
                                           enumerate([*texts[:3], "long " * 100])), return_exceptions=True)
        return took, [*batch, *mixed]

    took, results = run(go)
    assert took >= 0.020 + 8 * 0.005 - 0.002  # base latency + 8 inputs x 5 ms, in one request
    for n, result in enumerate(results[:8]):
        assert isinstance(result, Completion) and result.output == embedding_vector(texts[n], 16)
    refused = results[11]
    assert isinstance(refused, PermanentError) and refused.status == 400 and "maximum of 50" in refused.detail
    assert all(isinstance(r, Completion) for r in results[8:11])
    # 1 batch of 8; 1 batch of 4, refused; then its 4 inputs alone.
    assert sim.stats()["requests_total"] == 6


# ------------------------------------------------------------------ bench scenario (e)


def test_bench_scenario_e_runs_llmstream_batched_and_unbatched_with_valid_configs(tmp_path: Path) -> None:
    from jobs.dev.bench.harness import BenchContext, Topics, llmstream_config
    from jobs.dev.bench.scenarios import SCENARIOS, UNBATCHED

    scenario = SCENARIOS["e"]
    assert scenario.approaches(["sequential", "semaphore-gather", "llmstream"]) == [UNBATCHED, "llmstream"]
    assert scenario.approaches(["semaphore-gather"]) == []
    assert SCENARIOS["a"].approaches(["semaphore-gather", "llmstream"]) == ["semaphore-gather", "llmstream"]
    args = scenario.simulator_args()
    assert args[args.index("--per-input-ms") + 1] == "0.2" and args[args.index("--latency") + 1] == "fixed:20"
    ctx = BenchContext(broker=None, workdir=tmp_path)  # type: ignore[arg-type]
    topics = Topics.fresh(scenario, "llmstream")
    batched, unbatched = (
        config_from_dict(llmstream_config(topics, "127.0.0.1:9", "http://127.0.0.1:1/v1",
                                          ctx.settings_for(scenario, approach), scenario, tmp_path,
                                          batched=approach != UNBATCHED)) for approach in ("llmstream", UNBATCHED))
    assert batched.model.api == unbatched.model.api == "embeddings"
    assert (batched.model.batch.max_size, unbatched.model.batch.max_size) == (128, 1)
    assert (batched.async_.capacity, unbatched.async_.capacity) == (1024, 256)  # four times the default 64 slots


# ------------------------------------------------------------------ the stage, on fake PyFlink


def stage_config(endpoint: str, capacity: int, max_size: int) -> JobConfig:
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": endpoint, "model": "emb", "api": "embeddings",
                  "batch": {"max_size": max_size, "max_wait_ms": 20}},
        "async": {"capacity": capacity, "request_timeout_s": 5.0, "record_deadline_s": 20.0},
        "retry": {"max_attempts": 3, "initial_backoff_s": 0.001, "max_backoff_s": 0.005},
    })


def stage_text(i: int) -> str:
    return "far too long " * 40 if i == 13 else f"text {i}"


def test_the_stage_batches_admitted_records_and_a_restore_batches_the_pending_ones_again(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    """Capacity counts records (16 admitted, the rest wait); every record is answered once with
    its own vector; the refused input is the only dead letter; a snapshot holds exactly what was
    not emitted, and a restored instance sends it again, batched."""
    sim = make_sim(latency="fixed:300", max_input_tokens=50)
    config = stage_config(sim.url, capacity=16, max_size=8)
    first = Harness(config)
    harnesses.append(first)
    for i in range(24):
        first.element(i % 2, json.dumps({"id": f"id-{i}", "prompt": stage_text(i)}).encode(), offset=i)
    checkpoint = first.state.snapshot()
    emitted = {b["id"] for b in [*first.bodies("out"), *first.bodies("dlq")]}
    stored = {json.loads(v.value)["id"] for bucket in checkpoint.values() for v in bucket.values()}
    assert stored and not stored & emitted and stored | emitted == {f"id-{i}" for i in range(24)}
    wait_until(lambda: sim.stats()["requests_total"] >= 2, timeout=60, interval=0.02,
               message="the first instance's two batches to reach the server")
    first.close()

    sim.reset_stats()
    second = Harness(config, KeyedState(copy.deepcopy(checkpoint)))
    harnesses.append(second)
    for bucket in checkpoint:
        second.fire(bucket, 0)
    second.end_of_input()
    out = [*first.bodies("out"), *second.bodies("out")]
    dead = [*first.bodies("dlq"), *second.bodies("dlq")]
    assert Counter(b["id"] for b in out) == Counter({f"id-{i}": 1 for i in range(24) if i != 13})
    for body in out:
        i = int(body["id"].removeprefix("id-"))
        assert body["output"] == embedding_vector(stage_text(i), 16) and body["source"]["offset"] == i
    assert [(d["id"], d["reason"], d["last_status"]) for d in dead] == [("id-13", "inference_rejected", 400)]
    assert second.metric("reissued") == len(stored)
    assert sim.stats()["requests_total"] < len(stored)  # sent again in batches, not one by one
    assert second.state.snapshot() == {}
