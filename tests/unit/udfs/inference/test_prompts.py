"""Request bodies built from records: templates, params, APIs and the context guard."""

from __future__ import annotations

import dataclasses

import pytest

from udfs.config import ModelConfig
from udfs.errors import BadInput, ContextTooLong
from udfs.inference.prompts import build_payload, estimate_tokens, input_tokens
from udfs.records import Request, SourceRef

SOURCE = SourceRef("requests", 0, 7)


def model(**changes: object) -> ModelConfig:
    base = ModelConfig(endpoint="http://127.0.0.1:1/v1", model="sim", max_tokens=64)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def prompt_request(prompt: str = "Why is the sky blue?", **changes: object) -> Request:
    fields = {"id": "r1", "prompt": prompt}
    return Request(**{"id": "r1", "key": None, "source": SOURCE, "prompt": prompt, "fields": fields,
                      **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "tokens"), [("", 1), ("a", 1), ("abcd", 1), ("abcde", 2), ("x" * 400, 100)])
def test_estimate_tokens_is_chars_over_four_rounded_up_at_least_one(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens


def test_chat_body_has_system_prompt_then_the_prompt_and_model_settings() -> None:
    body = build_payload(prompt_request(), model(system_prompt="Be brief.", temperature=0.2))
    assert body == {
        "model": "sim", "max_tokens": 64, "temperature": 0.2,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Why is the sky blue?"}],
    }


def test_chat_body_uses_the_records_messages_when_given() -> None:
    messages = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "how are you?"})
    request = Request(id="r", key=None, source=SOURCE, messages=messages, fields={"id": "r"})
    body = build_payload(request, model(system_prompt="S"))
    assert body["messages"] == [{"role": "system", "content": "S"}, *map(dict, messages)]


def test_template_is_filled_from_the_records_fields() -> None:
    request = Request(id="r", key=None, source=SOURCE, prompt="the text",
                      fields={"id": "r", "prompt": "the text", "lang": "French"})
    body = build_payload(request, model(prompt_template="Translate to {lang}: {prompt}"))
    assert body["messages"] == [{"role": "user", "content": "Translate to French: the text"}]


def test_a_template_field_the_record_lacks_is_bad_input_not_a_model_error() -> None:
    with pytest.raises(BadInput) as caught:
        build_payload(prompt_request(), model(prompt_template="Translate to {lang}: {prompt}"))
    assert caught.value.reason == "template_field_missing"
    assert "lang" in caught.value.detail


def test_record_params_override_the_model_settings_and_unknown_ones_are_ignored() -> None:
    params = {"model": "other", "max_tokens": 5, "temperature": 0.9, "top_p": 0.5, "stop": ["\n"],
              "seed": 3, "presence_penalty": 0.1, "frequency_penalty": 0.2, "logit_bias": {"1": 100}}
    body = build_payload(prompt_request(params=params), model(temperature=0.0))
    assert {k: v for k, v in body.items() if k != "messages"} == {k: v for k, v in params.items()
                                                                   if k != "logit_bias"}


def test_unset_model_settings_are_left_out_of_the_body() -> None:
    body = build_payload(prompt_request(), model(max_tokens=None, temperature=None))
    assert set(body) == {"model", "messages"}


def test_completions_body_is_one_prompt_string_with_the_system_prompt_first() -> None:
    body = build_payload(prompt_request("Q?"), model(api="completions", system_prompt="S"))
    assert body == {"model": "sim", "max_tokens": 64, "prompt": "S\n\nQ?"}


def test_embeddings_body_is_the_filled_template_and_takes_only_the_model_param() -> None:
    request = prompt_request("embed me", params={"model": "emb", "max_tokens": 9, "temperature": 1.0})
    body = build_payload(request, model(api="embeddings", system_prompt="ignored"))
    assert body == {"model": "emb", "input": "embed me"}


@pytest.mark.parametrize("api", ["completions", "embeddings"])
def test_chat_messages_cannot_go_to_a_prompt_api(api: str) -> None:
    request = Request(id="r", key=None, source=SOURCE, messages=({"role": "user", "content": "x"},))
    with pytest.raises(BadInput) as caught:
        build_payload(request, model(api=api))
    assert caught.value.reason == "messages_unsupported"


def test_input_over_the_token_budget_is_dead_lettered_as_context_too_long() -> None:
    with pytest.raises(ContextTooLong) as caught:
        build_payload(prompt_request("x" * 400), model(max_input_tokens=50))
    assert isinstance(caught.value, BadInput)  # it never reaches the model
    assert caught.value.reason == "context_too_long"
    assert caught.value.attempts == 0


def test_truncate_keeps_the_start_of_the_user_content_within_the_budget() -> None:
    text = "".join(f"{i:04d}" for i in range(100))
    body = build_payload(prompt_request(text), model(max_input_tokens=30, system_prompt="x" * 40,
                                                     on_context_overflow="truncate"))
    user = body["messages"][-1]["content"]
    assert text.startswith(user) and len(user) == (30 - 10) * 4
    assert input_tokens(body) <= 30


def test_truncate_cuts_the_last_user_message_of_a_conversation() -> None:
    messages = ({"role": "user", "content": "a" * 40}, {"role": "assistant", "content": "b" * 40},
                {"role": "user", "content": "c" * 400})
    request = Request(id="r", key=None, source=SOURCE, messages=messages)
    body = build_payload(request, model(max_input_tokens=40, on_context_overflow="truncate"))
    assert [m["content"] for m in body["messages"]] == ["a" * 40, "b" * 40, "c" * 80]


@pytest.mark.parametrize("api", ["completions", "embeddings"])
def test_truncate_applies_to_prompt_apis_too(api: str) -> None:
    body = build_payload(prompt_request("y" * 1000), model(api=api, max_input_tokens=10,
                                                           on_context_overflow="truncate"))
    assert input_tokens(body) <= 10


def test_truncate_cannot_help_when_the_system_prompt_alone_is_too_long() -> None:
    with pytest.raises(ContextTooLong):
        build_payload(prompt_request("hi"), model(max_input_tokens=10, system_prompt="s" * 100,
                                                  on_context_overflow="truncate"))
