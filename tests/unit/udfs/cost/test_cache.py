"""The result cache: key derivation, both backends (a real redis-server on loopback), outages,
and the client with the cache in front of the simulator (which counts the calls it answers)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jobs.dev.simulator import ThreadedSimulator
from tests.support.calls import run
from tests.support.configs import job_config, request
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_until_async
from udfs.config import JobConfig, ModelConfig, with_overrides
from udfs.cost.cache import (
    GuardedCache,
    LocalCache,
    RedisCache,
    cache_key,
    cacheable,
    is_deterministic,
)
from udfs.inference.client import InferenceClient
from udfs.inference.prompts import build_payload
from udfs.metrics import InferenceMetrics

ANSWER = {"output": "Paris.", "model": "sim", "finish_reason": "stop", "prompt_tokens": 7, "completion_tokens": 2}


def model(**changes: Any) -> ModelConfig:
    return ModelConfig(**{"endpoint": "http://127.0.0.1:9/v1", "model": "m", "temperature": 0.0, **changes})


def key_of(config: ModelConfig, **request_changes: Any) -> str:
    return cache_key(config.api, build_payload(request(**request_changes), config))


async def expired(cache: LocalCache | RedisCache, key: str) -> bool:
    return await cache.get(key) is None


def cached_config(endpoint: str, tmp_path: Path, **cache: Any) -> JobConfig:
    config = job_config(endpoint, model={"temperature": 0})
    return with_overrides(config, cache={"backend": "local", "path": str(tmp_path / "cache.sqlite"), **cache})


# ---------------------------------------------------------------------- keys


def test_same_request_same_key_and_the_record_id_does_not_matter() -> None:
    config = model()
    assert key_of(config) == key_of(config)
    assert key_of(config, id="another-id", key=b"other", raw=b"{}") == key_of(config)
    assert len(key_of(config)) == 64


@pytest.mark.parametrize("change", [
    {"model": "other-model"}, {"max_tokens": 17}, {"temperature": 0.5}, {"system_prompt": "Be terse."},
    {"api": "completions"}, {"prompt_template": "Q: {prompt}"},
])
def test_any_model_setting_changes_the_key(change: dict[str, Any]) -> None:
    assert key_of(model(**change)) != key_of(model())


@pytest.mark.parametrize("params", [{"seed": 1}, {"top_p": 0.9}, {"stop": ["\n"]}, {"max_tokens": 3},
                                    {"presence_penalty": 0.1}, {"model": "x"}])
def test_any_record_parameter_or_prompt_changes_the_key(params: dict[str, Any]) -> None:
    assert key_of(model(), params=params) != key_of(model())
    assert key_of(model(), prompt="What is the capital of Spain?") != key_of(model())


def test_the_key_is_stable_across_processes() -> None:
    code = ("from tests.unit.udfs.cost.test_cache import key_of, model; print(key_of(model()))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == key_of(model())


def test_only_deterministic_requests_are_cacheable_by_default() -> None:
    assert is_deterministic("chat", {"temperature": 0})
    assert is_deterministic("chat", {"temperature": 0.7, "seed": 3})
    assert is_deterministic("embeddings", {"input": "x"})
    assert not is_deterministic("chat", {})
    assert not is_deterministic("completions", {"temperature": 1.0})
    config = job_config("http://127.0.0.1:9/v1")
    local = with_overrides(config, cache={"backend": "local"}).cache
    assert not cacheable(local, "chat", {"temperature": 1.0})
    assert cacheable(with_overrides(config, cache={"backend": "local", "only_deterministic": False}).cache,
                     "chat", {"temperature": 1.0})
    assert not cacheable(config.cache, "chat", {"temperature": 0})  # backend none


# ---------------------------------------------------------------------- local backend


def test_local_cache_round_trip_and_ttl(tmp_path: Path) -> None:
    async def go() -> None:
        cache = LocalCache(tmp_path / "c.sqlite", ttl_s=0.3)
        assert await cache.get("k") is None
        await cache.put("k", ANSWER)
        assert await cache.get("k") == ANSWER
        await wait_until_async(lambda: expired(cache, "k"), timeout=30, interval=0.05, message="the entry to expire")
        await cache.close()
    run(go)


def test_local_cache_is_shared_by_two_processes(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite"
    writer = ("import sys; from udfs.cost.cache import LocalCache; c = LocalCache(sys.argv[1]); "
              "[c.put_now(f'{sys.argv[2]}-{i}', {'i': i}) for i in range(200)]")
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(path), name]) for name in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    cache = LocalCache(path)
    assert cache.get_now("a-199") == {"i": 199} and cache.get_now("b-0") == {"i": 0}
    assert cache.stats()[0] == 400


def test_local_cache_stays_within_its_size_bounds(tmp_path: Path) -> None:
    by_entries = LocalCache(tmp_path / "n.sqlite", max_entries=50)
    for i in range(500):
        by_entries.put_now(f"k{i}", ANSWER)
    count, _ = by_entries.stats()
    assert count <= 50
    assert by_entries.get_now("k499") == ANSWER and by_entries.get_now("k0") is None  # oldest evicted
    by_bytes = LocalCache(tmp_path / "b.sqlite", max_bytes=20_000)
    for i in range(2000):
        by_bytes.put_now(f"k{i}", {"output": "x" * 100})
    assert by_bytes.stats()[1] <= 22_000  # checked every tenth of the bound written


# ---------------------------------------------------------------------- redis backend


@pytest.fixture
def redis_server(tmp_path: Path) -> Any:
    with RedisServer(tmp_path / "redis") as server:
        yield server


def test_redis_cache_round_trip_ttl_and_restart(redis_server: RedisServer) -> None:
    async def go() -> None:
        cache = RedisCache(redis_server.url, ttl_s=1)
        assert await cache.get("k") is None
        await cache.put("k", ANSWER)
        assert await cache.get("k") == ANSWER
        other = RedisCache(redis_server.url)  # another subtask, another machine: same entry
        assert await other.get("k") == ANSWER
        await other.close()
        await wait_until_async(lambda: expired(cache, "k"), timeout=30, interval=0.1, message="the entry to expire")
        await cache.close()
    run(go)


def test_a_cache_outage_is_logged_once_counted_and_never_fails(redis_server: RedisServer,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    metrics = InferenceMetrics()

    async def go() -> None:
        guarded = GuardedCache(RedisCache(redis_server.url), metrics, name="test", retry_after_s=0.2)
        await guarded.put("k", ANSWER)
        redis_server.kill()
        for _ in range(20):
            assert await guarded.get("k") is None
            await guarded.put("k2", ANSWER)
        assert guarded.out
        redis_server.start()

        async def back() -> bool:
            if not guarded.out:
                return True
            await guarded.put("k3", ANSWER)
            return False

        await wait_until_async(back, 30, interval=0.05, message="the cache to come back")
        assert await guarded.get("k3") == ANSWER
        await guarded.close()

    with caplog.at_level(logging.WARNING, logger="udfs.cost.cache"):
        run(go)
    unavailable = [r for r in caplog.records if "unavailable" in r.getMessage()]
    back = [r for r in caplog.records if "is back after" in r.getMessage()]
    assert len(unavailable) == 1 and len(back) == 1
    assert 1 <= metrics.cache_errors.value <= 40


# ---------------------------------------------------------------------- the client with a cache


def complete_all(config: JobConfig, requests: list[Any]) -> tuple[list[Any], InferenceMetrics]:
    metrics = InferenceMetrics()

    async def go() -> list[Any]:
        async with InferenceClient(config, metrics=metrics) as client:
            return list(await asyncio.gather(*(client.complete(r) for r in requests)))
    return run(go), metrics


def test_the_client_calls_once_per_distinct_request_and_marks_cached_answers(
        sim: ThreadedSimulator, tmp_path: Path) -> None:
    config = cached_config(sim.url, tmp_path)
    prompts = [f"question {i % 5}" for i in range(40)]  # 5 distinct, asked 8 times each, concurrently
    done, metrics = complete_all(config, [request(p, id=f"r{i}") for i, p in enumerate(prompts)])
    assert sim.stats()["served"] == 5
    assert sum(not c.cached for c in done) == 5 and sum(c.cached for c in done) == 35
    assert metrics.cache_hits.value == 35 and metrics.cache_misses.value == 5
    first = {c.output for c in done if not c.cached}
    assert {c.output for c in done} == first
    cached = next(c for c in done if c.cached)
    assert cached.attempts == 0 and cached.prompt_tokens > 0
    # a replay in a new process (a new client on the same file) calls nothing
    again, _ = complete_all(config, [request(p, id=f"replay{i}") for i, p in enumerate(prompts[:5])])
    assert all(c.cached for c in again) and sim.stats()["served"] == 5


def test_sampled_requests_are_not_cached_by_default(sim: ThreadedSimulator, tmp_path: Path) -> None:
    config = with_overrides(cached_config(sim.url, tmp_path), model={"temperature": 0.8})
    done, metrics = complete_all(config, [request("same", id=f"r{i}") for i in range(4)])
    assert sim.stats()["served"] == 4 and not any(c.cached for c in done)
    assert metrics.cache_hits.value == metrics.cache_misses.value == 0


def test_the_client_calls_the_model_when_the_cache_is_out(sim: ThreadedSimulator, tmp_path: Path,
                                                          make_cache_dir: Callable[[], Path]) -> None:
    unusable = make_cache_dir() / "cache.sqlite"  # a directory where the file should be
    unusable.mkdir(parents=True)
    config = cached_config(sim.url, tmp_path, path=str(unusable))
    done, metrics = complete_all(config, [request(f"q{i}", id=f"r{i}") for i in range(10)])
    assert len(done) == 10 and not any(c.cached for c in done)
    assert sim.stats()["served"] == 10 and metrics.cache_errors.value >= 1


@pytest.fixture
def make_cache_dir(tmp_path: Path) -> Callable[[], Path]:
    return lambda: tmp_path / "broken"


def test_concurrent_puts_are_committed_together_and_all_readable(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "g.sqlite")
    writes: list[int] = []
    original = cache._write

    def counting(rows: list[Any]) -> None:
        writes.append(len(rows))
        original(rows)

    cache._write = counting  # type: ignore[method-assign]

    async def go() -> None:
        await asyncio.gather(*(cache.put(f"k{i}", {"i": i}) for i in range(100)))
    run(go)
    assert sum(writes) == 100 and len(writes) < 10
    assert all(cache.get_now(f"k{i}") == {"i": i} for i in range(100))
