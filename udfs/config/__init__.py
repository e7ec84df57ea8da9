"""Typed, frozen job configuration loaded from one YAML file.

The package by concern: `sections.py` (one frozen dataclass per section, each value's rules in
its field's type, a section's own rules in its `validate`), `loader.py` (the generic walk of YAML
data against those types), `rules.py` (rules across sections, checked once the whole config is
built), `kafka_security.py` and `json_schema.py` (values the loader reads or checks). Every
problem is a `ConfigError` naming the key path (`kafka.group_id: required`), so a typo never
reaches a running job. Secrets are never in the file: `model.api_key_env` /
`model.api_key_file` name where the key is, and `kafka.properties`, `model.headers` and
`cache.redis_url` take `${env:NAME}` / `${file:PATH}` placeholders (`udfs/secret_refs.py`),
checked at load and resolved only where they are used.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

import yaml

from udfs.config.loader import build, one_line, to_dict
from udfs.config.rules import validate_job
from udfs.config.sections import (  # the sections are the package's face: `from udfs.config import JobConfig`
    ADAPTIVE_MIN_BUNDLE,
    AVRO_NAME,
    FORMAT,
    HTTP_URL,
    NON_NEGATIVE,
    NOT_EMPTY,
    POSITIVE,
    REDIS_URL,
    SECRET_HEADERS,
    TCP_PORT,
    TEMPLATE,
    AsyncConfig,
    BatchConfig,
    BudgetConfig,
    CacheConfig,
    CheckpointConfig,
    CircuitConfig,
    EndpointConfig,
    FallbackConfig,
    InputConfig,
    JobConfig,
    KafkaConfig,
    LimitsConfig,
    MetricsConfig,
    ModelConfig,
    ModelTlsConfig,
    Name,
    NonNegativeFloat,
    NonNegativeInt,
    OutputConfig,
    ParallelismConfig,
    Port,
    PositiveFloat,
    PositiveInt,
    PriceConfig,
    PythonConfig,
    RateLimitConfig,
    RetryConfig,
    SchemaRegistryConfig,
    VectorizedConfig,
    read_api_key,
)
from udfs.errors import ConfigError

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "inference.yaml"


__all__ = [
    "ADAPTIVE_MIN_BUNDLE",
    "AVRO_NAME",
    "DEFAULT_CONFIG",
    "FORMAT",
    "HTTP_URL",
    "NON_NEGATIVE",
    "NOT_EMPTY",
    "POSITIVE",
    "REDIS_URL",
    "SECRET_HEADERS",
    "TCP_PORT",
    "TEMPLATE",
    "AsyncConfig",
    "BatchConfig",
    "BudgetConfig",
    "CacheConfig",
    "CheckpointConfig",
    "CircuitConfig",
    "EndpointConfig",
    "FallbackConfig",
    "InputConfig",
    "JobConfig",
    "KafkaConfig",
    "LimitsConfig",
    "MetricsConfig",
    "ModelConfig",
    "ModelTlsConfig",
    "Name",
    "NonNegativeFloat",
    "NonNegativeInt",
    "OutputConfig",
    "ParallelismConfig",
    "Port",
    "PositiveFloat",
    "PositiveInt",
    "PriceConfig",
    "PythonConfig",
    "RateLimitConfig",
    "RetryConfig",
    "SchemaRegistryConfig",
    "VectorizedConfig",
    "config_from_dict",
    "load_config",
    "overridden",
    "read_api_key",
    "to_dict",
    "with_overrides",
]
"""The package's face: the sections (`udfs/config/sections.py`) and the loader's entry points."""


KEY_CHARS = 200
PROBLEM_CHARS = 600
"""How much of a key path and of a problem a config error shows: it is read on a terminal, and a
value or an unknown key may be a huge string."""


def config_from_dict(data: Any) -> JobConfig:
    """Builds a `JobConfig` from already-parsed YAML, validating every key. A problem is one line
    (`one_line`), whatever the key or value it quotes holds."""
    try:
        config = typing.cast(JobConfig, build(JobConfig, data, ""))
        validate_job(config)
    except ConfigError as err:
        key, problem = one_line(err.key, KEY_CHARS), one_line(err.problem, PROBLEM_CHARS)
        if (key, problem) == (err.key, err.problem):
            raise
        raise ConfigError(key, problem) from None
    return config


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML parser's error in one line: what it was doing, what it found, and where (its own text
    spreads that over several lines, with the line quoted and a caret under it)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return ": ".join(part for part in (err.context, err.problem) if part) + where
    return str(err)


def load_config(path: str | os.PathLike[str] | None = None) -> JobConfig:
    """Loads and validates the YAML job config; errors name the file and the key path, in one line."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError("", f"cannot read config {path}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ConfigError("", f"{path} is not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        raise ConfigError("", one_line(f"{path} is not valid YAML: {_yaml_problem(err)}", PROBLEM_CHARS)) from None
    except RecursionError:
        raise ConfigError("", f"{path} is not valid YAML here: nested too deeply") from None
    except ValueError as err:  # a value the YAML reader's constructors refuse: an integer of thousands of digits, month 13
        raise ConfigError("", one_line(f"{path} is not valid YAML: {err}", PROBLEM_CHARS)) from None
    try:
        return config_from_dict(data)
    except ConfigError as err:
        raise ConfigError(err.key, f"{err.problem} (in {path})") from None


def with_overrides(config: JobConfig, **sections: Any) -> JobConfig:
    """Returns a copy with some section fields replaced (a top-level value such as `lane`
    replaced whole), re-validated (used by tests and tools)."""
    return config_from_dict(overridden(to_dict(config), **sections))


def overridden(data: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """`data` (a config as `to_dict` gives it) with some section fields replaced. An override of
    the lane, by `lane` or one of its old keys (`stage`, `model.mode`), replaces the lane whichever
    key chose it before (`JobConfig` refuses two keys that disagree): the other keys are cleared,
    and the spelling given is kept (an old one warns as it would in a file)."""
    model = sections.get("model")
    mode_given = isinstance(model, dict) and "mode" in model
    if "lane" in sections or "stage" in sections or mode_given:
        data = {**data, "lane": None, "stage": None, "model": {**(data.get("model") or {}), "mode": None}}
    for section, values in sections.items():
        key = "async" if section == "async_" else section
        data[key] = {**(data.get(key) or {}), **values} if isinstance(values, dict) else values
    return data


