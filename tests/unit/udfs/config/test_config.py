"""Config loading: typed, frozen, and every mistake named by its key path."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from udfs.config import (
    DEFAULT_CONFIG,
    JobConfig,
    config_from_dict,
    load_config,
    to_dict,
    with_overrides,
)
from udfs.config.loader import Loaded, Rule
from udfs.errors import ConfigError


def _base() -> dict[str, Any]:
    """The default config without its `lane`: a test adds the key, or an old one, it is about."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.pop("lane", None)
    return data


def _error(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return info.value


def test_default_config_loads_and_is_frozen() -> None:
    config = load_config()
    assert isinstance(config, JobConfig)
    assert config.kafka.input_topic == "llm-requests"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kafka.input_topic = "x"  # type: ignore[misc]


def test_round_trip_through_dict() -> None:
    config = load_config()
    assert config_from_dict(to_dict(config)) == config


@pytest.mark.parametrize(
    ("mutate", "key", "problem"),
    [
        (lambda d: d["kafka"].pop("group_id"), "kafka.group_id", "required"),
        (lambda d: d["kafka"].update(groupid="x"), "kafka.groupid", "unknown key"),
        (lambda d: d["async"].update(capacity="lots"), "async.capacity", "expected an integer"),
        (lambda d: d["async"].update(capacity=0), "async.capacity", "must be > 0"),
        (lambda d: d["async"].update(capacity=True), "async.capacity", "expected an integer"),
        (lambda d: d["parallelism"].update(inference=1.5), "parallelism.inference", "expected an integer"),
        (lambda d: d["model"].update(api="rerank"), "model.api", "expected one of"),
        (lambda d: d["model"].update(endpoint="localhost:8000"), "model.endpoint", "http(s) URL"),
        (lambda d: d["model"].update(prompt_template="{prompt"), "model.prompt_template", "not a valid template"),
        (lambda d: d["kafka"].update(transactional_id_prefix=""), "kafka.transactional_id_prefix", "must not be empty"),
        (lambda d: d["kafka"].update(output_topic=d["kafka"]["input_topic"]), "kafka.output_topic", "must differ"),
        (lambda d: d["kafka"].update(transaction_timeout_ms=60000), "kafka.transaction_timeout_ms",
         "shorter than a transaction can stay open"),
        (lambda d: d["checkpointing"].update(tolerable_failed_checkpoints=1), "kafka.transaction_timeout_ms",
         "(1 + 1) x (5000 + 600000) + 120000 = 1330000 ms"),
        (lambda d: d["checkpointing"].update(tolerable_failed_checkpoints=-1),
         "checkpointing.tolerable_failed_checkpoints", "must be >= 0"),
        (lambda d: d["limits"].update(max_result_bytes=1_048_576), "limits.max_result_bytes",
         "headroom below the producer's max.request.size (1048576)"),
        (lambda d: d["kafka"].update(properties={"max.request.size": "500000"}), "limits.max_result_bytes",
         "(500000)"),
        (lambda d: d["model"].update(headers=["a"]), "model.headers", "expected a mapping"),
        (lambda d: d.update(kafka="broker"), "kafka", "expected a mapping"),
        (lambda d: d["rate_limit"].update(requests_per_minute="fast"), "rate_limit.requests_per_minute",
         "expected a number"),
        (lambda d: d.update(flink={"python.execution-mode": "thread"}), "flink.python.execution-mode",
         "thread is not supported"),
    ],
)
def test_errors_name_the_key(mutate: Any, key: str, problem: str) -> None:
    data = _base()
    mutate(data)
    err = _error(data)
    assert err.key == key
    assert problem in str(err)
    assert str(err).startswith(f"{key}: ")


def test_load_config_names_the_file(tmp_path: Path) -> None:
    data = _base()
    del data["model"]["model"]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"model\.model: required \(in .*job\.yaml\)"):
        load_config(path)


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_transaction_timeout_rule_counts_interval_checkpoint_time_failures_and_restart() -> None:
    config = with_overrides(load_config(), kafka={"transaction_timeout_ms": 900_000},
                            checkpointing={"interval_ms": 10_000, "timeout_ms": 60_000, "max_restart_ms": 60_000,
                                           "tolerable_failed_checkpoints": 3})
    assert config.checkpointing.transaction_lifetime_ms() == 4 * 70_000 + 60_000
    with pytest.raises(ConfigError) as err:
        with_overrides(config, kafka={"transaction_timeout_ms": 339_999})
    assert err.value.key == "kafka.transaction_timeout_ms"
    assert with_overrides(config, kafka={"transaction_timeout_ms": 340_000}).kafka.transaction_timeout_ms == 340_000


