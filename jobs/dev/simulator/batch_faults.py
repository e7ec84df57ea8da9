"""Forced batch outcomes while a job runs: each action of a list goes to its own batch once one
qualifies (``POST /admin/batches/ID``), from a background thread; used by the batch lane's
measurement (``llmstream bench --batch-lane N --inject``) and its integration test.

An ``expire`` waits for a batch that has answered some of its requests and not all, so that the
lane has both kinds to handle (answers kept, the rest made again); the other actions take the first
batch still running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

log = logging.getLogger(__name__)

ACTIONS = ("expire", "fail", "delete", "cancel")
"""What ``--inject`` forces, one batch each: an expiry, a validation failure, a batch deleted at the
provider, a cancel by someone else."""

_RUNNING = ("validating", "in_progress")


class BatchAdmin(Protocol):
    def batches(self) -> list[dict[str, Any]]: ...

    def force_batch(self, batch_id: str, action: dict[str, Any]) -> dict[str, Any]: ...


def _qualifies(action: str, batch: dict[str, Any]) -> bool:
    if batch["status"] not in _RUNNING or batch.get("forced"):
        return False
    if action == "expire":
        return batch["status"] == "in_progress" and 0 < int(batch["answered"]) < int(batch["requests"])
    return True


def _body(action: str) -> dict[str, Any]:
    if action == "fail":
        return {"action": "fail", "line": 2, "message": "Injected validation failure of line 2 (simulator)"}
    return {"action": action}


class ForcedOutcomes:
    """Give ``actions`` to distinct batches, in order, as they qualify; ``forced`` says what was
    done: action, batch id, its requests and how many it had answered then."""

    def __init__(self, admin: BatchAdmin, actions: tuple[str, ...] = ACTIONS, poll_s: float = 0.2) -> None:
        unknown = set(actions) - set(ACTIONS)
        if unknown:
            raise ValueError(f"unknown batch actions {sorted(unknown)} (known: {', '.join(ACTIONS)})")
        self._admin = admin
        self._pending = list(actions)
        self._poll_s = poll_s
        self._stop = threading.Event()
        self.forced: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, name="forced-batch-outcomes", daemon=True)

    def start(self) -> ForcedOutcomes:
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return not self._pending

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        used: set[str] = set()
        while self._pending and not self._stop.is_set():
            try:
                self._once(used)
            except Exception as exc:  # noqa: BLE001 - a batch may end between the view and the force
                log.debug("forcing a batch outcome: %s", exc)
            self._stop.wait(self._poll_s)

    def _once(self, used: set[str]) -> None:
        action = self._pending[0]
        for batch in reversed(self._admin.batches()):  # oldest first
            if batch["id"] in used or not _qualifies(action, batch):
                continue
            left = self._admin.force_batch(batch["id"], _body(action))["batch"]  # as the action left it
            used.add(batch["id"])
            self.forced.append({"action": action, "batch": batch["id"], "requests": int(left["requests"]),
                                "answered": int(left["answered"]), "outcomes": dict(left.get("outcomes") or {}),
                                "at": time.time()})
            self._pending.pop(0)
            return

    def accounting(self, stats: dict[str, Any], reasons: Iterable[str], records: int) -> dict[str, Any]:
        """What was forced, the dead letters by reason, and the requests submitted beyond one a
        record set against what explains them (``stats``: the simulator's counters of the API):
        each refused request tried again (refused, less those dead-lettered for it), each request
        an expired batch left unanswered (less those dead-lettered for it), and the deleted batches
        made again whole (less their refusals, which went again with them). ``unexplained`` is what
        a record paid for twice without cause."""
        by_reason = Counter(reasons)
        deleted = [f for f in self.forced if f["action"] == "delete"]
        explained = (int(stats["requests_errored"]) - by_reason["batch_request_failed"]
                     + int(stats["requests_expired"]) - by_reason["batch_expired"]
                     + sum(f["requests"] - (f["answered"] - f["outcomes"].get("succeeded", 0)) for f in deleted))
        extra = int(stats["requests_submitted"]) - records
        return {"forced": [{k: f[k] for k in ("action", "batch", "requests", "answered")} for f in self.forced],
                "all_forced": self.done, "dead_letter_reasons": dict(by_reason),
                "requests_errored": int(stats["requests_errored"]),
                "requests_expired": int(stats["requests_expired"]),
                "requests_cancelled": int(stats["requests_cancelled"]),
                "extra_requests": extra, "explained": explained, "unexplained": extra - explained}
