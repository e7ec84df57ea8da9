"""Bounded reads of what a model server answers (`udfs/inference/transport.py`), over real HTTP on
loopback against `FloodServer`, which answers as large as asked or without end and counts the
body bytes it managed to send.

What a user sees is asserted: an answer up to `model.max_response_bytes` is a completion, one
byte more is `response_too_large` after the attempts `retry.*` allows, each on a connection of
its own (a half-read one is never reused); an error body is quoted, capped, whatever its size;
in a fleet, the flooding endpoint's circuit opens and the records are answered by another.
That the worker never held a whole flood shows in the server's count: near the bound plus the
socket buffers, far below what it would have sent.
"""

from __future__ import annotations

import gzip
from typing import Any

import pytest

from jobs.dev.simulator import ThreadedSimulator
from tests.support.calls import complete_one, failure, run
from tests.support.configs import job_config, request
from tests.support.servers import Flood, FloodServer
from tests.support.waiting import wait_until
from udfs.config import JobConfig
from udfs.errors import ResponseTooLarge, RetryableError
from udfs.inference.client import InferenceClient
from udfs.inference.transport import MAX_DETAIL_CHARS
from udfs.records import Completion

LIMIT = 1_048_576
HUGE = 512 * 1_048_576
HELD = 64 * 1_048_576
"""More than a reader stopped at `LIMIT` lets the server push (the bound, a chunk, the socket
buffers of both ends), far less than `HUGE`: a server count over it means the body was read on."""
ATTEMPTS = 3


def config(server: FloodServer) -> JobConfig:
    return job_config(server.url + "/v1", model={"max_response_bytes": LIMIT}, retry={"max_attempts": ATTEMPTS})


def chat_answer(size: int) -> bytes:
    """A chat completion of exactly `size` bytes, its content padded with `a`s."""
    head = b'{"model":"m","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"'
    tail = b'"}}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


def answers_sent(server: FloodServer, count: int) -> list[int]:
    """The server's byte counts once it has finished `count` answers (it counts after the client left)."""
    wait_until(lambda: len(server.sent) >= count, timeout=60, interval=0.05, message=f"{count} answers sent")
    return server.sent


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_an_answer_of_exactly_the_bound_is_a_completion(framing: str) -> None:
    body = chat_answer(LIMIT)
    with FloodServer(Flood(body=body, size=len(body), framing=framing)) as server:  # type: ignore[arg-type]
        completion, _ = run(lambda: complete_one(config(server)))
    assert completion.attempts == 1
    assert set(completion.output) == {"a"} and len(completion.output) > LIMIT - 200


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_one_byte_over_the_bound_is_response_too_large_after_every_attempt(framing: str) -> None:
    body = chat_answer(LIMIT + 1)
    with FloodServer(Flood(body=body, size=len(body), framing=framing)) as server:  # type: ignore[arg-type]
        err, _, client = run(lambda: failure(config(server)))
        answers_sent(server, ATTEMPTS)
    assert type(err) is ResponseTooLarge and err.reason == "response_too_large"
    assert err.status == 200 and err.attempts == ATTEMPTS and client.metrics.requests.value == ATTEMPTS
    assert f"model.max_response_bytes ({LIMIT})" in err.detail
    assert ("Content-Length" in err.detail) == (framing == "length")


@pytest.mark.parametrize(("framing", "size"), [
    ("length", HUGE),    # refused by its Content-Length, unread
    ("chunked", HUGE),
    ("chunked", None),   # never ends
    ("close", None),     # never ends, no length, no chunks: the body is all until the connection closes
], ids=["content-length", "chunked", "chunked-endless", "close-delimited-endless"])
def test_a_flood_is_cut_at_the_bound_and_its_connection_dropped(framing: str, size: int | None) -> None:
    with FloodServer(Flood(size=size, framing=framing)) as server:  # type: ignore[arg-type]
        err, _, _ = run(lambda: failure(config(server)))
        sent = answers_sent(server, ATTEMPTS)
    assert type(err) is ResponseTooLarge and err.reason == "response_too_large" and err.attempts == ATTEMPTS
    assert len(sent) == ATTEMPTS and max(sent) < HELD, f"the server sent {sent} bytes per answer"
    assert server.connections == ATTEMPTS, "a half-read connection went back to the pool"


def test_a_compressed_answer_is_bounded_by_what_it_inflates_to() -> None:
    """A small gzip body (64 MiB of zeros) under its Content-Length: the bound counts the bytes it
    inflates to, so it is refused as it is read instead of inflating whole."""
    bomb = gzip.compress(b"0" * HELD)
    flood = Flood(body=bomb, size=len(bomb), framing="length", headers=(("Content-Encoding", "gzip"),))
    with FloodServer(flood) as server:
        err, _, _ = run(lambda: failure(config(server)))
    assert len(bomb) < LIMIT
    assert type(err) is ResponseTooLarge and err.attempts == ATTEMPTS
    assert "while it was read" in err.detail


@pytest.mark.parametrize(("framing", "size"), [("length", HUGE), ("chunked", None)],
                         ids=["content-length", "chunked-endless"])
def test_a_huge_error_body_is_quoted_capped_and_not_read_on(framing: str, size: int | None) -> None:
    flood = Flood(status=502, body=b"upstream exploded: ", size=size, framing=framing,  # type: ignore[arg-type]
                  content_type="text/plain")
    with FloodServer(flood) as server:
        err, _, _ = run(lambda: failure(config(server)))
        sent = answers_sent(server, ATTEMPTS)
    assert type(err) is RetryableError and err.reason == "inference_retries_exhausted"
    assert err.status == 502 and err.attempts == ATTEMPTS
    assert err.detail.startswith("HTTP 502: upstream exploded: xxx")
    assert len(err.detail) <= len("HTTP 502: ") + MAX_DETAIL_CHARS
    assert len(sent) == ATTEMPTS and max(sent) < HELD, f"the server sent {sent} bytes per answer"
    assert server.connections == ATTEMPTS


def test_in_a_fleet_a_flooding_endpoint_opens_its_circuit_and_the_records_are_answered_elsewhere(
        sim: ThreadedSimulator) -> None:
    with FloodServer(Flood(size=None, framing="chunked")) as flooding:
        config = job_config("http://unused", model={
            "endpoint": None, "max_response_bytes": LIMIT,
            "endpoints": [{"url": flooding.url + "/v1", "weight": 10}, {"url": sim.url}],
            "circuit": {"failures": 3, "cooldown_s": 30, "max_cooldown_s": 60}})

        async def calls() -> tuple[list[Completion], dict[str, Any]]:
            async with InferenceClient(config) as client:
                done = [await client.complete(request()) for _ in range(20)]
                return done, client.metrics.snapshot()

        completions, snapshot = run(calls)
        sent = answers_sent(flooding, 3)
    assert all(c.endpoint.startswith(sim.url) for c in completions)
    assert len(sent) == 3 and max(sent) < HELD, "the circuit opens after 3 answers cut at the bound"
    assert snapshot["endpoints"][f"127_0_0_1_{flooding.url.rsplit(':', 1)[1]}"]["circuit"] == 2
