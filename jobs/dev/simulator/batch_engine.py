"""How a simulated provider batch lives: its phases, its clock, its requests answered over time, the
outcomes a test can force, and the counters; the same for both APIs (no HTTP, no provider shapes).

A batch is created ``validating`` (OpenAI) or ``in_progress`` (Anthropic, which has no such
status), with durations drawn from ``BatchSettings``. After ``validating_s`` its ``Flavor`` checks
it (a list of errors fails it), then its requests are answered in random order, spread evenly
over ``delay_s``; once all are answered it is ``finalizing`` for ``finalizing_s``, then
``completed`` and its results are written. One asyncio task drives each batch, sleeping between
steps; forcing an outcome cancels that task:

- ``expire``: the requests not answered yet expire, the answered ones stay in the results (also
  what happens by itself when the completion window, 24 h / ``time_scale``, ends first);
- ``cancel``: ``cancelling`` for ``finalizing_s``, then ``cancelled``; unanswered requests are
  cancelled, answered ones stay;
- ``fail``: the batch fails as if validation had refused it (nothing is answered);
- ``process``: answer that many more requests now (all when no count is given), e.g. to end a
  long batch at once or to have a known share answered before an ``expire``;
- ``delete``: the batch is forgotten, as a provider that no longer knows it (404 from then on).

Statuses are OpenAI's (``validating in_progress finalizing completed failed expired cancelling
cancelled``); the Anthropic flavor maps them to its ``processing_status``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jobs.dev.simulator.batch_config import BatchSettings, sample
from jobs.dev.simulator.config import SimulatorConfig

log = logging.getLogger("llmstream.simulator.batches")

LIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")
STATUSES = LIVE + ENDED
_ANSWER_CHUNK = 200
"""Requests answered between two yields to the event loop, so a large batch never stalls the server."""
FINISH_CHUNK = 1000
"""Result lines a flavor writes between two yields (``Flavor.finish``)."""
_MIN_STEP_S = 0.05
"""The driver wakes at most this often while answers fall due."""


@dataclass(eq=False, slots=True)
class RequestResult:
    """What became of one request: ``succeeded`` (``body``), ``errored`` (``status``, ``body`` the
    provider's error object), ``expired`` or ``cancelled``."""

    kind: str
    body: dict[str, Any] | None = None
    status: int = 200
    request_id: str = ""


@dataclass(eq=False, slots=True)
class Item:
    """One request of a batch: its ``custom_id``, its request (OpenAI ``body``, Anthropic
    ``params``), its line (1-based) and, once decided, its ``result``."""

    custom_id: str
    request: Any
    line: int
    result: RequestResult | None = None


class Flavor:
    """What one provider API does with a batch: check it, answer one request, write the results."""

    api = ""
    statuses: tuple[str, ...] = STATUSES
    """The statuses ``stats`` counts batches by, in this API's words (see ``status_of``)."""

    def status_of(self, batch: Batch) -> str:
        return batch.status

    def validate(self, batch: Batch, settings: BatchSettings) -> list[dict[str, Any]]:
        """The validation errors that fail the batch (none: it goes on)."""
        return []

    def answer(self, batch: Batch, item: Item, engine: BatchEngine) -> RequestResult:
        raise NotImplementedError

    def failed(self, batch: Batch, engine: BatchEngine) -> None:
        """Called once the batch has failed (``batch.errors`` says why)."""

    def finish(self, batch: Batch, engine: BatchEngine) -> Iterator[None]:
        """Called once the batch has ended otherwise: write its results, yielding now and then
        (every ``FINISH_CHUNK`` lines) so that the engine can let the event loop breathe."""
        yield


@dataclass(eq=False)
class Batch:
    id: str
    flavor: Flavor
    items: list[Item]
    created_at: float
    created_mono: float
    expires_at: float
    expires_mono: float
    validating_s: float
    delay_s: float
    finalizing_s: float
    status: str = "validating"
    stamps: dict[str, float] = field(default_factory=dict)
    """Unix times of what happened: in_progress_at, finalizing_at, completed_at, failed_at, expired_at,
    cancelling_at, cancelled_at."""
    errors: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """What the flavor keeps: input file, endpoint, metadata, output files, results."""
    pending: list[int] = field(default_factory=list)
    """Indexes of the requests not answered yet, in the order they will be."""
    answered: int = 0
    submitted: int = 0
    """What the batch added to ``requests_submitted``: the lines of its input (valid or not)."""
    started_mono: float = 0.0
    task: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    forced: str | None = None
    """The outcome a test forced (``expire``, ``cancel``, ``fail``, ``delete``), if any."""

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def count(self, kind: str) -> int:
        return sum(1 for item in self.items if item.result is not None and item.result.kind == kind)

    def counts(self) -> Counter[str]:
        return Counter(item.result.kind for item in self.items if item.result is not None)

    def summary(self) -> dict[str, Any]:
        """One line of ``GET /admin/batches``."""
        counts = self.counts()
        return {"id": self.id, "api": self.flavor.api, "status": self.status,
                "api_status": self.flavor.status_of(self), "requests": len(self.items),
                "answered": self.answered, "outcomes": dict(counts), "forced": self.forced,
                "age_s": round(time.monotonic() - self.created_mono, 3),
                "delay_s": round(self.delay_s, 3), "expires_in_s": round(self.expires_mono - time.monotonic(), 3)}


class BatchEngine:
    """The batches of both APIs in one simulator; runs on the server's event loop.

    ``settings`` and ``config`` are read at each use, so ``POST /admin/batches`` and
    ``POST /admin/config`` apply to what comes after them (durations are drawn at creation).
    """

    def __init__(self, settings: Callable[[], BatchSettings], config: Callable[[], SimulatorConfig]) -> None:
        self.settings = settings
        self.config = config
        seed = config().seed
        self.rng = random.Random(None if seed is None else seed + 7919)
        self.batches: dict[str, Batch] = {}
        self.files: dict[str, Any] = {}
        """The OpenAI flavor's files (here so both live and die with the engine)."""
        self._tag = secrets.token_hex(3)
        self._numbers = itertools.count(1)
        self.reset_stats()

    # ----------------------------------------------------------------- ids

    def new_id(self, prefix: str) -> str:
        """``prefix`` + a per-process tag + a serial number: unique, and never reused by a restarted simulator."""
        return f"{prefix}{self._tag}{next(self._numbers):06x}"

    def request_id(self) -> str:
        return self.new_id("req_sim")

    # ----------------------------------------------------------------- stats

    def reset_stats(self) -> None:
        self.counters: dict[str, Counter[str]] = {}

    def bump(self, api: str, key: str, amount: int = 1) -> None:
        self.counters.setdefault(api, Counter())[key] += amount

    def stats(self, flavors: list[Flavor]) -> dict[str, Any]:
        """Per API: the counters since start or the last reset, and the live batches by status."""
        out: dict[str, Any] = {}
        for flavor in flavors:
            counters = self.counters.get(flavor.api, Counter())
            by_status = dict.fromkeys(flavor.statuses, 0)
            for batch in self.batches.values():
                if batch.flavor is flavor:
                    status = flavor.status_of(batch)
                    by_status[status] = by_status.get(status, 0) + 1
            out[flavor.api] = {key: counters.get(key, 0) for key in _COUNTERS} | {"batches_by_status": by_status}
        out["requests_submitted"] = sum(self.counters.get(f.api, Counter())["requests_submitted"] for f in flavors)
        return out

    # ----------------------------------------------------------------- lifecycle

    def create(self, flavor: Flavor, items: list[Item], prefix: str, extra: dict[str, Any],
               submitted: int | None = None, validating: bool = True) -> Batch:
        """A new batch, started; ``submitted`` (default: its items) is what it adds to ``requests_submitted``;
        without ``validating`` it starts answering at once (its status is ``validating`` until then)."""
        settings = self.settings()
        now, mono = time.time(), time.monotonic()
        window = settings.window_s
        batch = Batch(
            id=self.new_id(prefix), flavor=flavor, items=items, created_at=now, created_mono=mono,
            expires_at=now + window, expires_mono=mono + window,
            validating_s=sample(settings.validating_s, self.rng) if validating else 0.0,
            delay_s=sample(settings.delay_s, self.rng), finalizing_s=sample(settings.finalizing_s, self.rng), extra=extra,
            submitted=len(items) if submitted is None else submitted)
        self.batches[batch.id] = batch
        self.bump(flavor.api, "batches_created")
        self.bump(flavor.api, "requests_submitted", batch.submitted)
        batch.task = asyncio.get_running_loop().create_task(self._drive(batch), name=f"batch {batch.id}")
        log.info("%s batch %s created: %d requests, answered over %.1f s, window %.0f s",
                 flavor.api, batch.id, len(items), batch.delay_s, window)
        return batch

    async def _wait(self, batch: Batch, until: float) -> None:
        """Sleep until the monotonic time ``until``, or until ``batch.wake`` is set."""
        timeout = until - time.monotonic()
        if timeout > 0 and not batch.wake.is_set():
            try:
                await asyncio.wait_for(batch.wake.wait(), timeout)
            except TimeoutError:
                pass
        batch.wake.clear()

    async def _drive(self, batch: Batch) -> None:
        await self._wait(batch, batch.created_mono + batch.validating_s)
        try:
            started = self._start(batch)
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the batch validating for ever
            self._crashed(batch, exc)
            return
        if started:
            await self._run(batch)

    def _crashed(self, batch: Batch, exc: Exception) -> None:
        """A bug here must not leave a batch in progress for ever: it fails, naming the exception."""
        log.error("batch %s: the simulator failed it", batch.id, exc_info=exc)
        self._fail(batch, [{"code": "simulator_error", "line": None, "param": None,
                            "message": f"The simulator failed this batch: {exc!r}"}])

    def _start(self, batch: Batch) -> bool:
        """Validate the batch and set it going (True), or fail or expire it (False)."""
        if time.monotonic() >= batch.expires_mono:
            self._expire(batch)
            return False
        errors = batch.flavor.validate(batch, self.settings())
        if errors:
            self._fail(batch, errors)
            return False
        self._set(batch, "in_progress")
        batch.started_mono = time.monotonic()
        batch.pending = list(range(len(batch.items)))
        self.rng.shuffle(batch.pending)
        return True

    async def _run(self, batch: Batch) -> None:
        """Answer the requests as they fall due, then finalize; expire at the end of the window."""
        try:
            while batch.pending:
                now = time.monotonic()
                if now >= batch.expires_mono:
                    self._unanswered(batch, "expired")
                    await self._end_async(batch, "expired")
                    return
                total = len(batch.items)
                elapsed = now - batch.started_mono
                due = total if batch.delay_s <= 0 else min(total, math.floor(total * elapsed / batch.delay_s))
                if due > batch.answered:
                    self._answer(batch, min(due - batch.answered, _ANSWER_CHUNK))
                    await asyncio.sleep(0)
                    continue
                next_due = batch.started_mono + batch.delay_s * (batch.answered + 1) / total
                await self._wait(batch, min(max(next_due, now + _MIN_STEP_S), batch.expires_mono))
            self._set(batch, "finalizing")
            await self._wait(batch, time.monotonic() + batch.finalizing_s)
            await self._end_async(batch, "completed")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the batch in progress for ever
            self._crashed(batch, exc)

    def _answer(self, batch: Batch, count: int) -> None:
        api = batch.flavor.api
        for _ in range(min(count, len(batch.pending))):
            item = batch.items[batch.pending.pop()]
            item.result = result = batch.flavor.answer(batch, item, self)
            item.request = None  # answered: a 100,000-record bench keeps only what it still needs
            batch.answered += 1
            self.bump(api, "requests_succeeded" if result.kind == "succeeded" else "requests_errored")

    def _set(self, batch: Batch, status: str) -> None:
        batch.status = status
        batch.stamps[f"{status}_at"] = time.time()

    def _unanswered(self, batch: Batch, kind: str) -> None:
        api = batch.flavor.api
        for item in batch.items:
            if item.result is None:
                item.result = RequestResult(kind)
                self.bump(api, f"requests_{kind}")
        batch.pending = []

    def _end(self, batch: Batch, status: str) -> None:
        """End a batch that was not refused: write its results, then say it has ended."""
        for _ in batch.flavor.finish(batch, self):
            pass
        self._ended(batch, status)

    async def _end_async(self, batch: Batch, status: str) -> None:
        """``_end``, yielding to the event loop while the results are written."""
        for _ in batch.flavor.finish(batch, self):
            await asyncio.sleep(0)
        self._ended(batch, status)

    def _ended(self, batch: Batch, status: str) -> None:
        self._set(batch, status)
        self.bump(batch.flavor.api, f"batches_{status}")
        log.info("%s batch %s %s: %s", batch.flavor.api, batch.id, status, dict(batch.counts()))

    def _expire(self, batch: Batch) -> None:
        self._unanswered(batch, "expired")
        self._end(batch, "expired")

    def _fail(self, batch: Batch, errors: list[dict[str, Any]]) -> None:
        batch.errors = errors
        batch.pending = []
        self._set(batch, "failed")
        self.bump(batch.flavor.api, "batches_failed")
        self.bump(batch.flavor.api, "requests_refused", batch.submitted - batch.answered)
        batch.flavor.failed(batch, self)
        log.info("%s batch %s failed: %s", batch.flavor.api, batch.id, errors[:3])

    async def _cancelling(self, batch: Batch) -> None:
        await self._wait(batch, time.monotonic() + batch.finalizing_s)
        self._unanswered(batch, "cancelled")
        await self._end_async(batch, "cancelled")

    def _stop_driver(self, batch: Batch) -> None:
        if batch.task is not None and not batch.task.done():
            batch.task.cancel()
        batch.task = None

    # ----------------------------------------------------------------- what a client or a test does

    def cancel(self, batch: Batch) -> None:
        """Cancel as the API's cancel does; raises ValueError when the batch can no longer be cancelled."""
        if batch.status not in ("validating", "in_progress"):
            raise ValueError(f"cannot cancel batch {batch.id}: it is {batch.status}")
        self._stop_driver(batch)
        self._set(batch, "cancelling")
        batch.task = asyncio.get_running_loop().create_task(self._cancelling(batch), name=f"cancel {batch.id}")

    def expire(self, batch: Batch) -> None:
        if batch.status not in ("validating", "in_progress"):
            raise ValueError(f"cannot expire batch {batch.id}: it is {batch.status}")
        self._stop_driver(batch)
        self._expire(batch)

    def fail(self, batch: Batch, line: int | None = None, message: str | None = None,
             code: str = "simulated_validation_error") -> None:
        if batch.status not in ("validating", "in_progress"):
            raise ValueError(f"cannot fail batch {batch.id}: it is {batch.status}")
        self._stop_driver(batch)
        for item in batch.items:  # refused as a whole: what was answered is never delivered
            if item.result is not None:
                self.bump(batch.flavor.api, "requests_succeeded" if item.result.kind == "succeeded"
                          else "requests_errored", -1)
            item.result = None
        batch.answered = 0
        line = 1 if line is None and batch.items else line
        self._fail(batch, [{"code": code, "line": line, "param": None,
                            "message": message or f"Simulated validation failure of line {line} "
                                                  "(simulator: forced by POST /admin/batches)"}])

    def process(self, batch: Batch, count: int | None = None) -> int:
        """Answer ``count`` more requests now (all when None), validating a ``validating`` batch
        first; returns how many were answered."""
        if batch.status not in ("validating", "in_progress"):
            raise ValueError(f"cannot process batch {batch.id}: it is {batch.status}")
        if batch.status == "validating":
            self._stop_driver(batch)
            if not self._start(batch):
                return 0
            batch.task = asyncio.get_running_loop().create_task(self._run(batch), name=f"batch {batch.id}")
        before = batch.answered
        self._answer(batch, len(batch.pending) if count is None else count)
        batch.wake.set()
        return batch.answered - before

    def delete(self, batch: Batch) -> None:
        self._stop_driver(batch)
        del self.batches[batch.id]
        self.bump(batch.flavor.api, "batches_deleted")
        log.info("%s batch %s deleted", batch.flavor.api, batch.id)

    def force(self, batch: Batch, body: dict[str, Any]) -> dict[str, Any]:
        """Apply a ``POST /admin/batches/{id}`` body; raises ValueError on a bad one."""
        action = body.get("action")
        allowed = {"expire": set(), "cancel": set(), "delete": set(), "fail": {"line", "message", "code"},
                   "process": {"requests"}}
        if action not in allowed:
            raise ValueError(f"action must be one of {sorted(allowed)}, got {action!r}")
        unknown = set(body) - {"action"} - allowed[action]
        if unknown:
            raise ValueError(f"unknown keys for {action}: {sorted(unknown)}")
        result: dict[str, Any] = {"id": batch.id, "action": action}
        if action == "process":
            count = body.get("requests")
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise ValueError(f"requests must be an integer >= 0, got {count!r}")
            result["answered_now"] = self.process(batch, count)
        else:
            batch.forced = action
            if action == "expire":
                self.expire(batch)
            elif action == "cancel":
                self.cancel(batch)
            elif action == "delete":
                self.delete(batch)
            else:
                line, message, code = body.get("line"), body.get("message"), body.get("code", "simulated_validation_error")
                if line is not None and (isinstance(line, bool) or not isinstance(line, int) or line < 1):
                    raise ValueError(f"line must be an integer >= 1, got {line!r}")
                if not (message is None or isinstance(message, str)) or not isinstance(code, str):
                    raise ValueError("message and code must be strings")
                self.fail(batch, line, message, code)
        result["batch"] = batch.summary()  # as it was left (a deleted one too: what it had answered)
        return result


_COUNTERS = ("batches_created", "requests_submitted", "requests_succeeded", "requests_errored",
             "requests_expired", "requests_cancelled", "requests_refused",
             "batches_completed", "batches_failed", "batches_expired", "batches_cancelled", "batches_deleted",
             "files_uploaded", "bytes_uploaded", "prompt_tokens", "completion_tokens")
"""The counters of ``BatchEngine.stats`` per API (every one present, zero until it happens)."""
