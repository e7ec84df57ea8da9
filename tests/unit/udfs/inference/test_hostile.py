"""The simulator's hostile answers (`jobs/dev/simulator/hostile.py`) against llmstream's real client
(`InferenceClient`) and inference stage (`Harness`, tests/support/fake_flink.py), over loopback HTTP.

For every kind and API, what a user sees is asserted: the result, or the error its dead letter is
made of (reason, attempts, last status), as docs/operations.md ("Bad input from every side")
documents it; a test keeps that table and `OUTCOMES` the same. Then every kind again with a
canary API key that each hostile answer quotes back where it has room for text: the key is in
no dead letter, no exception's text and no log record, whole or in part. The Retry-After kinds
pause the endpoint no longer than `retry.max_retry_after_s`; a certificate that changes is a
`tls_error` at once; in a fleet an endpoint whose answers fail is avoided; and the stage, fed
every kind at a rate, ends each record once, never as an `internal_error`.

Timeouts here are short only where the hostile answer never completes (a trickle), so the
outcome does not depend on the machine's speed: a slow machine only takes longer to get there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from jobs.dev.simulator import (
    FaultSettings,
    SimulatorConfig,
    ThreadedSimulator,
    build_parser,
    config_from_args,
)
from jobs.dev.simulator.config import ANSWER_KINDS, KINDS, parse_kinds
from jobs.dev.simulator.fleet import serve_fleet
from tests.support.calls import failure, run
from tests.support.configs import job_config, request
from tests.support.fake_flink import Harness, record
from tests.support.servers import serve_app
from tests.support.tls_certs import make_certs
from tests.support.waiting import wait_until
from udfs.config import JobConfig
from udfs.errors import InferenceError, TlsError, UnsupportedResponse
from udfs.inference import responses
from udfs.inference.client import InferenceClient
from udfs.inference.transport import MAX_DETAIL_CHARS
from udfs.records import Completion

ROOT = Path(__file__).resolve().parents[4]
ATTEMPTS = 2
TRICKLE_TIMEOUT_S = 0.5
"""The per-attempt timeout where an answer trickles: it never completes, so any timeout ends it."""
CAP_S = 0.2
"""`retry.max_retry_after_s` here."""
DIM = 16
"""The simulator's embedding length, and `model.embedding_dim` where it is set."""
BATCH = 3


@dataclass(frozen=True)
class Expect:
    """What a record gets: a result (`reason` None) or a dead letter with this reason, after
    `attempts`, the last answer's `status` (None: no answer)."""

    reason: str | None
    attempts: int = 1
    status: int | None = None


RESULT = Expect(None)
UNSUPPORTED = Expect("unsupported_response", 1, 200)
RETRIED = Expect("inference_retries_exhausted", ATTEMPTS, None)

CHAT: dict[str, Expect] = {
    "huge-body": Expect("response_too_large", ATTEMPTS, 200),
    "endless-body": Expect("response_too_large", ATTEMPTS, 200),
    "trickle-headers": RETRIED,
    "trickle-body": RETRIED,
    "header-flood": RETRIED,
    "reset-mid-body": RETRIED,
    "redirect": Expect("inference_rejected", 1, 307),
    "invalid-utf8": UNSUPPORTED,
    "not-json": UNSUPPORTED,
    "bad-charset": Expect("inference_retries_exhausted", ATTEMPTS, 500),
    "deep-json-error": Expect("inference_retries_exhausted", ATTEMPTS, 500),
    "no-choices": UNSUPPORTED,
    "empty-choices": UNSUPPORTED,
    "null-content": UNSUPPORTED,
    "number-content": UNSUPPORTED,
    "wrong-dimension": RESULT,
    "missing-index": RESULT,
    "repeated-index": RESULT,
    "index-out-of-range": RESULT,
    "absurd-usage": RESULT,
    "error-in-200": Expect("inference_retries_exhausted", ATTEMPTS, 200),
    "retry-after-zero": Expect("inference_retries_exhausted", ATTEMPTS, 429),
    "retry-after-negative": Expect("inference_retries_exhausted", ATTEMPTS, 429),
    "retry-after-huge": Expect("inference_retries_exhausted", ATTEMPTS, 429),
    "retry-after-past-date": Expect("inference_retries_exhausted", ATTEMPTS, 429),
}
EMBEDDINGS: dict[str, Expect] = {
    **CHAT,
    "wrong-dimension": UNSUPPORTED,
    "missing-index": UNSUPPORTED,
    "repeated-index": UNSUPPORTED,
    "index-out-of-range": UNSUPPORTED,
}
OUTCOMES: dict[str, dict[str, Expect]] = {
    "chat": CHAT,
    "completions": CHAT,
    # one input per request, model.embedding_dim set; its one item without an index is as a
    # server's that sends no index at all: taken in order
    "embeddings": {**EMBEDDINGS, "missing-index": RESULT},
    "embeddings-batch": EMBEDDINGS,  # BATCH inputs per request, no model.embedding_dim
}
TLS_OUTCOME = Expect("tls_error", 1, None)
DOCUMENTED_REASONS = {e.reason for table in OUTCOMES.values() for e in table.values()} | {TLS_OUTCOME.reason}


