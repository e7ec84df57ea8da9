"""The inference stage's side of the admission gate (`pom-free/gate/AdmissionGate.java`).

While a spend budget is paused, or every endpoint of a fleet is down or paused, no call can
start, and a stage that waited for a free slot inside its bundle would hold every checkpoint
until the window rolls over (up to an hour) or a cooldown ends (up to `max_cooldown_s`); a
Retry-After or a binding rate limit holds it for seconds to minutes.
Instead the stage keeps what it cannot start in its keyed state and says "paused" with a
file, `<directory>/<subtask>.closed`; the Java gate chained in front of it (same subtask, same
host: a Python worker always runs beside its TaskManager) stops taking input while the file
exists, and keeps running the task's mails so an unaligned checkpoint completes meanwhile.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

STOPPING = "stopping"
"""In a job's gate directory: a stop with a savepoint is under way (`jobs.graph.gate_operator.open_for_stop`)."""


class GateSignal:
    """The pause file of one inference subtask. `set` writes only on a change; `close` removes
    it, and so does the constructor, in case a worker that died while paused left one."""

    def __init__(self, directory: str, subtask: int) -> None:
        self.path = Path(directory) / f"{subtask}.closed"
        self.closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove()

    def stopping(self) -> bool:
        """A stop with a savepoint is under way (`jobs.graph.gate_operator.open_for_stop`): the gate must stay
        open, for the savepoint's aligned barrier is behind the input it would hold back."""
        return (self.path.parent / STOPPING).exists()

    def set(self, reason: str | None) -> None:
        """Closed while `reason` (why no call can start) is given, open when it is None or a
        stop with a savepoint is under way."""
        closed = reason is not None and not self.stopping()
        if closed == self.closed:
            return
        self.closed = closed
        if closed:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # swept while empty (`jobs.graph.gate_operator.job_directory`)
            self.path.touch()
            log.info("admission gate closed: %s (%s)", reason, self.path)
        else:
            self._remove()
            log.info("admission gate open again")

    def close(self) -> None:
        """Removes the file, and the job's directory once no subtask has a file in it."""
        self.closed = False
        self._remove()
        try:
            self.path.parent.rmdir()
        except OSError:
            pass  # another subtask's file is still there, or the directory is gone already

    def _remove(self) -> None:
        self.path.unlink(missing_ok=True)
