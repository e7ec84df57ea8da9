"""The keyed lane (`lane: keyed`): decode, inference and dead letters in one keyed operator.

`InferenceStage` keeps every request it has started in keyed `MapState` until its answer
(or dead letter) is emitted, and runs the calls on a `CallRunner` event loop that lives
outside Flink's bundles. So neither a bundle end nor a checkpoint waits for a model call:
a checkpoint snapshots the pending requests, and a restored job starts them again. This
replaced PyFlink's `AsyncDataStream`, whose operator drains every call at each bundle end
and checkpoint barrier (see README, "Architecture", and docs/architecture.md for the measurements).

What every lane shares (set-up, emitting, dead letters, the bucket skeleton and its timers) is
`udfs/lanes/base.py`; the rules for a record `udfs/lanes/record_path.py`. This lane decides only
when a record's call is made: at once, up to `async.capacity` in flight. Keys are a few buckets
(the input offset modulo `buckets`, computed before the shuffle), only so that keyed state and
timers exist; they have no meaning. Per bucket:

- `process_element` decodes the record (bad input: a dead letter at once), stores it as a
  `PendingRecord` under `topic:partition:offset`, waits for a free slot while
  `async.capacity` calls are in flight (backpressure) and starts the call; then emits the
  bucket's finished calls.
- a processing-time timer `EMIT_PERIOD_MS` ahead, set while the bucket has calls out,
  emits finished calls when no input arrives.
- an event-time timer at `FLUSH_AT` fires on the final MAX watermark (end of a bounded
  input, stop-with-savepoint --drain): it waits for every call of the bucket and emits it.
  Processing-time timers do not fire at the end of input.
- the first element or timer of a bucket in a new function instance (after a restore)
  starts again every request in its state: nothing is live in a fresh instance. Ticks
  (`None` elements from a slow generator source, see `jobs/graph/pipeline.py`) reach every bucket
  about every 1/8 s, so this happens even when no input comes: restored
  processing-time timers did not reach the Python function (measured).

A result leaves state in the same call that emits it, so a snapshot never holds a request
whose answer is already downstream.

`ordering: per_key` (the buckets are then a hash of the Kafka key, `jobs/graph/pipeline.py`): every
outcome of a keyed record, dead letters and forwarded tombstones included, goes through a
`udfs.lanes.ordering.KeyOrder` and leaves only after the earlier records of its key; a record that
must wait is kept in state like a call in flight. A restore admits a bucket's pending records
again sorted by (topic, partition, offset). `ordering: none` takes none of these steps.

A null value (a tombstone) is, by `input.tombstones`: forwarded as a null value with the
same key on the output topic (a record with no key to delete stays a `null_value` dead letter),
a `null_value` dead letter, or skipped. Results and dead letters carry the input record's
headers as `kafka.forward_headers` lets through (`records.forwarded_headers`).

Nothing raises out of the function: an unexpected exception is a bug, an `InternalError`;
it becomes an `internal_error` dead letter and is logged with its traceback
(tests/unit/udfs/lanes/test_keyed.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Coroutine, Generator, Hashable, Iterator
from typing import Any

from pyflink.common import Row, Types
from pyflink.datastream import RuntimeContext
from pyflink.datastream.state import MapStateDescriptor

from udfs.lanes.base import (
    FLUSH_AT,
    INPUT_ROW_TYPE,
    SINK_ROW_TYPE,
    KeyedLane,
    epoch_ms,
    salvage,
)
from udfs.lanes.ordering import KeyOrder, restore_order
from udfs.lanes.record_path import SKIP, Settled
from udfs.records import PendingRecord, Request

__all__ = ["EMIT_PERIOD_MS", "FLUSH_AT", "INPUT_ROW_TYPE", "PENDING_STATE", "SINK_ROW_TYPE", "InferenceStage",
           "epoch_ms"]

log = logging.getLogger("llmstream.udfs")

PENDING_STATE = MapStateDescriptor("pending", Types.STRING(), Types.PICKLED_BYTE_ARRAY())
"""`PendingRecord.handle` -> `PendingRecord`: the record, to start again after a restore. A state
written before that type holds `partition:offset` -> 6-tuple; `PendingRecord.restored` reads both."""
EMIT_PERIOD_MS = 20
"""How long a finished call may wait for its bucket's next element before a timer emits it."""
SLOT_WAIT_S = 0.05
"""Admission re-checks this often for the bucket's finished calls while waiting for a slot."""


