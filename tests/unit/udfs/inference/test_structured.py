"""Structured output without a JVM: schema loading (inline, file, bad), validation of answers,
the invalid-answer retry count, and how requests ask for the schema."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import ClientSession, web

from jobs.dev.simulator import ThreadedSimulator
from tests.support.calls import run
from tests.support.configs import job_config, request
from tests.support.servers import serve_app
from udfs.config import DEFAULT_CONFIG, config_from_dict, load_config, with_overrides
from udfs.errors import ConfigError, InvalidModelOutput, RetryableError
from udfs.inference.client import InferenceClient
from udfs.inference.prompts import build_payload
from udfs.inference.structured import (
    Invalid,
    StructuredOutput,
    extract_json_text,
    load_schema,
    prompt_instruction,
    schema_name,
)
from udfs.records import Completion, Request, SourceRef, dead_letter
from udfs.records.encode import result_value

EXAMPLE = Path(__file__).resolve().parents[4] / "jobs" / "examples" / "structured-sentiment.yaml"
SCHEMA: dict[str, Any] = {
    "title": "Sentiment and topic",
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "topic": {"type": "string", "minLength": 1},
    },
    "required": ["sentiment", "topic"],
    "additionalProperties": False,
}


def _config(**model: Any) -> Any:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["model"].update(model)
    return config_from_dict(data)


def _error(**model: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _config(**model)
    return info.value


def test_inline_schema_is_kept_and_checked() -> None:
    config = _config(response_format=SCHEMA)
    assert config.model.response_format == SCHEMA
    assert config.model.response_format_mode == "native"
    assert config.model.max_invalid_retries == 2


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_schema_file_is_read_at_load_and_carried_by_the_config(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"schema{suffix}"
    path.write_text(json.dumps(SCHEMA) if suffix == ".json" else yaml.safe_dump(SCHEMA))
    config = _config(response_format=str(path))
    path.unlink()  # a worker never needs the file
    assert config.model.response_format == SCHEMA
    assert StructuredOutput.from_config(config.model) is not None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"type": "objekt"}, "not a valid JSON Schema at type"),
        ({"type": "object", "properties": {"a": {"minLength": -1}}}, "not a valid JSON Schema at properties/a"),
        ("/nonexistent/schema.json", "cannot read schema file '/nonexistent/schema.json'"),
        (7, "expected"),
        ([1, 2], "expected"),
    ],
)
def test_bad_schema_is_a_config_error_naming_the_key(value: Any, problem: str) -> None:
    err = _error(response_format=value)
    assert err.key == "model.response_format"
    assert problem in err.problem


def test_schema_file_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "schema.json"
    path.write_text("{not json")
    err = _error(response_format=str(path))
    assert err.key == "model.response_format" and "not valid JSON/YAML" in err.problem


def test_other_structured_keys_are_checked() -> None:
    assert _error(response_format=SCHEMA, api="embeddings").key == "model.response_format"
    assert _error(response_format_mode="grammar").key == "model.response_format_mode"
    assert _error(max_invalid_retries=-1).key == "model.max_invalid_retries"
    assert _config(max_invalid_retries=0).model.max_invalid_retries == 0


def test_load_schema_accepts_a_mapping_as_is() -> None:
    assert load_schema(SCHEMA, "k") is SCHEMA


def test_schema_name_follows_openai_rules() -> None:
    assert schema_name(SCHEMA) == "Sentiment_and_topic"
    assert schema_name({"type": "object"}) == "output"
    assert schema_name({"title": "!!!"}) == "output"
    assert len(schema_name({"title": "x" * 100})) == 64


def test_valid_answers_parse_invalid_ones_say_why() -> None:
    structured = StructuredOutput(SCHEMA)
    assert structured.check('{"sentiment": "positive", "topic": "food"}') == {"sentiment": "positive",
                                                                               "topic": "food"}
    assert structured.check('```json\n{"sentiment": "neutral", "topic": "x"}\n```')["sentiment"] == "neutral"
    wrong_enum = structured.check('{"sentiment": "meh", "topic": "food"}')
    assert isinstance(wrong_enum, Invalid) and "$.sentiment" in wrong_enum.message and "'meh'" in wrong_enum.message
    missing = structured.check('{"sentiment": "positive"}')
    assert isinstance(missing, Invalid) and "'topic' is a required property" in missing.message
    not_json = structured.check("Sure! Here is the JSON you asked for")
    assert isinstance(not_json, Invalid) and not_json.message.startswith("not JSON")
    assert isinstance(structured.check([0.1, 0.2]), Invalid)


def test_fence_stripping_only_strips_a_whole_fence() -> None:
    assert extract_json_text('  {"a": 1}\n') == '{"a": 1}'
    assert extract_json_text('```\n{"a": 1}\n```') == '{"a": 1}'
    assert extract_json_text('text ```json\n{"a": 1}\n```') == 'text ```json\n{"a": 1}\n```'


def _request(**fields: Any) -> Request:
    return Request(id="r1", key=None, source=SourceRef("in", 0, 1), prompt="I loved the soup", fields=fields)


def test_native_mode_sends_openai_response_format() -> None:
    model = _config(response_format=SCHEMA, system_prompt=None).model
    payload = build_payload(_request(), model)
    assert payload["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "Sentiment_and_topic", "schema": SCHEMA}}
    assert payload["messages"] == [{"role": "user", "content": "I loved the soup"}]
    completions = build_payload(_request(), replace(model, api="completions"))
    assert completions["response_format"]["json_schema"]["schema"] == SCHEMA


def test_prompt_mode_asks_in_the_prompt_and_sends_no_response_format() -> None:
    model = _config(response_format=SCHEMA, response_format_mode="prompt", system_prompt="Be brief.").model
    payload = build_payload(_request(), model)
    assert "response_format" not in payload
    system = payload["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    assert system["content"].endswith(prompt_instruction(SCHEMA))
    assert json.dumps(SCHEMA, separators=(",", ":")) in system["content"]
    no_system = build_payload(_request(), replace(model, system_prompt=None))
    assert no_system["messages"][0] == {"role": "system", "content": prompt_instruction(SCHEMA)}
    completions = build_payload(_request(), replace(model, api="completions"))
    assert completions["prompt"].startswith("Be brief.\n\n" + prompt_instruction(SCHEMA))
    assert completions["prompt"].endswith("I loved the soup")


def test_no_schema_leaves_the_request_alone() -> None:
    payload = build_payload(_request(), _config(system_prompt=None).model)
    assert "response_format" not in payload
    assert payload["messages"] == [{"role": "user", "content": "I loved the soup"}]


def _completion(output: str, attempts: int = 1, started_ms: int = 0, cost: float | None = None) -> Completion:
    return Completion(output=output, model="m", finish_reason="stop", prompt_tokens=10, completion_tokens=5,
                      latency_ms=100.0, attempts=attempts, endpoint="http://x", started_ms=started_ms,
                      completed_ms=started_ms + 100, cost=cost)


class Answers:
    """Hands out the scripted answers (or raises the scripted errors) one call at a time."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls = 0

    async def __call__(self) -> Completion:
        item = self.script[self.calls]
        self.calls += 1
        if isinstance(item, Exception):
            raise item
        return item if isinstance(item, Completion) else _completion(item)


