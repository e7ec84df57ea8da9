"""Turn a `Request` into the JSON body of an OpenAI-compatible call.

The body depends on `model.api`: chat gets `messages`, completions a `prompt` string,
embeddings an `input` string. Per-record `params` override the model settings, but only
those in `OVERRIDABLE_PARAMS`; any other key is ignored here (decode already rejects them,
so this is a second line, not the contract). Input that cannot become a body raises
`BadInput`; input over `model.max_input_tokens` is truncated or raises `ContextTooLong`,
as `model.on_context_overflow` says. Token counts are estimates (~4 characters a token):
good enough for budgets and rate limits, never billed.
"""

from __future__ import annotations

import math
from typing import Any

from udfs.config import ModelConfig
from udfs.errors import BadInput, ContextTooLong
from udfs.inference.structured import prompt_instruction, response_format_field
from udfs.records import Request

CHARS_PER_TOKEN = 4

OVERRIDABLE_PARAMS = (
    "model", "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
)
"""Per-record params that override the model config; embeddings take only `model`."""


def estimate_tokens(text: str) -> int:
    """About `len(text) / 4`, rounded up, at least 1: a cheap stand-in for a tokenizer."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def input_tokens(payload: dict[str, Any]) -> int:
    """Estimated input tokens of a body built by `build_payload` (for budgets and rate limits)."""
    if "messages" in payload:
        return sum(estimate_tokens(_content_text(m.get("content"))) for m in payload["messages"])
    text = payload.get("prompt", payload.get("input", ""))
    return estimate_tokens(text if isinstance(text, str) else str(text))


def fill_template(request: Request, template: str) -> str:
    """The user text: `template` filled from the record's fields (`{prompt}` is the prompt)."""
    fields = dict(request.fields)
    if request.prompt is not None:
        fields["prompt"] = request.prompt
    try:
        return template.format_map(fields)
    except KeyError as err:
        raise BadInput("template_field_missing",
                       f"prompt_template needs field {err.args[0]!r}, which the record lacks") from None
    except (AttributeError, IndexError, TypeError, ValueError) as err:
        raise BadInput("template_field_invalid",
                       f"prompt_template cannot be filled from the record: {type(err).__name__}: {err}"[:300]) from None


def _fit(text: str, budget_tokens: int, model: ModelConfig, used_elsewhere: int) -> str:
    """`text` if it fits in `budget_tokens`, else its start (truncate) or `ContextTooLong`."""
    if estimate_tokens(text) <= budget_tokens:
        return text
    total = used_elsewhere + estimate_tokens(text)
    if model.on_context_overflow != "truncate" or budget_tokens < 1:
        raise ContextTooLong(
            f"input is ~{total} tokens, over model.max_input_tokens={model.max_input_tokens}")
    return text[: budget_tokens * CHARS_PER_TOKEN]


def _system_text(model: ModelConfig) -> str | None:
    """The system prompt, with the schema instruction of `response_format_mode: prompt` after it."""
    if not isinstance(model.response_format, dict) or model.response_format_mode != "prompt":
        return model.system_prompt
    instruction = prompt_instruction(model.response_format)
    return f"{model.system_prompt}\n\n{instruction}" if model.system_prompt else instruction


def _chat_messages(request: Request, model: ModelConfig) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = _system_text(model)
    if system:
        messages.append({"role": "system", "content": system})
    if request.messages is not None:
        messages.extend(dict(m) for m in request.messages)
    else:
        messages.append({"role": "user", "content": fill_template(request, model.prompt_template)})
    total = sum(estimate_tokens(_content_text(m.get("content"))) for m in messages)
    if total <= model.max_input_tokens:
        return messages
    target = next((i for i in range(len(messages) - 1, -1, -1)
                   if messages[i].get("role") == "user" and isinstance(messages[i].get("content"), str)), None)
    if target is None:
        raise ContextTooLong(
            f"input is ~{total} tokens, over model.max_input_tokens={model.max_input_tokens}")
    content = messages[target]["content"]
    others = total - estimate_tokens(content)
    messages[target] = {**messages[target],
                        "content": _fit(content, model.max_input_tokens - others, model, others)}
    return messages


def _settings(request: Request | None, model: ModelConfig) -> dict[str, Any]:
    """The model's settings, with `request`'s own params over them (none: the model's alone)."""
    settings: dict[str, Any] = {"model": model.model, "max_tokens": model.max_tokens,
                                "temperature": model.temperature}
    if request is not None:
        settings.update((k, v) for k, v in request.params.items() if k in OVERRIDABLE_PARAMS)
    return {k: v for k, v in settings.items() if v is not None}


def _native_format(model: ModelConfig) -> dict[str, Any]:
    """`response_format` for `response_format_mode: native` or `json_object`, else nothing."""
    if isinstance(model.response_format, dict) and model.response_format_mode != "prompt":
        return {"response_format": response_format_field(model.response_format, model.response_format_mode)}
    return {}


class Payloads:
    """The request bodies of many records for one `model`: what every body shares (the model's
    settings, the system prompt and its token estimate, the schema's `response_format`) is made
    once, when the client opens, and only each record's own part (its params, its prompt filled in,
    the fit to `model.max_input_tokens`) per record. `build_payload` is the same for one record."""

    def __init__(self, model: ModelConfig) -> None:
        self._model = model
        self._settings = _settings(None, model)
        self._system = _system_text(model)
        self._system_tokens = estimate_tokens(self._system) if self._system else 0
        self._native = _native_format(model)

    def build(self, request: Request) -> dict[str, Any]:
        """The request body of `request` (as `build_payload`); raises `BadInput` or `ContextTooLong`."""
        model = self._model
        if model.api != "chat":
            return _plain_payload(request, model)
        settings = _settings(request, model) if request.params else self._settings
        return {**settings, "messages": self._messages(request), **self._native}

    def _messages(self, request: Request) -> list[dict[str, Any]]:
        """A chat's messages: the system prompt and the record's text, as `_chat_messages` makes them,
        which still makes them for a record's own messages and for input that must be fitted."""
        if request.messages is not None:
            return _chat_messages(request, self._model)
        user = fill_template(request, self._model.prompt_template)
        if self._system_tokens + estimate_tokens(user) > self._model.max_input_tokens:
            return _chat_messages(request, self._model)
        if self._system:
            return [{"role": "system", "content": self._system}, {"role": "user", "content": user}]
        return [{"role": "user", "content": user}]


def build_payload(request: Request, model: ModelConfig, shared: Payloads | None = None) -> dict[str, Any]:
    """The request body for `model.api`; raises `BadInput` or `ContextTooLong` before any call.
    With `model.response_format` the body asks for the schema (see udfs/inference/structured.py).
    `shared`: `Payloads(model)` made once for many records (none: made for this one)."""
    return (shared if shared is not None else Payloads(model)).build(request)


def _plain_payload(request: Request, model: ModelConfig) -> dict[str, Any]:
    """The body of a completions or embeddings call."""
    if request.messages is not None:
        raise BadInput("messages_unsupported", f"model.api '{model.api}' takes a prompt, not chat messages")
    text = fill_template(request, model.prompt_template)
    if model.api == "embeddings":
        model_name = request.params.get("model") or model.model
        return {"model": model_name, "input": _fit(text, model.max_input_tokens, model, 0)}
    system = _system_text(model)
    prefix = f"{system}\n\n" if system else ""
    prefix_tokens = estimate_tokens(prefix) if prefix else 0
    text = _fit(text, model.max_input_tokens - prefix_tokens, model, prefix_tokens)
    return {**_settings(request, model), "prompt": prefix + text, **_native_format(model)}
