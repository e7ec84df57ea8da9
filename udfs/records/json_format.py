"""JSON, llmstream's own record contract (docs/record-contract.md): the default `input.format` and
`output.format`.

In: the value is a JSON object with a string `id` and either a string `prompt` or a list of chat
`messages`, plus optional `params`; anything else raises `BadInput` with a stable reason code,
which the stage dead-letters. Out: the result record as a JSON object, written with `fastjson`.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from udfs.errors import BadInput
from udfs.records import Request, SourceRef, fastjson
from udfs.records.result import RESULT_FIELDS, ResultField

if TYPE_CHECKING:
    from udfs.config import JobConfig, LimitsConfig

MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "max_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "stop": (str, list),
    "seed": (int,),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
"""One decoder for every record: `json.loads` with an argument builds a new one per call, a few
microseconds of each record's CPU on the fast lanes. Stateless, so safe across threads."""


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
"""A `\\ud800`-`\\udfff` escape: half of a pair, or alone (then no Unicode text)."""


def lone_surrogate(value: Any) -> bool:
    """Whether a string in `value` (a key too) holds a lone surrogate, which no UTF-8 writer takes."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _parse(value: bytes) -> Any:
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInput("invalid_utf8", f"value is not UTF-8 at byte {err.start}") from None
    if "\x00" in text:
        raise BadInput("invalid_json", "value contains a NUL character")
    try:
        if text.startswith("\ufeff"):  # as `json.loads` refuses it; the decoder itself would not
            raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig)")
        parsed = _DECODER.decode(text)
    except RecursionError:
        raise BadInput("invalid_json", "JSON nested too deeply") from None
    except ValueError as err:
        raise BadInput("invalid_json", str(err)[:200]) from None
    # `json` reads "\ud800" into a str that cannot be written as UTF-8 again (the output record, the
    # dead letter, the model's request): not text, so not a record, whatever field it is in.
    if SURROGATE_ESCAPE.search(text) and lone_surrogate(parsed):
        raise BadInput("invalid_json", "a string holds a lone surrogate escape (\\ud800-\\udfff), not Unicode text")
    return parsed


def checked_text(record: dict[str, Any], name: str, *, max_chars: int, reason_empty: str) -> str:
    value = record.get(name)
    if not isinstance(value, str):
        raise BadInput("wrong_type", f"'{name}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadInput(reason_empty, f"'{name}' is empty")
    if len(value) > max_chars:
        raise BadInput("prompt_too_large" if name == "prompt" else "id_too_long",
                       f"'{name}' has {len(value)} characters, limit {max_chars}")
    return value


def checked_messages(value: Any, limits: LimitsConfig) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise BadInput("invalid_messages", "'messages' must be a non-empty list")
    total = 0
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadInput("invalid_messages", f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            raise BadInput("invalid_messages", f"messages[{i}].role must be one of {sorted(MESSAGE_ROLES)}")
        if not isinstance(content, str):
            raise BadInput("invalid_messages", f"messages[{i}].content must be a string")
        total += len(content)
    if not any(m["content"].strip() for m in value):  # blank, as a prompt is (docs/record-contract.md)
        raise BadInput("empty_prompt", "all message contents are blank")
    if total > limits.max_prompt_chars:
        raise BadInput("prompt_too_large", f"messages have {total} characters, limit {limits.max_prompt_chars}")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def checked_params(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput("invalid_params", "'params' must be an object")
    for name, param in value.items():
        allowed = PARAM_TYPES.get(name)
        if allowed is None:
            raise BadInput("invalid_params", f"unknown param '{name}' (known: {', '.join(sorted(PARAM_TYPES))})")
        if isinstance(param, bool) or not isinstance(param, allowed):
            raise BadInput("invalid_params", f"param '{name}' has the wrong type {type(param).__name__}")
        if isinstance(param, float) and not math.isfinite(param):
            raise BadInput("invalid_params", f"param '{name}' must be finite")
    if "max_tokens" in value and value["max_tokens"] <= 0:
        raise BadInput("invalid_params", "param 'max_tokens' must be > 0")
    return dict(value)


CONTRACT_FIELDS: tuple[ResultField, ...] = (
    tuple(f for f in RESULT_FIELDS if f.only in (None, "text"))
    + tuple(f for f in RESULT_FIELDS if f.only == "structured")
    + tuple(f for f in RESULT_FIELDS if f.only == "batch"))
"""The result fields of the record contract: `output` holds any answer, an embedding too (JSON needs
no field per type, so `embedding` is a typed format's), and the structured-output fields come
last, as the contract added them (a result has them only when its answer is structured), then
`lane` (only in a job with a provider-batch lane)."""


class JsonFormat:
    """The record contract; it needs no settings and holds nothing."""

    fields = CONTRACT_FIELDS

    def __init__(self, config: JobConfig | None = None) -> None:
        pass

    @classmethod
    def preflight(cls, config: JobConfig, *, output: bool, timeout_s: float) -> None:
        """Nothing outside the job to check."""

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def read(self, value: bytes, limits: LimitsConfig) -> dict[str, Any]:
        """The value as a JSON object, whatever its fields (a user's preprocess makes the request of
        it); raises `BadInput` if it is not one."""
        if len(value) > limits.max_record_bytes:
            raise BadInput("record_too_large", f"value has {len(value)} bytes, limit {limits.max_record_bytes}")
        record = _parse(value)
        if not isinstance(record, dict):
            raise BadInput("not_an_object", f"value is a JSON {type(record).__name__}, expected an object")
        return record

    def decode(self, key: bytes | None, value: bytes, source: SourceRef, limits: LimitsConfig) -> Request:
        """Validates one value against the record contract; raises `BadInput` if it cannot be a request."""
        record = self.read(value, limits)
        if "id" not in record:
            raise BadInput("missing_field", "'id' is required")
        request_id = checked_text(record, "id", max_chars=limits.max_id_chars, reason_empty="empty_id")
        has_prompt, has_messages = "prompt" in record, "messages" in record
        if has_prompt == has_messages:
            raise BadInput("missing_field" if not has_prompt else "ambiguous_input",
                           "exactly one of 'prompt' and 'messages' is required")
        prompt = messages = None
        if has_prompt:
            prompt = checked_text(record, "prompt", max_chars=limits.max_prompt_chars, reason_empty="empty_prompt")
        else:
            messages = checked_messages(record["messages"], limits)
        return Request(id=request_id, key=key, source=source, prompt=prompt, messages=messages,
                       params=checked_params(record.get("params")), fields=record, raw=value)

    def encode(self, record: dict[str, Any]) -> bytes:
        return fastjson.dumps(record)


JSON = JsonFormat()
"""The record contract's one object (a default where no format is given)."""


if TYPE_CHECKING:  # mypy holds the class to the format protocols (udfs/records/formats.py)
    from udfs.records.formats import FormatClass

    _AS_FORMAT: FormatClass = JsonFormat