VALID = '{"sentiment": "negative", "topic": "rain"}'


def test_a_valid_first_answer_is_taken() -> None:
    answers = Answers(VALID)
    completion = asyncio.run(StructuredOutput(SCHEMA, max_invalid_retries=2).until_valid(answers))
    assert answers.calls == 1
    assert completion.structured and completion.output_json == json.loads(VALID)
    assert completion.invalid_answers == 0 and completion.attempts == 1


def test_invalid_answers_are_retried_and_paid_rounds_summed() -> None:
    answers = Answers(_completion("nope", started_ms=1000, cost=0.5),
                      _completion('{"sentiment": "x"}', attempts=3, started_ms=1200, cost=0.5),
                      _completion(VALID, started_ms=1900, cost=0.25))
    completion = asyncio.run(StructuredOutput(SCHEMA, max_invalid_retries=2).until_valid(answers))
    assert answers.calls == 3
    assert completion.output_json == json.loads(VALID) and completion.output == VALID
    assert completion.invalid_answers == 2 and completion.attempts == 5
    assert (completion.prompt_tokens, completion.completion_tokens) == (30, 15)
    assert completion.cost == 1.25
    assert completion.started_ms == 1000 and completion.latency_ms == 1000.0


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_after_max_invalid_retries_the_last_answer_is_dead_lettered(retries: int) -> None:
    script = [f'{{"sentiment": "bad{i}", "topic": "t"}}' for i in range(retries + 1)] + [VALID]
    answers = Answers(*script)
    with pytest.raises(InvalidModelOutput) as info:
        asyncio.run(StructuredOutput(SCHEMA, max_invalid_retries=retries).until_valid(answers))
    assert answers.calls == retries + 1  # the valid answer after the allowance is never asked for
    err = info.value
    assert err.reason == "invalid_model_output"
    assert err.last_output == script[retries]
    assert f"'bad{retries}'" in err.detail and "$.sentiment" in err.detail
    assert err.attempts == retries + 1 and err.status == 200


def test_a_transport_failure_in_a_later_round_keeps_its_own_reason_and_all_attempts() -> None:
    answers = Answers(_completion("nope", attempts=2), RetryableError("HTTP 503", status=503, attempts=4))
    with pytest.raises(RetryableError) as info:
        asyncio.run(StructuredOutput(SCHEMA, max_invalid_retries=2).until_valid(answers))
    assert info.value.attempts == 6


