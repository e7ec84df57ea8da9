"""Generated configs (Hypothesis): whatever a YAML document holds, `config_from_dict` and `load_config`
end in a loaded `JobConfig` or one `ConfigError` whose message is one line naming a key, never
another exception and never a traceback (docs/configuration.md: "a wrong one is one line naming it").

The documents start from a valid config (the smallest one, and jobs/inference.yaml) and get one to
three changes at key paths read from the config's own dataclasses (`udfs/config/sections.py`): a
value of the key's type, a wrong type, an out-of-range or huge number, nested junk, a huge or
unicode string, a string that means something to the value (a path, a placeholder, a template, a
regular expression, a URL), a key removed, an unknown key. `load_config` also gets the document
as YAML text that is cut, garbled or not UTF-8. Each case a run found is kept below as an
`@example`. Example counts: the `ci` and `fuzz` Hypothesis profiles (tests/conftest.py,
docs/testing.md).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from tests.support.configs import MINIMAL_KAFKA
from udfs.config import DEFAULT_CONFIG, JobConfig, config_from_dict, load_config
from udfs.errors import ConfigError

MINIMAL: dict[str, Any] = {"kafka": MINIMAL_KAFKA, "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"}}
FULL: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
MAX_MESSAGE_CHARS = 2_000
"""A config error is read on a terminal: a huge value is cut in it, not printed whole."""


def _key_of(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("key", f.name))


def _unwrap(tp: Any) -> Any:
    """A field's type without `Annotated` and without `None` in a union of one other type."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        options = [o for o in get_args(tp) if o is not type(None)]
        if len(options) == 1:
            return _unwrap(options[0])
    return tp


def _key_paths(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every key path of the config (sections included) with its field's type."""
    out: list[tuple[tuple[str, ...], Any]] = []
    hints = get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        path = (*prefix, _key_of(f))
        tp = hints[f.name]
        out.append((path, tp))
        inner = _unwrap(tp)
        if dataclasses.is_dataclass(inner):
            out.extend(_key_paths(typing.cast(type, inner), path))
    return out


KEY_PATHS = _key_paths(JobConfig)
TOP_KEYS = frozenset(path[0] for path, _ in KEY_PATHS)

# ------------------------------------------------------------------ values

MEANINGFUL_TEXT = [
    "", " ", "\t", "~", "~nosuchuser/x", "~/", "/", ".", "a\x00b", "\x00", "a\nb", "a\rb", "\u2028", "\x85",
    "${env:LLMSTREAM_NO_SUCH_VARIABLE}", "${env:}", "${env:1A}", "${env:A\nB}", "${file:/no/such/file}",
    "${file:a\x00b}", "${file:~nosuchuser/x}", "${file:/}", "$${env:X}", "${", "${x:y}",
    "{", "}", "{prompt", "{0}", "{}", "{a.b}", "{a[x]}", "{a[0]}", "{a!z}", "{a:d}", "{a:{b}}", "{a.__class__}",
    "(", "a{99999999999}", "(?P<", "[", "*", "\\",
    "http://", "https://", "http://[::1", "http://a:99999", "http://a:x", "http://u:p@host/", "http://a:0/",
    "redis://", "unix://", "rediss://a:-1",
    "json", "avro", "none", "all", "keyed", "vectorized", "per_key", "forward", "skip", "dead-letter",
    "m:f", "a.b:c", "os:getcwd", "json:dumps", "nosuchmodule:f",
    "SSL", "SASL_SSL", "SASL_PLAINTEXT", "PLAIN", "SCRAM-SHA-256", "GSSAPI", "PEM", "JKS", "thread",
    str(DEFAULT_CONFIG), str(Path(__file__)), str(DEFAULT_CONFIG.parent),
    "x" * 100_000, "\u00e9\u4e2d\U0001f600" * 50,
]
HUGE_NUMBERS = [0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 10**400, 1e308, -0.0, 1e-320,
                math.inf, -math.inf, math.nan]
KAFKA_PROPERTIES = ["security.protocol", "sasl.mechanism", "sasl.jaas.config", "ssl.truststore.location",
                    "ssl.truststore.type", "ssl.keystore.location", "ssl.keystore.type", "ssl.key.password",
                    "ssl.keystore.password", "ssl.endpoint.identification.algorithm", "ssl.cipher.suites",
                    "ssl.protocol", "sasl.client.callback.handler.class", "max.request.size", "acks",
                    "sasl.oauthbearer.client.credentials.client.secret"]

texts = st.one_of(st.sampled_from(MEANINGFUL_TEXT), st.text(max_size=30),
                  st.text(st.characters(codec=None), max_size=12),  # surrogates and all
                  st.text("{}[]().:!$~/\\*?+ab0 \n", max_size=16))
numbers = st.one_of(st.sampled_from(HUGE_NUMBERS), st.integers(), st.floats(), st.integers(-3, 70_000))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts, st.binary(max_size=8))
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.one_of(texts, st.integers()), inner,
                                                                     max_size=4)),
                    max_leaves=10)


