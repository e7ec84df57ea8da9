"""Secrets by reference: `${env:NAME}` and `${file:PATH}` placeholders in config values.

A config value that holds a secret (a SASL password inside `kafka.properties`, an
`Authorization` header, a Redis URL with a password) names where the secret is instead of
holding it. The config keeps the placeholder: it is what `llmstream plan`, the state
directory, logs and status ever show. `check` resolves every placeholder once at load, so a
missing variable or file fails at start naming the key; `resolve` is called where the value
is used (building the Kafka ends, opening a client on a worker), and its result is handed
straight to the library that needs it, never stored or logged.

Syntax: `${env:NAME}` is the environment variable NAME; `${file:PATH}` is the file's content
without one trailing newline (PATH relative to the working directory, or absolute); `$${`
is a literal `${`. Any other `${` is a config error. Error messages name the key and the
variable or file, never a value.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from udfs.errors import ConfigError

log = logging.getLogger("llmstream.config")

PLACEHOLDER = re.compile(r"\$\$\{|\$\{(env|file):([^}]+)\}")
"""A `$${` escape, or `${env:NAME}` / `${file:PATH}` (the kind and the name)."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MASK = "******"
_WARNED: set[str] = set()
_RESOLVED: set[str] = set()
"""Every secret this process has resolved, for `MaskSecrets`."""
MIN_MASKED_CHARS = 4
"""Shorter values (an empty key, a one-letter test value) are not masked: they would mangle every line."""
"""Secret files already warned about: a worker reads the API key file on every request."""


def has_placeholder(text: str) -> bool:
    """Whether `text` names a secret (rather than holding one literally)."""
    return any(m.group(1) for m in PLACEHOLDER.finditer(text))


def _bad_syntax(text: str) -> int | None:
    """The position of a `${` that is neither an escape nor a well-formed placeholder."""
    covered = {m.start() for m in PLACEHOLDER.finditer(text)}
    for match in re.finditer(r"\$\{", text):
        start = match.start()
        escaped = start > 0 and text[start - 1] == "$" and (start - 1) in covered
        if start not in covered and not escaped:
            return start
    return None


def _read_env(name: str, path: str) -> str:
    if not ENV_NAME.fullmatch(name):
        raise ConfigError(path, f"${{env:{name}}}: not a valid environment variable name")
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(path, f"${{env:{name}}}: environment variable {name} is not set")
    return value


def read_secret_file(file: str, path: str) -> str:
    """The content of a secret file without one trailing newline; a missing or unreadable file is a
    `ConfigError` naming `path`, and a file other users may read is worth a warning (never its content)."""
    try:
        target = Path(file).expanduser()
        mode = target.stat().st_mode
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(path, f"secret file {file} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(path, f"secret file {file} is a directory") from None
    except PermissionError:
        raise ConfigError(path, f"secret file {file} is not readable by this user") from None
    except UnicodeDecodeError:
        raise ConfigError(path, f"secret file {file} is not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(path, f"secret file {file} cannot be read ({err.strerror})") from None
    except (RuntimeError, ValueError):  # a `~user` with no home, a NUL in the name
        raise ConfigError(path, f"secret file {file!r} is not a path that can be read") from None
    if stat.S_ISREG(mode) and mode & (stat.S_IRGRP | stat.S_IROTH) and str(target) not in _WARNED:
        _WARNED.add(str(target))
        log.warning("%s: secret file %s is readable by other users (mode %o); chmod 600 it",
                    path, file, stat.S_IMODE(mode))
    return remember(text.removesuffix("\n"))


def resolve(text: str, path: str) -> str:
    """`text` with every placeholder replaced by its secret; raises `ConfigError` naming `path`."""
    bad = _bad_syntax(text)
    if bad is not None:
        raise ConfigError(path, f"bad placeholder at character {bad}: write ${{env:NAME}} or ${{file:PATH}} "
                                "(or $${ for a literal ${)")

    def replace(match: re.Match[str]) -> str:
        kind, name = match.group(1), match.group(2)
        if kind is None:
            return "${"
        return remember(_read_env(name, path) if kind == "env" else read_secret_file(name, path))

    return PLACEHOLDER.sub(replace, text)


def resolve_all(values: dict[str, str], path: str) -> dict[str, str]:
    """Every value of a mapping resolved; each key's path is `path.key`."""
    return {key: resolve(value, f"{path}.{key}") for key, value in values.items()}


def check(text: str, path: str) -> None:
    """Fails at load, naming `path`, if a placeholder in `text` cannot be resolved now."""
    resolve(text, path)


def remember(secret: str) -> str:
    """Notes a resolved secret so that `MaskSecrets` keeps it out of every log line; returns it."""
    if len(secret) >= MIN_MASKED_CHARS:
        _RESOLVED.add(secret)
    return secret


class MaskSecrets(logging.Filter):
    """A log handler's filter that replaces every secret resolved in this process by a mask, whichever
    library logs it: with `-v`, kafka-python logs its admin client's whole configuration at DEBUG,
    SASL password included. Installed on the CLI's handlers (`jobs/cli.py`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _RESOLVED:
            message = record.getMessage()
            masked = mask(message, list(_RESOLVED))
            if masked != message:
                record.msg, record.args = masked, None
        return True


def mask(text: str, secrets: list[str]) -> str:
    """`text` with each of `secrets` (resolved values) replaced by a mask: for messages built by a
    library that may quote what it was given."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
