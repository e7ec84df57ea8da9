"""The registry client (udfs/registry.py) over loopback HTTP: retries while the registry does not
answer, final answers not retried, basic auth from placeholders, and no secret in any message.
Against the real Apicurio: tests/integration/test_avro.py."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from jobs.ports import free_port
from udfs.config import SchemaRegistryConfig, config_from_dict
from udfs.registry import (
    RegistryClient,
    RegistryRefused,
    RegistryUnavailable,
    SchemaNotFound,
    SchemaRejected,
)

SCHEMA = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "string"}]}


class Registry(ThreadingHTTPServer):
    """Answers /schemas/ids/1 and registrations; `fail_next` 503s first; records what it saw."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.fail_next = 0
        self.seen: list[tuple[str, str, str | None]] = []


class Handler(BaseHTTPRequestHandler):
    server: Registry

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else None
        self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
        if self.server.fail_next:
            self.server.fail_next -= 1
            return self._answer(503, {"message": "warming up"})
        if self.path == "/schemas/ids/1":
            return self._answer(200, {"schema": json.dumps(SCHEMA)})
        if self.path == "/subjects/bad-value/versions" and self.command == "POST":
            return self._answer(409, {"error_code": 409, "message": "Incompatible artifact"})
        if self.path.startswith("/subjects/") and self.command == "POST":
            assert body is not None and "schema" in json.loads(body)
            return self._answer(200, {"id": 7})
        if self.path.startswith("/private"):
            return self._answer(401, {"message": "Unauthorized"})
        return self._answer(404, {"error_code": 40403, "message": "not found"})

    do_GET = do_POST = do_PUT = _handle

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def registry() -> Iterator[Registry]:
    server = Registry()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


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


def test_a_schema_is_fetched_once_by_id_and_kept(registry: Registry) -> None:
    c, _ = client(f"http://127.0.0.1:{registry.server_port}")
    assert c.schema(1) == ("AVRO", SCHEMA)
    assert c.schema(1) == ("AVRO", SCHEMA)
    assert [p for _, p, _ in registry.seen] == ["/schemas/ids/1"]
    with pytest.raises(SchemaNotFound):
        c.schema(2)


def test_503s_are_retried_with_backoff_then_answered(registry: Registry) -> None:
    registry.fail_next = 3
    c, slept = client(f"http://127.0.0.1:{registry.server_port}")
    assert c.schema(1)[1] == SCHEMA
    assert len(slept) == 3 and len(registry.seen) == 4


def test_a_registry_that_never_answers_is_unavailable_after_the_timeout() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: connection refused
    c, slept = client(url)
    with pytest.raises(RegistryUnavailable) as info:
        c.schema(1)
    assert "schema_registry.url did not answer" in str(info.value) and "ConnectionError" in str(info.value)
    assert 2.9 <= sum(slept) + 0.01 * (len(slept) * 2 + 2) <= 3.5


def test_final_answers_are_not_retried(registry: Registry) -> None:
    c, slept = client(f"http://127.0.0.1:{registry.server_port}")
    with pytest.raises(SchemaRejected, match="Incompatible artifact"):
        c.register("bad-value", SCHEMA)
    assert c.register("good-value", SCHEMA) == 7
    assert slept == []


def test_basic_auth_comes_from_placeholders_and_never_shows_in_errors(
        registry: Registry, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cr3t-registry\n")
    secret.chmod(0o600)
    monkeypatch.setenv("REGISTRY_USER", "job")
    c, _ = client(f"http://127.0.0.1:{registry.server_port}", username="${env:REGISTRY_USER}",
                  password=f"${{file:{secret}}}")
    c.schema(1)
    assert registry.seen[-1][2] == "Basic " + base64.b64encode(b"job:s3cr3t-registry").decode()
    with pytest.raises(SchemaNotFound) as missing:
        c.schema(5)
    c._base += "/private"
    with pytest.raises(RegistryRefused) as refused:
        c.schema(3)
    for err in (missing.value, refused.value):
        assert "s3cr3t" not in str(err) and "job:" not in str(err)


def test_the_password_is_a_placeholder_only() -> None:
    with pytest.raises(Exception, match="literal credential"):
        config_from_dict({
            "kafka": {"bootstrap_servers": "b:9", "input_topic": "i", "output_topic": "o", "dead_letter_topic": "d",
                      "group_id": "g", "transactional_id_prefix": "t"},
            "model": {"endpoint": "http://m/v1", "model": "m"},
            "schema_registry": {"url": "http://r", "username": "u", "password": "hunter2"}})
