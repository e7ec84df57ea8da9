"""Schema-shaped answers: what the simulator says to a request with ``response_format``.

A chat or completions request with ``response_format: {"type": "json_schema", "json_schema":
{"schema": ...}}`` gets a JSON document built from the schema (deterministic for a prompt:
strings are words of the prompt, enums and numbers are picked by a hash of it), as a model
with constrained decoding would answer. ``{"type": "json_object"}`` gets a small object.

A configurable share of answers (``invalid_json_rate``) is deliberately wrong the ways real
models are wrong: prose around the JSON, a required property missing, a value of the wrong
type or outside its enum. Every answer is checked with ``jsonschema`` before it is sent, so
``/stats`` counts what was really sent (``invalid_answers`` are answers that do not validate)
whatever the generator managed for an unusual schema.
"""

from __future__ import annotations

import json
import random
import zlib
from typing import Any

import jsonschema

from udfs.inference.structured import PROMPT_SCHEMA_MARKER

_MAX_DEPTH = 8


class ResponseFormatError(ValueError):
    """A request's ``response_format`` is malformed (the server answers 400)."""
_FILLER_WORDS = ("stream", "model", "record", "topic", "answer", "signal", "value")


def requested_schema(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema a request's ``response_format`` asks for, ``{"type": "object"}`` for
    ``json_object``, or ``None`` for plain text. Raises `ResponseFormatError` for a malformed one (a 400)."""
    fmt = payload.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ResponseFormatError("'response_format.type' must be 'text', 'json_object' or 'json_schema'")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":  # llama-cpp-python's form may carry the schema beside the type
        schema = fmt.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise ResponseFormatError("'response_format.schema' must be an object")
        _validator(schema)
        return schema
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(schema, dict):
        raise ResponseFormatError("'response_format.json_schema' needs a 'name' and a 'schema' object")
    _validator(schema)
    return schema


_VALIDATORS: dict[str, Any] = {}


def _validator(schema: dict[str, Any]) -> Any:
    """A checked validator for `schema`, kept for the next request with the same schema (a job
    sends one schema in every request); a bad schema raises `ResponseFormatError`."""
    key = json.dumps(schema, sort_keys=True)
    validator = _VALIDATORS.get(key)
    if validator is None:
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as err:
            raise ResponseFormatError(f"invalid JSON schema in response_format: {err.message}"[:300]) from None
        if len(_VALIDATORS) >= 64:
            _VALIDATORS.clear()
        validator = _VALIDATORS[key] = cls(schema)
    return validator


def schema_in_prompt(texts: list[str]) -> dict[str, Any] | None:
    """The schema of llmstream's `response_format_mode: prompt` instruction, if one of `texts`
    (system prompt, messages or prompt) carries it: the simulator then answers schema-shaped
    too, as a model following the instruction would."""
    for text in texts:
        at = text.find(PROMPT_SCHEMA_MARKER)
        if at < 0:
            continue
        try:
            schema, _ = json.JSONDecoder().raw_decode(text, at + len(PROMPT_SCHEMA_MARKER))
        except ValueError:
            continue
        if isinstance(schema, dict):
            _validator(schema)
            return schema
    return None


class _Builder:
    """Builds one instance of a schema from a seeded generator and the prompt's words."""

    def __init__(self, root: dict[str, Any], prompt: str) -> None:
        self.root = root
        self.rng = random.Random(zlib.crc32(prompt.encode("utf-8", "surrogatepass")))
        self.words = [w.strip(".,;:!?\"'()").lower() for w in prompt.split()] or list(_FILLER_WORDS)
        self.words = [w for w in self.words if w] or list(_FILLER_WORDS)

    def _resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            node: Any = self.root
            for part in ref[2:].split("/"):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            return node if isinstance(node, dict) else {}
        return schema

    def _text(self, schema: dict[str, Any]) -> str:
        count = self.rng.randint(1, 3)
        start = self.rng.randrange(len(self.words))
        text = " ".join(self.words[(start + i) % len(self.words)] for i in range(count))
        min_len, max_len = int(schema.get("minLength", 1)), schema.get("maxLength")
        while len(text) < min_len:
            text += " " + self.rng.choice(_FILLER_WORDS)
        return text[: int(max_len)] if isinstance(max_len, int) else text

    def build(self, schema: Any, depth: int = 0) -> Any:
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return None
        schema = self._resolve(schema)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rng.choice(schema["enum"])
        for combinator in ("oneOf", "anyOf", "allOf"):
            if isinstance(schema.get(combinator), list) and schema[combinator]:
                return self.build(schema[combinator][0], depth + 1)
        kind = schema.get("type", "object" if "properties" in schema else "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind == "object":
            properties = schema.get("properties") or {}
            return {name: self.build(sub, depth + 1) for name, sub in properties.items()}
        if kind == "array":
            low = int(schema.get("minItems", 1))
            high = max(low, min(int(schema.get("maxItems", 3)), 3))
            return [self.build(schema.get("items", {}), depth + 1) for _ in range(self.rng.randint(low, high))]
        if kind in ("number", "integer"):
            lowest = float(schema.get("minimum", 0))
            highest = float(schema.get("maximum", lowest + 100))
            number = self.rng.uniform(lowest, highest)
            return round(number) if kind == "integer" else round(number, 3)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self._text(schema)


def _spoiled(schema: dict[str, Any], value: Any, rng: random.Random) -> str:
    """An answer made wrong on purpose, one of the ways real models get it wrong."""
    ways = ["prose"]
    if isinstance(value, dict) and [p for p in schema.get("required", []) if p in value]:
        ways.append("missing")
    if isinstance(value, dict) and value:
        ways.append("wrong_value")
    way = rng.choice(ways)
    if way == "missing":
        broken = dict(value)
        del broken[rng.choice([p for p in schema["required"] if p in value])]
        return json.dumps(broken)
    if way == "wrong_value":
        name = rng.choice(sorted(value))
        declared = (schema.get("properties") or {}).get(name)
        if isinstance(declared, dict) and isinstance(declared.get("enum"), list):
            wrong: Any = "not-an-allowed-value"
        else:
            wrong = 12345 if isinstance(value[name], str) else "not-a-number"
        return json.dumps({**value, name: wrong})
    return f"Sure! Here is the JSON you asked for: {json.dumps(value)}"


def answer(schema: dict[str, Any], prompt: str, invalid: bool) -> tuple[str, bool]:
    """The answer text for `prompt` and whether it validates against `schema`: an instance of
    the schema, or (``invalid``) a spoiled one; checked either way, never assumed."""
    builder = _Builder(schema, prompt)
    value = builder.build(schema)
    text = _spoiled(schema, value, builder.rng) if invalid else json.dumps(value)
    try:
        valid = _validator(schema).is_valid(json.loads(text))
    except ValueError:
        valid = False
    return text, valid
