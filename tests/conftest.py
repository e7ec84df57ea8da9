"""Test-wide hooks: the shared fixture modules, the shell's environment, and the run order.

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Container tests, then real-model tests, last: the image build and the llama.cpp build
    `make test` starts in the background then overlap everything else instead of holding the
    run up."""
    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("real_model") is not None:
            return 2
        return 1 if item.get_closest_marker("containers") is not None else 0

    items.sort(key=rank)
