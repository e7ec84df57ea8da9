"""Test-wide hooks: the shared fixture modules, the shell's environment, the run order and how
two workers share it.

Markers, warning filters and test paths are in ``pyproject.toml``. What test modules share lives
in ``tests/support/`` (see its ``__init__``); its fixture modules are plugins, listed here because
pytest takes ``pytest_plugins`` only from the top conftest.
"""

from __future__ import annotations

import os

import pytest

# The environment as the user's shell gave it, before any test ran PyFlink in this process:
# PyFlink's in-process (loopback) workers merge their own settings into os.environ, and a
# command a test starts should see what a user's command would see.
SHELL_ENV = dict(os.environ)

pytest.register_assert_rewrite("tests.support")  # before any import of it: its asserts explain themselves

pytest_plugins = [
    "tests.support.servers",
    "tests.support.stages",
]


def _module_rank(items: list[pytest.Item]) -> int:
    """Where a module's tests go in the run, longest work first (so two workers end together):
    fault tests, then other slow integration tests, other integration tests, unit tests, then
    the container tests and the real-model tests, last, because `make test` builds the image and
    llama.cpp in the background meanwhile."""
    def has(name: str) -> bool:
        return any(item.get_closest_marker(name) is not None for item in items)

    if has("real_model"):
        return 5
    if has("containers"):
        return 4
    if items[0].nodeid.startswith("tests/unit/"):
        return 3
    return 0 if has("fault") else 1 if has("slow") else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The run order: modules kept whole, ranked by `_module_rank`. `make test` runs two pytest-xdist
    workers with ``--dist loadscope --no-loadscope-reorder``: a module goes whole to one worker (its
    module fixtures, such as a compose project, a model server or a bench run, are made once, and
    its tests keep their file order), modules are handed out in this order as workers free up."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    rank = {name: _module_rank(module) for name, module in by_module.items()}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
