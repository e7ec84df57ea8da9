"""Fixtures of the unit tests: the model-server simulator in a thread (real HTTP on loopback) and
inference stages on a fake PyFlink runtime."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from jobs.dev.simulator import SimulatorConfig, ThreadedSimulator, start_in_thread
from tests.unit.fake_flink import Harness


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


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    """Inference stages driven by fake PyFlink (tests/unit/fake_flink.py), closed after the test."""
    made: list[Harness] = []
    yield made
    for h in made:
        h.close()