def config(url: str, api: str, kind: str = "", **model: Any) -> JobConfig:
    """The client's config for `api` at `url`; a short attempt timeout for the kinds that trickle."""
    sections: dict[str, Any] = {"max_response_bytes": 262_144, **model}
    if api != "chat":
        sections.update(api=api.split("-")[0], max_tokens=None)
    if api == "embeddings":
        sections["embedding_dim"] = DIM
    if api == "embeddings-batch":
        sections["batch"] = {"max_size": BATCH, "max_wait_ms": 1000}
    timeout = TRICKLE_TIMEOUT_S if kind.startswith("trickle") else 10.0
    return job_config(url, model=sections, async_={"request_timeout_s": timeout, "record_deadline_s": 30.0},
                      retry={"max_attempts": ATTEMPTS, "max_retry_after_s": CAP_S})


def hostile_sim(make_sim: Callable[..., ThreadedSimulator], kinds: str, rate: float = 1.0,
                **settings: Any) -> ThreadedSimulator:
    return make_sim(faults=FaultSettings(hostile=kinds, hostile_rate=rate), hang_max_s=60.0, **settings)


async def outcomes(config: JobConfig, count: int) -> tuple[list[Completion | BaseException], InferenceClient]:
    """`count` records at once through one client (a batch, when the config batches)."""
    async with InferenceClient(config) as client:
        done = await asyncio.gather(*(client.complete(request(f"question {i}", id=f"r-{i}")) for i in range(count)),
                                    return_exceptions=True)
        return list(done), client


def assert_outcome(got: Completion | BaseException, expected: Expect, api: str) -> None:
    if expected.reason is None:
        assert isinstance(got, Completion), got
        if api.startswith("embeddings"):
            assert isinstance(got.output, list) and len(got.output) == DIM
        else:
            assert got.output.startswith("Simulated answer to: question")
        assert 0 < got.prompt_tokens < 1000 and 0 <= got.completion_tokens < 1000  # absurd-usage: estimated
        return
    assert isinstance(got, InferenceError), got
    assert (got.reason, got.attempts, got.status) == (expected.reason, expected.attempts, expected.status), got.detail
    # what the server said is quoted capped: its message, and a redirect's Location too
    assert len(got.detail) <= 2 * MAX_DETAIL_CHARS + 100


# ------------------------------------------------------------------ every kind, every API