class InferenceStage(KeyedLane):
    """The keyed lane (`KeyedLane`: input rows keyed by bucket or ticks, output sink rows).

    `capacity` bounds the calls in flight per subtask (`async.capacity`). `gate_dir`: the
    job has an admission gate in front (`udfs/lanes/admission.py`: a spend budget, a fleet or a rate limit); while no
    call can start before a window or a cooldown ends (`InferenceClient.pause_reason`) the stage
    parks what it cannot start (it is in state already) instead of waiting for a slot inside
    the bundle, and tells the gate to stop its input. `cache_file`: the local result cache's file
    as the job's launch decided it (`udfs.cost.cache.open_cache`).
    """

    RUNNER_NAME = "llmstream-calls"

    # ------------------------------------------------------------------ lifecycle
    def _opened(self, runtime_context: RuntimeContext) -> None:
        self._pending = runtime_context.get_map_state(PENDING_STATE)
        self._outstanding: dict[Any, int] = {}
        self._order = KeyOrder() if self._config.ordering == "per_key" else None
        self._parked: deque[tuple[Any, str, Callable[[], Coroutine[Any, Any, Settled]]]] = deque()
        self._gate = None
        if self._gate_dir is not None:
            from udfs.lanes.admission import GateSignal
            self._gate = GateSignal(self._gate_dir, runtime_context.get_index_of_this_subtask())
        self._parts.announce(f"inference subtask {runtime_context.get_index_of_this_subtask() + 1}/"
                             f"{runtime_context.get_number_of_parallel_subtasks()}")

    def _closed(self) -> None:
        gate = getattr(self, "_gate", None)
        if gate is not None:
            gate.close()

    # ------------------------------------------------------------------ the hooks
    def _take_in(self, bucket: Any, record: PendingRecord) -> Iterator[Row]:
        yield from self._start(bucket, record)

    def _wake(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        yield from self._take_finished(bucket)
        self._admit_parked()
        if self._outstanding.get(bucket, 0) > 0:
            self._wake_in(bucket, ctx, EMIT_PERIOD_MS)

    def _adopt(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        """First sight of `bucket` in this instance: start again whatever its state holds (after a
        restore; empty otherwise), each under the handle it was stored with."""
        self._outstanding[bucket] = 0
        try:
            stored = list(self._pending.items())
        except Exception as err:  # a state backend failure
            log.exception("reading the pending requests of bucket %r failed", bucket)
            yield from self._parts.emit(self._parts.internal(err, salvage(None)))
            return
        if stored:
            log.info("bucket %r: starting %d pending request(s) again after a restore", bucket, len(stored))
        records: list[tuple[str, PendingRecord]] = []
        for handle, value in stored:
            try:
                records.append((handle, PendingRecord.restored(value)))
                self._metrics.holding.hold(handle)
            except Exception as err:
                log.exception("bucket %r: state entry %r is not a pending record", bucket, handle)
                self._let_go(handle)
                yield from self._parts.emit(self._parts.internal(err, salvage(value)))
        if self._order is not None:
            records = restore_order(records)
        for handle, record in records:
            yield from self._start(bucket, record, handle)

    def _flush(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        """End of input: every call of `bucket`, waited for and emitted."""
        while self._outstanding.get(bucket, 0) > 0:
            self._admit_parked(at_end=True)
            self._runner.wait(SLOT_WAIT_S, bucket)
            yield from self._take_finished(bucket)

    # ------------------------------------------------------------------ when calls are made
    def _start(self, bucket: Any, record: PendingRecord, stored_as: str | None = None) -> Iterator[Row]:
        """Decodes `record` and starts its call, waiting for a slot; bad input and tombstones are
        settled at once. `stored_as`: the record is already in state under that handle (a restore)."""
        reissue = stored_as is not None
        handle = stored_as if stored_as is not None else record.handle
        prepared = self._path.prepare(record)
        if prepared is SKIP:
            if reissue:
                self._let_go(handle)
            return
        if not isinstance(prepared, Request):  # bad input or a forwarded tombstone: no call
            yield from self._settle_without_call(bucket, record, handle, reissue, prepared)
            return
        request = prepared
        if not reissue:
            self._hold(handle, record)
        else:
            self._metrics.reissued.inc()
        if self._order is not None:
            self._order.admit(bucket, record.key, handle)
        self._outstanding[bucket] += 1

        def call() -> Coroutine[Any, Any, Settled]:
            return self._path.call(request, record)

        # In line behind any parked records, and started with them; it stays parked only while a
        # pause holds the line (a job without a gate never parks: `_slot` just waits).
        self._parked.append((bucket, handle, call))
        yield from self._start_parked(bucket)

    def _slot(self, bucket: Any) -> Generator[Row, None, bool]:
        """Waits for a free slot, emitting the bucket's finished calls meanwhile: the stage's
        backpressure. False at once while the client is paused and a gate is in front: no slot
        frees before a budget window or a cooldown ends, so the record is parked instead."""
        runner = self._runner
        while not runner.has_slot():
            if self._paused():
                return False
            runner.wait_for_slot(SLOT_WAIT_S)
            yield from self._take_finished(bucket)
        return True

    def _paused(self) -> bool:
        """Whether the client is paused (budget, fleet, Retry-After or rate limit) and a gate is
        in front; tells the gate on a change."""
        gate = self._gate
        if gate is None:
            return False
        reason = self._client.pause_reason
        gate.set(reason)
        return reason is not None

    def _start_parked(self, bucket: Any) -> Iterator[Row]:
        """Starts every parked record, oldest first, waiting for slots (the stage's backpressure);
        stops, leaving the rest parked, while the client is paused. A parked record may belong to
        another bucket: starting it touches no keyed state (it is removed under its own bucket
        when its answer is emitted)."""
        while self._parked and (yield from self._slot(bucket)):
            parked_bucket, handle, call = self._parked.popleft()
            self._runner.submit(parked_bucket, handle, call)
        self._metrics.admitted = self._runner.in_flight

    def _admit_parked(self, *, at_end: bool = False) -> None:
        """Starts parked records, oldest first, while slots are free and the client is not paused
        (`at_end`: paused or not; the calls then wait for the window themselves). Never waits."""
        if self._gate is None:
            return
        paused = self._paused()  # read on every element and timer: it also tells the gate
        runner = self._runner
        while self._parked and runner.has_slot() and (at_end or not paused):
            bucket, handle, call = self._parked.popleft()
            runner.submit(bucket, handle, call)
        self._metrics.admitted = runner.in_flight

    # ------------------------------------------------------------------ records out
    def _settle_without_call(self, bucket: Any, record: PendingRecord, handle: str, reissue: bool,
                             settled: Settled) -> Iterator[Row]:
        """A record that needs no call (bad input, a tombstone): out at once, unless an earlier
        record of its key is still out under `ordering: per_key`; then it waits in state, like a
        call in flight, and leaves in its turn."""
        order = self._order
        if order is None or not order.waiting(bucket, record.key):
            if reissue:
                self._let_go(handle)
            yield from self._parts.emit(settled)
            return
        if not reissue:
            self._hold(handle, record)
        order.admit(bucket, record.key, handle)
        yield from self._settle(order.finish(handle, settled))

    def _take_finished(self, bucket: Any) -> Iterator[Row]:
        """The bucket's finished calls out, each removed from state as it leaves (under
        `ordering: per_key`, those whose turn has come)."""
        done = self._runner.take(bucket)
        if not done:
            return
        order = self._order
        for handle, settled in done:
            if settled is None:  # the runner caught a raise that `RecordPath.call` should have prevented
                settled = self._parts.internal("the inference call raised", self._stored(handle))
            yield from self._settle(order.finish(handle, settled) if order is not None else [(handle, settled)])
        self._outstanding[bucket] -= len(done)
        self._metrics.admitted = self._runner.in_flight

    def _settle(self, released: list[tuple[Any, Settled]]) -> Iterator[Row]:
        """Each record out of state and its row out, in the same call."""
        for handle, settled in released:
            self._let_go(handle)
            yield from self._parts.emit(settled)

    # ------------------------------------------------------------------ state
    def _hold(self, handle: str, record: PendingRecord) -> None:
        """`record` into state until its outcome leaves (`_let_go`), counted as held."""
        self._pending.put(handle, record)
        self._metrics.holding.hold(handle)

    def _let_go(self, handle: Hashable) -> None:
        self._pending.remove(handle)
        self._metrics.holding.release(handle)

    def _stored(self, handle: Any) -> PendingRecord:
        """The record kept under `handle`, or what can be salvaged of it."""
        value = self._pending.get(handle)
        try:
            return PendingRecord.restored(value)
        except TypeError:
            return salvage(value)
