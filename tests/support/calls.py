"""Calling the inference client from a synchronous test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tests.support.configs import request
from udfs.config import JobConfig
from udfs.inference.client import InferenceClient
from udfs.records import Completion, Request

T = TypeVar("T")


def run(make: Callable[[], Awaitable[T]], timeout: float = 60.0) -> T:
    """Runs a test coroutine on a fresh loop, with a guard so a bug fails instead of hanging."""
    async def guarded() -> T:
        return await asyncio.wait_for(make(), timeout)

    return asyncio.run(guarded())


async def complete_one(config: JobConfig, req: Request | None = None) -> tuple[Completion, InferenceClient]:
    """One call through a fresh client (closed after it), and the client, for its metrics."""
    async with InferenceClient(config) as client:
        return await client.complete(req or request()), client


async def failure(config: JobConfig, req: Request | None = None) -> tuple[Exception, float, InferenceClient]:
    """One call that must fail: what it raised, the seconds it took, and the client."""
    started = time.monotonic()
    async with InferenceClient(config) as client:
        try:
            await client.complete(req or request())
        except Exception as err:  # noqa: BLE001 - the test inspects whatever was raised
            return err, time.monotonic() - started, client
    raise AssertionError("complete() succeeded; a failure was expected")
