"""In-process model servers of the unit tests, on free loopback ports: the simulator in a thread
(fixtures ``make_sim`` and ``sim``, a plugin listed in ``tests/conftest.py``) and any aiohttp app
(``serve_app``) for answers the simulator does not give."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from jobs.dev.simulator import SimulatorConfig, ThreadedSimulator, start_in_thread


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


async def serve_app(routes: list[web.RouteDef]) -> tuple[web.AppRunner, str]:
    """An aiohttp app with ``routes`` on a free loopback port: its runner (``cleanup()`` it) and
    its ``/v1`` base URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1"
