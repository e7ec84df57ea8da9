"""Unit tests for the model-server simulator, over real HTTP on loopback."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests

from jobs.dev import simulator as ms
from jobs.dev.simulator import (
    FaultSettings,
    SimulatorConfig,
    ThreadedSimulator,
)
from jobs.dev.simulator import server as sim_server
from tests.support.tls_certs import make_certs
from tests.support.waiting import wait_until

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def post(sim: ThreadedSimulator, path: str, body: Any = None, timeout: float = 5, **kwargs: Any) -> requests.Response:
    return requests.post(sim.url + path, json=body, timeout=timeout, **kwargs)


def admin(sim: ThreadedSimulator, path: str, body: Any = None) -> requests.Response:
    return requests.post(sim.base_url + path, json=body, timeout=5)


def stats(sim: ThreadedSimulator) -> dict[str, Any]:
    result: dict[str, Any] = requests.get(sim.base_url + "/stats", timeout=5).json()
    return result


async def fire(url: str, count: int, body: dict[str, Any] = CHAT) -> list[tuple[int, dict[str, str]]]:
    """Send ``count`` requests at once; returns (status, headers) in completion order."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=count)) as session:

        async def one() -> tuple[int, dict[str, str]]:
            async with session.post(url + "/chat/completions", json=body) as response:
                await response.read()
                return response.status, dict(response.headers)

        return await asyncio.gather(*(one() for _ in range(count)))


