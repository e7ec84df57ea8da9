"""The simulator's provider batch APIs, with the official ``openai`` and ``anthropic`` SDKs as clients
(their conformance), and with plain HTTP for the edges the SDKs hide.

Each test starts its own simulator in a thread with short delays (a tenth of a second), and waits
for conditions with generous deadlines: nothing here depends on the machine's speed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest
import requests

from jobs.dev.simulator import (
    SimulatorConfig,
    ThreadedSimulator,
    build_parser,
    config_from_args,
    spawn,
)
from jobs.dev.simulator.batch_config import BatchSettings, parse_range
from tests.support.waiting import wait_until

FAST = BatchSettings(validating_s=0.05, delay_s=0.1, finalizing_s=0.05)
SLOW = BatchSettings(validating_s=0, delay_s=600, finalizing_s=0.05)
"""A batch that answers nothing by itself within a test: its outcome is what the test forces."""
DEADLINE_S = 30.0
CHAT_URL = "/v1/chat/completions"

MakeSim = Callable[..., ThreadedSimulator]


def chat_line(custom_id: str, prompt: str, url: str = CHAT_URL, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "sim-model", "messages": [{"role": "user", "content": prompt}], **body}}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def message_request(custom_id: str, prompt: str, **params: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "params": {"model": "claude-sim", "max_tokens": 24,
                                               "messages": [{"role": "user", "content": prompt}], **params}}


@pytest.fixture
def batch_sim(make_sim: MakeSim) -> Callable[..., ThreadedSimulator]:
    def make(settings: BatchSettings = FAST, **overrides: Any) -> ThreadedSimulator:
        return make_sim(batch=settings, **overrides)

    return make


@pytest.fixture
def clients() -> Iterator[Callable[[ThreadedSimulator], tuple[openai.OpenAI, anthropic.Anthropic]]]:
    """The official SDKs pointed at a simulator (no retries: every answer is seen as sent)."""
    made: list[Any] = []

    def make(sim: ThreadedSimulator, key: str = "sk-sim") -> tuple[openai.OpenAI, anthropic.Anthropic]:
        pair = (openai.OpenAI(base_url=sim.url, api_key=key, max_retries=0, timeout=20),
                anthropic.Anthropic(base_url=sim.base_url, api_key=key, max_retries=0, timeout=20))
        made.extend(pair)
        return pair

    yield make
    for client in made:
        client.close()


def upload_and_create(client: openai.OpenAI, lines: list[Any], endpoint: str = CHAT_URL,
                      **create: Any) -> tuple[str, Any]:
    file = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint,  # type: ignore[arg-type]
                                  completion_window="24h", **create)
    return file.id, batch


def wait_for_openai(client: openai.OpenAI, batch_id: str, *statuses: str) -> Any:
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b, DEADLINE_S,
                      interval=0.05, message=f"batch {batch_id} to be {' or '.join(statuses)}")


def wait_for_ended(client: anthropic.Anthropic, batch_id: str) -> Any:
    return wait_until(lambda: (b := client.messages.batches.retrieve(batch_id)).processing_status == "ended" and b,
                      DEADLINE_S, interval=0.05, message=f"message batch {batch_id} to end")


def admin(sim: ThreadedSimulator, batch_id: str, **body: Any) -> requests.Response:
    return requests.post(f"{sim.base_url}/admin/batches/{batch_id}", json=body, timeout=10)


def batch_stats(sim: ThreadedSimulator) -> dict[str, Any]:
    result: dict[str, Any] = requests.get(sim.base_url + "/stats", timeout=10).json()["batches"]
    return result


def wait_in_progress(sim: ThreadedSimulator, batch_id: str) -> None:
    wait_until(lambda: any(b["id"] == batch_id and b["status"] == "in_progress"
                           for b in requests.get(sim.base_url + "/admin/batches", timeout=10).json()["batches"]),
               DEADLINE_S, interval=0.05, message=f"batch {batch_id} in progress")


# --------------------------------------------------------------------------- OpenAI, with its SDK


def test_openai_upload_create_poll_download(batch_sim: MakeSim, clients: Any) -> None:
    """The whole round trip with the official SDK: every request answered once, by the same code as the
    simulator's realtime answers, in the output file; the batch object's fields filled in as OpenAI's."""
    sim = batch_sim()
    client, _ = clients(sim)
    prompts = {f"rec-{i}": f"question number {i} about batches" for i in range(12)}
    file_id, batch = upload_and_create(client, [chat_line(cid, p, max_tokens=12) for cid, p in prompts.items()],
                                       metadata={"lane": "test"})
    assert batch.status == "validating" and batch.input_file_id == file_id and batch.metadata == {"lane": "test"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    done = wait_for_openai(client, batch.id, "completed", "failed", "expired", "cancelled")
    assert done.status == "completed" and done.errors is None and done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.model == "sim-model" and done.usage is not None
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output"
    lines = parse_jsonl(client.files.content(done.output_file_id).text)
    assert sorted(line["custom_id"] for line in lines) == sorted(prompts)
    assert done.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)
    realtime = requests.post(sim.url + "/chat/completions", json=chat_line("x", prompts["rec-3"], max_tokens=12)["body"],
                             timeout=10).json()
    for line in lines:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and body["system_fingerprint"] == "llmstream-simulator"
        assert f"Simulated answer to: {prompts[line['custom_id']]}." in body["choices"][0]["message"]["content"]
        if line["custom_id"] == "rec-3":
            assert body["choices"][0]["message"]["content"] == realtime["choices"][0]["message"]["content"]
    stats = batch_stats(sim)
    assert stats["openai"]["requests_submitted"] == 12 and stats["openai"]["requests_succeeded"] == 12
    assert stats["openai"]["batches_by_status"]["completed"] == 1