def _typed(tp: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of a field's own type, valid or near it (a number's edges, a literal's options)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _typed(get_args(tp)[0], depth)
    if origin in (Union, types.UnionType):
        return st.one_of([_typed(o, depth) for o in get_args(tp)])
    if tp is type(None):
        return st.none()
    if origin is Literal:
        return st.sampled_from(get_args(tp))
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(st.integers(-2, 2_000_000), st.sampled_from(HUGE_NUMBERS))
    if tp is float:
        return st.one_of(st.floats(-10.0, 1e6), st.sampled_from(HUGE_NUMBERS))
    if tp is str:
        return texts
    if origin is list:
        return st.lists(_typed(get_args(tp)[0], depth + 1), max_size=3)
    if origin is dict:
        keys = st.one_of(st.sampled_from(KAFKA_PROPERTIES + ["python.execution-mode", "Authorization", "X-Api-Key"]),
                         texts)
        return st.dictionaries(keys, _typed(get_args(tp)[1], depth + 1), max_size=3)
    if dataclasses.is_dataclass(tp):
        if depth > 2:
            return st.fixed_dictionaries({})
        hints = get_type_hints(tp, include_extras=True)
        fields = {_key_of(f): _typed(hints[f.name], depth + 1) for f in dataclasses.fields(tp)}
        return st.fixed_dictionaries({}, optional=fields)
    return junk


def _value_for(tp: Any) -> st.SearchStrategy[Any]:
    return st.one_of(_typed(tp), junk, st.sampled_from(MEANINGFUL_TEXT), st.sampled_from(HUGE_NUMBERS))


# ------------------------------------------------------------------ documents


@st.composite
def changes(draw: st.DrawFn) -> tuple[str, tuple[Any, ...], Any]:
    """One change to a document: ("set", path, value), ("drop", path, None) or ("unknown", path, value)."""
    path, tp = draw(st.sampled_from(KEY_PATHS))
    kind = draw(st.sampled_from(["set", "set", "set", "drop", "unknown"]))
    if kind == "set":
        return "set", path, draw(_value_for(tp))
    if kind == "drop":
        return "drop", path, None
    name = draw(st.one_of(texts, st.integers(), st.none(), st.booleans()))
    return "unknown", (*path[:-1], name), draw(junk)


def _apply(doc: dict[str, Any], change: tuple[str, tuple[Any, ...], Any]) -> None:
    kind, path, value = change
    node: Any = doc
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if kind == "drop":
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


@st.composite
def documents(draw: st.DrawFn) -> Any:
    """A config document: a valid one with one to three changes (or, rarely, no mapping at all)."""
    if draw(st.integers(0, 40)) == 0:
        return draw(junk)
    doc = copy.deepcopy(draw(st.sampled_from([MINIMAL, FULL])))
    for change in draw(st.lists(changes(), min_size=1, max_size=3)):
        _apply(doc, change)
    return doc


# ------------------------------------------------------------------ the property


def _check_error(err: ConfigError, doc: Any) -> None:
    """One line, not too long, naming a key of the document (or saying the document is no mapping)."""
    message = str(err)
    assert len(message.splitlines()) == 1, f"a config error of several lines: {message!r}"
    assert len(message) <= MAX_MESSAGE_CHARS, f"a config error of {len(message)} characters: {message[:300]!r}…"
    assert "Traceback" not in message
    if not err.key:
        assert not isinstance(doc, dict) or "YAML" in message, f"no key named: {message!r}"
        return
    assert message.startswith(f"{err.key}: "), message
    root = err.key.split(".")[0].split("[")[0]
    assert root in TOP_KEYS or "unknown key" in err.problem, f"names no key of the config: {message!r}"


def _outcome(doc: Any) -> JobConfig | ConfigError:
    """What loading `doc` gives; anything but a config or a `ConfigError` fails the test."""
    try:
        return config_from_dict(doc)
    except ConfigError as err:
        _check_error(err, doc)
        return err


def _with(section: str, **values: Any) -> dict[str, Any]:
    doc = copy.deepcopy(MINIMAL)
    doc[section] = {**doc.get(section, {}), **values}
    return doc


# What earlier runs found, each fixed in the loader: the exception that escaped, or what the message broke.
@example(_with("retry", initial_backoff_s=10**400))  # OverflowError: an integer too large for a float
@example(_with("model", prompt_template="{a.b}"))  # AttributeError from the template check (a valid template)
@example(_with("model", prompt_template="{a[x]}"))  # TypeError, likewise
@example(_with("kafka", properties={"max.request.size": "abc"}))  # ValueError from int()
@example(_with("model", tls={"ca_file": "~nosuchuser/ca.pem"}))  # RuntimeError: no home directory for ~nosuchuser
@example(_with("model", api_key_file="~nosuchuser/key"))  # RuntimeError, likewise
@example(_with("model", api_key_file="a\x00b"))  # ValueError: embedded null byte
@example(_with("model", headers={"X-Team": "${file:a\x00b}"}))  # ValueError, likewise
@example(_with("model", response_format="a\x00b"))  # ValueError, likewise
@example(_with("model", response_format="~nosuchuser/schema.json"))  # RuntimeError
@example(_with("model", response_format={"$schema": []}))  # TypeError: unhashable type: 'list'
@example(_with("kafka", input_topic=None, input_topic_pattern="a{99999999999}"))  # OverflowError from re
@example(_with("kafka", input_topic=None, input_topic_pattern="(" * 500 + ")" * 500))  # RecursionError from re
@example(_with("model", endpoint=None, endpoints=[{"url": "http://[::1"}]))  # ValueError from urlsplit
@example(_with("model", endpoint=None, endpoints=[{"url": "http://a:99999"}]))  # ValueError: port out of range
@example({**_with("schema_registry", url="http://[::1"), "input": {"format": "avro"}})  # ValueError from urlsplit
@example(_with("kafka", properties={"security.protocol": "SSL", "ssl.truststore.type": "PEM",
                                    "ssl.truststore.location": "~nosuchuser/ca.pem"}))  # RuntimeError
@example({**MINIMAL, "kafka\nx": 1})  # an unknown key with a line break: a message of two lines
@example({**MINIMAL, "": 1})  # an unknown key that is empty: a message naming no key
@example(_with("model", headers={"a\u2028b": 5}))  # a dict key with a line separator, in the key path
@example(_with("input", format="x" * 100_000))  # a message of 100,053 characters
@given(documents())
def test_a_generated_document_loads_or_is_one_config_error_line_naming_a_key(doc: Any) -> None:
    _outcome(doc)


# ------------------------------------------------------------------ as a YAML file


@st.composite
def yaml_texts(draw: st.DrawFn) -> bytes:
    """A generated document as YAML, sometimes cut, garbled (a character inserted) or not UTF-8."""
    doc = draw(documents())
    try:
        text = yaml.safe_dump(doc, allow_unicode=draw(st.booleans()), sort_keys=False)
    except (yaml.YAMLError, ValueError, RecursionError):
        text = draw(st.text(max_size=200))
    data = text.encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from(["none", "none", "cut", "insert", "bytes"]))
    if damage != "none" and data:
        at = draw(st.integers(0, len(data)))
        if damage == "cut":
            data = data[:at]
        elif damage == "insert":
            data = data[:at] + draw(st.sampled_from([b":", b"- ", b"\t", b"{", b"[", b"&a", b"*a", b"!!python/name:os.x",
                                                     b"\n  x: 1\n", b"'", b'"', b"%", b"\x00", b"\\u"])) + data[at:]
        else:
            data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    return data


