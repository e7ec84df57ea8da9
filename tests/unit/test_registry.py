"""The registry client (udfs/records/registry.py) without a registry: a registry that never answers is
unavailable after `schema_registry.unavailable_timeout_s` (a closed loopback port, a fake clock),
basic auth comes from placeholders and shows in no message, and the password is a placeholder only.
What a registry answers (lookups, the cache, refusals not retried) is tested against the real
Apicurio in tests/integration/test_avro.py."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import requests

from jobs.runtime.ports import free_port
from udfs.config import SchemaRegistryConfig, config_from_dict
from udfs.records.registry import RegistryClient, RegistryUnavailable


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
