"""What one input record becomes, in every lane: a result row, a dead letter, a forwarded
tombstone, or nothing (a skipped tombstone, or a record the user's functions drop).

The keyed lane (`udfs/lanes/keyed.py`), the vectorized lane (`udfs/lanes/vectorized.py`) and
the provider-batch lane (`udfs/lanes/provider_batch/lane.py`) differ only in how records are grouped and
when their calls are made (keyed state and a call loop outside Flink's bundles, the Arrow batch
in progress, a provider's batch); the rules for a record are the same, so they are written once here: tombstones by `input.tombstones`, decode with its dead letters, the call
through `InferenceClient` (retries, deadlines, fleet, cache, budget), the user's own functions
around it (`model.preprocess`, `output.postprocess`: `udfs/lanes/user_functions.py`), the output
record, the forwarded headers, and the one place a record becomes a dead letter. Nothing here raises for a
record: every failure is a dead letter with its reason.

A lane with a batch of records in hand (the vectorized lane's Arrow batch) hands it over whole:
`call_many` makes its calls as one batch through the client's one entry
(`InferenceClient.complete_many`) and writes their rows in one pass, the output settings read once
a batch. A record's own call (`call`) is that entry with a batch of one.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from udfs.config import JobConfig
from udfs.errors import BadInput, InternalError, RecordError, UserFunctionError
from udfs.lanes.user_functions import UserFunctions, provisional_id, references
from udfs.records import (
    Completion,
    PendingRecord,
    Request,
    SinkHeaders,
    SinkRow,
    dead_letter,
    forwarded_headers,
)
from udfs.records.decode import decode, record_id
from udfs.records.encode import result_row, sized_row
from udfs.records.json_format import CONTRACT_FIELDS
from udfs.records.result import result_record

if TYPE_CHECKING:
    from udfs.inference.client import InferenceClient
    from udfs.metrics import InferenceMetrics
    from udfs.records.formats import JobFormats

log = logging.getLogger("llmstream.udfs")


@dataclass(frozen=True)
class Settled:
    """What one record came to: the `row` it leaves as (None: nothing leaves, a record the user's
    functions drop) and, for a dead letter, its `dead_letter_reason`. Every lane hands these to
    `LaneParts.emit` (`udfs/lanes/base.py`), the one place a record leaves."""

    row: SinkRow | None
    dead_letter_reason: str | None = None


SKIP = None
"""`RecordPath.prepare`'s answer for a record that leaves nothing behind (`input.tombstones: skip`)."""