def test_parallelism_falls_back_to_default() -> None:
    config = with_overrides(load_config(), parallelism={"default": 3, "inference": None, "sink": 2})
    assert config.parallelism.of("inference") == 3
    assert config.parallelism.of("sink") == 2


def test_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = with_overrides(load_config(), model={"api_key_env": "LLMSTREAM_TEST_KEY"})
    monkeypatch.delenv("LLMSTREAM_TEST_KEY", raising=False)
    assert config.api_key() is None
    monkeypatch.setenv("LLMSTREAM_TEST_KEY", "sk-secret")
    assert config.api_key() == "sk-secret"
    assert "sk-secret" not in repr(config)


def _sections(cls: type) -> list[type]:
    hints = typing.get_type_hints(cls)
    out = [cls]
    for f in dataclasses.fields(cls):
        for tp in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(tp) and isinstance(tp, type) and tp not in out:
                out += [s for s in _sections(tp) if s not in out]
    return out


# Optional text any value of which is fine, or checked where it is used (a schema path: load_schema).
FREE_TEXT = ("api_key_env", "system_prompt", "directory", "path", "response_format")


def test_every_number_and_name_in_the_config_states_its_rule_in_its_type() -> None:
    """A new numeric or string field cannot slip in unchecked: its range (or non-emptiness) is part
    of its declared type, next to the field, not a list in a generic walker."""
    unruled = []
    for section in _sections(JobConfig):
        hints = typing.get_type_hints(section, include_extras=True)
        for f in dataclasses.fields(section):
            options = [t for t in (typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) in
                                   (typing.Union, types.UnionType) else (hints[f.name],)) if t is not type(None)]
            for tp in options:
                if tp in (int, float, str) and f.name not in FREE_TEXT:
                    unruled.append(f"{section.__name__}.{f.name}")
                if typing.get_origin(tp) is typing.Annotated:
                    assert any(isinstance(r, (Rule, Loaded)) for r in typing.get_args(tp)[1:]), f"{section.__name__}.{f.name}"
    assert unruled == []


@pytest.mark.parametrize(("written", "lane"), [
    ({}, "keyed"),
    ({"lane": "vectorized"}, "vectorized"),
    ({"lane": "provider-batch"}, "provider-batch"),
    ({"lane": "auto", "model": {"api": "embeddings"}}, "vectorized"),
    ({"lane": "auto"}, "keyed"),
    ({"stage": "vectorized"}, "vectorized"),
    ({"model": {"mode": "batch"}}, "provider-batch"),
    ({"stage": "keyed", "model": {"mode": "batch"}}, "provider-batch"),
])
def test_one_lane_key_and_its_old_names(written: dict[str, Any], lane: str) -> None:
    data = _base()
    data.pop("stage", None)
    for key, value in written.items():
        data[key] = {**data[key], **value} if key == "model" else value
    config = config_from_dict(data)
    assert config.lane == lane
    assert (config.model.mode == "batch") == (lane == "provider-batch")  # still true for whoever reads it
    assert config_from_dict(to_dict(config)).lane == lane  # and a written-out config reads back the same


def test_an_old_lane_key_warns_once_naming_lane(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from udfs.config import sections

    monkeypatch.setattr(sections, "_deprecations_said", set())
    for _ in range(3):
        config_from_dict({**_base(), "stage": "vectorized"})
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert said == ["config: stage: vectorized is deprecated; write lane: vectorized instead"]
    config_from_dict({**_base(), "model": {**_base()["model"], "mode": "batch"}})
    assert "config: model.mode: batch is deprecated; write lane: provider-batch instead" in caplog.text


@pytest.mark.parametrize(("written", "key"), [
    ({"lane": "keyed", "stage": "vectorized"}, "stage"),
    ({"lane": "keyed", "model": {"mode": "batch"}}, "model.mode"),
    ({"lane": "provider-batch", "model": {"mode": "realtime"}}, "model.mode"),
    ({"stage": "vectorized", "model": {"mode": "batch"}}, "stage"),
])
def test_an_old_lane_key_that_disagrees_is_one_line_naming_it(written: dict[str, Any], key: str) -> None:
    data = _base()
    data.pop("stage", None)
    for name, value in written.items():
        data[name] = {**data[name], **value} if name == "model" else value
    err = _error(data)
    assert err.key == key and "lane" in err.problem and "\n" not in str(err)