def test_no_schema_means_no_structured_output() -> None:
    assert StructuredOutput.from_config(_config().model) is None


# ------------------------------------------------------------------ through the client, over HTTP


class ScriptedServer:
    """A chat endpoint that answers the scripted contents in turn (an int is an HTTP error status)
    and keeps every request body it got."""

    def __init__(self, *script: str | int) -> None:
        self.script = list(script)
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, req: web.Request) -> web.Response:
        self.bodies.append(await req.json())
        item = self.script[min(len(self.bodies), len(self.script)) - 1]
        if isinstance(item, int):
            return web.json_response({"error": {"message": "busy"}}, status=item)
        return web.json_response({"model": "m", "choices": [{"message": {"role": "assistant", "content": item},
                                                             "finish_reason": "stop"}]})

    async def complete(self, model: dict[str, Any], *reqs: Request, **sections: Any) -> list[Any]:
        runner, url = await serve_app([web.post("/v1/chat/completions", self.handle)])
        outcomes: list[Any] = []
        try:
            config = with_overrides(job_config(url, model={"response_format": SCHEMA, **model}), **sections)
            async with InferenceClient(config) as client:
                for req in reqs:
                    try:
                        outcomes.append(await client.complete(req))
                    except Exception as err:  # noqa: BLE001 - the test inspects whatever was raised
                        outcomes.append(err)
        finally:
            await runner.cleanup()
        return outcomes


def test_the_client_asks_again_until_an_answer_validates_and_http_retries_stay_separate() -> None:
    server = ScriptedServer("nope", 503, '{"sentiment": "meh", "topic": "x"}', VALID)
    [completion] = run(lambda: server.complete({"max_invalid_retries": 2}, request()))
    assert isinstance(completion, Completion), completion
    assert completion.output_json == json.loads(VALID) and completion.invalid_answers == 2
    assert completion.attempts == 4  # 3 answers + the 503's retry, which used no invalid-answer allowance
    assert len(server.bodies) == 4
    assert all(body["response_format"]["json_schema"]["schema"] == SCHEMA for body in server.bodies)
    value = json.loads(result_value(request(), completion))
    assert value["output_json"] == json.loads(VALID) and value["output"] == VALID and value["invalid_answers"] == 2


def test_the_client_dead_letters_the_last_invalid_answer_with_the_validators_message() -> None:
    server = ScriptedServer('{"sentiment": "meh", "topic": "x"}')
    [err] = run(lambda: server.complete({"max_invalid_retries": 1}, request()))
    assert isinstance(err, InvalidModelOutput), err
    assert len(server.bodies) == 2 and err.attempts == 2
    row = dead_letter.for_error(err, key=b"k", value=b'{"prompt": "p"}', source=SourceRef("in", 0, 42),
                                record_id="r-1", job="j", topic="dlq")
    body = json.loads(row.value)
    assert row.topic == "dlq" and body["reason"] == "invalid_model_output"
    assert body["last_output"] == '{"sentiment": "meh", "topic": "x"}'
    assert "$.sentiment" in body["error"] and "'meh' is not one of" in body["error"]
    assert body["attempts"] == 2 and body["last_status"] == 200


def test_no_schema_means_no_output_json_in_the_record() -> None:
    server = ScriptedServer("plain text")
    [completion] = run(lambda: server.complete({"response_format": None}, request()))
    assert isinstance(completion, Completion) and not completion.structured
    assert "output_json" not in json.loads(result_value(request(), completion))
    assert "response_format" not in server.bodies[0]


def test_the_cache_never_stores_an_invalid_answer(tmp_path: Path) -> None:
    server = ScriptedServer("nope", VALID, '{"sentiment": "meh", "topic": "x"}')
    cache = {"cache": {"backend": "local", "path": str(tmp_path / "cache.sqlite")}}
    first, second = run(lambda: server.complete({"temperature": 0.0, "max_invalid_retries": 1}, request(), request(),
                                                **cache))
    assert isinstance(first, Completion) and first.output_json == json.loads(VALID) and not first.cached
    assert isinstance(second, Completion) and second.cached and second.output_json == json.loads(VALID)
    assert len(server.bodies) == 2  # the second record was answered from the cache: the valid answer


# ------------------------------------------------------------------ the simulator's schema-shaped answers


def _ask_sim(url: str, prompts: list[str], response_format: Any) -> list[tuple[int, dict[str, Any]]]:
    async def go() -> list[tuple[int, dict[str, Any]]]:
        out = []
        async with ClientSession() as session:
            for prompt in prompts:
                body = {"model": "m", "messages": [{"role": "user", "content": prompt}],
                        "response_format": response_format}
                async with session.post(url + "/chat/completions", json=body) as response:
                    out.append((response.status, await response.json()))
        return out

    return run(go)


