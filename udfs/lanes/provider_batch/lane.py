"""The provider-batch lane (`lane: provider-batch`, docs/cost.md): the same input, record rules,
client and exactly-once sink as the keyed lane, with the calls made through a provider's batch API
at its batch price instead of one at a time.

`BatchStage` is a `KeyedLane` (`udfs/lanes/base.py`) over the same buckets and ticks as the keyed
lane; what it decides is how records are grouped (a provider's batch) and when their calls are
made (once a checkpoint holds the batch). A record is decoded once by the same `RecordPath`, its
request body made once by the client's one builder (`InferenceClient.payload`), an answer read by
the client's one reader (`InferenceClient.completion_from`: the same checks, `model.embedding_dim`
and `model.response_format` included) and cached in the client's one cache. Per bucket:

1. A record is read by the record path (bad input and tombstones are settled at once), shaped by
   the preprocess when there is one, kept in keyed state (`RECORDS`) and, when the result cache may
   hold its answer, looked up there first: a hit is emitted at once and never enters a batch.
2. The bucket's records wait in a collection (in memory; rebuilt from state after a restore) until it
   holds `provider_batch.max_requests` records or `max_bytes` of requests, or its oldest record has
   waited `max_wait_s`; then it becomes a batch: a `BatchEntry` (`udfs/lanes/provider_batch/entries.py`) in
   state (`BATCHES`), each record marked as in it (`ASSIGNED`).
3. Talking to the provider (`udfs/lanes/provider_batch/providers.py`) is done on a loop of its own
   (`CallRunner`), never on the task thread: creating the batch, viewing it on a timer with backoff,
   reading its results. The task thread hands work to the loop and takes what came back on its next
   element, tick or timer, so a checkpoint never waits for a batch: it holds records and batch ids.
4. An ended batch's results are matched to records by line (`r<index>`), whatever their order: an
   answer becomes the output record (`cost` at the batch price, `lane: batch`, through the
   postprocess when there is one) and fills the cache; an answer that does not validate against
   `model.response_format` goes to a later batch while `model.max_invalid_retries` allows; a
   refused request goes to a later batch while it is retryable and `retry.max_attempts` allows, else it
   is dead-lettered with the provider's code; records an expired or cancelled batch did not answer are
   resubmitted, called now (`realtime`) or dead-lettered, as `provider_batch.on_expired` /
   `on_cancelled` say; a batch that failed validation dead-letters its records with the provider's
   words; a batch the provider no longer knows is made again once, then dead-lettered.

Never paid twice: a record leaves state in the call that emits its outcome, and a batch is made at
the provider only once a completed checkpoint holds its entry: the admission gate chained in front
(`pom-free/gate/AdmissionGate.java`) writes when the last completed checkpoint's barrier passed, and a
batch sealed before that is durable. So a restore knows every batch this lane made: it views those
with an id, and for one whose creation it had not seen answered (the worker died while it was
under way) it asks the provider for a batch made for its key before making it (`Provider.find`:
OpenAI's metadata; Anthropic keeps none, so there that one batch may be paid twice). Making a
batch waits about a checkpoint interval for this; a batch waits hours.

End of input (the final watermark): everything collected becomes a batch and the function waits for
every batch of the bucket, as the keyed stage waits for its calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pyflink.common import Row, Types
from pyflink.datastream import RuntimeContext
from pyflink.datastream.state import MapStateDescriptor

from udfs.clock import now_ms
from udfs.config import JobConfig
from udfs.errors import BadInput, InvalidModelOutput, ProviderBatchError, RecordError
from udfs.lanes.base import KeyedLane, salvage
from udfs.lanes.record_path import SKIP, Settled
from udfs.records import PendingRecord, Request

log = logging.getLogger("llmstream.udfs")

RECORDS = MapStateDescriptor("batch_records", Types.STRING(), Types.PICKLED_BYTE_ARRAY())
"""handle -> `Held`: every record of the bucket not yet emitted."""
ASSIGNED = MapStateDescriptor("batch_assigned", Types.STRING(), Types.STRING())
"""handle -> the key of the batch it is in (a record not in here waits in the collection)."""
BATCHES = MapStateDescriptor("batch_entries", Types.STRING(), Types.PICKLED_BYTE_ARRAY())
"""batch key -> `BatchEntry`."""
OPERATIONS = 8
"""Provider calls and cache lookups at once per subtask (a batch is one call, not one per record)."""
WAKE_MS = 1000
"""How often a bucket with records looks at its batches when no element or tick comes."""
TAKE_UP_WINDOW_S = 1.0
TAKE_UP_SHARE_S = 0.25
"""Of each `TAKE_UP_WINDOW_S`, the most the task thread spends taking up results. A checkpoint barrier waits
for the Python bundle in progress, and every element, tick and timer of a bucket wakes it: at a
fixed count a wake (500), a batch of 10,000 answers arriving while input flowed held barriers for
2.5-6 s (`llmstream bench --batch-lane 100000`). A share of the time bounds that wait whatever
arrives; at the end of input there is no limit."""
TAKE_UP_CHUNK = 50
"""Results taken up between two looks at the clock."""
UNREAD_WAKE_MS = 250
"""How soon a bucket with results left unread wakes again (PyFlink delivers timers at bundle ends,
so in practice at the next one), instead of after a whole `WAKE_MS`."""
RUN_SLACK_S = 30.0
"""How long past `async.record_deadline_s` the task thread waits for a user function it runs on the
loop (after a restore, or a postprocess): the function's own deadline ends it first."""
DURABLE_READ_S = 0.2
"""How often the gate's `.durable` file is read while a sealed batch waits for a checkpoint."""
LINE_OVERHEAD_BYTES = 96
"""What a request line adds to its body (custom_id, method, url): the collection's byte count."""


