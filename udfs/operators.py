"""The Python function Flink runs: decode, inference and dead letters in one keyed operator.

`InferenceStage` keeps every request it has started in keyed `MapState` until its answer
(or dead letter) is emitted, and runs the calls on a `CallRunner` event loop that lives
outside Flink's bundles. So neither a bundle end nor a checkpoint waits for a model call:
a checkpoint snapshots the pending requests, and a restored job starts them again. This
replaced PyFlink's `AsyncDataStream`, whose operator drains every call at each bundle end
and checkpoint barrier (see README, "Architecture", and NOTES for the measurements).

Keys are a few buckets (the input offset modulo `buckets`, computed before the shuffle),
only so that keyed state and timers exist; they have no meaning. Per bucket:

- `process_element` decodes the record (bad input: a dead letter at once), stores it under
  `partition:offset`, waits for a free slot while `async.capacity` calls are in flight
  (backpressure) and starts the call; then emits the bucket's finished calls.
- a processing-time timer `EMIT_PERIOD_MS` ahead, set while the bucket has calls out,
  emits finished calls when no input arrives.
- an event-time timer at `FLUSH_AT` fires on the final MAX watermark (end of a bounded
  input, stop-with-savepoint --drain): it waits for every call of the bucket and emits it.
  Processing-time timers do not fire at the end of input.
- the first element or timer of a bucket in a new function instance (after a restore)
  starts again every request in its state: nothing is live in a fresh instance. Ticks
  (`None` elements from a slow generator source, see `jobs/pipeline.py`) reach every bucket
  about every 1/8 s, so this happens even when no input comes: restored
  processing-time timers did not reach the Python function (measured).

A result leaves state in the same call that emits it, so a snapshot never holds a request
whose answer is already downstream. Nothing raises out of the function: an unexpected
exception is a bug, an `InternalError`; it becomes an `internal_error` dead letter and is
logged with its traceback (tests/unit/test_operators.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from pyflink.common import Row, Types
from pyflink.datastream import KeyedProcessFunction, RuntimeContext
from pyflink.datastream.state import MapStateDescriptor

from udfs import dead_letter
from udfs.config import JobConfig
from udfs.decode import decode, record_id
from udfs.encode import result_row
from udfs.errors import BadInput, InternalError, RecordError
from udfs.records import Request, SinkRow, SourceRef

log = logging.getLogger("llmstream.udfs")

SINK_ROW_TYPE = Types.ROW_NAMED(
    ["k", "v", "topic"], [Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.STRING()]
)
INPUT_ROW_TYPE = Types.ROW_NAMED(
    ["k", "v", "topic", "partition", "offset", "ts"],
    [Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.STRING(), Types.INT(),
     Types.LONG(), Types.INSTANT()])
"""One Kafka record as the source table hands it over (the value of the keyed stream)."""
PENDING_STATE = MapStateDescriptor("pending", Types.STRING(), Types.PICKLED_BYTE_ARRAY())
"""partition:offset -> (key, value, topic, partition, offset, timestamp_ms): the record, to start again."""
FLUSH_AT = 2**62
"""Event time of the end-of-input timer: only the final MAX watermark reaches it."""
EMIT_PERIOD_MS = 20
"""How long a finished call may wait for its bucket's next element before a timer emits it."""
SLOT_WAIT_S = 0.05
"""Admission re-checks this often for the bucket's finished calls while waiting for a slot."""

Stored = tuple[bytes | None, bytes | None, str, int, int, int | None]


def epoch_ms(ts: Any) -> int | None:
    """A Kafka timestamp as PyFlink hands it over (Instant, datetime or millis) in epoch ms."""
    if ts is None or isinstance(ts, int):
        return ts
    to_ms = getattr(ts, "to_epoch_milli", None)
    if to_ms is not None:
        return int(to_ms())
    timestamp = getattr(ts, "timestamp", None)
    return int(timestamp() * 1000) if timestamp is not None else None


def _row(row: SinkRow) -> Row:
    return Row(row.key, row.value, row.topic)


