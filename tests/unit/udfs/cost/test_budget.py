"""The spend budget: fixed windows on the wall clock, each subtask its share, waiting instead of
failing. Windows are made short through config (`budget.window_s`), never by patching clocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from jobs.dev.simulator import ThreadedSimulator
from tests.support.calls import run
from tests.support.configs import job_config, request
from udfs.config import (
    BudgetConfig,
    PriceConfig,
    config_from_dict,
    to_dict,
    with_overrides,
)
from udfs.cost import pricing
from udfs.cost.budget import SpendBudget
from udfs.errors import ConfigError
from udfs.inference.client import InferenceClient
from udfs.metrics import InferenceMetrics


def test_calls_within_the_window_share_pass_and_the_next_waits_for_the_next_window(
        caplog: pytest.LogCaptureFixture) -> None:
    budget = SpendBudget(BudgetConfig(max_tokens_per_hour=200, window_s=0.5), None, subtasks=2)
    assert budget.max_tokens == 100  # this subtask's share

    async def go() -> tuple[list[float], int]:
        waits = [await budget.acquire(30, 10) for _ in range(2)]  # 80 of 100
        window = int(time.time() / 0.5)
        waits.append(await budget.acquire(30, 10))  # 120 > 100: next window
        return waits, int(time.time() / 0.5) - window

    with caplog.at_level(logging.WARNING, logger="udfs.cost.budget"):
        waits, windows_later = run(go)
    assert waits[0] < 0.1 and waits[1] < 0.1
    assert windows_later >= 1 and not budget.paused
    messages = [r.getMessage() for r in caplog.records]
    assert sum("pausing" in m for m in messages) == 1 and sum("resume" in m for m in messages) == 1


def test_settle_corrects_the_estimate_to_the_usage() -> None:
    budget = SpendBudget(BudgetConfig(max_tokens_per_hour=100, window_s=3600), None)

    async def go() -> float:
        await budget.acquire(10, 80)
        budget.settle((10, 80), (10, 5))
        return await budget.acquire(10, 60)  # 15 + 70 fits once settled
    assert run(go) < 0.1 and budget.tokens == 85


def test_cost_budget_prices_the_calls() -> None:
    prices = PriceConfig(prompt_per_1k=1.0, completion_per_1k=2.0)
    budget = SpendBudget(BudgetConfig(max_cost_per_hour=0.05, window_s=0.3), prices)
    assert budget.price(1000, 1000) == 3.0

    async def go() -> int:
        for _ in range(3):
            await budget.acquire(10, 10)  # 0.03 each: one per window
        return budget.pauses
    assert run(go) == 2


def test_answers_and_the_budget_share_one_price_formula() -> None:
    prices = PriceConfig(prompt_per_1k=1.0, completion_per_1k=2.0)
    assert pricing.cost(prices, 1500, 250) == 2.0
    assert pricing.cost_or_none(prices, 1500, 250) == 2.0 and pricing.cost_or_none(None, 1500, 250) is None
    assert SpendBudget(BudgetConfig(max_cost_per_hour=1.0), prices).price(1500, 250) == 2.0
    assert SpendBudget(BudgetConfig(max_tokens_per_hour=10), None).price(1500, 250) == 0.0


def test_a_call_larger_than_the_share_still_runs_alone() -> None:
    budget = SpendBudget(BudgetConfig(max_tokens_per_hour=10, window_s=0.3), None)
    assert run(lambda: budget.acquire(100, 100)) < 0.1


def test_budget_config_errors_name_the_key() -> None:
    data = to_dict(job_config("http://127.0.0.1:9/v1"))
    data["budget"] = {"max_cost_per_hour": 1.0}
    with pytest.raises(ConfigError, match="budget.max_cost_per_hour"):
        config_from_dict(data)
    data["budget"] = {"window_s": 0}
    with pytest.raises(ConfigError, match="budget.window_s"):
        config_from_dict(data)
    data["budget"] = {"max_tokens_per_hour": 1000}  # the default hour, longer than any checkpoint timeout: fine
    assert config_from_dict(data).budget.window_s == 3600
    data["python"] = {"unaligned_checkpoints": False}  # the admission gate lets only an unaligned barrier by
    with pytest.raises(ConfigError, match="python.unaligned_checkpoints: a spend budget"):
        config_from_dict(data)
    data.pop("python")
    data["budget"] = {}
    data["cache"] = {"backend": "memcached"}
    with pytest.raises(ConfigError, match="cache.backend"):
        config_from_dict(data)
    data["cache"] = {"backend": "redis", "redis_url": "http://x"}
    with pytest.raises(ConfigError, match="cache.redis_url"):
        config_from_dict(data)


def test_the_client_pauses_past_the_budget_and_finishes_everything(sim: ThreadedSimulator) -> None:
    """12 calls of ~25 tokens with 100 tokens per 1 s window: at least two window changes, no failure."""
    config = with_overrides(job_config(sim.url), budget={"max_tokens_per_hour": 100, "window_s": 1.0})
    metrics = InferenceMetrics()
    seen_paused = []

    async def go() -> int:
        async with InferenceClient(config, metrics=metrics) as client:
            tasks = [asyncio.ensure_future(client.complete(request(f"q{i}", id=f"r{i}"))) for i in range(12)]
            while not all(t.done() for t in tasks):
                seen_paused.append(metrics.budget_paused)
                await asyncio.sleep(0.05)
            return len([t.result() for t in tasks])

    started = time.time()
    assert run(go) == 12
    assert sim.stats()["served"] == 12
    assert True in seen_paused and not metrics.budget_paused
    assert int(time.time()) - int(started) >= 2


def test_a_waiting_call_cancelled_ends_the_pause() -> None:
    """A call cancelled while it waits (a record deadline, a shutdown) must not leave `paused` set:
    the inference stage's admission gate follows it and would stay closed with nothing waiting."""
    budget = SpendBudget(BudgetConfig(max_tokens_per_hour=10, window_s=3600), None)

    async def go() -> tuple[bool, bool]:
        await budget.acquire(5, 5)  # the window's share is used up
        waiter = asyncio.ensure_future(budget.acquire(5, 5))
        await asyncio.sleep(0.05)
        during = budget.paused
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        return during, budget.paused
    assert run(go) == (True, False)