@dataclass
class _Collection:
    handles: list[str] = field(default_factory=list)
    size: int = 0
    oldest_ms: int = 0


Shaped = tuple[Request, dict[str, Any]]
"""A record's request, as the preprocess made it when there is one, and the body made of it."""


class BatchStage(KeyedLane):
    """The provider-batch lane (`KeyedLane`: input rows keyed by bucket or ticks, output sink rows).

    `gate_dir`: where the admission gate in front says which checkpoint completed (a job always
    has it in this lane; without it, as on the fake runtime of the unit tests, a batch is made as
    soon as it is sealed)."""

    RUNNER_NAME = "llmstream-batch-lane"

    def __init__(self, config: JobConfig, cache_file: str | None = None, gate_dir: str | None = None) -> None:
        super().__init__(config, gate_dir=gate_dir, cache_file=cache_file)

    def _capacity(self) -> int:
        return OPERATIONS

    # ------------------------------------------------------------------ lifecycle
    def _opened(self, runtime_context: RuntimeContext) -> None:
        from udfs.lanes.provider_batch.providers import provider_for

        self._records = runtime_context.get_map_state(RECORDS)
        self._assigned = runtime_context.get_map_state(ASSIGNED)
        self._batches = runtime_context.get_map_state(BATCHES)
        # The client's: the realtime calls (`on_expired: realtime`), the result cache, the answer
        # reader, the fleet that chooses where a batch is made, and each endpoint's transport the
        # provider's batch API is called through (one provider per route; `model.endpoint`: one).
        routed = self._config.model.routed
        self._providers = [provider_for(self._config, route.transport, route.endpoint if routed else None)
                           for route in self._client.routes]
        self._by_label = {provider.label: i for i, provider in enumerate(self._providers)}
        self._sending: dict[str, Any] = {}  # batch key -> the fleet endpoint whose slot its creation holds
        self._collections: dict[Any, _Collection] = {}
        self._entries: dict[Any, dict[str, Any]] = {}
        self._held: dict[Any, int] = {}
        self._busy: set[str] = set()
        self._maybe_created: set[str] = set()
        self._durable: set[str] = set()
        # bucket -> batch key -> (entry, its results, how many taken up, its records still in state)
        self._unread: dict[Any, dict[str, tuple[Any, list[Any], int, dict[str, Any]]]] = {}
        self._take_up_second = 0.0  # time.monotonic() at which the current window of take-up began
        self._take_up_spent = 0.0  # seconds spent taking up results in it
        # Records not yet in a batch made at the provider, as state holds them: making a batch of
        # 10,000 read them from state one by one (a round trip to the JVM each), 2-5 s of the task
        # thread that held checkpoint barriers as long. State stays what a checkpoint holds.
        self._unbatched: dict[str, Any] = {}
        # Each held record's request and body, made once when it came in (after a restore, once
        # again when first needed): a record is decoded and shaped once, not for its line and again
        # for its answer.
        self._shaped: dict[str, Shaped] = {}
        self._flushing = False
        self._durable_file = (Path(self._gate_dir) / f"{runtime_context.get_index_of_this_subtask()}.durable"
                              if self._gate_dir is not None else None)
        self._durable_ms = 0
        self._durable_read_at = 0.0
        settings = self._config.provider_batch
        log.info("batch lane: %s batches at %s of at most %d requests, %d bytes, %g s of waiting",
                 self._providers[0].name, ", ".join(p.base for p in self._providers), settings.max_requests,
                 settings.max_bytes, settings.max_wait_s)

    def _closed(self) -> None:
        durable = getattr(self, "_durable_file", None)
        if durable is not None:  # the gate's note to this subtask, and the job's directory once empty
            for path in (durable, durable.with_name(durable.name + ".partial")):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                durable.parent.rmdir()

    # ------------------------------------------------------------------ records in
    def _adopt(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        """First sight of `bucket` in this instance: what its state holds (after a restore) is taken
        up again: unassigned records into the collection, batches to be viewed (or found or made)."""
        from udfs.lanes.provider_batch.entries import BatchEntry

        entries: dict[str, BatchEntry] = {key: entry for key, entry in self._batches.items()}
        assigned = {handle for handle, _ in self._assigned.items()}
        collection = self._collections[bucket] = _Collection(oldest_ms=now_ms())
        unmade = {handle for entry in entries.values() if entry.provider_id is None for handle in entry.handles}
        held = 0
        for handle, value in self._records.items():  # one pass, read in pages, not one get a record
            held += 1
            if handle not in assigned:
                collection.handles.append(handle)
            if handle not in assigned or handle in unmade:
                self._unbatched[handle] = value
        self._held[bucket] = held
        self._entries[bucket] = entries
        for key, entry in entries.items():
            self._durable.add(key)  # restored: a completed checkpoint holds it
            if entry.provider_id is None:
                self._maybe_created.add(key)  # its creation may have been answered after the checkpoint
        if held:
            log.info("batch lane: bucket %r took up %d record(s) and %d batch(es) from its state",
                     bucket, held, len(entries))
        yield from ()

    def _take_in(self, bucket: Any, record: PendingRecord) -> Iterator[Row]:
        """A record read (bad input and tombstones settled at once) and held; then shaped by the
        preprocess and looked up in the cache on the loop when either applies, else its body made
        and into the collection at once."""
        from udfs.lanes.provider_batch.entries import Held

        prepared = self._path.prepare(record)
        if prepared is SKIP:
            return
        if not isinstance(prepared, Request):  # bad input, a forwarded tombstone
            yield from self._parts.emit(prepared)
            return
        handle = record.handle
        payload = None
        if not self._path.shapes:
            try:
                payload = self._client.payload(prepared)
            except BadInput as err:
                self._metrics.bad_input.inc()
                yield from self._parts.emit(self._path.dead_letter(err, record, prepared.id))
                return
        held = Held(record)
        self._records.put(handle, held)
        self._unbatched[handle] = held
        self._held[bucket] += 1
        if payload is None or self._client.may_cache(payload):
            yield from self._submit(bucket, ("admit", handle), functools.partial(self._shape, prepared, record, payload))
            return
        self._shaped[handle] = (prepared, payload)
        self._collect(bucket, handle, payload)

    async def _shape(self, request: Request, record: PendingRecord, payload: dict[str, Any] | None) -> Any:
        """On the loop: the preprocess's request and its body (unless `payload` is made already), and
        the cache's answer. A `Settled` when the record needs no batch (skipped, a dead letter),
        `(request, payload, settled)` for a cache hit, `(request, payload, None)` for a batch."""
        if payload is None:
            shaped = await self._path.shape(request, record)
            if isinstance(shaped, Settled):
                return shaped
            try:
                payload = self._client.payload(shaped)
            except BadInput as err:
                self._metrics.bad_input.inc()
                return self._path.dead_letter(err, record, shaped.id)
            request = shaped
        try:
            cached = await self._client.cached(payload)
        except RecordError:  # a cached answer that no longer validates: asked of the provider again
            cached = None
        except Exception as err:  # noqa: BLE001 - a cache that fails is a miss, not a dead letter
            log.warning("batch lane: a cache lookup failed (%r); the record goes to a batch", err)
            cached = None
        if cached is not None:
            return request, payload, await self._path.answered(request, dataclasses.replace(cached, lane="batch"), record)
        return request, payload, None

    def _collect(self, bucket: Any, handle: str, payload: dict[str, Any] | None = None) -> None:
        from udfs.records import fastjson

        collection = self._collections[bucket]
        if not collection.handles:
            collection.oldest_ms = now_ms()
        collection.handles.append(handle)
        collection.size += (len(fastjson.dumps(payload)) if payload is not None else 0) + LINE_OVERHEAD_BYTES

    # ------------------------------------------------------------------ the bucket's work
    def _wake(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        yield from self._events(bucket)
        yield from self._take_up(bucket)
        self._seal(bucket)
        yield from self._drive(bucket)
        self._gauges()
        if self._held.get(bucket):
            self._wake_in(bucket, ctx, UNREAD_WAKE_MS + 1 if self._unread.get(bucket) else WAKE_MS)

    def _seal(self, bucket: Any, *, force: bool = False) -> None:
        """The collection as a new batch, when it is full or its oldest record has waited long enough."""
        from udfs.lanes.provider_batch.entries import BatchEntry

        collection = self._collections[bucket]
        if not collection.handles:
            return
        settings = self._config.provider_batch
        now = now_ms()
        due = (len(collection.handles) >= settings.max_requests or collection.size >= settings.max_bytes
               or now - collection.oldest_ms >= settings.max_wait_s * 1000)
        if not (due or force):
            return
        while collection.handles:
            handles = tuple(collection.handles[:settings.max_requests])
            del collection.handles[:len(handles)]
            entry = BatchEntry(uuid.uuid4().hex, handles, sealed_ms=now)
            self._batches.put(entry.key, entry)
            for handle in handles:
                self._assigned.put(handle, entry.key)
            self._entries[bucket][entry.key] = entry
            log.info("batch lane: bucket %r sealed batch %s of %d record(s)", bucket, entry.key, len(handles))
        collection.size = 0
        collection.oldest_ms = now

    def _drive(self, bucket: Any) -> Iterator[Row]:
        """Each batch's next step with the provider, when it is due and none is under way."""
        now = now_ms()
        for key in list(self._entries[bucket]):
            # Read again for each: `_submit` takes up events while it waits for a slot, which may
            # have answered, changed or dropped this entry since the loop began (a stale entry once
            # had a second batch made for it).
            entry = self._entries[bucket].get(key)
            if entry is None or key in self._busy or entry.next_poll_ms > now:
                continue
            if entry.provider_id is None:
                if not self._may_create(entry):
                    continue
                chosen = self._place(self._route(entry) if entry.endpoint is not None else None)
                if chosen is None:  # no endpoint may take a batch now (circuits open): at a later wake
                    continue
                self._sending[key] = chosen
                yield from self._submit(bucket, ("create", key), self._creator(bucket, entry, chosen.index))
            elif (index := self._route(entry)) is None:
                from udfs.lanes.provider_batch.providers import BatchView

                yield from self._viewed(bucket, entry, BatchView(entry.provider_id, "gone", "its endpoint left the fleet"))
            else:
                yield from self._submit(bucket, ("view", key),
                                        functools.partial(self._providers[index].view, entry.provider_id))

    def _route(self, entry: Any) -> int | None:
        """The index (in the client's routes) of the endpoint that made `entry`'s batch: None when it
        is no longer in `model.endpoints` (an upgrade removed it); state from before the lane served
        a fleet names none, and was made at `model.endpoint`, the first."""
        return 0 if entry.endpoint is None else self._by_label.get(entry.endpoint)

    def _place(self, prefer: int | None = None) -> Any:
        """The fleet endpoint a batch is made at, its slot taken for the creation (released when it
        is answered): the fleet's own choice among the endpoints it lets take a call now (circuits,
        `Retry-After` pauses, probes, the fallback group when every primary is open), preferring
        `prefer` (where an earlier try went), else the one with the fewest batches open per
        `weight`. None: none may take one now."""
        from udfs.inference.fleet import CircuitState

        fleet = self._client.fleet
        if len(fleet.endpoints) == 1:
            return fleet.choose()
        if prefer is None:
            open_at = Counter(self._route(e) for entries in self._entries.values() for e in entries.values()
                              if e.provider_id is not None or e.key in self._sending)
            closed = [e for e in fleet.candidates() if e.circuit.state is CircuitState.CLOSED] or fleet.endpoints
            prefer = min(closed, key=lambda e: ((open_at[e.index] + 1) / e.weight, e.index)).index
        return fleet.choose(avoid=[e.index for e in fleet.endpoints if e.index != prefer])

    def _sent(self, key: str, value: Any) -> None:
        """A creation answered (or failed): its slot back to the fleet, with what the answer says of
        the endpoint's health (`udfs/inference/statuses.py`): a batch API that fails opens its circuit."""
        from udfs.inference.statuses import Outcome, of_status
        from udfs.lanes.provider_batch.providers import ProviderError

        endpoint = self._sending.pop(key, None)
        if endpoint is None:
            return
        if isinstance(value, ProviderError):
            outcome = of_status(value.status) if value.retryable else Outcome.NEUTRAL
        else:
            outcome = Outcome.SUCCESS if isinstance(value, tuple) else Outcome.NEUTRAL
        self._client.fleet.release(endpoint, outcome)

    def _may_create(self, entry: Any) -> bool:
        """Whether `entry` may be made at the provider: once a completed checkpoint holds it (the
        gate's `.durable` time is past its seal), so that a restore knows every batch this lane made.
        At the end of input there is no checkpoint to wait for (the drain's savepoint comes after)."""
        if self._durable_file is None or self._flushing or entry.key in self._durable:
            return True
        now = time.monotonic()
        if now - self._durable_read_at >= DURABLE_READ_S:
            self._durable_read_at = now
            try:
                self._durable_ms = int(self._durable_file.read_text().strip() or 0)
            except (OSError, ValueError):
                pass  # no checkpoint has completed yet (or the gate is writing it): not yet
        if self._durable_ms > entry.sealed_ms:
            self._durable.add(entry.key)
            return True
        return False

    def _submit(self, bucket: Any, op: tuple[str, str], call: Callable[[], Coroutine[Any, Any, Any]]) -> Iterator[Row]:
        """`call` on the lane's loop, its value to come back as an event of `bucket`; waits for a free
        operation slot meanwhile taking up what came back (the lane's backpressure)."""
        while not self._runner.has_slot():
            self._runner.wait_for_slot(0.05)
            yield from self._events(bucket)
        if op[0] != "admit":
            self._busy.add(op[1])

        async def guarded() -> Any:
            try:
                return await call()
            except Exception as err:  # noqa: BLE001 - the event carries it; a provider error or a bug
                return err
        self._runner.submit(bucket, op, guarded)

    def _creator(self, bucket: Any, entry: Any, index: int) -> Callable[[], Coroutine[Any, Any, Any]]:
        """The batch of `entry` made at the endpoint `index`; first, when its creation may have been
        answered unseen (a restore, a creation that got no answer), looked for where it may have
        been sent: its endpoint, or every one when its entry names none. Only the chosen endpoint's
        failure to answer that question fails the creation; another's (its circuit opened, so the
        fleet chose elsewhere) is passed over, and there that batch may be paid twice."""
        from udfs.lanes.provider_batch.providers import ProviderError

        records = [(handle, self._unbatched.pop(handle, None) or self._stored(handle)) for handle in entry.handles]
        known = {handle: self._shaped[handle] for handle in entry.handles if handle in self._shaped}
        provider, route = self._providers[index], self._client.routes[index]
        looked_at = []
        if entry.key in self._maybe_created:
            where = self._route(entry) if entry.endpoint is not None else None
            looked_at = [self._providers[where]] if where is not None else list(self._providers)
        self._put(bucket, dataclasses.replace(entry, endpoint=provider.label))  # a checkpoint knows where it went

        async def create() -> Any:
            for place in looked_at:
                try:
                    found = await place.find(entry.key, entry.sealed_ms / 1000)
                except ProviderError as err:
                    if place is provider:
                        raise
                    log.warning("batch lane: looking for batch %s at %s failed (%s); making it at %s",
                                entry.key, place.label, err, provider.label)
                    continue
                if found is not None:
                    return ("found", found, place.label)
            lines = []
            for i, (handle, held) in enumerate(records):
                shaped = known.get(handle) or await self._reshaped(held.record)
                lines.append(provider.line(i, route.payload(shaped[1]) if not isinstance(shaped, Settled) else {}))
            batch_id = await provider.create(entry.key, lines)
            self._metrics.batch_requests.inc(len(lines))
            return ("created", batch_id, provider.label)
        return create

    async def _reshaped(self, record: PendingRecord) -> Shaped | Settled:
        """A held record's request and body made again (after a restore), or what it comes to
        without a call; never raises."""
        prepared = self._path.prepare(record)
        if not isinstance(prepared, Request):
            return prepared if prepared is not None else Settled(None)
        shaped = await self._path.shape(prepared, record)
        if isinstance(shaped, Settled):
            return shaped
        try:
            return shaped, self._client.payload(shaped)
        except BadInput as err:
            return self._path.dead_letter(err, record, shaped.id)

    def _shaped_now(self, handle: str, record: PendingRecord) -> Shaped | Settled:
        """`_reshaped` from the task thread, through the loop only when a preprocess must run."""
        known = self._shaped.get(handle)
        if known is not None:
            return known
        coroutine = self._reshaped(record)
        if self._path.shapes:
            found = self._runner.run_sync(coroutine, self._config.async_.record_deadline_s + RUN_SLACK_S)
        else:
            found = _without_loop(coroutine)
        if not isinstance(found, Settled):
            self._shaped[handle] = found
        return cast("Shaped | Settled", found)

    # ------------------------------------------------------------------ what came back
    def _events(self, bucket: Any) -> Iterator[Row]:
        from udfs.lanes.provider_batch.providers import BatchView, ProviderError

        for op, value in self._runner.take(bucket):
            kind, name = cast(tuple[str, str], op)
            if kind != "admit":
                self._busy.discard(name)
            if kind == "admit":
                yield from self._admitted(bucket, name, value)
                continue
            if kind == "realtime":
                yield from self._settle(bucket, name, value if value is not None else self._internal(name))
                continue
            if kind == "create":
                self._sent(name, value)
            entry = self._entries[bucket].get(name)
            if entry is None:
                continue
            if isinstance(value, ProviderError):
                yield from self._provider_failed(bucket, entry, kind, value)
            elif isinstance(value, BaseException) or value is None:
                log.error("batch lane: %s of batch %s failed: %r", kind, name, value)
                self._retry_later(bucket, entry)
            elif kind == "create":
                self._created(bucket, entry, value)
            elif kind == "view":
                assert isinstance(value, BatchView)
                yield from self._viewed(bucket, entry, value)
            elif kind == "results":
                self._busy.add(name)  # viewed no more while its results are taken up
                self._unread.setdefault(bucket, {})[name] = (entry, list(value), 0, self._load(entry))

    def _take_up(self, bucket: Any) -> Iterator[Row]:
        """Results of the bucket's ended batches while this window's `TAKE_UP_SHARE_S` lasts, the
        rest in the next (not from `_events`, which `_submit` calls while it waits, inside a
        take-up). What is not taken up yet is still in state; a restore reads the batch's results
        again."""
        unread = self._unread.get(bucket)
        if not unread:
            return
        started = time.monotonic()
        if started - self._take_up_second >= TAKE_UP_WINDOW_S:
            self._take_up_second, self._take_up_spent = started, 0.0
        left = TAKE_UP_SHARE_S - self._take_up_spent
        if left <= 0 and not self._flushing:
            return
        while unread:  # a chunk at least, then more while the share lasts
            key, (entry, results, at, loaded) = next(iter(unread.items()))
            end = min(len(results), at + TAKE_UP_CHUNK)
            yield from self._answered(bucket, entry, results[at:end], loaded)
            if end < len(results):
                unread[key] = (entry, results, end, loaded)
            else:
                del unread[key]
                self._drop(bucket, entry)
            if not self._flushing and time.monotonic() - started >= left:
                break
        self._take_up_spent += time.monotonic() - started

    def _admitted(self, bucket: Any, handle: str, value: Any) -> Iterator[Row]:
        """What `_shape` came to for a held record: a batch's, a cache hit's or no call's."""
        if isinstance(value, Settled):
            yield from self._settle(bucket, handle, value)
            return
        if isinstance(value, BaseException) or value is None:
            log.error("batch lane: shaping a record failed: %r", value)
            failure = value if isinstance(value, BaseException) else "shaping the record gave nothing"
            yield from self._settle(bucket, handle, self._parts.internal(failure, self._stored(handle).record))
            return
        request, payload, settled = value
        if settled is not None:
            yield from self._settle(bucket, handle, settled)
            return
        self._shaped[handle] = (request, payload)
        self._collect(bucket, handle, payload)

    def _created(self, bucket: Any, entry: Any, value: tuple[str, str, str]) -> None:
        how, provider_id, label = value
        if entry.provider_id is not None and entry.provider_id != provider_id:
            # A second batch for one entry would be paid twice: never expected, cancelled if it happens.
            log.error("batch lane: batch %s was made twice (%s, %s); cancelling the second", entry.key,
                      entry.provider_id, provider_id)
            loop = self._runner.loop
            provider = self._providers[self._by_label[label]]
            loop.call_soon_threadsafe(lambda: loop.create_task(provider.cancel(provider_id)))
            return
        now = now_ms()
        settings = self._config.provider_batch
        entry = entry.created(provider_id, label, now, now + int(settings.poll_initial_s * 1000))
        self._maybe_created.discard(entry.key)
        self._put(bucket, entry)
        log.info("batch lane: batch %s %s as %s at %s (%d requests)", entry.key,
                 "found at the provider" if how == "found" else "created", provider_id, label, len(entry.handles))

    def _viewed(self, bucket: Any, entry: Any, view: Any) -> Iterator[Row]:
        from udfs.lanes.provider_batch.entries import poll_delay_s

        settings = self._config.provider_batch
        if view.phase == "running":
            age_s = (now_ms() - (entry.created_ms or entry.sealed_ms)) / 1000
            if age_s > settings.stale_after_s and entry.polls % 10 == 0:
                log.warning("batch lane: batch %s (%s) is %.0f s old and still %s", entry.key, entry.provider_id,
                            age_s, view.status)
            delay = poll_delay_s(entry.polls, settings.poll_initial_s, settings.poll_max_s)
            self._put(bucket, entry.polled(now_ms() + int(delay * 1000)))
            return
        if view.phase == "ended":
            count = len(entry.handles)
            self._busy.add(entry.key)
            provider = self._providers[self._route(entry) or 0]
            yield from self._submit(bucket, ("results", entry.key), lambda: provider.results(view, count))
            return
        if view.phase == "failed":
            lines = dict(view.errors)
            loaded = self._load(entry)
            for i, handle in enumerate(entry.handles):
                if handle not in loaded:
                    continue
                said = lines.get(i + 1) or lines.get(None) or next(iter(lines.values()), "the batch failed")
                err = ProviderBatchError("batch_failed", f"the provider failed batch {entry.provider_id}: {said}")
                yield from self._settle(bucket, handle, self._dead(handle, err, loaded[handle]), in_batch=True)
            self._drop(bucket, entry)
            return
        # gone: the provider no longer knows the batch
        if entry.resubmits < 1:
            log.warning("batch lane: the provider no longer knows batch %s (%s); making it again", entry.key,
                        entry.provider_id)
            self._drop(bucket, entry)
            again = dataclasses.replace(entry, key=uuid.uuid4().hex, provider_id=None, created_ms=None, polls=0,
                                        next_poll_ms=0, resubmits=entry.resubmits + 1, endpoint=None)
            self._batches.put(again.key, again)
            for handle in again.handles:
                self._assigned.put(handle, again.key)
            self._entries[bucket][again.key] = again
            return
        loaded = self._load(entry)
        for handle in entry.handles:
            if handle in loaded:
                err = ProviderBatchError("batch_gone", f"the provider lost batch {entry.provider_id} twice")
                yield from self._settle(bucket, handle, self._dead(handle, err, loaded[handle]), in_batch=True)
        self._drop(bucket, entry)

    def _answered(self, bucket: Any, entry: Any, results: list[Any], loaded: dict[str, Any]) -> Iterator[Row]:
        """`results` of `entry`; `loaded`: its records still in state (`_load`)."""
        from udfs.lanes.provider_batch.providers import Answered, Refused

        settings = self._config.provider_batch
        for result in results:
            handle = entry.handles[result.index]
            held = loaded.pop(handle, None)
            if held is None:  # settled before (results read again after a restore)
                continue
            if isinstance(result, Answered):
                settled = self._result(bucket, entry, handle, held, result.body)
                if settled is not None:
                    yield from self._settle(bucket, handle, settled, in_batch=True)
            elif isinstance(result, Refused):
                tries = held.tries + 1
                if result.retryable and tries < self._config.retry.max_attempts:
                    self._again(bucket, handle, held, tries)
                    continue
                err = ProviderBatchError("batch_request_failed", f"{result.code}: {result.message}",
                                         attempts=tries, status=result.status)
                yield from self._settle(bucket, handle, self._dead(handle, err, held), in_batch=True)
            else:
                policy = settings.on_expired if result.why == "expired" else settings.on_cancelled
                tries = held.tries + 1
                if policy == "resubmit" and tries < self._config.retry.max_attempts + 1:
                    self._again(bucket, handle, held, tries)
                elif policy == "realtime":
                    self._assigned.remove(handle)  # in no batch while its call is out
                    yield from self._submit(bucket, ("realtime", handle), self._realtime(held))
                else:
                    err = ProviderBatchError(f"batch_{result.why}",
                                             f"batch {entry.provider_id} {result.why} before answering this request",
                                             attempts=tries)
                    yield from self._settle(bucket, handle, self._dead(handle, err, held), in_batch=True)

    def _provider_failed(self, bucket: Any, entry: Any, kind: str, err: Any) -> Iterator[Row]:
        if kind == "create" and not err.retryable:
            for handle in entry.handles:
                failure = ProviderBatchError("batch_failed", f"the provider refused the batch: {err}",
                                             status=err.status)
                yield from self._settle(bucket, handle, self._dead(handle, failure))
            self._drop(bucket, entry)
            return
        if kind == "create" and err.status is None:
            self._maybe_created.add(entry.key)  # no answer: it may have been made all the same
        log.warning("batch lane: %s of batch %s failed (%s); trying again later", kind, entry.key, err)
        self._retry_later(bucket, entry)

    def _retry_later(self, bucket: Any, entry: Any) -> None:
        from udfs.lanes.provider_batch.entries import poll_delay_s

        settings = self._config.provider_batch
        delay = poll_delay_s(entry.polls, settings.poll_initial_s, settings.poll_max_s)
        self._put(bucket, entry.polled(now_ms() + int(delay * 1000)))

    # ------------------------------------------------------------------ records out
    def _result(self, bucket: Any, entry: Any, handle: str, held: Any, body: dict[str, Any]) -> Settled | None:
        """What an answer of a provider's batch comes to: through the client's one reader and the
        record path, as a realtime answer does. None: it did not validate and goes to a later batch."""
        shaped = self._shaped_now(handle, held.record)
        if isinstance(shaped, Settled):
            return shaped
        request, payload = shaped
        tries = held.tries + 1
        started = entry.created_ms or entry.sealed_ms
        index = self._route(entry) or 0
        try:
            completion = self._client.completion_from(
                body, payload, attempts=tries, started_ms=started, latency_ms=float(now_ms() - started),
                endpoint=self._providers[index].base, sent=self._client.routes[index].payload(payload),
                price_factor=self._config.provider_batch.price_factor)
            self._metrics.prompt_tokens.inc(completion.prompt_tokens)
            self._metrics.completion_tokens.inc(completion.completion_tokens)
            completion = self._client.validated(dataclasses.replace(completion, lane="batch"))
        except InvalidModelOutput as err:
            self._metrics.invalid_answers.inc()
            if tries <= self._config.model.max_invalid_retries:
                self._again(bucket, handle, held, tries)
                return None
            err.attempts = tries
            return self._path.dead_letter(err, held.record, request.id)
        except RecordError as err:
            err.attempts = tries
            return self._path.dead_letter(err, held.record, request.id)
        if self._client.may_cache(payload):  # the answer into the cache, on the loop, not waited for
            loop = self._runner.loop
            loop.call_soon_threadsafe(lambda: loop.create_task(self._client.remember(payload, completion)))
        answered = self._path.answered(request, completion, held.record)
        if self._path.postprocesses:
            return cast(Settled, self._runner.run_sync(answered, self._config.async_.record_deadline_s + RUN_SLACK_S))
        return cast(Settled, _without_loop(answered))

    def _realtime(self, held: Any) -> Callable[[], Coroutine[Any, Any, Any]]:
        record = held.record
        request = self._path.prepare(record)

        async def call() -> Any:
            if not isinstance(request, Request):
                return request if request is not None else Settled(None)
            return await self._path.call(request, record)
        return call

    def _again(self, bucket: Any, handle: str, held: Any, tries: int) -> None:
        """`handle` into a later batch, one more try counted."""
        self._records.put(handle, again := dataclasses.replace(held, tries=tries))
        self._unbatched[handle] = again
        self._assigned.remove(handle)
        self._collect(bucket, handle)

    def _dead(self, handle: str, err: RecordError, held: Any = None) -> Settled:
        held = held if held is not None else self._stored(handle)
        return self._path.dead_letter(err, held.record)

    def _internal(self, handle: str) -> Settled:
        return self._parts.internal("the realtime call of an unanswered batch request raised",
                                    self._stored(handle).record)

    def _settle(self, bucket: Any, handle: str, settled: Settled, *, in_batch: bool = False) -> Iterator[Row]:
        """`handle`'s outcome out, and the record out of state in the same call. `in_batch`: the
        caller knows it is in state and in a batch (from `_load`), so state is not asked again."""
        self._unbatched.pop(handle, None)
        self._shaped.pop(handle, None)
        if in_batch or self._records.get(handle) is not None:
            self._records.remove(handle)
            self._held[bucket] -= 1
        if in_batch or self._assigned.get(handle) is not None:
            self._assigned.remove(handle)
        yield from self._parts.emit(settled)

    def _flush(self, bucket: Any, ctx: Any) -> Iterator[Row]:
        """End of input: every record into a batch, and every batch of the bucket waited for."""
        self._flushing = True
        while self._held.get(bucket):
            yield from self._events(bucket)
            yield from self._take_up(bucket)
            self._seal(bucket, force=True)
            yield from self._drive(bucket)
            self._gauges()
            self._runner.wait(0.2, bucket)

    # ------------------------------------------------------------------ state
    def _load(self, entry: Any) -> dict[str, Any]:
        """The records of `entry` still in state, by handle, in one pass over the bucket's records
        (read in pages): a get per record is a round trip to the JVM, and 10,000 of them held the
        task thread, and so checkpoint barriers, for seconds."""
        wanted = set(entry.handles)
        return {handle: held for handle, held in self._records.items() if handle in wanted}

    def _stored(self, handle: str) -> Any:
        from udfs.lanes.provider_batch.entries import Held

        value = self._records.get(handle)
        if isinstance(value, Held):
            return value
        return Held(salvage(None))

    def _put(self, bucket: Any, entry: Any) -> None:
        self._batches.put(entry.key, entry)
        self._entries[bucket][entry.key] = entry

    def _drop(self, bucket: Any, entry: Any) -> None:
        self._batches.remove(entry.key)
        self._entries[bucket].pop(entry.key, None)
        self._busy.discard(entry.key)

    def _gauges(self) -> None:
        metrics = self._metrics
        metrics.batch_records_waiting = sum(len(c.handles) for c in self._collections.values())
        entries = [e for bucket in self._entries.values() for e in bucket.values()]
        metrics.batches_open = len(entries)
        oldest = min((e.created_ms or e.sealed_ms for e in entries), default=None)
        now = now_ms()
        metrics.batch_oldest_age_s = int((now - oldest) / 1000) if oldest is not None else 0
        waiting_since = min((c.oldest_ms for c in self._collections.values() if c.handles), default=now)
        metrics.holding.set(sum(self._held.values()),
                            max(metrics.batch_oldest_age_s, (now - waiting_since) / 1000))


def _without_loop(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """The value of a coroutine that awaits nothing (the record path without a user function), run
    on the task thread: a trip to the loop for each of a batch's answers would cost more than the
    answer."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine waited for something; run it on the loop")
