"""Where the pinned JVM jars live, for code that launches Java or configures Flink.

The jars themselves are fetched and verified by ``pom-free/fetch.py``; this module
only loads that script (it sits outside the package, in a folder with a hyphen) and
turns its manifest into paths, classpaths and URLs.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from udfs.errors import LLMStreamError

_FETCHER_NAME = "llmstream_pom_free_fetch"


class JarsError(LLMStreamError, RuntimeError):
    """A pinned jar set is missing, or cannot be fetched or verified; the message says how to get it."""


def repo_root() -> Path:
    """The checkout root: ``$LLMSTREAM_HOME`` if set, else two levels above this file."""
    env = os.environ.get("LLMSTREAM_HOME")
    return Path(env).expanduser().resolve() if env else Path(__file__).resolve().parents[2]


def user_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/llmstream`` or ``~/.cache/llmstream``: what is built once per machine and
    user (the JVM class archives, the llama.cpp wheel) and must outlive a checkout's ``var/``."""
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "llmstream"


@lru_cache(maxsize=4)
def _load_fetcher(path: Path) -> ModuleType:
    if not path.is_file():
        raise JarsError(f"pom-free fetcher not found at {path}; set LLMSTREAM_HOME to the repo root")
    spec = importlib.util.spec_from_file_location(_FETCHER_NAME, path)
    if spec is None or spec.loader is None:
        raise JarsError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_FETCHER_NAME] = module
    spec.loader.exec_module(module)
    return module


def fetcher() -> ModuleType:
    """The ``pom-free/fetch.py`` module of the current repo root."""
    return _load_fetcher(repo_root() / "pom-free" / "fetch.py")


def cache_root() -> Path:
    env = os.environ.get("LLMSTREAM_JAR_CACHE")
    return Path(env).expanduser().resolve() if env else repo_root() / "pom-free" / "cache"


def _entries(set_name: str) -> list:
    mod = fetcher()
    if set_name not in mod.SETS:
        raise ValueError(f"unknown jar set {set_name!r}; known: {', '.join(mod.SETS)}")
    entries = mod.entries_for(set_name, mod.read_manifest(repo_root() / "pom-free" / "manifest.tsv"))
    if not entries:
        raise JarsError(f"pom-free/manifest.tsv has no rows for set {set_name!r}")
    return entries


def jar_dir(set_name: str) -> Path:
    """The cache directory of one set (it may not exist before ``ensure``)."""
    _entries(set_name)
    return cache_root() / set_name


def jars(set_name: str) -> list[Path]:
    """The set's jars in manifest order; raises if any is missing, so callers fail early and clearly."""
    directory = jar_dir(set_name)
    paths = [directory / e.filename for e in _entries(set_name)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise JarsError(
            f"{len(missing)} jar(s) of set {set_name!r} missing from {directory} (e.g. {missing[0]}); "
            f"call jobs.runtime.jars.ensure({set_name!r}) or run `python pom-free/fetch.py --set {set_name}`"
        )
    return paths


def classpath(set_name: str) -> str:
    """A ``java -cp`` value listing exactly the locked jars (never stray files in the cache)."""
    return os.pathsep.join(str(p) for p in jars(set_name))


def connector_jar_urls() -> list[str]:
    """``file://`` URLs of the Kafka connector, for Flink's ``pipeline.jars``."""
    return [p.as_uri() for p in jars("connector")]


def ensure(set_name: str) -> None:
    """Make sure the set's jars are cached and verified, fetching with Maven if they are not.

    A no-op apart from hashing when the cache is intact, so it is cheap to call
    before every launch.
    """
    entries = _entries(set_name)
    mod = fetcher()
    try:
        mod.fetch_set(set_name, entries, cache_root())
    except mod.FetchError as exc:
        raise JarsError(f"fetching jar set {set_name!r} failed: {exc}") from exc
    except OSError as exc:
        raise JarsError(f"fetching jar set {set_name!r} into {cache_root()} failed: {exc}") from exc
