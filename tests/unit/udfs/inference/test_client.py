"""The inference client over real HTTP on loopback, against the model-server simulator.

Backoffs are patched to milliseconds through the retry config; timing assertions leave
room for a busy 2-core machine. The pacing runs, which take whole windows of wall-clock
time, are in tests/integration/test_pacing.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from jobs.dev.simulator import ThreadedSimulator
from jobs.runtime.ports import free_port
from tests.support.calls import complete_one, failure, run
from tests.support.configs import job_config, request
from tests.support.fakes import MetricGroup
from tests.support.servers import serve_app
from tests.support.waiting import wait_until
from udfs.config import with_overrides
from udfs.errors import (
    BadInput,
    DeadlineExceeded,
    InternalError,
    PermanentError,
    RateLimited,
    RetryableError,
    UnsupportedResponse,
)
from udfs.inference import client as client_module
from udfs.inference.client import InferenceClient
from udfs.metrics import InferenceMetrics
from udfs.records import Completion

KEY_ENV = "LLMSTREAM_TEST_API_KEY"
SECRET = "sk-llmstream-test-7f3a9c2e"


# ------------------------------------------------------------------ answers


def test_chat_completion_carries_output_usage_timing_cost_and_endpoint(sim: ThreadedSimulator) -> None:
    config = job_config(sim.url, model={"system_prompt": "Be brief.",
                                        "prices": {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}})
    before = time.time_ns() // 1_000_000
    completion, client = run(lambda: complete_one(config))
    assert completion.output.startswith("Simulated answer to: What is the capital")
    assert completion.endpoint == sim.url + "/chat/completions"
    assert completion.attempts == 1 and completion.finish_reason in ("stop", "length")
    assert completion.prompt_tokens > 0 and completion.completion_tokens > 0
    assert completion.cost == pytest.approx(completion.prompt_tokens / 1000 + completion.completion_tokens / 500)
    assert before <= completion.started_ms <= completion.completed_ms <= time.time() * 1000 + 1
    assert 0 < completion.latency_ms < 5000
    snapshot = client.metrics.snapshot()
    assert snapshot["requests"] == 1 and snapshot["retries"] == 0
    assert snapshot["prompt_tokens"] == completion.prompt_tokens
    assert snapshot["latency_ms"]["count"] == 1


@pytest.mark.parametrize(("api", "path"), [("completions", "/completions"), ("embeddings", "/embeddings")])
def test_completions_and_embeddings_apis(sim: ThreadedSimulator, api: str, path: str) -> None:
    completion, _ = run(lambda: complete_one(job_config(sim.url, model={"api": api})))
    assert completion.endpoint == sim.url + path
    if api == "embeddings":
        assert isinstance(completion.output, list) and all(isinstance(x, float) for x in completion.output)
        assert completion.completion_tokens == 0
    else:
        assert completion.output.startswith("Simulated answer to:")


def test_record_params_override_the_model(sim: ThreadedSimulator) -> None:
    config = job_config(sim.url, model={"max_tokens": 8})
    short, _ = run(lambda: complete_one(config, request(params={"model": "other-model"})))
    long, _ = run(lambda: complete_one(config, request(params={"max_tokens": 200})))
    assert short.model == "other-model" and long.model == "sim"
    assert long.completion_tokens > short.completion_tokens


def test_client_construction_does_no_io() -> None:
    client = InferenceClient(job_config(f"http://127.0.0.1:{free_port()}/v1"))
    assert client.session is None


def test_metrics_reach_the_flink_metric_group(sim: ThreadedSimulator) -> None:
    group = MetricGroup()
    metrics = InferenceMetrics(group)
    config = job_config(sim.url, async_={"capacity": 8})

    async def one() -> Completion:
        async with InferenceClient(config, metrics=metrics) as client:
            return await client.complete(request())

    completion = run(one)
    assert group.gauges["requests"]() == 1
    assert group.gauges["completion_tokens"]() == completion.completion_tokens
    assert group.gauges["latency_count"]() == 1
    assert group.gauges["latency_max_ms"]() == int(completion.latency_ms)
    assert group.gauges["in_flight"]() == 0 and group.gauges["concurrency_limit"]() == 8
    assert metrics.snapshot()["requests"] == 1


# ------------------------------------------------------------------ retries and timeouts


def test_server_errors_are_retried_exactly_max_attempts_times(sim: ThreadedSimulator) -> None:
    sim.admin({"error_rate": 1.0, "error_status": 500})
    err, elapsed, client = run(lambda: failure(job_config(sim.url, retry={"max_attempts": 4})))
    assert type(err) is RetryableError
    assert err.status == 500 and err.attempts == 4
    assert "HTTP 500" in err.detail
    assert sim.stats()["errors"] == 4
    assert client.metrics.requests.value == 4 and client.metrics.retries.value == 3
    assert elapsed < 3.0


def test_retry_after_is_honoured(sim: ThreadedSimulator) -> None:
    sim.admin({"rate_limit_rate": 1.0, "retry_after_s": 1, "until_s": 0.3})
    started = time.monotonic()
    completion, client = run(lambda: complete_one(job_config(sim.url)))
    elapsed = time.monotonic() - started
    assert completion.attempts == 2
    assert 0.95 <= elapsed < 3.0
    assert completion.latency_ms >= 950
    assert client.metrics.rate_limited.value == 1


def test_a_bad_request_is_dead_lettered_after_one_attempt(sim: ThreadedSimulator) -> None:
    sim.admin({"error_rate": 1.0, "error_status": 400})
    err, _, _ = run(lambda: failure(job_config(sim.url)))
    assert type(err) is PermanentError
    assert err.attempts == 1 and err.status == 400
    assert sim.stats()["errors"] == 1


def test_503_is_retried(sim: ThreadedSimulator) -> None:
    sim.admin({"error_rate": 1.0, "error_status": 503, "retry_after_s": 0})
    err, _, _ = run(lambda: failure(job_config(sim.url, retry={"max_attempts": 3})))
    assert isinstance(err, RateLimited)
    assert err.attempts == 3 and err.status == 503
    assert sim.stats()["errors"] == 3


def test_the_one_endpoint_never_opens_a_circuit_and_a_503_shrinks_its_limit() -> None:
    """`model.endpoint` is a fleet of one whose circuit never opens: seven 503s in a row (more than
    `model.circuit.failures`) are retried at the backoff's pace, not after a cooldown, and each
    wave of them halves the concurrency limit, as 429s do."""
    answers: list[int] = []

    async def unavailable_then_fine(req: web.Request) -> web.Response:
        if len(answers) < 7:
            answers.append(503)
            return web.json_response({"error": {"message": "warming up"}}, status=503)
        answers.append(200)
        return web.json_response({"model": "sim", "choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]})

    async def scenario() -> tuple[Completion, int]:
        runner, url = await serve_app([web.post("/v1/chat/completions", unavailable_then_fine)])
        try:
            config = job_config(url, async_={"capacity": 8}, retry={"max_attempts": 10},
                                model={"circuit": {"failures": 2, "cooldown_s": 30, "max_cooldown_s": 60}})
            async with InferenceClient(config) as client:
                return await client.complete(request()), client.concurrency.limit
        finally:
            await runner.cleanup()

    started = time.monotonic()
    completion, limit = run(scenario)
    assert completion.attempts == 8 and answers == [503] * 7 + [200]
    assert time.monotonic() - started < 10  # no 30 s cooldown
    assert limit <= 4  # halved (once, when the 503s came within one decrease window)


def test_a_retry_after_pauses_every_call_to_the_one_endpoint_once() -> None:
    """A 429's Retry-After pauses the endpoint (`Fleet.release`), the one place that waits for it:
    no call of any record is sent before it ends, and the refused record waits for it once, not
    once in the fleet and again in the retry layer."""
    sent: list[float] = []

    async def limited_once(req: web.Request) -> web.Response:
        sent.append(time.monotonic())
        if len(sent) == 1:
            return web.json_response({"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "1"})
        return web.json_response({"model": "sim", "choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]})

    async def scenario() -> list[Completion]:
        runner, url = await serve_app([web.post("/v1/chat/completions", limited_once)])
        try:
            async with InferenceClient(job_config(url)) as client:
                first = asyncio.ensure_future(client.complete(request()))
                # the 429 has reached the client, not only the server: until then a call may go out
                await wait_for_async(lambda: client.fleet.endpoints[0].paused_until > 0)
                others = [client.complete(request()) for _ in range(3)]
                return [*await asyncio.gather(first, *others)]
        finally:
            await runner.cleanup()

    completions = run(scenario)
    assert [c.attempts for c in completions] == [2, 1, 1, 1]
    assert len(sent) == 5 and all(t - sent[0] >= 0.95 for t in sent[1:])
    assert completions[0].latency_ms < 1900


async def wait_for_async(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_connection_resets_are_retried(sim: ThreadedSimulator) -> None:
    sim.admin({"reset_rate": 1.0})
    err, _, _ = run(lambda: failure(job_config(sim.url, retry={"max_attempts": 2})))
    assert type(err) is RetryableError
    assert err.attempts == 2 and err.status is None


def test_nothing_listening_is_retryable() -> None:
    err, _, _ = run(lambda: failure(job_config(f"http://127.0.0.1:{free_port()}/v1", retry={"max_attempts": 2})))
    assert type(err) is RetryableError
    assert err.attempts == 2 and err.status is None


@pytest.mark.parametrize(("request_timeout_s", "deadline_s"), [(0.3, 0.8), (0.8, 0.8)])
def test_a_hung_server_ends_in_deadline_exceeded_within_the_deadline(
        sim: ThreadedSimulator, request_timeout_s: float, deadline_s: float) -> None:
    sim.admin({"hang_rate": 1.0})
    config = job_config(sim.url, async_={"request_timeout_s": request_timeout_s, "record_deadline_s": deadline_s},
                        retry={"max_attempts": 10})
    err, elapsed, _ = run(lambda: failure(config))
    assert type(err) is DeadlineExceeded
    assert err.attempts >= 1 and err.status is None
    assert f"{deadline_s:g} s" in err.detail
    assert deadline_s - 0.05 <= elapsed < deadline_s + 0.7


# ------------------------------------------------------------------ concurrency and rate limits


def test_the_server_never_sees_more_than_capacity_in_flight(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(latency="fixed:30")
    config = job_config(sim.url, async_={"capacity": 8})

    async def burst() -> list[Completion]:
        async with InferenceClient(config) as client:
            return await asyncio.gather(*(client.complete(request()) for _ in range(80)))

    completions = run(burst)
    assert len(completions) == 80
    stats = sim.stats()
    assert stats["served"] == 80
    assert 4 <= stats["max_in_flight"] <= 8


def test_a_batch_is_answered_in_order_within_capacity_each_request_with_its_answer_or_its_error(
        make_sim: Callable[..., ThreadedSimulator]) -> None:
    """`complete_many`: one answer a request, in order; a request that fails is its own error in its
    place (the rest answered); never more than `async.capacity` at the server; the tokens counted."""
    sim = make_sim(latency="fixed:30", max_input_tokens=20)
    config = job_config(sim.url, model={"api": "embeddings"}, async_={"capacity": 8})
    requests = [request(f"input {i}", id=f"r-{i}") for i in range(40)]
    requests[17] = request("far too long " * 40, id="r-17")  # over the server's input limit: a 400

    async def batch() -> tuple[list[Any], InferenceMetrics]:
        async with InferenceClient(config) as client:
            return await client.complete_many(requests), client.metrics

    answers, metrics = run(batch)
    assert len(answers) == 40
    assert type(answers[17]) is PermanentError and answers[17].status == 400 and answers[17].attempts == 1
    answered = [a for i, a in enumerate(answers) if i != 17]
    assert all(isinstance(a, Completion) and len(a.output) == 16 for a in answered)
    assert 4 <= sim.stats()["max_in_flight"] <= 8
    assert metrics.snapshot()["prompt_tokens"] == sum(a.prompt_tokens for a in answered)


def test_aimd_cuts_concurrency_in_a_429_storm_and_grows_it_back(make_sim: Callable[..., ThreadedSimulator]) -> None:
    """Every answer a 429 with Retry-After 1 s until the limit has been cut to a quarter (one cut
    per wave of retries: how many waves fit in a fixed storm depends on the machine's speed, so
    the storm lasts until the cuts are seen, or a minute), then calm: the limit grows back."""
    sim = make_sim(latency="fixed:20")
    capacity = 32
    config = job_config(sim.url, async_={"capacity": capacity},
                        retry={"max_attempts": 100, "initial_backoff_s": 0.05, "max_backoff_s": 0.2})
    limits: list[int] = []

    async def scenario() -> tuple[list[int], InferenceClient]:
        async with InferenceClient(config) as client:
            async def sample() -> None:
                deadline = time.monotonic() + 60
                storm_on = True
                while True:
                    limits.append(client.concurrency.limit)
                    if storm_on and (client.concurrency.limit <= capacity // 4 or time.monotonic() > deadline):
                        storm_on = False
                        await asyncio.to_thread(sim.admin, {})
                    await asyncio.sleep(0.01)

            sampler = asyncio.create_task(sample())
            sim.admin({"rate_limit_rate": 1.0, "retry_after_s": 1})
            storm = await asyncio.gather(*(client.complete(request()) for _ in range(200)))
            after_storm = client.concurrency.limit
            calm = await asyncio.gather(*(client.complete(request()) for _ in range(600)))
            sampler.cancel()
            return [after_storm, len(storm) + len(calm), client.concurrency.limit], client

    (after_storm, completed, final), client = run(scenario)
    assert completed == 800
    assert client.metrics.rate_limited.value > 0
    assert min(limits) <= capacity // 4
    assert after_storm < capacity
    assert final == capacity
    assert sim.stats()["served"] == 800


def test_a_sustained_rate_limit_slows_records_but_does_not_dead_letter_them(sim: ThreadedSimulator) -> None:
    config = job_config(sim.url, async_={"capacity": 64, "request_timeout_s": 0.5, "record_deadline_s": 0.5},
                        rate_limit={"requests_per_minute": 1200})

    async def queue_up() -> list[Completion]:
        async with InferenceClient(config) as client:
            return await asyncio.gather(*(client.complete(request()) for _ in range(60)))

    started = time.monotonic()
    completions = run(queue_up)
    assert len(completions) == 60 and all(c.attempts == 1 for c in completions)
    assert time.monotonic() - started >= 1.8


# ------------------------------------------------------------------ secrets, errors, cleanup


def test_a_batch_reads_the_api_key_once_and_a_rotated_key_is_sent_from_the_next_batch(
        make_sim: Callable[..., ThreadedSimulator], monkeypatch: pytest.MonkeyPatch) -> None:
    """The key (an environment variable here, a file's read in production) is read once a batch,
    not once a call; the next batch, or a call of its own, reads it again."""
    sim = make_sim(api_key=SECRET)
    config = job_config(sim.url, model={"api_key_env": KEY_ENV}, async_={"capacity": 4})
    monkeypatch.setenv(KEY_ENV, SECRET)
    reads = 0
    read = client_module.Transport.request_headers

    def counted(self: Any) -> dict[str, str]:
        nonlocal reads
        reads += 1
        return read(self)

    monkeypatch.setattr(client_module.Transport, "request_headers", counted)

    async def batches() -> tuple[list[Any], list[Any], Exception | None]:
        async with InferenceClient(config) as client:
            first = await client.complete_many([request(id=f"r-{i}") for i in range(12)])
            monkeypatch.setenv(KEY_ENV, "sk-llmstream-rotated-0c4d")  # the server refuses this one
            second = await client.complete_many([request(id=f"s-{i}") for i in range(3)])
            try:
                await client.complete(request())
            except PermanentError as err:
                return first, second, err
            return first, second, None

    first, second, alone = run(batches)
    assert all(isinstance(a, Completion) for a in first)
    assert all(type(a) is PermanentError and a.status == 401 for a in second)
    assert type(alone) is PermanentError and reads == 3


def test_the_api_key_never_appears_in_logs_errors_or_outputs(
        make_sim: Callable[..., ThreadedSimulator], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sim = make_sim(api_key=SECRET)
    config = job_config(sim.url, model={"api_key_env": KEY_ENV}, retry={"max_attempts": 2})
    monkeypatch.setenv(KEY_ENV, SECRET)
    completion, client = run(lambda: complete_one(config))
    assert SECRET not in repr(completion) and SECRET not in repr(client)
    wrong = "sk-llmstream-wrong-51b0e8d4"
    monkeypatch.setenv(KEY_ENV, wrong)
    err, _, _ = run(lambda: failure(config))
    assert type(err) is PermanentError and err.status == 401
    for secret in (SECRET, wrong):
        assert secret not in str(err) and secret not in repr(err) and secret not in str(err.detail)
        assert secret not in caplog.text
    assert any(r.name.startswith("udfs.") for r in caplog.records)


def test_a_server_that_echoes_the_key_in_its_error_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    async def echo(req: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"bad auth {req.headers.get('Authorization')}"}},
                                 status=400)

    async def scenario() -> Exception:
        runner, url = await serve_app([web.post("/v1/chat/completions", echo)])
        try:
            return (await failure(job_config(url, model={"api_key_env": KEY_ENV})))[0]
        finally:
            await runner.cleanup()

    monkeypatch.setenv(KEY_ENV, SECRET)
    err = run(scenario)
    assert type(err) is PermanentError and err.status == 400
    assert "bad auth Bearer ***" in str(err)
    assert SECRET not in str(err) and SECRET not in repr(err)


@pytest.mark.parametrize(("body", "problem"), [("not json", "not JSON"), ('{"choices": []}', "choices are an empty list")])
def test_a_malformed_answer_is_unsupported_at_once(body: str, problem: str) -> None:
    async def bad(req: web.Request) -> web.Response:
        return web.Response(text=body, content_type="application/json")

    async def scenario() -> Exception:
        runner, url = await serve_app([web.post("/v1/chat/completions", bad)])
        try:
            return (await failure(job_config(url)))[0]
        finally:
            await runner.cleanup()

    err = run(scenario)
    assert type(err) is UnsupportedResponse and err.reason == "unsupported_response" and err.attempts == 1
    assert problem in err.detail


def test_per_token_embeddings_are_refused_once_with_a_clear_reason() -> None:
    """llama.cpp's server answers /v1/embeddings with one vector per token for a model without
    pooling: not an embedding of the input, so a dead letter that says so, not a retry loop."""
    calls = []

    async def per_token(req: web.Request) -> web.Response:
        calls.append(await req.json())
        return web.json_response({"object": "list", "model": "m", "data": [
            {"object": "embedding", "index": 0, "embedding": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]}]})

    async def scenario() -> Exception:
        runner, url = await serve_app([web.post("/v1/embeddings", per_token)])
        try:
            return (await failure(job_config(url, model={"api": "embeddings"})))[0]
        finally:
            await runner.cleanup()

    err = run(scenario)
    assert type(err) is UnsupportedResponse and err.reason == "unsupported_response"
    assert "3 vectors (one per token)" in err.detail
    assert len(calls) == 1


def test_unexpected_exceptions_become_internal_errors(sim: ThreadedSimulator, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> dict[str, Any]:
        raise ZeroDivisionError("oops")

    monkeypatch.setattr(client_module, "build_payload", broken)
    err, _, _ = run(lambda: failure(job_config(sim.url)))
    assert type(err) is InternalError and "ZeroDivisionError" in err.detail


def test_a_record_that_cannot_become_a_request_is_bad_input_and_never_sent(sim: ThreadedSimulator) -> None:
    err, _, client = run(lambda: failure(job_config(sim.url, model={"prompt_template": "{title}: {prompt}"})))
    assert isinstance(err, BadInput) and err.reason == "template_field_missing"
    assert client.metrics.requests.value == 0
    assert sim.stats()["requests_total"] == 0


def test_close_leaves_no_connection_open(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(latency="fixed:10")
    config = job_config(sim.url, async_={"capacity": 8})

    async def scenario() -> None:
        client = InferenceClient(config)
        await asyncio.gather(*(client.complete(request()) for _ in range(20)))
        session = client.session
        assert session is not None and not session.closed
        connector = session.connector
        assert connector is not None
        await client.close()
        assert session.closed and connector.closed
        assert client.session is None

    run(scenario)
    wait_until(lambda: sim.stats()["open_connections"] == 0, timeout=30, interval=0.02,
               message="the simulator to see every connection closed")
    assert sim.stats()["open_connections"] == 0


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize("loop_state", ["running", "closed"])
def test_close_from_another_loop_as_pyflink_does(make_sim: Callable[..., ThreadedSimulator], loop_state: str) -> None:
    """The calls run on a loop in another thread (the stage's `CallRunner`); `close()` may come from
    another loop, while the calls' loop still runs or after it was closed."""
    sim = make_sim()
    client = InferenceClient(job_config(sim.url, async_={"capacity": 8}))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def calls() -> list[Completion]:
        return await asyncio.gather(*(client.complete(request()) for _ in range(20)))

    try:
        assert len(asyncio.run_coroutine_threadsafe(calls(), loop).result(30)) == 20
        assert sim.stats()["open_connections"] > 0
        if loop_state == "running":
            asyncio.run(client.close())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    asyncio.run(client.close())
    wait_until(lambda: sim.stats()["open_connections"] == 0, timeout=30, interval=0.02,
               message="the simulator to see every connection closed")
    assert sim.stats()["open_connections"] == 0


# ------------------------------------------------------------------ a model fleet (udfs/inference/fleet.py)


def fleet_config(endpoints: list[dict[str, Any]], *, fallback: dict[str, Any] | None = None,
                 circuit: dict[str, Any] | None = None, **sections: Any) -> Any:
    model: dict[str, Any] = {"endpoint": None, "endpoints": endpoints,
                             "circuit": {"failures": 3, "cooldown_s": 0.3, "max_cooldown_s": 60, **(circuit or {})}}
    if fallback is not None:
        model["fallback"] = fallback
    return job_config("http://unused", model=model, **sections)


def test_a_fleet_shares_calls_by_limit_and_says_which_endpoint_answered(
        make_sim: Callable[..., ThreadedSimulator]) -> None:
    sims = [make_sim(latency="fixed:20") for _ in range(3)]
    config = fleet_config([{"url": s.url, "max_concurrency": n} for s, n in zip(sims, (8, 4, 2), strict=True)],
                          async_={"capacity": 64})

    async def burst() -> tuple[list[Completion], dict[str, Any]]:
        async with InferenceClient(config) as client:
            done = await asyncio.gather(*(client.complete(request()) for _ in range(280)))
            return done, client.metrics.snapshot()

    completions, snapshot = run(burst)
    served = [s.stats()["served"] for s in sims]
    assert sum(served) == 280
    assert [s.stats()["max_in_flight"] for s in sims] == [8, 4, 2]
    for share, expected in zip(served, (4 / 7, 2 / 7, 1 / 7), strict=True):
        assert abs(share / 280 - expected) < 0.1
    assert {c.endpoint for c in completions} == {s.url + "/chat/completions" for s in sims}
    assert set(snapshot["endpoints"]) == {f"127_0_0_1_{s.port}" for s in sims}
    assert all(figures["circuit"] == 0 and figures["requests"] > 0 for figures in snapshot["endpoints"].values())


def test_a_failing_endpoint_opens_its_circuit_and_retries_go_elsewhere(
        make_sim: Callable[..., ThreadedSimulator]) -> None:
    good, bad = make_sim(latency="fixed:5"), make_sim(latency="fixed:5")
    bad.admin({"error_rate": 1.0, "error_status": 500})
    config = fleet_config([{"url": bad.url, "weight": 10}, {"url": good.url}], async_={"capacity": 8},
                          circuit={"cooldown_s": 30})

    async def calls() -> tuple[list[Completion], dict[str, Any]]:
        async with InferenceClient(config) as client:
            done = [await client.complete(request()) for _ in range(50)]
            return done, client.metrics.snapshot()

    completions, snapshot = run(calls)
    assert all(c.endpoint.startswith(good.url) for c in completions)
    assert bad.stats()["errors"] == 3  # failures: 3, then its circuit stays open
    assert snapshot["endpoints"][f"127_0_0_1_{bad.port}"]["circuit"] == 2


def test_a_429_pauses_only_its_endpoint(make_sim: Callable[..., ThreadedSimulator]) -> None:
    """Retry-After is the endpoint's pause, not the record's wait: the retry goes to the other one."""
    busy, free = make_sim(), make_sim()
    busy.admin({"rate_limit_rate": 1.0, "retry_after_s": 30})
    config = fleet_config([{"url": busy.url, "weight": 10}, {"url": free.url}],
                          retry={"max_retry_after_s": 30})

    async def calls() -> list[Completion]:
        async with InferenceClient(config) as client:
            return [await client.complete(request()) for _ in range(10)]

    started = time.monotonic()
    completions = run(calls)
    assert time.monotonic() - started < 10
    assert busy.stats()["rejected"] == 1 and free.stats()["served"] == 10
    assert completions[0].attempts == 2 and all(c.attempts == 1 for c in completions[1:])


def test_a_503_in_a_fleet_halves_that_endpoints_limit_and_opens_its_circuit(
        make_sim: Callable[..., ThreadedSimulator]) -> None:
    """A 503 is overload and a circuit failure of the endpoint that answered it: its limit halves,
    its circuit opens after `failures` of them, and the records are answered by the other one."""
    unavailable, good = make_sim(latency="fixed:5"), make_sim(latency="fixed:5")
    unavailable.admin({"error_rate": 1.0, "error_status": 503, "retry_after_s": 0})
    config = fleet_config([{"url": unavailable.url, "weight": 10}, {"url": good.url}], async_={"capacity": 8},
                          circuit={"cooldown_s": 30})

    async def calls() -> tuple[list[Completion], dict[str, Any]]:
        async with InferenceClient(config) as client:
            done = [await client.complete(request()) for _ in range(20)]
            return done, client.metrics.snapshot()

    completions, snapshot = run(calls)
    assert all(c.endpoint.startswith(good.url) for c in completions)
    assert unavailable.stats()["errors"] == 3  # failures: 3, then its circuit stays open
    figures = snapshot["endpoints"][f"127_0_0_1_{unavailable.port}"]
    assert figures["circuit"] == 2 and figures["failures"] == 3 and figures["rate_limited"] == 0
    assert figures["limit"] <= 4  # halved


def test_every_primary_down_the_fallback_answers_with_its_model_and_its_cache_key(
        make_sim: Callable[..., ThreadedSimulator], tmp_path: Any) -> None:
    """The fallback's answers carry its model and endpoint and are cached under its model, never
    under the primary's: a repeat is asked again, and the primary, back, answers for itself."""
    primary, spare = make_sim(), make_sim()
    primary.admin({"error_rate": 1.0, "error_status": 500})
    config = with_overrides(
        fleet_config([{"url": primary.url}], circuit={"failures": 2, "cooldown_s": 30},
                     fallback={"endpoints": [{"url": spare.url, "model": "small-model", "name": "spare"}]}),
        model={"temperature": 0}, cache={"backend": "local", "path": str(tmp_path / "cache.sqlite")})

    async def calls() -> list[Completion]:
        async with InferenceClient(config) as client:
            return [await client.complete(request(f"q{i % 3}")) for i in range(6)]

    completions = run(calls)
    assert all(c.model == "small-model" and c.endpoint.startswith(spare.url) for c in completions)
    assert primary.stats()["errors"] == 2
    assert spare.stats()["served"] == 3 + 3  # the primary's key never holds the fallback's answer
    primary.admin({})
    healthy = with_overrides(config, model={"fallback": None, "circuit": {"failures": 2, "cooldown_s": 0.1}})
    again = run(lambda: complete_one(healthy, request("q0")))[0]
    assert again.model == "sim" and not again.cached and again.endpoint.startswith(primary.url)


def test_each_endpoint_gets_its_own_key_and_no_error_shows_it(
        make_sim: Callable[..., ThreadedSimulator], monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = make_sim(api_key="sk-first-key"), make_sim(api_key="sk-second-key")
    second.admin({"error_rate": 1.0, "error_status": 500})
    monkeypatch.setenv("FIRST_KEY", "sk-first-key")
    monkeypatch.setenv("SECOND_KEY", "sk-wrong-key")  # the server refuses it: a 401, permanent
    config = fleet_config([{"url": first.url, "api_key_env": "FIRST_KEY", "weight": 10},
                           {"url": second.url, "api_key_env": "SECOND_KEY"}])
    completion, _ = run(lambda: complete_one(config))
    assert completion.endpoint.startswith(first.url)
    first.admin({"error_rate": 1.0, "error_status": 500})
    second.admin({})
    err, _, _ = run(lambda: failure(fleet_config([{"url": second.url, "api_key_env": "SECOND_KEY"}])))
    assert isinstance(err, PermanentError) and err.status == 401
    assert "sk-wrong-key" not in str(err) and "sk-first-key" not in str(err)
