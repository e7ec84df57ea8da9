"""Record formats as a seam (udfs/records/formats.py): names resolve through `FORMATS`, a worker
makes one object per named format and opens the output one, and a format added by registering
its class writes the one result record (udfs/records/result.py). The registry-backed Avro format
is in test_avro_format.py, the result's declarations in test_result.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.configs import minimal_config
from udfs.config import JobConfig, LimitsConfig
from udfs.errors import BadInput, ConfigError
from udfs.records import Completion, Request, SourceRef, formats
from udfs.records.decode import decode
from udfs.records.encode import result_row
from udfs.records.format_names import FORMATS
from udfs.records.formats import JobFormats, result_fields

SOURCE = SourceRef("in", 2, 9, 1_700_000_000_000)
EVENTS: list[tuple[str, ...]] = []


class LinesFormat:
    """A format added the way the module docstring says: one class, one line in `FORMATS`. It
    writes a result as `name=value` lines of the declared fields, and reads a value as a prompt."""

    def __init__(self, config: JobConfig) -> None:
        self.fields = result_fields(config)
        EVENTS.append(("made",))

    @classmethod
    def preflight(cls, config: JobConfig, *, output: bool, timeout_s: float) -> None:
        EVENTS.append(("preflight", str(output), str(timeout_s)))

    def open(self) -> None:
        EVENTS.append(("open",))

    def close(self) -> None:
        EVENTS.append(("close",))

    def decode(self, key: bytes | None, value: bytes, source: SourceRef, limits: LimitsConfig) -> Request:
        if not value.strip():
            raise BadInput("empty_prompt", "an empty line")
        return Request(id=(key or b"").decode(), key=key, source=source, prompt=value.decode(), raw=value)

    def encode(self, record: dict[str, Any]) -> bytes:
        return "\n".join(f"{name}={json.dumps(value)}" for name, value in record.items()).encode()


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> str:
    EVENTS.clear()
    monkeypatch.setitem(FORMATS, "lines", f"{__name__}:LinesFormat")
    return "lines"


job = minimal_config


def completion(**changes: Any) -> Completion:
    values: dict[str, Any] = {"output": "an answer", "model": "m", "finish_reason": "stop", "prompt_tokens": 3,
                              "completion_tokens": 4, "latency_ms": 5.55, "attempts": 1, "endpoint": "e",
                              "started_ms": 10, "completed_ms": 20}
    return Completion(**{**values, **changes})


def test_an_unknown_format_name_is_one_config_error_naming_the_key_and_the_registered_names() -> None:
    for key in ("input", "output"):
        with pytest.raises(ConfigError) as info:
            job(**{key: {"format": "xml"}})
        assert info.value.key == f"{key}.format"
        assert info.value.problem == "expected one of 'json' | 'avro', got 'xml'"
        assert "\n" not in str(info.value)


def test_a_registered_format_is_a_valid_name_and_reads_and_writes_the_declared_result(lines: str) -> None:
    config = job(input={"format": lines}, output={"format": lines})
    formats_ = JobFormats.open(config)
    assert formats_.input is formats_.output, "one object per format name"
    assert EVENTS == [("made",), ("open",)]
    request = decode(b"k1", b"say hi", SOURCE, config.limits, formats_.input)
    assert (request.id, request.prompt) == ("k1", "say hi")
    with pytest.raises(BadInput) as info:
        decode(b"k2", b"  ", SOURCE, config.limits, formats_.input)
    assert info.value.reason == "empty_prompt"
    row = result_row(request, completion(), "out", 10_000, None, formats_.output)
    names = [line.split("=", 1)[0] for line in row.value.decode().splitlines()]  # type: ignore[union-attr]
    assert names == ["id", "output", "model", "finish_reason", "usage", "latency_ms", "attempts", "endpoint", "cost",
                     "cached", "timestamps", "source"]
    formats_.close()
    assert EVENTS[-1:] == [("close",)]


def test_each_end_gets_its_format_the_output_one_opened_and_each_closed_once(lines: str) -> None:
    formats_ = JobFormats.open(job(input={"format": lines}))
    assert formats_.input is not formats_.output and formats_.output.fields[0].name == "id"
    assert EVENTS == [("made",)], "the JSON output needs no opening; the input format is not opened"
    formats_.close()
    assert EVENTS == [("made",), ("close",)]
    EVENTS.clear()
    JobFormats.open(job(output={"format": lines})).close()
    assert EVENTS == [("made",), ("open",), ("close",)]


def test_preflight_asks_each_named_format_once_saying_which_is_the_output(lines: str) -> None:
    formats.preflight(job(input={"format": lines}), timeout_s=3.0)
    formats.preflight(job(output={"format": lines}), timeout_s=3.0)
    formats.preflight(job(input={"format": lines}, output={"format": lines}), timeout_s=3.0)
    assert EVENTS == [("preflight", "False", "3.0"), ("preflight", "True", "3.0"), ("preflight", "True", "3.0")]