def test_openai_embeddings_batch_matches_realtime(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim(embedding_dim=8)
    client, _ = clients(sim)
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "embedder", "input": f"text {i}"}} for i in range(4)]
    _, batch = upload_and_create(client, lines, endpoint="/v1/embeddings")
    done = wait_for_openai(client, batch.id, "completed")
    answers = {line["custom_id"]: line["response"]["body"] for line in parse_jsonl(
        client.files.content(done.output_file_id).text)}
    realtime = client.embeddings.create(model="embedder", input="text 2")
    # the SDK asks for base64 (float32) where the file holds JSON floats (rounded to 6 places)
    assert answers["e2"]["data"][0]["embedding"] == pytest.approx(realtime.data[0].embedding, abs=1e-6)


def test_openai_per_request_failures_go_to_the_error_file(batch_sim: MakeSim, clients: Any) -> None:
    """Injected failures (``error_rate``) and a request the endpoint refuses (400) are lines of the error
    file; the successes are in the output file; together they hold every custom_id once."""
    sim = batch_sim(BatchSettings(validating_s=0, delay_s=0.1, finalizing_s=0, error_rate=0.5, error_status=503),
                    seed=11)
    client, _ = clients(sim)
    lines = [chat_line(f"r{i}", f"prompt {i}") for i in range(40)]
    lines.append({"custom_id": "bad-body", "method": "POST", "url": CHAT_URL, "body": {"model": "m"}})
    _, batch = upload_and_create(client, lines)
    done = wait_for_openai(client, batch.id, "completed")
    output = parse_jsonl(client.files.content(done.output_file_id).text)
    errors = parse_jsonl(client.files.content(done.error_file_id).text)
    assert sorted(e["custom_id"] for e in output + errors) == sorted(line["custom_id"] for line in lines)
    assert done.request_counts.completed == len(output) and done.request_counts.failed == len(errors)
    assert 5 <= len(output) <= 35  # half of 40, with room
    by_id = {e["custom_id"]: e for e in errors}
    bad = by_id.pop("bad-body")
    assert bad["response"]["status_code"] == 400 and bad["error"] is None
    assert bad["response"]["body"]["error"]["param"] == "messages"
    for error in by_id.values():
        assert error["response"]["status_code"] == 503 and error["error"] is None
        assert error["response"]["body"]["error"]["code"] == "simulated_fault"
    stats = batch_stats(sim)["openai"]
    assert stats["requests_errored"] == len(errors) and stats["requests_succeeded"] == len(output)


