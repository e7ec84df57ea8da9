"""`udfs/records/fastjson.py`: orjson where it can, the standard library where orjson refuses, so every
document reads to the same value as `json.loads` gives and writes to JSON that reads back equal."""

from __future__ import annotations

import json
import math

import pytest

from udfs.records import fastjson

DOCUMENTS = [
    {"id": "r-1", "output": "héllo \u2603 \"quoted\"\n", "usage": {"prompt_tokens": 3}, "cost": None, "cached": False},
    {"embedding": [0.1, -2.5e-07, 1e300, 0.0], "nested": [[[]]], "empty": {}},
    [1, "two", 3.5, True, None],
]


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_what_it_writes_reads_back_as_the_same_value(doc: object) -> None:
    written = fastjson.dumps(doc)
    assert json.loads(written) == doc
    assert fastjson.loads(written) == doc
    assert fastjson.loads(written.decode()) == doc


def test_what_orjson_refuses_to_read_is_read_as_json_reads_it() -> None:
    nan = fastjson.loads(b'{"x": NaN, "y": -Infinity}')
    assert math.isnan(nan["x"]) and nan["y"] == -math.inf
    big = 2**80
    assert fastjson.loads(str(big).encode()) == big
    deep = "[" * 2000 + "]" * 2000  # beyond orjson's 1,024 levels: json's own answer, an error here too
    with pytest.raises(RecursionError):
        json.loads(deep)
    with pytest.raises(RecursionError):
        fastjson.loads(deep)


def test_what_orjson_cannot_write_is_written_by_json() -> None:
    assert fastjson.dumps({"n": 2**80}) == b'{"n":1208925819614629174706176}'
    assert fastjson.dumps({1: "a"}) == b'{"1":"a"}'


def test_not_json_is_a_value_error_as_with_json() -> None:
    with pytest.raises(ValueError):
        fastjson.loads(b"<html>bad gateway</html>")


def test_nan_is_written_as_null_not_as_an_invalid_token() -> None:
    assert json.loads(fastjson.dumps({"v": [float("nan")]})) == {"v": [None]}
