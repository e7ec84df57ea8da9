"""The lane contract: what every lane (keyed, vectorized, provider-batch) does with a record, the
same in each, on the fake PyFlink runtime (tests/support/fake_flink.py) against the simulator over
loopback HTTP (its realtime API, and its batch API for the provider-batch lane).

A lane decides only how records are grouped and when their calls are made (`udfs/lanes/base.py`);
decode, the user's functions, the call's answer, the output record, the dead letters and their
reasons, skipped and forwarded tombstones are one record path (`udfs/lanes/record_path.py`) and
one client. These tests hold each lane to that. What only one lane does (a provider's batch
outcomes, per-key order, the keyed lane's restore) is tested in that lane's own module.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.dev.simulator import ThreadedSimulator
from jobs.dev.simulator.batch_config import BatchSettings
from tests.support.fake_flink import Harness
from tests.support.reasons import documented_reasons
from udfs.config import JobConfig, config_from_dict
from udfs.lanes import record_path
from udfs.lanes.provider_batch.lane import BatchStage
from udfs.lanes.vectorized import VectorizedInference
from udfs.records import PendingRecord

LANES = ["keyed", "vectorized", "provider-batch"]
FAST = BatchSettings(validating_s=0.05, delay_s=(0.05, 0.2), finalizing_s=0.05)

Out = tuple[bytes | None, bytes | None, str, dict[str, Any] | None]
"""An outgoing record as a lane wrote it: key, value, topic, headers."""


def lane_config(lane: str, endpoint: str, **sections: Any) -> JobConfig:
    model = {"endpoint": endpoint, "model": "sim", "max_tokens": 8,
             "prices": {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}, **sections.pop("model", {})}
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "lane": lane,
        "model": model,
        "async": {"capacity": 8, "request_timeout_s": 5.0, "record_deadline_s": 20.0},
        "retry": {"max_attempts": 2, "initial_backoff_s": 0.001, "max_backoff_s": 0.005},
        "provider_batch": {"max_requests": 40, "max_wait_s": 0.2, "poll_initial_s": 0.05, "poll_max_s": 0.2},
        **sections,
    })


class _FunctionContext:
    def get_metric_group(self) -> None:
        return None


def run(config: JobConfig, values: list[bytes | None], *, keys: list[bytes | None] | None = None,
        headers: dict[str, bytes | None] | None = None) -> list[Out]:
    """`values` through the lane `config` runs, to the end of the input: what it wrote."""
    keys = keys if keys is not None else [f"k{i}".encode() for i in range(len(values))]
    if config.lane == "vectorized":
        function = VectorizedInference(config)
        function.open(_FunctionContext())  # type: ignore[arg-type]
        try:
            records = [PendingRecord(k, v, "in", 0, i, 1_700_000_000_000, tuple((headers or {}).items()) or None)
                       for i, (k, v) in enumerate(zip(keys, values, strict=True))]
            settled = function.outcomes(records)
        finally:
            function.close()
        return [(s.row.key, s.row.value, s.row.topic, s.row.headers or None)
                for s in settled if s is not None and s.row is not None]
    h = Harness(config, function=BatchStage(config) if config.lane == "provider-batch" else None)
    try:
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            h.element(i % 3, v, offset=i, key=k, headers=headers)
        h.end_of_input()
    finally:
        h.close()
    return [(r[0], r[1], r[2], r[3] or None) for r in h.out]


def bodies(out: list[Out], topic: str) -> list[dict[str, Any]]:
    return [json.loads(v) for _, v, t, _ in out if t == topic and v is not None]


def reasons(out: list[Out]) -> dict[str, str]:
    return {str(b.get("id")): b["reason"] for b in bodies(out, "dlq")}


@pytest.fixture
def sim(make_sim: Callable[..., ThreadedSimulator]) -> ThreadedSimulator:
    return make_sim(batch=FAST, latency="0")


def _ask(i: int, **fields: Any) -> bytes:
    return json.dumps({"id": f"id-{i}", "prompt": f"question {i}", **fields}).encode()


@pytest.mark.parametrize("lane", LANES)
def test_a_record_is_decoded_called_and_written_with_its_headers(lane: str, sim: ThreadedSimulator) -> None:
    out = run(lane_config(lane, sim.url), [_ask(i) for i in range(5)], headers={"traceparent": b"00-1"})
    results = bodies(out, "out")
    assert sorted(b["id"] for b in results) == [f"id-{i}" for i in range(5)] and reasons(out) == {}
    assert all(b["output"].startswith("Simulated answer to: question") for b in results)
    assert all(b["usage"]["prompt_tokens"] > 0 and b["cost"] > 0 for b in results)
    assert {json.dumps(h, default=repr) for *_, h in out} == {json.dumps({"traceparent": b"00-1"}, default=repr)}


BAD_INPUT = {
    b"\xff\xfe": "invalid_utf8",
    b"{not json": "invalid_json",
    b"[1, 2]": "not_an_object",
    json.dumps({"id": "x"}).encode(): "missing_field",
    json.dumps({"id": "x", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}).encode(): "ambiguous_input",
    json.dumps({"id": 7, "prompt": "a"}).encode(): "wrong_type",
    json.dumps({"id": " ", "prompt": "a"}).encode(): "empty_id",
    json.dumps({"id": "x", "prompt": "a", "params": {"bogus": 1}}).encode(): "invalid_params",
    json.dumps({"id": "x", "prompt": "a" * 400}).encode(): "context_too_long",
}
"""Input the record path refuses, and the reason each dead letter says."""


@pytest.mark.parametrize("lane", LANES)
def test_every_bad_input_is_the_same_dead_letter_in_every_lane(lane: str, sim: ThreadedSimulator) -> None:
    config = lane_config(lane, sim.url, model={"max_input_tokens": 50}, input={"tombstones": "dead-letter"},
                         limits={"max_record_bytes": 2000})
    values: list[bytes | None] = [*BAD_INPUT, None, b"{" + b" " * 3000 + b"}", _ask(1)]
    out = run(config, values)
    got = [b["reason"] for b in bodies(out, "dlq")]
    assert sorted(got) == sorted([*BAD_INPUT.values(), "null_value", "record_too_large"])
    assert set(got) <= documented_reasons()
    assert [b["id"] for b in bodies(out, "out")] == ["id-1"]
    letters = bodies(out, "dlq")
    assert all(letter["original"] is not None or letter["reason"] == "null_value" for letter in letters)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize(("tombstones", "written"), [("skip", []), ("forward", [(b"gone", None, "out")])])
def test_a_tombstone_is_skipped_or_forwarded(lane: str, tombstones: str, written: list[Any],
                                             sim: ThreadedSimulator) -> None:
    out = run(lane_config(lane, sim.url, input={"tombstones": tombstones}), [None], keys=[b"gone"])
    assert [(k, v, t) for k, v, t, _ in out] == written


@pytest.mark.parametrize("lane", LANES)
def test_an_answer_too_large_for_a_result_is_a_dead_letter(lane: str, sim: ThreadedSimulator) -> None:
    out = run(lane_config(lane, sim.url, limits={"max_result_bytes": 200}), [_ask(1)])
    assert reasons(out) == {"id-1": "result_too_large"}


@pytest.mark.parametrize("lane", LANES)
def test_a_vector_of_the_wrong_length_is_unsupported_in_every_lane(lane: str, sim: ThreadedSimulator) -> None:
    """The provider-batch lane once read answers with a copy of the client's reader that skipped this check."""
    config = lane_config(lane, sim.url, model={"api": "embeddings", "embedding_dim": 3})
    out = run(config, [json.dumps({"id": f"id-{i}", "prompt": f"text {i}"}).encode() for i in range(3)])
    assert reasons(out) == {f"id-{i}": "unsupported_response" for i in range(3)}