def assert_openai_error(response: requests.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status
    error: dict[str, Any] = response.json()["error"]
    assert {"message", "type", "code"} <= set(error)
    return error


# --------------------------------------------------------------------------- shapes


def test_chat_completion_shape_echoes_prompt(sim: ThreadedSimulator) -> None:
    response = post(sim, "/chat/completions", {**CHAT, "max_tokens": 20, "temperature": 0.2})
    assert response.status_code == 200
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["model"] == "test-model"
    assert data["system_fingerprint"] == "llmstream-simulator"
    assert isinstance(data["id"], str) and isinstance(data["created"], int)
    [choice] = data["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    assert "What is the capital of France?" in choice["message"]["content"]
    usage = data["usage"]
    assert usage["completion_tokens"] == 20
    assert usage["prompt_tokens"] == math.ceil(len("What is the capital of France?") / 4)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_output_is_deterministic(sim: ThreadedSimulator) -> None:
    first = post(sim, "/chat/completions", CHAT).json()["choices"][0]["message"]["content"]
    second = post(sim, "/chat/completions", CHAT).json()["choices"][0]["message"]["content"]
    assert first == second


def test_concurrent_requests_each_get_their_own_answer(make_sim: Callable[..., ThreadedSimulator]) -> None:
    """Requests in flight at once on one endpoint share no state: each answer echoes its own prompt
    and counts its own tokens."""
    sim = make_sim(latency="fixed:100")
    prompts = [f"prompt number {i} " + "x" * i for i in range(24)]

    async def ask_all() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:

            async def ask(prompt: str, tokens: int) -> dict[str, Any]:
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}
                async with session.post(sim.url + "/chat/completions", json=body) as response:
                    assert response.status == 200
                    data: dict[str, Any] = await response.json()
                    return data

            return await asyncio.gather(*(ask(p, 30 + i) for i, p in enumerate(prompts)))

    answers = asyncio.run(ask_all())
    assert stats(sim)["max_in_flight"] > 1
    for i, (prompt, data) in enumerate(zip(prompts, answers, strict=True)):
        assert f"Simulated answer to: {' '.join(prompt[:40].split())}." in data["choices"][0]["message"]["content"]
        assert data["usage"]["prompt_tokens"] == math.ceil(len(prompt) / 4)
        assert data["usage"]["completion_tokens"] == 30 + i


def test_completions_shape(sim: ThreadedSimulator) -> None:
    data = post(sim, "/completions", {"model": "m", "prompt": ["alpha prompt", "beta prompt"], "max_tokens": 16}).json()
    assert data["object"] == "text_completion"
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert "alpha prompt" in data["choices"][0]["text"] and "beta prompt" in data["choices"][1]["text"]
    assert all(c["finish_reason"] == "stop" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 32


def test_embeddings_shape_and_determinism(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(embedding_dim=24)
    data = post(sim, "/embeddings", {"model": "e", "input": ["one", "two", "one"]}).json()
    assert data["object"] == "list"
    vectors = [item["embedding"] for item in data["data"]]
    assert [item["index"] for item in data["data"]] == [0, 1, 2]
    assert all(item["object"] == "embedding" and len(item["embedding"]) == 24 for item in data["data"])
    assert vectors[0] == vectors[2] != vectors[1]
    assert math.isclose(sum(v * v for v in vectors[0]), 1.0, rel_tol=1e-3)
    assert data["usage"]["prompt_tokens"] == data["usage"]["total_tokens"] == 3
    single = post(sim, "/embeddings", {"model": "e", "input": "one", "dimensions": 8}).json()
    assert len(single["data"][0]["embedding"]) == 8


def test_models_health_and_simulator_flag(sim: ThreadedSimulator) -> None:
    models = requests.get(sim.url + "/models", timeout=5).json()
    assert models["simulator"] is True
    assert [m["id"] for m in models["data"]] == ["llmstream-sim"]
    assert requests.get(sim.base_url + "/health", timeout=5).json()["status"] == "ok"
    assert stats(sim)["simulator"] is True


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/chat/completions", {"model": "m"}),
        ("/chat/completions", {"model": "m", "messages": []}),
        ("/chat/completions", {**CHAT, "max_tokens": 0}),
        ("/completions", {"model": "m"}),
        ("/embeddings", {"model": "m"}),
        ("/embeddings", {"model": "m", "input": []}),
        ("/embeddings", [1, 2]),
    ],
)
def test_missing_or_invalid_fields_are_400(sim: ThreadedSimulator, path: str, body: Any) -> None:
    assert_openai_error(post(sim, path, body), 400)


def test_bad_json_and_unknown_path(sim: ThreadedSimulator) -> None:
    response = requests.post(sim.url + "/chat/completions", data=b"{not json", timeout=5,
                             headers={"Content-Type": "application/json"})
    assert assert_openai_error(response, 400)["type"] == "invalid_request_error"
    assert assert_openai_error(post(sim, "/nope", CHAT), 404)["code"] == "unknown_url"
    assert requests.get(sim.url + "/chat/completions", timeout=5).status_code == 405


def test_api_key_required_when_set(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(api_key="sekrit")
    assert assert_openai_error(post(sim, "/chat/completions", CHAT), 401)["code"] == "invalid_api_key"
    assert post(sim, "/chat/completions", CHAT, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert post(sim, "/chat/completions", CHAT, headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert requests.get(sim.base_url + "/health", timeout=5).status_code == 200
    assert "sekrit" not in repr(SimulatorConfig(api_key="sekrit"))


def test_required_headers_are_checked_and_never_shown(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(required_headers=(("X-Gateway-Token", "gw-sekrit"),))
    refused = assert_openai_error(post(sim, "/chat/completions", CHAT, headers={"X-Gateway-Token": "other"}), 401)
    assert refused["code"] == "missing_header" and "X-Gateway-Token" in refused["message"]
    assert post(sim, "/chat/completions", CHAT, headers={"X-Gateway-Token": "gw-sekrit"}).status_code == 200
    view = requests.get(sim.base_url + "/admin/config", timeout=5).json()
    assert view["required_headers"] == ["X-Gateway-Token"] and "gw-sekrit" not in repr(sim.server.config)


def test_tls_settings_are_checked(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    with pytest.raises(ValueError, match="go together"):
        SimulatorConfig(tls_cert=certs.server_cert)
    with pytest.raises(ValueError, match="tls_client_ca needs tls_cert"):
        SimulatorConfig(tls_client_ca=certs.ca)
    with pytest.raises(ValueError, match="does not exist"):
        SimulatorConfig(tls_cert=str(tmp_path / "missing.pem"), tls_key=certs.server_key)
    with pytest.raises(ValueError, match="not a usable certificate and key"):
        SimulatorConfig(tls_cert=certs.server_cert, tls_key=certs.client_key).ssl_context()


def test_spawned_simulator_serves_https_and_requires_client_certificates(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    client_cert = (certs.client_cert, certs.client_key)
    handle = ms.spawn(["--tls-cert", certs.server_cert, "--tls-key", certs.server_key, "--tls-client-ca", certs.ca],
                      ca_file=certs.ca, client_cert=client_cert)
    try:
        assert handle.url.startswith("https://127.0.0.1:")
        answered = requests.post(handle.url + "/chat/completions", json=CHAT, timeout=5, verify=certs.ca,
                                 cert=client_cert)
        assert answered.status_code == 200
        refused = requests.post(handle.url + "/chat/completions", json=CHAT, timeout=5, verify=certs.ca)
        assert assert_openai_error(refused, 400)["code"] == "client_certificate_required"
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(handle.base_url + "/health", timeout=5)  # the system's CAs do not trust it
        assert handle.stats()["served"] == 1
    finally:
        handle.stop()
    assert handle.process.returncode == 0


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIM_TEST_KEY", "from-env")
    parser = argparse.ArgumentParser()
    ms.add_arguments(parser)
    config = ms.config_from_args(parser.parse_args(["--api-key-env", "SIM_TEST_KEY", "--concurrency", "3"]))
    assert config.api_key == "from-env" and config.concurrency == 3


# --------------------------------------------------------------------------- latency


def test_fixed_latency_is_honoured(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(latency="fixed:150")
    with requests.Session() as session:
        session.get(sim.base_url + "/health", timeout=5)
        start = time.perf_counter()
        assert session.post(sim.url + "/chat/completions", json=CHAT, timeout=5).status_code == 200
        elapsed = time.perf_counter() - start
    assert 0.14 <= elapsed < 1.0


def test_per_token_latency_adds_up(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(per_token_ms=5)
    start = time.perf_counter()
    post(sim, "/chat/completions", {**CHAT, "max_tokens": 40})
    assert 0.19 <= time.perf_counter() - start < 1.0


def test_lognormal_sampling_matches_median_and_p99() -> None:
    model = ms.parse_latency("lognormal:100:1000")
    rng = random.Random(7)
    samples = sorted(model.sample_ms(rng) for _ in range(40_000))
    assert statistics.median(samples) == pytest.approx(100, rel=0.05)
    assert samples[int(0.99 * len(samples))] == pytest.approx(1000, rel=0.12)


@pytest.mark.parametrize("spec", ["fixed:-1", "lognormal:100:50", "lognormal:0:10", "gauss:3", "fast"])
def test_bad_latency_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        ms.parse_latency(spec)


def test_instant_latency_specs() -> None:
    assert ms.parse_latency("0").instant and ms.parse_latency("instant").instant
    assert ms.parse_latency("25") == ms.LatencyModel("fixed", 25, 25)


# --------------------------------------------------------------------------- limits


def test_concurrency_limit_queues_and_caps_in_flight(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(latency="fixed:100", concurrency=5)
    sim.reset_stats()
    start = time.perf_counter()
    results = asyncio.run(fire(sim.url, 50))
    elapsed = time.perf_counter() - start
    assert [status for status, _ in results] == [200] * 50
    snapshot = sim.stats()
    assert snapshot["max_in_flight"] == 5
    assert snapshot["served"] == 50 and snapshot["in_flight"] == 0 and snapshot["queued"] == 0
    # How many wait at once depends on how fast the client sends (a busy machine sends slower);
    # that some waited, and that 50 calls at 5 at a time took at least ten 100 ms rounds, does not.
    assert snapshot["max_queued"] >= 1
    assert 0 < snapshot["mean_in_flight"] <= 5.0
    assert elapsed >= 0.95


def test_reject_over_limit_answers_429(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(latency="fixed:300", concurrency=2, reject_over_limit=True, retry_after_s=3)
    results = asyncio.run(fire(sim.url, 10))
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 200] + [429] * 8
    assert all(headers["Retry-After"] == "3" for status, headers in results if status == 429)
    assert sim.stats()["rejected"] == 8 and sim.stats()["max_in_flight"] == 2


def test_rpm_limit_answers_429_with_ratelimit_headers(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(rpm=3)
    ok = [post(sim, "/chat/completions", CHAT) for _ in range(3)]
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in ok] == ["2", "1", "0"]
    limited = post(sim, "/chat/completions", CHAT)
    assert_openai_error(limited, 429)
    assert limited.headers["Retry-After"] == "20"
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    assert limited.headers["x-ratelimit-reset-requests"].endswith("s")
    assert sim.stats()["rate_limited"] == 1


def test_tpm_limit_counts_prompt_and_max_tokens(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(tpm=100)
    body = {**CHAT, "max_tokens": 40}
    first = post(sim, "/chat/completions", body)
    assert first.status_code == 200
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 100 - 8 - 40
    assert post(sim, "/chat/completions", body).status_code == 200
    limited = post(sim, "/chat/completions", body)
    assert limited.status_code == 429
    assert int(limited.headers["Retry-After"]) >= 1 and "x-ratelimit-reset-tokens" in limited.headers


def test_format_reset_like_openai() -> None:
    assert ms.format_reset(0.25) == "250ms"
    assert ms.format_reset(1.0) == "1s"
    assert ms.format_reset(1.5) == "1.5s"
    assert ms.format_reset(360) == "6m0s"


# --------------------------------------------------------------------------- faults


class ServerClock:
    """The simulator's monotonic clock, moved on by `advance` without waiting: a fault scenario's
    ``until_s`` passes when the test says, so the calls inside it never race its expiry on a busy
    machine. It stands in for the ``time`` module of `jobs.dev.simulator.server` only (the thread's
    event loop keeps the real clock); everything else it passes to ``time``."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def advance(self, seconds: float) -> None:
        self.offset_s += seconds

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_s

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def server_clock(monkeypatch: pytest.MonkeyPatch) -> ServerClock:
    clock = ServerClock()
    monkeypatch.setattr(sim_server, "time", clock)
    return clock


def test_error_rate_fault_via_admin_reverts_after_until_s(sim: ThreadedSimulator, server_clock: ServerClock) -> None:
    view = admin(sim, "/admin/faults", {"error_rate": 1.0, "until_s": 60}).json()
    assert view["error_rate"] == 1.0 and 0 < view["until_remaining_s"] <= 60
    responses = [post(sim, "/chat/completions", CHAT) for _ in range(5)]
    assert all(r.status_code == 500 for r in responses)
    assert_openai_error(responses[0], 500)
    assert sim.stats()["errors"] == 5
    server_clock.advance(59)
    assert post(sim, "/chat/completions", CHAT).status_code == 500  # not yet: 59 of 60 s
    server_clock.advance(1)
    assert post(sim, "/chat/completions", CHAT).status_code == 200
    assert requests.get(sim.base_url + "/admin/faults", timeout=5).json()["error_rate"] == 0.0


def test_custom_error_status_and_rate_limit_fault(sim: ThreadedSimulator) -> None:
    admin(sim, "/admin/faults", {"error_rate": 1, "error_status": 503})
    assert post(sim, "/chat/completions", CHAT).status_code == 503
    admin(sim, "/admin/faults", {"rate_limit_rate": 1, "retry_after_s": 2})
    limited = post(sim, "/chat/completions", CHAT)
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "2"
    assert sim.stats()["rejected"] == 1
    admin(sim, "/admin/faults", {})
    assert post(sim, "/chat/completions", CHAT).status_code == 200


def test_bad_fault_bodies_are_400(sim: ThreadedSimulator) -> None:
    assert admin(sim, "/admin/faults", {"error_rate": 2}).status_code == 400
    assert admin(sim, "/admin/faults", {"eror_rate": 0.1}).status_code == 400
    assert admin(sim, "/admin/faults", {"error_rate": 0.6, "hang_rate": 0.6}).status_code == 400
    assert admin(sim, "/admin/faults", {"error_rate": "x"}).status_code == 400


def test_reset_fault_drops_connection(sim: ThreadedSimulator) -> None:
    sim.admin({"reset_rate": 1.0})
    with pytest.raises(requests.ConnectionError):
        post(sim, "/chat/completions", CHAT)
    assert sim.stats()["resets"] == 1


def test_hang_fault_holds_until_client_gives_up(sim: ThreadedSimulator) -> None:
    sim.admin({"hang_rate": 1.0})
    with pytest.raises(requests.ReadTimeout):
        requests.post(sim.url + "/chat/completions", json=CHAT, timeout=0.3)
    assert sim.stats()["hangs"] == 1
    wait_until(lambda: sim.stats()["open_connections"] == 0, timeout=30, interval=0.02,
               message="the hung connection to be closed")
    assert sim.stats()["open_connections"] == 0


def test_client_disconnect_frees_concurrency_slot(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(latency="fixed:5000", concurrency=1)
    with pytest.raises(requests.ReadTimeout):
        post(sim, "/chat/completions", CHAT, timeout=0.2)
    wait_until(lambda: sim.stats()["in_flight"] == 0, timeout=30, interval=0.02,
               message="the slot of the disconnected call to be freed")
    assert sim.stats()["in_flight"] == 0 and sim.stats()["cancelled"] == 1


def listening_again(sim: ThreadedSimulator, timeout: float = 30) -> None:
    """Until the simulator answers ``/health`` after an outage: its listener reopens on the event
    loop some time after ``down_for_s``, sooner or later with the machine's load."""
    wait_until(lambda: requests.get(sim.base_url + "/health", timeout=5).status_code == 200, timeout, interval=0.05,
               message="the simulator to listen again", ignoring=(requests.ConnectionError,))


def test_down_for_s_refuses_connections_then_recovers(sim: ThreadedSimulator) -> None:
    """Down for 2 s: the outage is the event loop's timer (real time), so it lasts long enough for
    two refused connections on a busy machine, and the recovery is awaited, not slept through."""
    with requests.Session() as session:
        assert session.post(sim.url + "/chat/completions", json=CHAT, timeout=5).status_code == 200
        response = requests.post(sim.base_url + "/admin/faults", json={"down_for_s": 2}, timeout=5)
        assert response.status_code == 200 and 0 < response.json()["down_remaining_s"] <= 2
        with pytest.raises(requests.ConnectionError):
            session.post(sim.url + "/chat/completions", json=CHAT, timeout=5)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", sim.port), timeout=1).close()
    listening_again(sim)
    assert post(sim, "/chat/completions", CHAT).status_code == 200


def test_down_only_body_keeps_fault_scenario(sim: ThreadedSimulator) -> None:
    sim.admin({"rate_limit_rate": 1.0})
    view = sim.admin({"down_for_s": 0.3})
    assert view["rate_limit_rate"] == 1.0 and view["down_remaining_s"] > 0
    listening_again(sim)
    assert post(sim, "/chat/completions", CHAT).status_code == 429


def test_faults_from_config_apply_at_start(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(faults=FaultSettings(error_rate=1.0, error_status=502))
    assert post(sim, "/chat/completions", CHAT).status_code == 502
    assert stats(sim)["faults"]["error_status"] == 502


# --------------------------------------------------------------------------- stats, admin, HTTP


def test_stats_count_and_reset(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(concurrency=4)
    for _ in range(3):
        post(sim, "/chat/completions", CHAT)
    post(sim, "/embeddings", {"input": "x"})
    post(sim, "/completions", {})
    snapshot = stats(sim)
    assert snapshot["served"] == 4 and snapshot["requests_total"] == 5 and snapshot["bad_requests"] == 1
    assert snapshot["concurrency_limit"] == 4 and snapshot["uptime_s"] >= 0
    for key in ("in_flight", "max_in_flight", "rejected", "errors", "queued", "mean_in_flight", "faults"):
        assert key in snapshot
    reset = admin(sim, "/stats/reset").json()
    assert reset["served"] == 0 and reset["requests_total"] == 0 and reset["concurrency_limit"] == 4


def test_admin_config_changes_latency_at_runtime(sim: ThreadedSimulator) -> None:
    updated = admin(sim, "/admin/config", {"latency": "fixed:120", "per-token-ms": 0}).json()
    assert updated["latency"] == "fixed:120" and "api_key" not in updated
    start = time.perf_counter()
    post(sim, "/chat/completions", CHAT)
    assert time.perf_counter() - start >= 0.11
    assert admin(sim, "/admin/config", {"latency": "sometimes"}).status_code == 400
    assert admin(sim, "/admin/config", {"port": 1}).status_code == 400


def raw_exchange(port: int, payload: bytes, responses: int) -> list[bytes]:
    """Send raw bytes and read ``responses`` HTTP responses, to test what clients rarely do."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        data = b""
        found: list[bytes] = []
        while len(found) < responses:
            chunk = sock.recv(65536)
            assert chunk, "server closed early"
            data += chunk
            while True:
                head_end = data.find(b"\r\n\r\n")
                if head_end < 0:
                    break
                head = data[:head_end].decode()
                length = int(next(line.split(":")[1] for line in head.split("\r\n")
                                  if line.lower().startswith("content-length")))
                if len(data) < head_end + 4 + length:
                    break
                found.append(data[: head_end + 4 + length])
                data = data[head_end + 4 + length:]
        return found


def test_pipelined_requests_answered_in_order(make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = make_sim(latency="fixed:50")
    body = b'{"messages":[{"role":"user","content":"first"}]}'
    chunked = b'{"messages":[{"role":"user",' + b'"content":"second"}]}'
    payload = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, chunked[:10], len(chunked) - 10, chunked[10:])
    )
    first, health, second = raw_exchange(sim.port, payload, 3)
    assert b"Simulated answer to: first" in first
    assert b'"status":"ok"' in health
    assert b"Simulated answer to: second" in second


def test_expect_continue_is_answered(sim: ThreadedSimulator) -> None:
    body = b'{"prompt":"continued"}'
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        data = b""
        while b"continued" not in data:
            chunk = sock.recv(65536)
            assert chunk
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK")


def test_http10_and_connection_close(sim: ThreadedSimulator) -> None:
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and b"Connection: close" in data


def test_help_says_simulator() -> None:
    assert "SIMULATOR" in ms.build_parser().format_help()
    assert "SIMULATOR" in (ms.__doc__ or "")


def test_spawn_runs_module_as_subprocess() -> None:
    handle = ms.spawn(["--latency", "0", "--seed", "1"])
    try:
        assert handle.url.endswith("/v1")
        assert requests.post(handle.url + "/chat/completions", json=CHAT, timeout=5).status_code == 200
        assert handle.admin({"error_rate": 1.0})["error_rate"] == 1.0
        assert requests.post(handle.url + "/chat/completions", json=CHAT, timeout=5).status_code == 500
        assert handle.stats()["served"] == 1
    finally:
        final = handle.stop()
    assert handle.process.returncode == 0
    assert final is not None and final["errors"] == 1


# ------------------------------------------------------------------ a fleet of endpoints in one process


def _chat(url: str) -> requests.Response:
    return requests.post(url + "/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                         timeout=5)


def test_a_spawned_fleet_serves_each_endpoint_and_kills_revives_and_faults_each() -> None:
    with ms.spawn_fleet([4, 2, 1], ["--latency", "0"]) as fleet:
        assert len(fleet.urls) == 3 and len(set(fleet.urls)) == 3
        assert [s["concurrency_limit"] for s in fleet.endpoint_stats()] == [4, 2, 1]
        assert all(_chat(url).status_code == 200 for url in fleet.urls)

        fleet.kill(0)  # a dead replica: connection refused, the others unaffected
        with pytest.raises(requests.ConnectionError):
            _chat(fleet.urls[0])
        assert _chat(fleet.urls[1]).status_code == 200
        fleet.revive(0)
        wait_until(lambda: _chat(fleet.urls[0]).status_code == 200, timeout=30, interval=0.05,
                   message="the revived endpoint answers again")

        fleet.faults(1, {"error_rate": 1.0})
        assert _chat(fleet.urls[1]).status_code == 500
        fleet.faults(2, {"rate_limit_rate": 1.0})
        assert _chat(fleet.urls[2]).status_code == 429
        fleet.faults(1, {})
        assert _chat(fleet.urls[1]).status_code == 200
        stats = fleet.endpoint_stats()
        assert [s["served"] for s in stats] == [2, 3, 1] and stats[1]["errors"] == 1 and stats[2]["rejected"] == 1

        bad = requests.post(fleet.control_url + "/fleet/0", json={"state": "sideways"}, timeout=5)
        assert bad.status_code == 400 and "state" in bad.json()["error"]["message"]
        assert requests.post(fleet.control_url + "/fleet/9", json={"state": "up"}, timeout=5).status_code == 400


def test_fleet_spec_is_checked() -> None:
    from jobs.dev.simulator.fleet import parse_fleet

    assert parse_fleet("16, 8,4") == [16, 8, 4]
    for bad in ("", "a,b", "4,-1"):
        with pytest.raises(ValueError):
            parse_fleet(bad)
