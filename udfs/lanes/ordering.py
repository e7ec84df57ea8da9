"""Per-key order (`ordering: per_key`): the outcomes of one Kafka key leave in input order.

Calls of one key still run concurrently (up to `async.capacity` with everything else); only
their emission waits. A finished call whose key has an earlier record still out is *held*:
its outcome waits here, in memory, and its record stays in the stage's keyed state, but it no
longer takes a call slot. So a hot key, or a key whose head record is slow, never blocks other
keys (the alternative, a bound on a key's calls in flight, would stop the input stream, and
with it every key, at the first record over the bound). What it costs is memory and state for
the held records: at most what arrives for that key while its head is out, which
`async.record_deadline_s` bounds.

Nothing extra is stored for the order: the input order of one key is the order of
(topic, partition, offset) of its pending records, which the stage keeps anyway, so a restore
sorts them and admits them again (`restore_order`). Queues are per (bucket, key): the stage
can only remove a record from state under its own bucket, and a key's records share a bucket
(the bucket is a hash of the key, `jobs/graph/pipeline.py`). Records with a null key have nothing to
order by and pass straight through.

Pure Python, no Flink: `tests/unit/udfs/lanes/test_key_order.py`.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any, TypeVar

from udfs.records import PendingRecord

Released = tuple[Hashable, Any]
"""(handle, outcome): an outcome whose turn has come, in the order it must be emitted."""
H = TypeVar("H", bound=Hashable)
R = TypeVar("R", bound=PendingRecord)


class KeyOrder:
    """Admission order per (bucket, key) and the outcomes held until their turn.

    `admit` appends a record's handle to its key's queue when it starts; `finish` records its
    outcome and returns every outcome now at the head of that queue, in order. A handle with
    a null key (or never admitted) is released at once.
    """

    def __init__(self) -> None:
        self._queues: dict[tuple[Hashable, bytes], deque[Hashable]] = {}
        self._queue_of: dict[Hashable, tuple[Hashable, bytes]] = {}
        self._ready: dict[Hashable, Any] = {}

    @property
    def held(self) -> int:
        """Outcomes finished but waiting for an earlier record of their key."""
        return len(self._ready)

    @property
    def admitted(self) -> int:
        """Records admitted and not yet released."""
        return len(self._queue_of)

    def waiting(self, bucket: Hashable, key: bytes | None) -> bool:
        """True if a new record of `key` would have to wait for an earlier one."""
        return key is not None and (bucket, key) in self._queues

    def admit(self, bucket: Hashable, key: bytes | None, handle: Hashable) -> None:
        """`handle` is the newest record of `key` in `bucket` (no-op for a null key)."""
        if key is None:
            return
        if handle in self._queue_of:
            raise ValueError(f"handle {handle!r} admitted twice")
        queue_id = (bucket, key)
        self._queues.setdefault(queue_id, deque()).append(handle)
        self._queue_of[handle] = queue_id

    def finish(self, handle: Hashable, outcome: Any) -> list[Released]:
        """Records `handle`'s outcome; returns the outcomes that may now leave, in order."""
        queue_id = self._queue_of.get(handle)
        if queue_id is None:
            return [(handle, outcome)]
        self._ready[handle] = outcome
        queue = self._queues[queue_id]
        out: list[Released] = []
        while queue and queue[0] in self._ready:
            head = queue.popleft()
            del self._queue_of[head]
            out.append((head, self._ready.pop(head)))
        if not queue:
            del self._queues[queue_id]
        return out


def restore_order(records: Iterable[tuple[H, R]]) -> list[tuple[H, R]]:
    """(handle, record) pairs as they must be admitted again after a restore: by
    (topic, partition, offset), the order they were read in within each partition."""
    return sorted(records, key=lambda pair: (pair[1].topic, pair[1].partition, pair[1].offset))


HASH_HEX_DIGITS = 6
"""Hex digits of the key's MD5 that pick its bucket: 16^6 values, plenty to spread over buckets."""


def key_hash(key: bytes) -> int:
    """The number the pipeline's SQL computes from a Kafka key (`jobs/graph/pipeline.py`,
    `key_hash_sql`): the first `HASH_HEX_DIGITS` hex digits of the MD5 of the key's bytes read
    as ISO-8859-1 (one character per byte, so no two keys collide before the hash). Stable
    across processes, restarts and rescales, unlike a JVM hashCode of a byte array."""
    digest = hashlib.md5(key.decode("iso-8859-1").encode("utf-8")).hexdigest()
    return int(digest[:HASH_HEX_DIGITS], 16)


def key_bucket(key: bytes | None, partition: int, buckets: int) -> int:
    """The bucket index of a record under `ordering: per_key`: by its key, or by its partition
    when it has none (such records are not ordered, only spread)."""
    return (key_hash(key) if key is not None else partition) % buckets