NATIVE = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}


def test_the_simulator_answers_valid_instances_of_the_schema_by_default(sim: ThreadedSimulator) -> None:
    answers = _ask_sim(sim.url, [f"review number {i}: the soup was cold" for i in range(30)], NATIVE)
    structured = StructuredOutput(SCHEMA)
    for status, body in answers:
        assert status == 200
        value = structured.check(body["choices"][0]["message"]["content"])
        assert not isinstance(value, Invalid), value
        assert value["sentiment"] in ("positive", "neutral", "negative") and value["topic"]
    stats = sim.stats()
    assert stats["structured_answers"] == 30 and stats["invalid_answers"] == 0


def test_the_simulators_invalid_share_is_what_its_stats_say(make_sim: Any) -> None:
    sim = make_sim(invalid_json_rate=0.3, seed=7)
    answers = _ask_sim(sim.url, [f"ticket {i} about billing" for i in range(200)], NATIVE)
    structured = StructuredOutput(SCHEMA)
    invalid = sum(isinstance(structured.check(body["choices"][0]["message"]["content"]), Invalid)
                  for _, body in answers)
    stats = sim.stats()
    assert stats["structured_answers"] == 200 and stats["invalid_answers"] == invalid
    assert 30 <= invalid <= 90  # 30% of 200, with a wide margin for chance


def test_the_simulator_refuses_a_malformed_response_format(sim: ThreadedSimulator) -> None:
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
                {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 5}}}):
        [(status, body)] = _ask_sim(sim.url, ["x"], bad)
        assert status == 400 and body["error"]["param"] == "response_format"


def test_counts_agree_between_client_outcomes_and_the_simulator(make_sim: Any) -> None:
    """Each valid output used one valid answer and its `invalid_answers` invalid ones; each
    dead letter used 1 + max_invalid_retries invalid ones: the simulator's counters must match."""
    sim = make_sim(invalid_json_rate=0.5, seed=3)
    config = job_config(sim.url, model={"response_format": SCHEMA, "max_invalid_retries": 1})

    counted: list[int] = []

    async def go() -> list[Any]:
        outcomes: list[Any] = []
        async with InferenceClient(config) as client:
            for i in range(60):
                try:
                    outcomes.append(await client.complete(request(f"message {i}")))
                except InvalidModelOutput as err:
                    outcomes.append(err)
            counted.append(client.metrics.invalid_answers.value)
        return outcomes

    outcomes = run(go)
    done = [o for o in outcomes if isinstance(o, Completion)]
    dead = [o for o in outcomes if isinstance(o, InvalidModelOutput)]
    assert len(done) + len(dead) == 60 and done and dead
    stats = sim.stats()
    assert stats["structured_answers"] - stats["invalid_answers"] == len(done)
    assert stats["invalid_answers"] == 2 * len(dead) + sum(c.invalid_answers for c in done)
    assert counted == [stats["invalid_answers"]]  # the `invalid_answers` metric counts the same answers


def test_the_structured_example_config_loads_with_its_schema() -> None:
    config = load_config(EXAMPLE)
    structured = StructuredOutput.from_config(config.model)
    assert structured is not None and structured.max_invalid_retries == 2
    assert structured.schema["required"] == ["sentiment", "topic", "confidence"]
    assert not isinstance(structured.check('{"sentiment": "negative", "topic": "delivery", "confidence": 0.9}'),
                          Invalid)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_prompt_mode_against_the_simulator_which_follows_the_instruction(sim: ThreadedSimulator, api: str) -> None:
    config = job_config(sim.url, model={"response_format": SCHEMA, "response_format_mode": "prompt", "api": api,
                                        "max_tokens": 64})

    async def go() -> Completion:
        async with InferenceClient(config) as client:
            return await client.complete(request("The soup was cold"))

    completion = run(go)
    assert completion.structured and completion.invalid_answers == 0
    assert completion.output_json["sentiment"] in ("positive", "neutral", "negative")
    assert sim.stats()["structured_answers"] == 1


def test_json_object_mode_sends_the_older_form_and_the_simulator_honours_it(sim: ThreadedSimulator) -> None:
    model = _config(response_format=SCHEMA, response_format_mode="json_object", system_prompt=None).model
    assert build_payload(_request(), model)["response_format"] == {"type": "json_object", "schema": SCHEMA}
    config = job_config(sim.url, model={"response_format": SCHEMA, "response_format_mode": "json_object"})

    async def go() -> Completion:
        async with InferenceClient(config) as client:
            return await client.complete(request("The soup was cold"))

    completion = run(go)
    assert completion.structured and set(completion.output_json) == {"sentiment", "topic"}
