"""Fixtures shared by the unit tests that run the model-server simulator over real HTTP on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from jobs.model_server import SimulatorConfig, ThreadedSimulator, start_in_thread


@pytest.fixture
def make_sim() -> Iterator[Callable[..., ThreadedSimulator]]:
    """Start simulators on free ports and always stop them, so a failing test leaks no thread."""
    started: list[ThreadedSimulator] = []

    def make(**overrides: Any) -> ThreadedSimulator:
        sim = start_in_thread(SimulatorConfig(port=0, stats_log_interval_s=0, **overrides))
        started.append(sim)
        return sim

    yield make
    for sim in started:
        sim.stop()


@pytest.fixture
def sim(make_sim: Callable[..., ThreadedSimulator]) -> ThreadedSimulator:
    return make_sim()