def test_a_generated_yaml_file_loads_or_is_one_config_error_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"

    @given(yaml_texts())
    def check(data: bytes) -> None:
        path.write_bytes(data)
        try:
            load_config(path)
        except ConfigError as err:
            message = str(err)
            assert len(message.splitlines()) == 1, f"a config error of several lines: {message!r}"
            assert len(message) <= MAX_MESSAGE_CHARS, f"a config error of {len(message)} characters"
            assert str(path) in message, f"the file is not named: {message!r}"
            if err.key:
                root = err.key.split(".")[0].split("[")[0]
                assert root in TOP_KEYS or "unknown key" in err.problem, message

    check()


@pytest.mark.parametrize("data", [
    b"kafka: [[[[[[" * 2_000,  # nested deeper than the YAML parser's recursion
    b"name: " + b"9" * 5_000 + b"\n",  # an integer longer than Python's int() takes
    b"name: \xff\xfe\n",  # not UTF-8
    b"name: 2001-13-01\n",  # a date YAML reads, with month 13: ValueError
    b"kafka:\n  bootstrap_servers: [\n",  # a YAML error: one line, with its line and column
])
def test_a_yaml_file_the_parser_refuses_is_one_config_error_line_naming_the_file(tmp_path: Path,
                                                                                 data: bytes) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and str(path) in message, message