@pytest.mark.parametrize("lane", LANES)
def test_structured_output_is_validated_and_written_in_every_lane(lane: str, sim: ThreadedSimulator) -> None:
    schema = {"type": "object", "properties": {"label": {"type": "string", "enum": ["a", "b"]}},
              "required": ["label"], "additionalProperties": False}
    out = run(lane_config(lane, sim.url, model={"response_format": schema}), [_ask(i) for i in range(4)])
    results = bodies(out, "out")
    assert reasons(out) == {} and len(results) == 4
    assert all(b["output_json"]["label"] in ("a", "b") for b in results)


@pytest.mark.parametrize("lane", LANES)
def test_an_internal_error_is_a_dead_letter_never_a_raise(lane: str, sim: ThreadedSimulator,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real = record_path.decode

    def decode(key: Any, value: Any, *args: Any) -> Any:
        if value is not None and b"boom" in value:
            raise RuntimeError("a bug")
        return real(key, value, *args)
    monkeypatch.setattr(record_path, "decode", decode)
    out = run(lane_config(lane, sim.url), [_ask(1), _ask(2, note="boom")])
    assert reasons(out) == {"id-2": "internal_error"} and [b["id"] for b in bodies(out, "out")] == ["id-1"]


USER_MODULE = '''
def preprocess(record):
    if record.get("kind") == "skip":
        return None
    if record.get("kind") == "raise":
        raise KeyError("subject")
    return {"id": "ticket-" + str(record["n"]), "prompt": "Ask " + record["text"]}


def postprocess(record, result):
    if record.get("kind") == "post-raise":
        raise ValueError("no label")
    if result is None:
        return {"n": record.get("n"), "skipped": True}
    return {"n": record["n"], "answer": result["output"], "id": result["id"]}
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    directory = tmp_path / "code"
    directory.mkdir()
    (directory / "lanemod.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(directory))
    sys.modules.pop("lanemod", None)
    yield
    sys.modules.pop("lanemod", None)


@pytest.mark.parametrize("lane", LANES)
def test_the_users_functions_shape_the_call_and_the_output_in_every_lane(lane: str, sim: ThreadedSimulator,
                                                                         user_module: None) -> None:
    config = lane_config(lane, sim.url, model={"preprocess": "lanemod:preprocess", "skipped": "forward"},
                         output={"postprocess": "lanemod:postprocess"})
    values = [json.dumps(v).encode() for v in (
        {"n": 1, "text": "one"}, {"n": 2, "text": "two"}, {"n": 3, "kind": "skip"},
        {"n": 4, "kind": "raise"}, {"n": 5, "text": "five", "kind": "post-raise"})]
    out = run(config, values)
    written = sorted(bodies(out, "out"), key=lambda b: b["n"])
    assert [b["n"] for b in written] == [1, 2, 3]
    assert written[0]["id"] == "ticket-1" and written[0]["answer"].startswith("Simulated answer to: Ask one")
    assert written[2] == {"n": 3, "skipped": True}
    assert sorted(b["reason"] for b in bodies(out, "dlq")) == ["user_function_error", "user_function_error"]


@pytest.mark.parametrize("lane", LANES)
def test_answers_that_never_validate_are_asked_again_then_dead_lettered(
        lane: str, make_sim: Callable[..., ThreadedSimulator]) -> None:
    """`model.max_invalid_retries` more answers, then `invalid_model_output`: the realtime lanes ask
    again at once, the provider-batch lane in a later batch."""
    sim = make_sim(batch=FAST, latency="0", invalid_json_rate=1.0)
    schema = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}
    config = lane_config(lane, sim.url, model={"response_format": schema, "max_invalid_retries": 1})
    out = run(config, [_ask(i) for i in range(3)])
    assert reasons(out) == {f"id-{i}": "invalid_model_output" for i in range(3)}
    assert {b["attempts"] for b in bodies(out, "dlq")} == {2}


@pytest.mark.parametrize("lane", LANES)
def test_embeddings_with_embedding_batches_get_one_vector_each(lane: str, sim: ThreadedSimulator) -> None:
    """`model.batch.max_size` groups the realtime calls of embeddings; a provider's batch has a line
    per record whatever it says, so the provider-batch lane takes the setting too."""
    config = lane_config(lane, sim.url, model={"api": "embeddings", "batch": {"max_size": 4}})
    out = run(config, [json.dumps({"id": f"id-{i}", "prompt": f"text {i}"}).encode() for i in range(6)])
    results = bodies(out, "out")
    assert reasons(out) == {} and sorted(b["id"] for b in results) == [f"id-{i}" for i in range(6)]
    assert all(isinstance(b["output"], list) and len(b["output"]) > 1 for b in results)


@pytest.mark.parametrize("lane", LANES)
def test_a_fleet_answers_every_record_once_in_every_lane(lane: str, make_sim: Callable[..., ThreadedSimulator]) -> None:
    """`model.endpoints` in every lane (the provider-batch lane makes each batch whole at one of them):
    every record answered once, by an endpoint of the fleet, asking for that endpoint's model."""
    sims = [make_sim(batch=FAST, latency="0") for _ in range(2)]
    endpoints = [{"url": s.url, "name": f"e{i}", "model": f"sim-{i}"} for i, s in enumerate(sims)]
    config = lane_config(lane, sims[0].url, model={"endpoint": None, "endpoints": endpoints})
    out = run(config, [_ask(i) for i in range(12)])
    results = bodies(out, "out")
    assert sorted(b["id"] for b in results) == sorted(f"id-{i}" for i in range(12)) and reasons(out) == {}
    urls = {s.url.rstrip("/") for s in sims}
    assert all(b["model"] in ("sim-0", "sim-1") and any(b["endpoint"].startswith(u) for u in urls) for b in results)
