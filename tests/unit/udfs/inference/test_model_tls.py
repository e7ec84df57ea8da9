"""TLS and secrets towards the model server: the client against the simulator over HTTPS.

Certificates are made per module with the `openssl` CLI (tests/support/tls_certs.py). What a
user sees is checked: the answer, or the record's error (its reason, attempts and detail),
and that no secret (API key, resolved header) appears in an error, a repr or a log line.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from aiohttp import web

from jobs.dev.simulator import ThreadedSimulator
from jobs.runtime.ports import free_port
from tests.support.calls import complete_one, failure, run
from tests.support.configs import job_config, request
from tests.support.servers import serve_app
from tests.support.tls_certs import OPENSSL, Certs, make_certs
from udfs.errors import ConfigError, PermanentError, TlsError
from udfs.inference.client import InferenceClient
from udfs.records import Completion

API_KEY = "sk-llmstream-tls-4b1d9e7a"
TOKEN = "gw-token-93c1f0aa52"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def https_sim(make_sim: Callable[..., ThreadedSimulator], certs: Certs) -> ThreadedSimulator:
    return make_sim(tls_cert=certs.server_cert, tls_key=certs.server_key)


def secret_file(tmp_path: Path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content + "\n")
    path.chmod(0o600)
    return str(path)


def test_https_with_the_ca_in_model_tls_ca_file_answers(https_sim: ThreadedSimulator, certs: Certs) -> None:
    assert https_sim.url.startswith("https://127.0.0.1:")
    completion, _ = run(lambda: complete_one(job_config(https_sim.url, model={"tls": {"ca_file": certs.ca}})))
    assert completion.output.startswith("Simulated answer to:")
    assert completion.endpoint == https_sim.url + "/chat/completions"


@pytest.mark.parametrize("trust", ["another CA", "the system's CAs"])
def test_an_untrusted_server_certificate_is_a_tls_error_after_one_attempt_naming_no_secret(
        make_sim: Callable[..., ThreadedSimulator], certs: Certs, tmp_path: Path, trust: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sim = make_sim(tls_cert=certs.server_cert, tls_key=certs.server_key, api_key=API_KEY,
                   required_headers=(("X-Gateway-Token", TOKEN),))
    tls = {"ca_file": certs.other_ca} if trust == "another CA" else {}
    config = job_config(sim.url, model={
        "tls": tls, "api_key_file": secret_file(tmp_path, "key", API_KEY),
        "headers": {"X-Gateway-Token": "${file:" + secret_file(tmp_path, "token", TOKEN) + "}"}})
    err, _, client = run(lambda: failure(config))
    assert type(err) is TlsError and err.reason == "tls_error" and err.attempts == 1
    assert "TLS" in err.detail and "certificate verify failed" in err.detail
    assert "model.tls.ca_file" in err.detail
    assert client.metrics.requests.value == 1 and sim.stats()["requests_total"] == 0
    for secret in (API_KEY, TOKEN):
        assert secret not in str(err) and secret not in repr(err) and secret not in repr(client)
        assert secret not in caplog.text


def test_https_to_a_plain_http_server_is_a_tls_error(sim: ThreadedSimulator) -> None:
    err, _, _ = run(lambda: failure(job_config(sim.url.replace("http://", "https://"))))
    assert type(err) is TlsError and err.attempts == 1
    assert "does not speak TLS" in err.detail


def test_verify_false_with_allow_insecure_answers(https_sim: ThreadedSimulator) -> None:
    config = job_config(https_sim.url, model={"tls": {"verify": False, "allow_insecure": True}})
    completion, _ = run(lambda: complete_one(config))
    assert completion.output.startswith("Simulated answer to:")


@pytest.fixture
def mtls_sim(make_sim: Callable[..., ThreadedSimulator], certs: Certs) -> ThreadedSimulator:
    return make_sim(tls_cert=certs.server_cert, tls_key=certs.server_key, tls_client_ca=certs.ca)


def test_mutual_tls_with_a_client_certificate_answers(mtls_sim: ThreadedSimulator, certs: Certs) -> None:
    config = job_config(mtls_sim.url, model={"tls": {
        "ca_file": certs.ca, "client_cert_file": certs.client_cert, "client_key_file": certs.client_key}})
    completion, _ = run(lambda: complete_one(config))
    assert completion.output.startswith("Simulated answer to:")


def test_mutual_tls_without_a_client_certificate_is_refused_clearly(mtls_sim: ThreadedSimulator,
                                                                     certs: Certs) -> None:
    err, _, _ = run(lambda: failure(job_config(mtls_sim.url, model={"tls": {"ca_file": certs.ca}})))
    assert type(err) is PermanentError and err.status == 400 and err.attempts == 1
    assert "No required SSL certificate was sent" in err.detail


@pytest.fixture
def alerting_server(certs: Certs) -> Iterator[str]:
    """`openssl s_server` requiring a client certificate: unlike asyncio's TLS server it answers a
    missing certificate with a TLS alert, as Go, Envoy and OpenSSL-based servers do."""
    port = free_port()
    process = subprocess.Popen(
        [OPENSSL, "s_server", "-accept", f"127.0.0.1:{port}", "-cert", certs.server_cert, "-key", certs.server_key,
         "-CAfile", certs.ca, "-Verify", "1", "-www"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    listening: Future[None] = Future()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("ACCEPT") and not listening.done():
                listening.set_result(None)
        if not listening.done():
            listening.set_exception(RuntimeError(f"openssl s_server exited with {process.wait()}"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        listening.result(timeout=30)
        yield f"https://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(10)
        reader.join(10)


def test_a_tls_alert_from_the_server_is_a_tls_error(alerting_server: str, certs: Certs) -> None:
    err, _, _ = run(lambda: failure(job_config(alerting_server, model={"tls": {"ca_file": certs.ca}})))
    assert type(err) is TlsError and err.attempts == 1
    assert "certificate required" in err.detail and "model.tls.client_cert_file" in err.detail


def test_the_api_key_from_api_key_file_reaches_the_server_and_no_error_detail(
        make_sim: Callable[..., ThreadedSimulator], certs: Certs, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sim = make_sim(tls_cert=certs.server_cert, tls_key=certs.server_key, api_key=API_KEY)
    key_file = secret_file(tmp_path, "key", API_KEY)
    config = job_config(sim.url, model={"tls": {"ca_file": certs.ca}, "api_key_file": key_file})

    async def answer_then_rotate() -> tuple[Completion, Exception]:
        async with InferenceClient(config) as client:
            completion = await client.complete(request())
            wrong = "sk-llmstream-rotated-0c8e5d21"
            secret_file(tmp_path, "key", wrong)  # read at each call: a rotated key is used at once
            try:
                await client.complete(request())
            except Exception as err:  # noqa: BLE001 - the test inspects what was raised
                return completion, err
        raise AssertionError("the rotated (wrong) key was accepted")

    completion, err = run(answer_then_rotate)
    assert completion is not None
    assert type(err) is PermanentError and err.status == 401
    for secret in (API_KEY, "sk-llmstream-rotated-0c8e5d21"):
        assert secret not in str(err) and secret not in repr(err) and secret not in caplog.text


def test_a_file_placeholder_header_reaches_the_server_resolved(make_sim: Callable[..., ThreadedSimulator],
                                                               certs: Certs, tmp_path: Path) -> None:
    sim = make_sim(tls_cert=certs.server_cert, tls_key=certs.server_key,
                   required_headers=(("X-Gateway-Token", TOKEN),))
    placeholder = "${file:" + secret_file(tmp_path, "token", TOKEN) + "}"
    config = job_config(sim.url, model={"tls": {"ca_file": certs.ca}, "headers": {"X-Gateway-Token": placeholder}})
    completion, client = run(lambda: complete_one(config))
    assert completion.output.startswith("Simulated answer to:")
    assert TOKEN not in repr(client) and config.model.headers["X-Gateway-Token"] == placeholder

    wrong = job_config(sim.url, model={"tls": {"ca_file": certs.ca}, "headers": {"X-Gateway-Token": "other"}})
    err, _, _ = run(lambda: failure(wrong))
    assert type(err) is PermanentError and err.status == 401 and "X-Gateway-Token" in err.detail


def test_resolved_header_values_are_redacted_from_error_details(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A header whose value came from a placeholder is a secret whatever its name."""
    async def echo(req: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"bad tenant {req.headers.get('X-Tenant')} "
                                                       f"{req.headers.get('X-Trace')}"}}, status=400)

    monkeypatch.setenv("LLMSTREAM_TEST_TENANT", TOKEN)

    async def scenario() -> Exception:
        runner, url = await serve_app([web.post("/v1/chat/completions", echo)])
        try:
            config = job_config(url, model={"headers": {"X-Tenant": "${env:LLMSTREAM_TEST_TENANT}",
                                                        "X-Trace": "trace-visible"}})
            return (await failure(config))[0]
        finally:
            await runner.cleanup()

    err = run(scenario)
    assert type(err) is PermanentError and "bad tenant *** trace-visible" in err.detail
    assert TOKEN not in str(err) and TOKEN not in repr(err)


