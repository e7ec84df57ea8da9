"""What the batch lane keeps in Flink state, per bucket (`udfs/lanes/provider_batch/lane.py`).

- every record not yet emitted, as a `Held` (the `PendingRecord` and the batches it went through);
- which batch a record is in (its handle -> the batch's `key`);
- each batch as a `BatchEntry`: its key, the handles of its records in the order of its request
  lines (line `i` is `r<i>`), the provider's id once the creation answered, and when to poll next.

So a checkpoint holds batch ids and records, never waits for a batch, and a restore polls the
batches it knows and finds (or creates) the ones whose creation it had not seen answered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from udfs.records import KeptInState, PendingRecord


@dataclass(frozen=True)
class Held(KeptInState):
    """A record the lane holds until its result or dead letter is emitted. `tries`: the batches it
    was in that did not answer it (a refused request, an expired or cancelled batch)."""

    record: PendingRecord
    tries: int = 0


@dataclass(frozen=True)
class BatchEntry(KeptInState):
    """One batch of a bucket. `key`: the lane's name for it (the provider's `metadata`), unique.
    `handles`: its records in line order. `provider_id`: None until the creation is answered.
    `sealed_ms`: when the lane made it; `created_ms`: when the provider took it. `polls`: views
    asked so far (the next waits longer); `next_poll_ms`: not before then. `resubmits`: how many
    times the provider lost it (a batch it no longer knows is made again once). `endpoint`: the
    label of the fleet endpoint it was sent to be made at (its batch API is the one that knows it);
    None: not sent yet, or state written before the lane served a fleet (`model.endpoint`, the first)."""

    key: str
    handles: tuple[str, ...]
    sealed_ms: int
    provider_id: str | None = None
    created_ms: int | None = None
    polls: int = 0
    next_poll_ms: int = 0
    resubmits: int = 0
    endpoint: str | None = None

    def created(self, provider_id: str, endpoint: str, now_ms: int, first_poll_ms: int) -> BatchEntry:
        return dataclasses.replace(self, provider_id=provider_id, endpoint=endpoint, created_ms=now_ms,
                                   next_poll_ms=first_poll_ms)

    def polled(self, next_poll_ms: int) -> BatchEntry:
        return dataclasses.replace(self, polls=self.polls + 1, next_poll_ms=next_poll_ms)


def poll_delay_s(polls: int, initial_s: float, max_s: float) -> float:
    """How long after its `polls`-th view a batch is viewed again: `initial_s`, doubling, at most `max_s`."""
    return min(max_s, initial_s * (2 ** min(polls, 30)))
