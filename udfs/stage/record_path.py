"""What one input record becomes, in either lane: a result row, a dead letter, a forwarded
tombstone, or nothing (a skipped tombstone).

The keyed lane (`udfs/stage/operators.py`) and the vectorized lane (`udfs/stage/vectorized.py`)
differ only in where a record waits for its call (keyed state and a call loop outside Flink's
bundles, or the Arrow batch in progress); the rules for a record are the same, so they are
written once here: tombstones by `input.tombstones`, decode with its dead letters, the call
through `InferenceClient` (retries, deadlines, fleet, cache, budget), the output record, the
forwarded headers, and the one place a record becomes a dead letter. Nothing here raises for a
record: every failure is a dead letter with its reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from udfs.config import JobConfig
from udfs.errors import BadInput, InternalError, RecordError
from udfs.records import (
    PendingRecord,
    Request,
    SinkHeaders,
    SinkRow,
    dead_letter,
    forwarded_headers,
)
from udfs.records.decode import decode, record_id
from udfs.records.encode import result_row

if TYPE_CHECKING:
    from udfs.inference.client import InferenceClient
    from udfs.metrics import InferenceMetrics
    from udfs.records.formats import JobFormats

log = logging.getLogger("llmstream.udfs")

Outcome = tuple[SinkRow, str | None]
"""What a record becomes: its outgoing row and, for a dead letter, the reason."""

SKIP = None
"""`RecordPath.prepare`'s answer for a record that leaves nothing behind (`input.tombstones: skip`)."""


class RecordPath:
    """The rules for one record, shared by both lanes; the lane owns the waiting."""

    def __init__(self, config: JobConfig, client: InferenceClient, formats: JobFormats,
                 metrics: InferenceMetrics) -> None:
        self._config = config
        self._client = client
        self._formats = formats
        self._metrics = metrics

    def prepare(self, record: PendingRecord) -> Request | Outcome | None:
        """The request to call the model with, or the outcome a record gets without a call (bad
        input, a forwarded tombstone), or `SKIP`."""
        tombstones = self._config.input.tombstones
        if record.value is None and tombstones != "dead-letter":
            if tombstones == "skip":
                return SKIP
            if record.key is not None:  # forward; without a key there is nothing to delete: a dead letter
                return SinkRow(record.key, None, self._config.kafka.output_topic, self.forwarded(record)), None
        try:
            return decode(record.key, record.value, record.source, self._config.limits, self._formats.input)
        except BadInput as err:
            self._metrics.bad_input.inc()
            return self.dead_letter(err, record), err.reason
        except Exception as err:
            log.exception("unexpected error decoding %s-%s@%s", record.topic, record.partition, record.offset)
            self._metrics.bad_input.inc()
            failure = InternalError.from_exception(err)
            return self.dead_letter(failure, record), failure.reason

    async def call(self, request: Request, record: PendingRecord) -> Outcome:
        """The output row of `request`, or its dead letter and reason; never raises."""
        failure: RecordError
        try:
            completion = await self._client.complete(request)
            return result_row(request, completion, self._config.kafka.output_topic,
                              self._config.limits.max_result_bytes, self.forwarded(record), self._formats.output), None
        except InternalError as err:
            log.error("internal error in inference for id=%s: %s", request.id, err.detail)
            failure = err
        except RecordError as err:
            failure = err
        except Exception as err:
            log.exception("unexpected error in inference for id=%s", request.id)
            failure = InternalError.from_exception(err)
        return self.dead_letter(failure, record, request.id), failure.reason

    def forwarded(self, record: PendingRecord) -> SinkHeaders:
        return forwarded_headers(record.headers, self._config.kafka.forward_headers)

    def dead_letter(self, err: RecordError, record: PendingRecord, request_id: str | None = None) -> SinkRow:
        """The dead letter of `record`: the one place a record becomes one. `request_id`: the
        decoded id, when there is one (else the best guess from the original bytes)."""
        return dead_letter.for_error(
            err, key=record.key, value=record.value, source=record.source,
            record_id=request_id if request_id is not None else record_id(record.value),
            job=self._config.name, topic=self._config.kafka.dead_letter_topic, headers=self.forwarded(record))