class RecordPath:
    """The rules for one record, shared by every lane; the lane owns the grouping and the waiting."""

    def __init__(self, config: JobConfig, client: InferenceClient, formats: JobFormats,
                 metrics: InferenceMetrics) -> None:
        self._config = config
        self._client = client
        self._formats = formats
        self._metrics = metrics
        self._user = UserFunctions(config) if references(config) else None
        self._preprocess = self._user is not None and self._user.preprocess is not None
        self._postprocess = self._user is not None and self._user.postprocess is not None

    @property
    def shapes(self) -> bool:
        """Whether a preprocess makes each record's request (`shape`)."""
        return self._preprocess

    @property
    def postprocesses(self) -> bool:
        """Whether a postprocess makes each output record (`answered` then awaits it)."""
        return self._postprocess

    @property
    def user_functions(self) -> int:
        """How many user functions a record goes through (each may take up to the record deadline)."""
        return self._user.count if self._user is not None else 0

    def close(self) -> None:
        if self._user is not None:
            self._user.close()

    def prepare(self, record: PendingRecord) -> Request | Settled | None:
        """The request to call the model with, or the outcome a record gets without a call (bad
        input, a forwarded tombstone), or `SKIP`. With a preprocess the request has the record's
        fields but no prompt yet: `call` asks the function for it."""
        tombstones = self._config.input.tombstones
        if record.value is None and tombstones != "dead-letter":
            if tombstones == "skip":
                return SKIP
            if record.key is not None:  # forward; without a key there is nothing to delete: a dead letter
                return Settled(SinkRow(record.key, None, self._config.kafka.output_topic, self.forwarded(record)))
        try:
            if self._preprocess:
                return self._unshaped(record)
            return decode(record.key, record.value, record.source, self._config.limits, self._formats.input)
        except BadInput as err:
            self._metrics.bad_input.inc()
            return self.dead_letter(err, record)
        except Exception as err:
            log.exception("unexpected error decoding %s-%s@%s", record.topic, record.partition, record.offset)
            self._metrics.bad_input.inc()
            return self.dead_letter(InternalError.from_exception(err), record)

    def _unshaped(self, record: PendingRecord) -> Request:
        """The record read by the input format, for the preprocess to make a request of."""
        if record.value is None:
            raise BadInput("null_value", "record value is null (a tombstone?)")
        fields = self._formats.input.read(record.value, self._config.limits)
        return Request(id=provisional_id(fields, record.key, record.handle, self._config.input.id_field),
                       key=record.key, source=record.source, fields=fields, raw=record.value)

    async def call(self, request: Request, record: PendingRecord) -> Settled:
        """The output row of `request` (none for a record the user's functions drop), or its dead
        letter and reason; never raises."""
        failure: RecordError
        try:
            if self._preprocess:
                assert self._user is not None
                shaped = await self._user.request(request, self._config.limits)
                if shaped is None:
                    return Settled(await self._skipped(request, record))
                request = shaped
            completion = await self._client.complete(request)
            return await self._finished(request, completion, record)
        except InternalError as err:
            log.error("internal error in inference for id=%s: %s", request.id, err.detail)
            failure = err
        except RecordError as err:
            failure = err
        except Exception as err:
            log.exception("unexpected error in inference for id=%s", request.id)
            failure = InternalError.from_exception(err)
        return self.dead_letter(failure, record, request.id)

    @property
    def batches(self) -> bool:
        """Whether a batch's calls may go to the client as one batch (`call_many`): when no user
        function runs. A preprocess makes each request and a postprocess each row, awaited for each
        record between its call and the next step, so with either a lane calls `call` per record."""
        return self._user is None

    async def call_many(self, calls: Sequence[tuple[Request, PendingRecord]], into: list[Settled | None]) -> None:
        """Each call's outcome into `into` (in order): the batch's calls made as one batch by the
        client (`InferenceClient.complete_many`, at most `async.capacity` at once), then each answer's
        row or dead letter, as `call` makes them. Never raises for a record; when the caller cancels
        it (a batch past its guard), the calls that ended are written and the rest stay None. Only
        where `batches` holds."""
        answers: list[Completion | RecordError | None] = [None] * len(calls)
        try:
            await self._client.complete_many([request for request, _ in calls], into=answers)
        finally:
            self._written(calls, answers, into)

    def _written(self, calls: Sequence[tuple[Request, PendingRecord]],
                 answers: Sequence[Completion | RecordError | None], into: list[Settled | None]) -> None:
        """The rows of a batch's answers, the output settings read once for the batch (the topic, the
        size limit, the format, whether headers are forwarded); each row is the record's own."""
        topic, max_bytes, fmt = self._config.kafka.output_topic, self._config.limits.max_result_bytes, self._formats.output
        forwards = self._config.kafka.forward_headers != "none"
        for i, ((request, record), answer) in enumerate(zip(calls, answers, strict=True)):
            if answer is None:
                continue
            failure: RecordError
            if isinstance(answer, RecordError):
                if isinstance(answer, InternalError):
                    log.error("internal error in inference for id=%s: %s", request.id, answer.detail)
                failure = answer
            else:
                try:
                    into[i] = Settled(result_row(request, answer, topic, max_bytes,
                                                 self.forwarded(record) if forwards else {}, fmt))
                    continue
                except RecordError as err:
                    failure = err
                except Exception as err:
                    log.exception("unexpected error in inference for id=%s", request.id)
                    failure = InternalError.from_exception(err)
            into[i] = self.dead_letter(failure, record, request.id)

    async def shape(self, request: Request, record: PendingRecord) -> Request | Settled:
        """The request the preprocess makes of `request` (itself without one), or what the record
        comes to without a call (skipped, or a dead letter); never raises. For a lane that calls
        elsewhere than `call` (a provider's batch)."""
        if not self._preprocess:
            return request

        async def shaped() -> Request | Settled:
            assert self._user is not None
            made = await self._user.request(request, self._config.limits)
            return made if made is not None else Settled(await self._skipped(request, record))
        return await self._guarded(shaped(), request, record, "the preprocess")

    async def answered(self, request: Request, completion: Completion, record: PendingRecord) -> Settled:
        """The output row of an answer got elsewhere than `call` (a provider's batch, the result
        cache), through the postprocess when there is one, or its dead letter; never raises."""
        return await self._guarded(self._finished(request, completion, record), request, record, "writing the answer")

    async def _guarded(self, step: Coroutine[Any, Any, Any], request: Request, record: PendingRecord,
                       what: str) -> Any:
        """`step`'s value, or the record's dead letter when it raises (a bug's is logged)."""
        try:
            return await step
        except RecordError as err:
            return self.dead_letter(err, record, request.id)
        except Exception as err:
            log.exception("unexpected error in %s of id=%s", what, request.id)
            return self.dead_letter(InternalError.from_exception(err), record, request.id)

    async def _finished(self, request: Request, completion: Completion, record: PendingRecord) -> Settled:
        """The output row of `completion`: the postprocess's, or the result record."""
        if self._postprocess:
            assert self._user is not None
            result = result_record(request, completion, CONTRACT_FIELDS)
            value = await self._user.output(request.fields, result, completion.attempts)
            return Settled(self._user_row(request, value, record, completion.attempts))
        return Settled(result_row(request, completion, self._config.kafka.output_topic,
                                  self._config.limits.max_result_bytes, self.forwarded(record), self._formats.output))

    async def _skipped(self, request: Request, record: PendingRecord) -> SinkRow | None:
        """A record the preprocess needs no call for (`model.skipped`): nothing, or on the output
        topic as it came (or as the postprocess makes it of no result)."""
        if self._config.model.skipped == "drop":
            self._metrics.dropped.inc()
            return None
        if self._postprocess:
            assert self._user is not None
            return self._user_row(request, await self._user.output(request.fields, None, 0), record, 0)
        return sized_row(record.key, record.value, self._config.kafka.output_topic,
                         self._config.limits.max_result_bytes, self.forwarded(record))

    def _user_row(self, request: Request, value: dict[str, Any] | None, record: PendingRecord,
                  attempts: int) -> SinkRow | None:
        """A postprocess's value written by the output format (none for None)."""
        if value is None:
            self._metrics.dropped.inc()
            return None
        try:
            written = self._formats.output.encode(value)
        except (TypeError, ValueError, OverflowError) as err:
            raise UserFunctionError(f"output.postprocess {self._config.output.postprocess} returned a dict the "
                                    f"output format ({self._config.output.format}) cannot write: {err}",
                                    attempts=attempts) from None
        return sized_row(request.key, written, self._config.kafka.output_topic,
                         self._config.limits.max_result_bytes, self.forwarded(record), attempts)

    def forwarded(self, record: PendingRecord) -> SinkHeaders:
        return forwarded_headers(record.headers, self._config.kafka.forward_headers)

    def dead_letter(self, err: RecordError, record: PendingRecord, request_id: str | None = None) -> Settled:
        """The dead letter of `record`, with its reason: the one place a record becomes one.
        `request_id`: the decoded id, when there is one (else the best guess from the original bytes)."""
        return Settled(dead_letter.for_error(
            err, key=record.key, value=record.value, source=record.source,
            record_id=request_id if request_id is not None else record_id(record.value),
            job=self._config.name, topic=self._config.kafka.dead_letter_topic, headers=self.forwarded(record)),
            err.reason)
