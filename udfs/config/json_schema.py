"""A schema given in the config: inline, or a JSON/YAML file read when the config loads.

The config loader calls `load_schema` for `model.response_format` (a JSON Schema) and
`load_avro_schema` for `output.schema` (an Avro schema), each a `Loaded` field (see
`udfs/config/sections.py`), so a bad schema is a `ConfigError` naming the key before the job starts, and the
config then carries the schema itself: a cluster's workers never need the file. It lives apart from
`udfs/inference/structured.py`, which uses the schema, so that the config depends on neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema.exceptions import SchemaError

from udfs.errors import ConfigError


def _mapping(value: Any, key: str, what: str) -> dict[str, Any]:
    """The mapping `value` is, or the one in the JSON or YAML file it names."""
    if isinstance(value, str):
        try:
            path = Path(value).expanduser()
            text = path.read_text()
        except OSError as err:
            raise ConfigError(key, f"cannot read schema file {value!r}: {err.strerror}") from None
        except (RuntimeError, ValueError) as err:  # a `~user` with no home, a NUL, bytes that are not UTF-8
            raise ConfigError(key, f"cannot read schema file {value!r}: {err}"[:500]) from None
        try:
            value = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as err:
            raise ConfigError(key, f"schema file {str(path)!r} is not valid JSON/YAML: {err}"[:500]) from None
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected {what} (a mapping) or a file path, got {type(value).__name__}")
    return value


def load_schema(value: Any, key: str) -> dict[str, Any]:
    """The JSON Schema `value` names: a mapping is the schema, a string a JSON or YAML file
    (relative paths from the current directory). Raises `ConfigError(key, ...)` when the file
    cannot be read or parsed, or the schema is not a valid JSON Schema of its draft."""
    value = _mapping(value, key, "a JSON Schema")
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        raise ConfigError(key, f"not a valid JSON Schema at {where}: {err.message}"[:500]) from None
    except Exception as err:  # noqa: BLE001 - e.g. a `$schema` that is a list (unhashable) or nesting too deep
        raise ConfigError(key, f"not a valid JSON Schema: {type(err).__name__}: {err}"[:500]) from None
    return value


def load_avro_schema(value: Any, key: str) -> dict[str, Any]:
    """The Avro record schema `value` names (a mapping, or a .avsc/.json/YAML file), checked by
    fastavro; `ConfigError(key, ...)` when it cannot be read or is not an Avro record schema."""
    import fastavro  # apache-flink brings it; only configs with an Avro output schema need it

    value = _mapping(value, key, "an Avro schema")
    try:
        fastavro.parse_schema(value)
    except Exception as err:  # noqa: BLE001 - fastavro raises several types for a bad schema
        raise ConfigError(key, f"not a valid Avro schema: {type(err).__name__}: {err}"[:500]) from None
    if value.get("type") != "record":
        raise ConfigError(key, f"expected an Avro record schema, got type {value.get('type')!r}")
    return value