def test_openai_cancel(batch_sim: MakeSim, clients: Any) -> None:
    """Cancelled mid-way: ``cancelling`` at once, then ``cancelled``; what was answered stays in the
    output file, the rest are ``batch_cancelled`` lines of the error file."""
    sim = batch_sim(SLOW)
    client, _ = clients(sim)
    _, batch = upload_and_create(client, [chat_line(f"c{i}", f"p{i}") for i in range(6)])
    wait_in_progress(sim, batch.id)
    assert admin(sim, batch.id, action="process", requests=2).json()["answered_now"] == 2
    assert client.batches.retrieve(batch.id).request_counts.completed == 2
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_for_openai(client, batch.id, "cancelled")
    assert done.cancelled_at and (done.request_counts.completed, done.request_counts.failed) == (2, 4)
    assert len(parse_jsonl(client.files.content(done.output_file_id).text)) == 2
    errors = parse_jsonl(client.files.content(done.error_file_id).text)
    assert len(errors) == 4 and all(e["response"] is None and e["error"]["code"] == "batch_cancelled" for e in errors)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    assert batch_stats(sim)["openai"]["requests_cancelled"] == 4


def test_openai_list_pages_newest_first(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim(SLOW)
    client, _ = clients(sim)
    file = client.files.create(file=("r.jsonl", jsonl([chat_line("a", "b")])), purpose="batch")
    created = [client.batches.create(input_file_id=file.id, endpoint=CHAT_URL, completion_window="24h").id
               for _ in range(5)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == created[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=2, after=created[1]).data] == [created[0]]
    assert [b.id for b in client.batches.list(limit=2)] == created[::-1]  # the SDK follows the pages
    files = client.files.list(purpose="batch")
    assert [f.id for f in files] == [file.id]


def test_openai_validation_failure_names_lines(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim()
    client, _ = clients(sim)
    lines: list[Any] = [chat_line("ok-1", "fine"), "{not json", chat_line("ok-1", "dup"),
                        chat_line("other", "x", url="/v1/embeddings"), chat_line("nourl", "x", url="/v1/responses"),
                        {"custom_id": "get", "method": "GET", "url": CHAT_URL, "body": {}},
                        {"custom_id": "nobody", "method": "POST", "url": CHAT_URL}]
    _, batch = upload_and_create(client, lines)
    done = wait_for_openai(client, batch.id, "failed")
    assert done.failed_at and done.output_file_id is None and done.error_file_id is None
    assert done.request_counts.total == 0
    found = [(e.line, e.code, e.param) for e in done.errors.data]
    assert found == [(2, "invalid_json_line", None), (3, "duplicate_custom_id", "custom_id"),
                     (4, "mismatched_url", "url"), (5, "invalid_url", "url"), (6, "invalid_method", "method"),
                     (7, "invalid_request", "body")]
    assert all(e.message for e in done.errors.data)
    stats = batch_stats(sim)["openai"]
    assert stats["requests_submitted"] == 7 and stats["requests_refused"] == 7 and stats["batches_failed"] == 1


def test_openai_batch_expires_with_the_scaled_window(batch_sim: MakeSim, clients: Any) -> None:
    """24 h / time_scale = 0.5 s: a batch that would take 10 minutes expires, every request in the error file."""
    sim = batch_sim(BatchSettings(validating_s=0, delay_s=600, finalizing_s=0, time_scale=24 * 3600 / 0.5))
    client, _ = clients(sim)
    _, batch = upload_and_create(client, [chat_line(f"x{i}", "p") for i in range(3)])
    assert batch.expires_at - batch.created_at <= 1
    done = wait_for_openai(client, batch.id, "expired")
    assert done.expired_at and done.output_file_id is None
    errors = parse_jsonl(client.files.content(done.error_file_id).text)
    assert sorted(e["custom_id"] for e in errors) == ["x0", "x1", "x2"]
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in errors)


def test_openai_forced_expiry_keeps_the_answered_requests(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim(SLOW)
    client, _ = clients(sim)
    _, batch = upload_and_create(client, [chat_line(f"y{i}", f"p{i}") for i in range(5)])
    wait_in_progress(sim, batch.id)
    admin(sim, batch.id, action="process", requests=3).raise_for_status()
    forced = admin(sim, batch.id, action="expire")
    assert forced.status_code == 200 and forced.json()["batch"]["status"] == "expired"
    done = client.batches.retrieve(batch.id)
    assert done.status == "expired" and (done.request_counts.completed, done.request_counts.failed) == (3, 2)
    assert len(parse_jsonl(client.files.content(done.output_file_id).text)) == 3
    assert {e["error"]["code"] for e in parse_jsonl(client.files.content(done.error_file_id).text)} == {"batch_expired"}


def test_openai_forced_failure_and_deletion(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim(SLOW)
    client, _ = clients(sim)
    _, failing = upload_and_create(client, [chat_line("f", "p")])
    _, deleted = upload_and_create(client, [chat_line("d", "p")])
    admin(sim, failing.id, action="fail", line=1, message="line 1 is not acceptable").raise_for_status()
    failed = client.batches.retrieve(failing.id)
    assert failed.status == "failed"
    assert [(e.line, e.message) for e in failed.errors.data] == [(1, "line 1 is not acceptable")]
    admin(sim, deleted.id, action="delete").raise_for_status()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(deleted.id)
    assert deleted.id not in [b.id for b in client.batches.list()]
    assert admin(sim, deleted.id, action="expire").status_code == 404
    assert batch_stats(sim)["openai"]["batches_deleted"] == 1


def test_openai_files(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim()
    client, _ = clients(sim)
    content = jsonl([chat_line("a", "b")])
    file = client.files.create(file=("in.jsonl", content), purpose="batch")
    assert (file.bytes, file.filename, file.purpose, file.status) == (len(content), "in.jsonl", "batch", "processed")
    assert client.files.retrieve(file.id).id == file.id
    assert client.files.content(file.id).content == content
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)
    with pytest.raises(openai.BadRequestError, match="jsonl"):
        client.files.create(file=("in.txt", content), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=file.id, endpoint=CHAT_URL, completion_window="24h")


# --------------------------------------------------------------------------- Anthropic, with its SDK


def test_anthropic_create_poll_results(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim()
    _, client = clients(sim)
    prompts = {f"m-{i}": f"message number {i}" for i in range(10)}
    batch = client.messages.batches.create(requests=[
        message_request(cid, p, system="be brief") for cid, p in prompts.items()])
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 10
    assert (batch.expires_at - batch.created_at).total_seconds() == pytest.approx(24 * 3600, abs=1)
    done = wait_for_ended(client, batch.id)
    assert done.ended_at and done.request_counts.succeeded == 10 and done.request_counts.processing == 0
    assert done.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    results = list(client.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == sorted(prompts)
    for result in results:
        assert result.result.type == "succeeded"
        message = result.result.message
        assert message.role == "assistant" and message.type == "message" and message.stop_reason == "end_turn"
        assert f"Simulated answer to: {prompts[result.custom_id]}." in message.content[0].text
        assert message.usage.output_tokens == 24 and message.usage.service_tier == "batch"
    stats = batch_stats(sim)
    assert stats["anthropic"]["requests_submitted"] == 10 and stats["requests_submitted"] == 10
    assert stats["anthropic"]["batches_by_status"] == {"in_progress": 0, "canceling": 0, "ended": 1}


def test_anthropic_errored_requests(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim(BatchSettings(validating_s=0, delay_s=0.1, finalizing_s=0, error_rate=0.5, error_status=529),
                    seed=5)
    _, client = clients(sim)
    requests_ = [message_request(f"q{i}", f"p{i}") for i in range(30)]
    requests_.append({"custom_id": "no-max-tokens", "params": {"model": "claude-sim",
                                                               "messages": [{"role": "user", "content": "x"}]}})
    batch = client.messages.batches.create(requests=requests_)  # type: ignore[arg-type]
    done = wait_for_ended(client, batch.id)
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert len(results) == 31
    invalid = results.pop("no-max-tokens")
    assert invalid.type == "errored" and invalid.error.error.type == "invalid_request_error"
    assert "max_tokens" in invalid.error.error.message
    errored = [r for r in results.values() if r.type == "errored"]
    assert 3 <= len(errored) <= 27
    assert all(r.error.error.type == "overloaded_error" for r in errored)
    assert done.request_counts.errored == len(errored) + 1
    assert done.request_counts.succeeded == 30 - len(errored)


def test_anthropic_cancel_then_delete(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim(SLOW)
    _, client = clients(sim)
    batch = client.messages.batches.create(requests=[message_request(f"k{i}", "p") for i in range(4)])
    wait_in_progress(sim, batch.id)
    admin(sim, batch.id, action="process", requests=1).raise_for_status()
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.delete(batch.id)  # in progress: cancel it first
    canceling = client.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at
    done = wait_for_ended(client, batch.id)
    assert (done.request_counts.succeeded, done.request_counts.canceled) == (1, 3)
    kinds = sorted(r.result.type for r in client.messages.batches.results(batch.id))
    assert kinds == ["canceled", "canceled", "canceled", "succeeded"]
    assert client.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def test_anthropic_list_pages(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim(SLOW)
    _, client = clients(sim)
    created = [client.messages.batches.create(requests=[message_request("a", "b")]).id for _ in range(5)]
    first = client.messages.batches.list(limit=2)
    assert [b.id for b in first.data] == created[::-1][:2] and first.has_more and first.last_id == created[3]
    assert [b.id for b in client.messages.batches.list(limit=2, after_id=created[1]).data] == [created[0]]
    assert [b.id for b in client.messages.batches.list(limit=2)] == created[::-1]


def test_anthropic_expired_failed_and_deleted(batch_sim: MakeSim, clients: Any) -> None:
    """A batch past its (scaled) window ends with ``expired`` results; a forced failure errors every
    request; a batch deleted behind the client's back answers 404."""
    sim = batch_sim(BatchSettings(validating_s=0, delay_s=600, finalizing_s=0, time_scale=24 * 3600 / 0.5))
    _, client = clients(sim)
    expiring = client.messages.batches.create(requests=[message_request(f"e{i}", "p") for i in range(3)])
    done = wait_for_ended(client, expiring.id)
    assert done.request_counts.expired == 3
    assert {r.result.type for r in client.messages.batches.results(expiring.id)} == {"expired"}
    requests.post(sim.base_url + "/admin/batches", json={"time_scale": 1}, timeout=10).raise_for_status()
    failing = client.messages.batches.create(requests=[message_request(f"f{i}", "p") for i in range(2)])
    admin(sim, failing.id, action="fail", message="simulated refusal").raise_for_status()
    results = list(client.messages.batches.results(failing.id))
    assert [r.result.type for r in results] == ["errored", "errored"]
    assert "simulated refusal" in results[0].result.error.error.message  # type: ignore[union-attr]
    vanishing = client.messages.batches.create(requests=[message_request("v", "p")])
    admin(sim, vanishing.id, action="delete").raise_for_status()
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(vanishing.id)


def test_anthropic_refuses_a_malformed_batch(batch_sim: MakeSim, clients: Any) -> None:
    sim = batch_sim(BatchSettings(anthropic_max_requests=3))
    _, client = clients(sim)
    for bad in ([message_request("same", "a"), message_request("same", "b")],  # duplicate custom_id
                [message_request("has space", "a")],
                [message_request(f"n{i}", "a") for i in range(4)]):  # over the (lowered) limit
        with pytest.raises(anthropic.BadRequestError):
            client.messages.batches.create(requests=bad)
    assert batch_stats(sim)["anthropic"]["batches_created"] == 0


# --------------------------------------------------------------------------- plain HTTP: what the SDKs hide


def upload(sim: ThreadedSimulator, content: bytes, filename: str = "in.jsonl", purpose: str = "batch",
           headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(sim.url + "/files", files={"file": (filename, content)}, data={"purpose": purpose},
                         headers=headers, timeout=10)


def create(sim: ThreadedSimulator, headers: dict[str, str] | None = None, **body: Any) -> requests.Response:
    return requests.post(sim.url + "/batches", json={"endpoint": CHAT_URL, "completion_window": "24h", **body},
                         headers=headers, timeout=10)


def assert_error(response: requests.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["message"] and {"type", "code", "param"} <= set(error)
    if param is not None:
        assert error["param"] == param
    return error


def test_openai_refusals_at_upload_and_creation(batch_sim: MakeSim) -> None:
    sim = batch_sim(BatchSettings(openai_max_bytes=200))
    assert_error(requests.post(sim.url + "/files", json={"purpose": "batch"}, timeout=10), 400)
    assert_error(upload(sim, b"", purpose="nonsense"), 400, "purpose")
    assert assert_error(upload(sim, b"x" * 201), 400, "file")["code"] == "file_too_large"
    file_id = upload(sim, jsonl([chat_line("a", "b")])).json()["id"]
    other = upload(sim, b"{}", filename="notes.txt", purpose="user_data").json()["id"]
    assert_error(create(sim), 400, "input_file_id")
    assert_error(create(sim, input_file_id=file_id, endpoint="/v1/responses"), 400, "endpoint")
    assert_error(create(sim, input_file_id=file_id, completion_window="1h"), 400, "completion_window")
    assert_error(create(sim, input_file_id=file_id, metadata={f"k{i}": "v" for i in range(17)}), 400, "metadata")
    assert_error(create(sim, input_file_id=other), 400, "input_file_id")
    assert_error(create(sim, input_file_id="file-nope"), 404)
    assert_error(requests.get(sim.url + "/batches?limit=101", timeout=10), 400, "limit")
    assert_error(requests.put(sim.url + "/batches", timeout=10), 405)
    assert_error(requests.get(sim.url + "/batches/x/y/z", timeout=10), 404)
    assert_error(requests.get(sim.url + "/batches?after=batch_nope", timeout=10), 404)
    assert batch_stats(sim)["openai"]["batches_created"] == 0


@pytest.mark.parametrize(("content", "code", "line"), [
    (b"", "empty_file", None),
    (jsonl([chat_line(f"l{i}", "p") for i in range(4)]), "too_many_requests", 4),
])
def test_openai_file_level_validation(batch_sim: MakeSim, content: bytes, code: str, line: int | None) -> None:
    sim = batch_sim(BatchSettings(validating_s=0, delay_s=0, finalizing_s=0, openai_max_requests=3))
    batch_id = create(sim, input_file_id=upload(sim, content).json()["id"]).json()["id"]
    batch = wait_until(lambda: (b := requests.get(f"{sim.url}/batches/{batch_id}", timeout=10).json())["status"]
                       == "failed" and b, DEADLINE_S, interval=0.05, message="the batch to fail")
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [(code, line)]
    assert batch_stats(sim)["openai"]["requests_submitted"] == content.count(b"\n")


def test_openai_cancel_before_validation_and_of_a_failed_batch(batch_sim: MakeSim) -> None:
    sim = batch_sim(BatchSettings(validating_s=600, delay_s=0, finalizing_s=0))
    batch_id = create(sim, input_file_id=upload(sim, jsonl([chat_line("a", "b")])).json()["id"]).json()["id"]
    cancelled = requests.post(f"{sim.url}/batches/{batch_id}/cancel", timeout=10).json()
    assert cancelled["status"] == "cancelling"
    wait_until(lambda: requests.get(f"{sim.url}/batches/{batch_id}", timeout=10).json()["status"] == "cancelled",
               DEADLINE_S, interval=0.05, message="the batch to be cancelled")
    assert_error(requests.post(f"{sim.url}/batches/{batch_id}/cancel", timeout=10), 409)


def test_api_keys(batch_sim: MakeSim, clients: Any) -> None:
    """With ``--api-key``: Bearer for the OpenAI routes, ``x-api-key`` (or Bearer) for Anthropic's; admin open."""
    sim = batch_sim(api_key="sk-batch")
    assert_error(upload(sim, b"{}"), 401)
    assert upload(sim, jsonl([chat_line("a", "b")]), headers={"Authorization": "Bearer sk-batch"}).ok
    url = sim.base_url + "/v1/messages/batches"
    refused = requests.get(url, headers={"x-api-key": "wrong"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert refused.json()["type"] == "error" and refused.headers["request-id"]
    assert requests.get(url, headers={"x-api-key": "sk-batch", "anthropic-version": "2023-06-01"}, timeout=10).ok
    assert requests.get(url, headers={"Authorization": "Bearer sk-batch"}, timeout=10).ok
    assert requests.get(sim.base_url + "/admin/batches", timeout=10).ok
    _, client = clients(sim, key="sk-batch")
    assert client.messages.batches.create(requests=[message_request("a", "b")]).id.startswith("msgbatch_")


def test_anthropic_edges_over_http(batch_sim: MakeSim) -> None:
    sim = batch_sim(BatchSettings(validating_s=0, delay_s=600, finalizing_s=0, anthropic_max_bytes=2000))
    url = sim.base_url + "/v1/messages/batches"

    def error(response: requests.Response, status: int, kind: str) -> None:
        assert response.status_code == status, response.text
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind

    error(requests.post(url, json={"requests": [message_request("a", "x" * 3000)]}, timeout=10), 413,
          "request_too_large")
    error(requests.post(url, json={"requests": []}, timeout=10), 400, "invalid_request_error")
    error(requests.post(url, json={"requests": [{"custom_id": "a"}]}, timeout=10), 400, "invalid_request_error")
    error(requests.post(url, data=b"{", timeout=10), 400, "invalid_request_error")
    batch_id = requests.post(url, json={"requests": [message_request("a", "b")]}, timeout=10).json()["id"]
    error(requests.get(f"{url}/{batch_id}/results", timeout=10), 400, "invalid_request_error")
    error(requests.get(f"{url}/msgbatch_nope", timeout=10), 404, "not_found_error")
    error(requests.put(url, timeout=10), 405, "invalid_request_error")
    error(requests.get(url + "?limit=0", timeout=10), 400, "invalid_request_error")
    admin(sim, batch_id, action="process").raise_for_status()
    ended = wait_until(lambda: (b := requests.get(f"{url}/{batch_id}", timeout=10).json())["processing_status"]
                       == "ended" and b, DEADLINE_S, interval=0.05, message="the batch to end")
    results = requests.get(ended["results_url"], timeout=10)
    assert results.ok and [json.loads(line)["custom_id"] for line in results.text.splitlines()] == ["a"]
    error(requests.post(f"{url}/{batch_id}/cancel", timeout=10), 409, "invalid_request_error")


def test_stats_count_every_submitted_request_and_reset(batch_sim: MakeSim, clients: Any) -> None:
    """``requests_submitted`` counts every line of every batch created, per API and in all (the figure a
    "submitted ÷ records" check reads), failed batches' lines too; ``/stats/reset`` zeroes the counters
    but not the batches by status, which are what exists now."""
    sim = batch_sim(SLOW)
    openai_client, anthropic_client = clients(sim)
    upload_and_create(openai_client, [chat_line(f"o{i}", "p") for i in range(7)])
    upload_and_create(openai_client, [chat_line("dup", "p"), chat_line("dup", "p")])
    anthropic_client.messages.batches.create(requests=[message_request(f"a{i}", "p") for i in range(5)])
    stats = batch_stats(sim)
    assert (stats["openai"]["requests_submitted"], stats["anthropic"]["requests_submitted"]) == (9, 5)
    assert stats["requests_submitted"] == 14
    assert stats["openai"]["files_uploaded"] == 2 and stats["openai"]["batches_created"] == 2
    assert stats["anthropic"]["batches_by_status"]["in_progress"] == 1
    assert requests.get(sim.base_url + "/stats", timeout=10).json()["requests_total"] == 0  # realtime untouched
    requests.post(sim.base_url + "/stats/reset", timeout=10).raise_for_status()
    after = batch_stats(sim)
    assert after["requests_submitted"] == 0 and after["anthropic"]["batches_by_status"]["in_progress"] == 1


def test_admin_settings_and_forcing(batch_sim: MakeSim) -> None:
    sim = batch_sim(SLOW)
    url = sim.base_url + "/admin/batches"
    view = requests.post(url, json={"delay-s": "10:120", "error_rate": 0.05, "finalizing_s": [1, 2]},
                         timeout=10).json()
    assert view["settings"]["delay_s"] == "10:120" and view["settings"]["finalizing_s"] == "1:2"
    assert view["settings"]["error_rate"] == 0.05 and view["settings"]["window_s"] == 86400
    assert requests.get(sim.base_url + "/admin/config", timeout=10).json()["batch"]["delay_s"] == "10:120"
    for bad in ({"delay_s": "5:1"}, {"nonsense": 1}, {"error_rate": 2}, {"time_scale": 0}):
        assert_error(requests.post(url, json=bad, timeout=10), 400)
    batch_id = create(sim, input_file_id=upload(sim, jsonl([chat_line("a", "b")])).json()["id"]).json()["id"]
    listed = requests.get(url, timeout=10).json()["batches"]
    assert [(b["id"], b["api"], b["requests"]) for b in listed] == [(batch_id, "openai", 1)]
    for bad in ({"action": "explode"}, {"action": "expire", "extra": 1}, {"action": "process", "requests": -1},
                {"action": "fail", "line": 0}):
        assert_error(requests.post(f"{url}/{batch_id}", json=bad, timeout=10), 400)
    assert_error(requests.post(f"{url}/batch_nope", json={"action": "expire"}, timeout=10), 404)
    assert admin(sim, batch_id, action="process").json()["answered_now"] == 1  # validates first, then answers
    wait_until(lambda: requests.get(f"{sim.url}/batches/{batch_id}", timeout=10).json()["status"] == "completed",
               DEADLINE_S, interval=0.05, message="the processed batch to complete")
    assert_error(admin(sim, batch_id, action="expire"), 400)


def test_command_line_flags() -> None:
    help_text = build_parser().format_help()
    for flag in ("--batch-delay-s", "--batch-validating-s", "--batch-finalizing-s", "--batch-error-rate",
                 "--batch-error-status", "--batch-time-scale"):
        assert flag in help_text
    args = build_parser().parse_args(["--batch-delay-s", "10:120", "--batch-finalizing-s", "3",
                                      "--batch-error-rate", "0.05", "--batch-time-scale", "1440"])
    settings = config_from_args(args).batch
    assert (settings.delay_s, settings.finalizing_s, settings.error_rate) == ((10.0, 120.0), (3.0, 3.0), 0.05)
    assert settings.window_s == 60
    assert SimulatorConfig().batch == BatchSettings()
    with pytest.raises(ValueError, match="batch-delay-s"):
        config_from_args(build_parser().parse_args(["--batch-delay-s", "ten"]))
    assert parse_range("x", [1, 2]) == (1.0, 2.0) and parse_range("x", 3) == (3.0, 3.0)


def test_flags_reach_a_spawned_simulator() -> None:
    """``python -m jobs.dev.simulator --batch-*`` (what ``llmstream model-server`` runs): the settings it serves."""
    with spawn(["--batch-delay-s", "10:120", "--batch-finalizing-s", "2", "--batch-time-scale", "1440",
                "--batch-error-rate", "0.05", "--stats-interval-s", "0"], timeout=60) as sim:
        settings = requests.get(sim.base_url + "/admin/batches", timeout=10).json()["settings"]
        assert (settings["delay_s"], settings["finalizing_s"], settings["window_s"]) == ("10:120", "2", 60)
        assert settings["error_rate"] == 0.05 and sim.stats()["batches"]["requests_submitted"] == 0