@pytest.mark.parametrize("kind", ANSWER_KINDS)
@pytest.mark.parametrize("api", OUTCOMES)
def test_a_hostile_answer_ends_as_documented(api: str, kind: str, make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = hostile_sim(make_sim, kind)
    count = BATCH if api == "embeddings-batch" else 1
    done, _ = run(lambda: outcomes(config(sim.url, api, kind), count))
    for got in done:
        assert_outcome(got, OUTCOMES[api][kind], api)
    assert sim.stats()["hostile_kinds"].get(kind, 0) >= 1
    # the client closed its connections, and the simulator let go of every hostile answer's
    wait_until(lambda: sim.stats()["open_connections"] == 0, timeout=30, interval=0.05,
               message="the simulator's connections closed")


def test_without_model_embedding_dim_a_lone_vector_of_any_length_is_taken(
        make_sim: Callable[..., ThreadedSimulator]) -> None:
    """Only `model.embedding_dim` says what one vector's length must be; a batch's must agree."""
    sim = hostile_sim(make_sim, "wrong-dimension")
    cfg = job_config(sim.url, model={"api": "embeddings", "max_tokens": None})
    [got], _ = run(lambda: outcomes(cfg, 1))
    assert isinstance(got, Completion) and len(got.output) == DIM + 1


@pytest.mark.parametrize("kind", [k for k in ANSWER_KINDS if k.startswith("retry-after-")])
def test_a_retry_after_never_pauses_the_endpoint_past_its_cap(kind: str, make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = hostile_sim(make_sim, kind)
    started = time.monotonic()
    err, _, client = run(lambda: failure(config(sim.url, "chat", kind)))
    paused_until = client.fleet.endpoints[0].paused_until
    assert err.reason == "inference_retries_exhausted" and getattr(err, "attempts", 0) == ATTEMPTS
    if kind == "retry-after-huge":  # 10^9 s asked, the cap honoured: the second attempt waited for it, no longer
        assert started < paused_until <= time.monotonic() + CAP_S
        assert time.monotonic() - started >= CAP_S
    else:  # 0, negative, a date in the past: no pause at all (the retry's backoff still applies)
        assert paused_until == 0.0


def test_a_certificate_that_changes_is_a_tls_error_at_once(tmp_path: Path,
                                                           make_sim: Callable[..., ThreadedSimulator]) -> None:
    certs = make_certs(tmp_path)
    sim = make_sim(tls_cert=certs.server_cert, tls_key=certs.server_key, hostile_tls_cert=certs.other_server_cert,
                   hostile_tls_key=certs.other_server_key)
    cfg = config(sim.url, "chat", tls={"ca_file": certs.ca})
    [answered], _ = run(lambda: outcomes(cfg, 1))
    assert isinstance(answered, Completion)
    sim.admin({"hostile": "tls-cert-change"})  # the next handshake presents the other CA's certificate
    err, _, _ = run(lambda: failure(cfg))
    assert type(err) is TlsError and (err.reason, err.attempts) == (TLS_OUTCOME.reason, TLS_OUTCOME.attempts)
    assert "certificate" in err.detail and "model.tls.ca_file" in err.detail
    assert sim.stats()["hostile_kinds"] == {"tls-cert-change": 1}


FAILING = "error-in-200,reset-mid-body,huge-body,bad-charset,header-flood"
"""Kinds whose answer is a failure of the endpoint (statuses.py: FAILURE), not of the request."""


def test_in_a_fleet_an_endpoint_whose_answers_fail_opens_its_circuit_and_the_records_go_elsewhere(
        make_sim: Callable[..., ThreadedSimulator]) -> None:
    hostile, healthy = hostile_sim(make_sim, FAILING), make_sim()
    cfg = job_config("http://unused", model={
        "endpoint": None, "max_response_bytes": 262_144,
        "endpoints": [{"url": hostile.url, "weight": 10}, {"url": healthy.url}],
        "circuit": {"failures": 3, "cooldown_s": 60, "max_cooldown_s": 60}})

    async def calls() -> tuple[list[Completion], dict[str, Any]]:
        async with InferenceClient(cfg) as client:
            return [await client.complete(request()) for _ in range(12)], client.metrics.snapshot()

    completions, snapshot = run(calls)
    assert all(c.endpoint.startswith(healthy.url) for c in completions)
    assert hostile.stats()["hostile"] == 3, "the circuit opened after 3 failed answers"
    assert snapshot["endpoints"][f"127_0_0_1_{hostile.port}"]["circuit"] == 2


def test_the_stage_fed_every_kind_at_a_rate_ends_each_record_once_with_a_documented_reason(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    sim = hostile_sim(make_sim, "all", rate=0.5, seed=44)
    h = Harness(job_config(sim.url, model={"max_response_bytes": 262_144},
                           async_={"capacity": 8, "request_timeout_s": TRICKLE_TIMEOUT_S, "record_deadline_s": 30.0},
                           retry={"max_attempts": 3, "max_retry_after_s": CAP_S}))
    harnesses.append(h)
    for i in range(60):
        h.element(i % 4, record(i), offset=i)
    h.end_of_input()
    results, dead = h.bodies("out"), h.bodies("dlq")
    assert Counter(b["id"] for b in results + dead) == Counter({f"id-{i}": 1 for i in range(60)})
    reasons = Counter(b["reason"] for b in dead)
    assert set(reasons) <= DOCUMENTED_REASONS, reasons
    assert results and dead and h.state.snapshot() == {}
    assert sim.stats()["hostile"] >= len(dead)


# ------------------------------------------------------------------ the API key under hostility


CANARY = secrets.token_hex(20)
"""The API key: random hex, so any 12 characters of it found anywhere are a leak."""
KEY_ENV = "LLMSTREAM_TEST_HOSTILE_KEY"


def leaked(text: str) -> bool:
    return any(CANARY[i:i + 12] in text for i in range(len(CANARY) - 11))


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    handler = logging.Formatter()
    return "\n".join(handler.format(r) for r in caplog.records)


@pytest.mark.parametrize("kind", ANSWER_KINDS)
def test_no_hostile_answer_lets_the_api_key_out(kind: str, make_sim: Callable[..., ThreadedSimulator],
                                                harnesses: list[Harness], caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hostile answer quotes the request's headers (`Authorization: Bearer <key>` among them)
    where it has room for text; the dead letter, the exception and every log record (at DEBUG, the
    simulator's included) hold none of the key."""
    monkeypatch.setenv(KEY_ENV, CANARY)
    caplog.set_level(logging.DEBUG)
    sim = hostile_sim(make_sim, kind, api_key=CANARY)
    cfg = config(sim.url, "chat", kind, api_key_env=KEY_ENV)
    h = Harness(cfg)
    harnesses.append(h)
    h.element(0, record(1), offset=1)
    h.end_of_input()
    [row] = h.out
    written = b"".join(bytes(part or b"") for part in (row[0], row[1]))
    written += b"".join(bytes(value or b"") + name.encode() for name, value in (row[3] or {}).items())
    assert not leaked(written.decode("utf-8", "replace"))
    done, _ = run(lambda: outcomes(cfg, 1))
    for got in done:
        assert not leaked(f"{got!s} {got!r} {getattr(got, 'detail', '')} {getattr(got, 'args', '')}")
    assert sim.stats()["hostile"] >= 2, "the key was sent and the answers were hostile"
    assert not leaked(log_text(caplog))


def _padded(prefix: str) -> str:
    """`prefix`, padding, then the key, so that a cut at `MAX_DETAIL_CHARS` falls in the key's middle."""
    return prefix + "p" * (MAX_DETAIL_CHARS - len(CANARY) // 2 - len(prefix)) + CANARY


@pytest.mark.parametrize("where", ["error body", "error object in a 200", "Location"])
def test_a_key_that_a_cut_would_split_is_redacted_before_the_cut(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A detail quotes at most `MAX_DETAIL_CHARS` of what the server said: redacted first, so a cut
    through the middle of the key leaves none of it."""
    monkeypatch.setenv(KEY_ENV, CANARY)

    async def answer(req: web.Request) -> web.Response:
        if where == "error body":
            return web.Response(status=500, text=_padded(""))
        if where == "Location":
            return web.Response(status=302, headers={"Location": _padded("http://127.0.0.1/")})
        return web.json_response({"error": {"message": _padded("")}})

    async def scenario() -> Exception:
        runner, url = await serve_app([web.post("/v1/chat/completions", answer)])
        try:
            return (await failure(job_config(url, model={"api_key_env": KEY_ENV},
                                             retry={"max_attempts": 1})))[0]
        finally:
            await runner.cleanup()

    err = run(scenario)
    assert isinstance(err, InferenceError) and "ppp" in err.detail
    assert not leaked(f"{err!s} {err!r}")


# ------------------------------------------------------------------ the documented table


def documented_rows() -> dict[str, str]:
    """kind -> its row of the table in docs/operations.md's "Bad input from every side"."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Bad input from every side", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_the_operations_table_documents_every_kind_and_its_outcome() -> None:
    rows = documented_rows()
    assert list(rows) == list(KINDS), "docs/operations.md lists the hostile kinds in config.KINDS' order"
    for kind, row in rows.items():
        reason_cell = row.rstrip(" |").rsplit("|", 1)[1]
        expected = {table[kind] for table in OUTCOMES.values()} if kind in ANSWER_KINDS else {TLS_OUTCOME}
        for outcome in expected:
            assert (f"`{outcome.reason}`" if outcome.reason else "a result") in reason_cell, (kind, reason_cell)


# ------------------------------------------------------------------ the simulator's side


def test_kinds_are_checked_and_all_is_every_kind_of_an_answer() -> None:
    assert parse_kinds("all") == tuple(ANSWER_KINDS)
    assert parse_kinds("redirect, not-json,redirect") == ("redirect", "not-json")
    assert parse_kinds(["huge-body"]) == ("huge-body",) and parse_kinds(None) == ()
    with pytest.raises(ValueError, match="unknown hostile kind 'huge'"):
        parse_kinds("huge")
    with pytest.raises(ValueError, match="hostile_rate"):
        FaultSettings(hostile="redirect", hostile_rate=1.5)
    with pytest.raises(ValueError, match="tls-cert-change needs"):
        SimulatorConfig(faults=FaultSettings(hostile="tls-cert-change"))


def test_the_command_line_sets_the_kinds_the_rate_and_the_size() -> None:
    args = build_parser().parse_args(["--hostile", "huge-body,redirect", "--hostile-rate", "0.25",
                                      "--hostile-size-bytes", "4096"])
    cfg = config_from_args(args)
    assert cfg.faults.hostile == ("huge-body", "redirect") and cfg.faults.hostile_rate == 0.25
    assert cfg.hostile_size_bytes == 4096
    assert "tls-cert-change" in build_parser().format_help()


def test_a_rate_makes_only_that_share_hostile_and_admin_changes_it(
        make_sim: Callable[..., ThreadedSimulator]) -> None:
    sim = hostile_sim(make_sim, "no-choices", rate=0.5, seed=3)
    done, _ = run(lambda: outcomes(config(sim.url, "chat"), 40))
    hostile = sum(isinstance(d, UnsupportedResponse) for d in done)
    assert 0 < hostile < 40 and hostile == sim.stats()["hostile"]
    assert sum(isinstance(d, Completion) for d in done) == 40 - hostile
    view = sim.admin({"hostile": ["empty-choices"], "hostile_rate": 1})
    assert (view["hostile"], view["hostile_rate"]) == (["empty-choices"], 1.0)
    done, _ = run(lambda: outcomes(config(sim.url, "chat"), 3))
    assert all(isinstance(d, UnsupportedResponse) for d in done)
    sim.admin({})
    done, _ = run(lambda: outcomes(config(sim.url, "chat"), 3))
    assert all(isinstance(d, Completion) for d in done)


def test_a_fleet_makes_hostile_only_the_endpoints_named_and_its_control_port_changes_each() -> None:
    async def scenario() -> tuple[int, int, int]:
        base = SimulatorConfig(port=0, stats_log_interval_s=0, faults=FaultSettings(hostile="not-json"))
        fleet = await serve_fleet(base, [0, 0], hostile_on=[1])
        try:
            async with ClientSession() as http:
                async def status_of(url: str) -> str:
                    async with http.post(url + "/chat/completions", json={"messages": [
                            {"role": "user", "content": "hi"}]}) as response:
                        return response.content_type

                first = [await status_of(url) for url in fleet.urls]
                async with http.post(f"{fleet.control_url}/fleet/0", data=json.dumps(
                        {"faults": {"hostile": "not-json"}})) as changed:
                    assert changed.status == 200
                second = await status_of(fleet.urls[0])
                assert first == ["application/json", "text/html"] and second == "text/html"
                return tuple(server.hostile for server in fleet.servers) + (len(first),)  # type: ignore[return-value]
        finally:
            await fleet.close()

    assert run(scenario) == (1, 1, 2)
    with pytest.raises(ValueError, match="hostile endpoints"):
        run(lambda: serve_fleet(SimulatorConfig(port=0), [0], hostile_on=[3]))


# ------------------------------------------------------------------ reading a 2xx, the pure functions


def test_a_batch_whose_items_carry_no_index_at_all_is_taken_in_order() -> None:
    body = {"data": [{"embedding": [1.0]}, {"embedding": [2.0]}]}
    assert responses.batch_vectors(body, 2) == [[1.0], [2.0]]
    shuffled = {"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}]}
    assert responses.batch_vectors(shuffled, 2) == [[1.0], [2.0]]


@pytest.mark.parametrize(("body", "problem"), [
    ({"choices": [{"message": {"content": [{"type": "text", "text": "hi"}]}}]}, "is a list of 1, not text"),
    ({"choices": [{"message": {"content": None, "tool_calls": [{}]}}]}, "has tool_calls instead"),
    ({"choices": ["hi"]}, "choices[0] is a string"),
    ({"choices": [{"message": "hi"}]}, "message is a string"),
])
def test_a_chat_answer_without_text_where_it_belongs_is_unsupported(body: dict[str, Any], problem: str) -> None:
    with pytest.raises(UnsupportedResponse, match=re.escape(problem)):
        responses.answer("chat", body)


def test_what_an_answer_carries_besides_its_text_is_taken_only_when_sane() -> None:
    body = {"model": "x" * 300, "choices": [{"message": {"content": "ok"}, "finish_reason": 7}],
            "usage": {"prompt_tokens": True, "completion_tokens": responses.MAX_REPORTED_TOKENS + 1}}
    payload = {"model": "asked", "messages": [{"role": "user", "content": "abcd" * 10}]}
    answer = responses.answer("chat", body)
    assert answer == responses.Answer("ok", None)
    usage = responses.usage("chat", body, payload, answer.output)
    assert 0 < usage.prompt_tokens < 100 and usage.completion_tokens == 1
    assert responses.model_name(body, payload) == "asked"
    with pytest.raises(UnsupportedResponse, match="holds something other than numbers"):
        responses.batch_vectors({"data": [{"index": 0, "embedding": [0.5, "x"]}]}, 1)
    with pytest.raises(UnsupportedResponse, match="model.embedding_dim is 3"):
        responses.batch_vectors({"data": [{"index": 0, "embedding": [0.5, 0.5]}]}, 1, dimensions=3)