class InferenceStage(KeyedProcessFunction):
    """Input: rows (key, value, topic, partition, offset, timestamp) keyed by bucket, or `None` (a tick).
    Output: `SINK_ROW_TYPE` rows, results and dead letters alike (the topic tells them apart).

    `capacity` bounds the calls in flight per subtask (`async.capacity`).
    """

    def __init__(self, config: JobConfig) -> None:
        self._config = config

    # ------------------------------------------------------------------ lifecycle
    def open(self, runtime_context: RuntimeContext) -> None:
        from udfs.client import InferenceClient
        from udfs.inflight import CallRunner
        from udfs.metrics import InferenceMetrics

        subtasks = runtime_context.get_number_of_parallel_subtasks()
        self._metrics = InferenceMetrics(runtime_context.get_metrics_group().add_group("llmstream"))
        self._pending = runtime_context.get_map_state(PENDING_STATE)
        self._runner = CallRunner(self._config.async_.capacity)
        self._client = InferenceClient(self._config, subtasks=subtasks, metrics=self._metrics)
        self._outstanding: dict[Any, int] = {}
        self._timer_at: dict[Any, int] = {}
        model = self._config.model
        log.info("inference subtask %s/%s: %s %s model=%s capacity=%s",
                 runtime_context.get_index_of_this_subtask() + 1, subtasks, model.api,
                 model.endpoint, model.model, self._config.async_.capacity)

    def close(self) -> None:
        runner = getattr(self, "_runner", None)
        if runner is not None:
            runner.close(before_stop=self._client.close)

    # ------------------------------------------------------------------ Flink callbacks
    def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterator[Row]:
        bucket = ctx.get_current_key()
        try:
            if bucket not in self._outstanding:
                yield from self._adopt(bucket, ctx)
            if value is None:  # a tick: only wakes the bucket
                yield from self._emit(bucket)
                self._ensure_timer(bucket, ctx)
                return
            self._metrics.records_in.inc()
            stored: Stored = (value[0], value[1], value[2], value[3], value[4], epoch_ms(value[5]))
        except Exception as err:
            log.exception("unexpected error reading an input row")
            yield self._dead_letter_row(InternalError.from_exception(err), value)
            return
        yield from self._start(bucket, stored, reissue=False)
        yield from self._emit(bucket)
        self._ensure_timer(bucket, ctx)

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Iterator[Row]:
        bucket = ctx.get_current_key()
        if bucket not in self._outstanding:
            yield from self._adopt(bucket, ctx)
        if timestamp >= FLUSH_AT:
            yield from self._flush(bucket)
            return
        if self._timer_at.get(bucket) == timestamp:
            del self._timer_at[bucket]
        yield from self._emit(bucket)
        self._ensure_timer(bucket, ctx)

    # ------------------------------------------------------------------ the stage
    def _adopt(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        """First sight of `bucket` in this instance: arm the end-of-input timer and start again
        whatever its state holds (after a restore; empty otherwise)."""
        self._outstanding[bucket] = 0
        ctx.timer_service().register_event_time_timer(FLUSH_AT)
        try:
            stored = list(self._pending.values())
        except Exception as err:  # pragma: no cover - a state backend failure
            log.exception("reading the pending requests of bucket %r failed", bucket)
            yield self._dead_letter_row(InternalError.from_exception(err), None)
            return
        if stored:
            log.info("bucket %r: starting %d pending request(s) again after a restore", bucket, len(stored))
        for record in stored:
            yield from self._start(bucket, record, reissue=True)
        if stored:
            self._ensure_timer(bucket, ctx)

    def _start(self, bucket: Any, stored: Stored, *, reissue: bool) -> Iterator[Row]:
        """Decodes `stored` and starts its call, waiting for a slot; bad input is answered at once."""
        key, raw, topic, partition, offset, ts = stored
        source = SourceRef(topic, partition, offset, ts)
        handle = f"{partition}:{offset}"
        try:
            request = decode(key, raw, source, self._config.limits)
        except BadInput as err:
            self._metrics.bad_input.inc()
            if reissue:
                self._pending.remove(handle)
            yield _row(self._dead_letter(err, key, raw, source, record_id(raw)))
            return
        except Exception as err:
            log.exception("unexpected error decoding %s-%s@%s", topic, partition, offset)
            self._metrics.bad_input.inc()
            if reissue:
                self._pending.remove(handle)
            yield _row(self._dead_letter(InternalError.from_exception(err), key, raw, source, record_id(raw)))
            return
        if not reissue:
            self._pending.put(handle, stored)
        else:
            self._metrics.reissued.inc()
        runner = self._runner
        while not runner.has_slot():
            runner.wait_for_slot(SLOT_WAIT_S)
            yield from self._emit(bucket)
        runner.submit(bucket, handle, lambda: self._call(request))
        self._outstanding[bucket] += 1
        self._metrics.admitted = runner.in_flight

    async def _call(self, request: Request) -> tuple[SinkRow, str | None]:
        """The output row of `request`, or its dead letter and reason; never raises. Runs on the
        runner's loop, so the dead letter is counted when it is emitted, on the operator thread."""
        failure: RecordError
        try:
            completion = await self._client.complete(request)
            return result_row(request, completion, self._config.kafka.output_topic,
                              self._config.limits.max_result_bytes), None
        except InternalError as err:
            log.error("internal error in inference for id=%s: %s", request.id, err.detail)
            failure = err
        except RecordError as err:
            failure = err
        except Exception as err:
            log.exception("unexpected error in inference for id=%s", request.id)
            failure = InternalError.from_exception(err)
        return self._dead_letter_value(failure, request.key, request.raw, request.source, request.id), failure.reason

    def _emit(self, bucket: Any) -> Iterator[Row]:
        """The bucket's finished calls, each removed from state as it is emitted."""
        done = self._runner.take(bucket)
        if not done:
            return
        pending = self._pending
        for handle, outcome in done:
            if outcome is None:  # the runner caught a raise that `_call` should have prevented
                row = self._lost_call(handle)
            else:
                row, dead_letter_reason = outcome
                if dead_letter_reason is not None:
                    self._metrics.dead_letter(dead_letter_reason)
            pending.remove(handle)
            yield _row(row)
        self._outstanding[bucket] -= len(done)
        self._metrics.admitted = self._runner.in_flight

    def _flush(self, bucket: Any) -> Iterator[Row]:
        """End of input: every call of `bucket`, waited for and emitted."""
        while self._outstanding.get(bucket, 0) > 0:
            self._runner.wait(SLOT_WAIT_S, bucket)
            yield from self._emit(bucket)

    def _ensure_timer(self, bucket: Any, ctx: Any) -> None:
        if bucket in self._timer_at or self._outstanding.get(bucket, 0) <= 0:
            return
        at = ctx.timer_service().current_processing_time() + EMIT_PERIOD_MS
        ctx.timer_service().register_processing_time_timer(at)
        self._timer_at[bucket] = at

    # ------------------------------------------------------------------ dead letters
    def _dead_letter(self, err: RecordError, key: bytes | None, raw: bytes | None,
                     source: SourceRef, rid: str | None) -> SinkRow:
        """A dead letter written on the operator thread, counted by reason."""
        self._metrics.dead_letter(err.reason)
        return self._dead_letter_value(err, key, raw, source, rid)

    def _dead_letter_value(self, err: RecordError, key: bytes | None, raw: bytes | None,
                           source: SourceRef, rid: str | None) -> SinkRow:
        return dead_letter.for_error(err, key=key, value=raw, source=source, record_id=rid,
                                     job=self._config.name, topic=self._config.kafka.dead_letter_topic)

    def _dead_letter_row(self, err: RecordError, value: Any) -> Row:
        """A dead letter for a row that could not even be read."""
        try:
            key, raw = value[0], value[1]
            source = SourceRef(str(value[2]), int(value[3]), int(value[4]), epoch_ms(value[5]))
        except Exception:  # noqa: BLE001 - a row that cannot be read still gets a dead letter
            key, raw, source = None, None, SourceRef("unknown", -1, -1)
        return _row(self._dead_letter(err, key, raw, source, record_id(raw) if isinstance(raw, bytes) else None))

    def _lost_call(self, handle: Any) -> SinkRow:
        stored = self._pending.get(handle)
        key, raw, topic, partition, offset, ts = stored
        source = SourceRef(topic, partition, offset, ts)
        return self._dead_letter(InternalError("the inference call raised"), key, raw, source,
                                 record_id(raw))
