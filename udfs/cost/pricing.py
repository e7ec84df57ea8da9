"""What tokens cost: the one price formula of llmstream.

`model.prices` gives a price per 1,000 prompt tokens and per 1,000 completion tokens, in any
currency. The client prices each answer with it (a result's `cost`), the spend budget prices
estimates and corrections (`udfs/cost/budget.py`), and `llmstream status` prices the job's token
counters per hour; all three call `cost`, so they cannot disagree.
"""

from __future__ import annotations

from udfs.config import PriceConfig


def cost(prices: PriceConfig, prompt_tokens: float, completion_tokens: float) -> float:
    """The price of `prompt_tokens` + `completion_tokens` (counts or estimates) at `prices`."""
    return prompt_tokens / 1000 * prices.prompt_per_1k + completion_tokens / 1000 * prices.completion_per_1k


def cost_or_none(prices: PriceConfig | None, prompt_tokens: float, completion_tokens: float) -> float | None:
    """`cost`, or `None` when the job has no `model.prices` (a result then carries no cost)."""
    return None if prices is None else cost(prices, prompt_tokens, completion_tokens)
