"""The generic half of the config loader: YAML data walked against a dataclass's field types.

Knows nothing of llmstream's sections (`udfs/config/sections.py`): a field's type says what a
value must be (`int`, a `Literal`, a nested section, a list of them), and `Annotated` carries
the rules on one value (`Rule`) and what the loader replaces a value by (`Loaded`). Every error
is a `ConfigError` naming the key path (`kafka.group_id: required`), never a traceback.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from udfs.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """A constraint on one config value, carried in the field's type (`Annotated[int, POSITIVE]`):
    `holds(value)`, or the load fails at the key's path with `problem`, a text with `{value}`
    filled in, or a function of the value."""

    holds: Callable[[Any], bool]
    problem: str | Callable[[Any], str]

    def check(self, value: Any, path: str) -> None:
        if not self.holds(value):
            problem = self.problem(value) if callable(self.problem) else self.problem.format(value=value)
            raise ConfigError(path, problem)


@dataclass(frozen=True)
class Loaded:
    """A value the loader replaces by what it names, carried in the field's type: `load(value, path)`
    (a schema file becomes the schema). The config then holds what the workers need, and a frozen
    section never rewrites itself in `validate`."""

    load: Callable[[Any, str], Any]


def _key_of(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("key", f.name))


def join_key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Annotated:
        return _type_name(get_args(tp)[0])
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *rules = get_args(tp)
        converted = _convert(base, value, path)
        for rule in rules:
            if isinstance(rule, Rule):
                rule.check(converted, path)
            elif isinstance(rule, Loaded) and converted is not None:
                converted = rule.load(converted, path)
        return converted
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _convert(option, value, path)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(path, f"expected one of {_type_name(tp)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(typing.cast(type, tp), value, path)
    if origin is list:
        if not isinstance(value, list) or not value:
            raise ConfigError(path, f"expected a non-empty list, got {value!r}")
        (itype,) = get_args(tp)
        return [_convert(itype, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        _, vtype = get_args(tp)
        return {str(k): _convert(vtype, v, join_key(path, str(k))) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise ConfigError(path, "expected a number, got an integer too large for one") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    raise ConfigError(path, f"unsupported type {tp!r}")  # pragma: no cover - a bug in this module


def build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls, include_extras=True)
    fields = {_key_of(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        name = unknown[0] if unknown[0].strip() and unknown[0].isprintable() else repr(unknown[0])  # '' is named too
        raise ConfigError(join_key(path, name), f"unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for key, f in fields.items():
        if key in data:
            kwargs[f.name] = _convert(hints[f.name], data[key], join_key(path, key))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(join_key(path, key), "required")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def require(ok: bool, path: str, problem: str) -> None:
    if not ok:
        raise ConfigError(path, problem)


LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})
"""What `str.splitlines` breaks a line at, each as its escape."""


def one_line(text: str, limit: int) -> str:
    """`text` as one line of about `limit` characters at most: a line break written as its escape (a
    key or a value in a message may hold one), the rest of a longer text left out, its length said."""
    text = text.translate(LINE_BREAKS)
    return f"{text[:limit]}… ({len(text)} characters)" if len(text) > limit else text


def is_file(name: str) -> bool:
    """Whether `name` (`~` expanded) is a file; False for a name no path can have (a NUL, a `~user`
    with no home), which `Path` answers with an exception instead."""
    try:
        return Path(name).expanduser().is_file()
    except (RuntimeError, ValueError, OSError):
        return False



def to_dict(config: Any) -> dict[str, Any]:
    """The config as YAML-ready data, keyed as in the file."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, list):  # model.endpoints: a list of sections
            value = [to_dict(item) if dataclasses.is_dataclass(item) else item for item in value]
        out[_key_of(f)] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out