def test_unusable_tls_files_fail_at_client_construction_naming_the_key(certs: Certs, tmp_path: Path) -> None:
    not_pem = secret_file(tmp_path, "not-a-ca.pem", "hello")
    with pytest.raises(ConfigError) as caught:
        InferenceClient(job_config("https://127.0.0.1:9/v1", model={"tls": {"ca_file": not_pem}}))
    assert caught.value.key == "model.tls.ca_file"

    encrypted = tmp_path / "encrypted.key"
    subprocess.run([OPENSSL, "ec", "-in", certs.client_key, "-aes256", "-passout", "pass:xyz", "-out",
                    str(encrypted)], check=True, capture_output=True, timeout=60)
    encrypted.chmod(0o600)
    config = job_config("https://127.0.0.1:9/v1", model={"tls": {
        "client_cert_file": certs.client_cert, "client_key_file": str(encrypted)}})
    with pytest.raises(ConfigError) as caught:
        InferenceClient(config)
    assert caught.value.key == "model.tls.client_key_file" and "encrypted" in str(caught.value)

    mismatched = job_config("https://127.0.0.1:9/v1", model={"tls": {
        "client_cert_file": certs.client_cert, "client_key_file": certs.other_client_key}})
    with pytest.raises(ConfigError) as caught:
        InferenceClient(mismatched)
    assert caught.value.key == "model.tls.client_cert_file"
