"""The registry client (udfs/records/registry.py) without a registry: a registry that never answers is
unavailable after `schema_registry.unavailable_timeout_s` (a closed loopback port, a fake clock),
basic auth comes from placeholders and shows in no message, and the password is a placeholder only.
Bounded reads against `FloodServer`: an answer past `MAX_ANSWER_BYTES` (endless, or by its
Content-Length) is one `RegistryAnswerTooLarge`, not retried, the server's count showing it was not
read on; a huge error body still gives its error.
What a registry answers (lookups, the cache, refusals not retried) is tested against the real
Apicurio in tests/integration/test_avro.py."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import requests

from jobs.runtime.ports import free_port
from tests.support.servers import Flood, FloodServer
from tests.support.waiting import wait_until
from udfs.config import SchemaRegistryConfig, config_from_dict
from udfs.records.registry import (
    MAX_ANSWER_BYTES,
    RegistryAnswerTooLarge,
    RegistryClient,
    RegistryUnavailable,
    SchemaNotFound,
)


def client(url: str, **settings: Any) -> tuple[RegistryClient, list[float]]:
    slept: list[float] = []
    clock = [0.0]

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    def now() -> float:
        clock[0] += 0.01
        return clock[0]

    config = SchemaRegistryConfig(**{"url": url, "unavailable_timeout_s": 3.0, "timeout_s": 2.0, **settings})
    return RegistryClient(config, sleep=sleep, clock=now), slept


def test_a_registry_that_never_answers_is_unavailable_after_the_timeout() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: connection refused
    c, slept = client(url)
    with pytest.raises(RegistryUnavailable) as info:
        c.schema(1)
    assert "schema_registry.url did not answer" in str(info.value) and "ConnectionError" in str(info.value)
    assert len(slept) > 1, "gave up without retrying"
    assert 2.9 <= sum(slept) + 0.01 * (len(slept) * 2 + 2) <= 3.5


def test_basic_auth_comes_from_placeholders_and_never_shows_in_errors(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cr3t-registry\n")
    secret.chmod(0o600)
    monkeypatch.setenv("REGISTRY_USER", "job")
    url = f"http://127.0.0.1:{free_port()}"
    c, _ = client(url, username="${env:REGISTRY_USER}", password=f"${{file:{secret}}}")
    sent = c._session.prepare_request(requests.Request("GET", f"{url}/schemas/ids/1"))
    assert sent.headers["Authorization"] == "Basic " + base64.b64encode(b"job:s3cr3t-registry").decode()
    with pytest.raises(RegistryUnavailable) as unavailable:
        c.schema(1)
    text = f"{unavailable.value} {unavailable.value!r} {unavailable.value.__cause__!r}"
    assert "s3cr3t" not in text and "job:" not in text


def test_the_password_is_a_placeholder_only() -> None:
    with pytest.raises(Exception, match="literal credential"):
        config_from_dict({
            "kafka": {"bootstrap_servers": "b:9", "input_topic": "i", "output_topic": "o", "dead_letter_topic": "d",
                      "group_id": "g", "transactional_id_prefix": "t"},
            "model": {"endpoint": "http://m/v1", "model": "m"},
            "schema_registry": {"url": "http://r", "username": "u", "password": "hunter2"}})


# ------------------------------------------------------------------ bounded reads


def test_a_schema_answer_is_read_and_cached() -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}]}
    body = json.dumps({"schema": json.dumps(schema)}).encode()
    with FloodServer(Flood(body=body, size=len(body), framing="chunked")) as server:
        c, _ = client(server.url)
        assert c.schema(1) == ("AVRO", schema)
        assert c.schema(1) == ("AVRO", schema)
    assert len(server.sent) == 1


@pytest.mark.parametrize(("framing", "size"), [("chunked", None), ("close", None), ("length", 4 * MAX_ANSWER_BYTES)],
                         ids=["chunked-endless", "close-delimited-endless", "content-length"])
def test_an_answer_past_the_bound_is_one_clear_error_and_not_read_on(framing: str, size: int | None) -> None:
    with FloodServer(Flood(size=size, framing=framing)) as server:  # type: ignore[arg-type]
        c, slept = client(server.url)
        with pytest.raises(RegistryAnswerTooLarge) as info:
            c.schema(1)
        wait_until(lambda: server.sent, timeout=60, interval=0.05, message="the answer's end")
    assert f"schema_registry.url answered (schema id 1) with more than {MAX_ANSWER_BYTES} bytes" in str(info.value)
    assert ("Content-Length" in str(info.value)) == (framing == "length")
    assert slept == [] and server.connections == 1 and len(server.sent) == 1, "retried"
    assert server.sent[0] < 2 * MAX_ANSWER_BYTES, f"the server sent {server.sent[0]} bytes"


def test_a_huge_error_body_is_cut_and_the_error_still_says_what_happened() -> None:
    flood = Flood(status=404, body=b'{"error_code": 40403, "message": "Schema not found"', framing="chunked")
    with FloodServer(flood) as server:
        c, _ = client(server.url)
        with pytest.raises(SchemaNotFound) as info:
            c.schema(9)
        wait_until(lambda: server.sent, timeout=60, interval=0.05, message="the answer's end")
    assert "has no schema id 9 (HTTP 404)" in str(info.value)
    assert server.sent[0] < 2 * MAX_ANSWER_BYTES, f"the server sent {server.sent[0]} bytes"
