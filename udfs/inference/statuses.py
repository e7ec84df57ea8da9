"""What an attempt's answer means, decided in one table: retry it or not, is the server overloaded,
does it count against the endpoint's circuit.

Every module that reacts to an answer asks this one: `transport.status_error` (which error a
non-2xx answer becomes), `retry.classify` (retry, or dead-letter at once), `InferenceClient`
(the outcome it reports for each attempt) and `Fleet.release` (what that outcome does to the
endpoint: its AIMD limit, its `Retry-After` pause, its circuit). So changing how a status is
handled, a 429 say, is an edit here and nowhere else.

The table, one `Outcome` per kind of answer:

| outcome | answers | retried | overload: AIMD shrinks | circuit failure |
|---|---|---|---|---|
| `SUCCESS` | 2xx | - | no (grows it) | no (closes it) |
| `OVERLOAD` | 429 | yes | yes | no: the server is alive, only full |
| `UNAVAILABLE` | 503 | yes | yes | yes |
| `FAILURE` | no answer (connection error, timeout, an answer over `model.max_response_bytes`, a 2xx holding an error object), 408, 409, other 5xx | yes | no | yes |
| `NEUTRAL` | any other status (4xx, 3xx); TLS failures, an unreadable 2xx body | no | no | no |

Why a 503 is both: a server that says "unavailable" is as often a replica that is starting,
draining or out of memory as one that is merely full. As overload it halves that endpoint's
limit and honours its `Retry-After`, as a 429 does; as a failure it counts towards that
endpoint's circuit, so a replica that keeps answering 503 stops taking traffic like one that
answers 500. `model.endpoint` alone is a fleet of one whose circuit never opens (`Fleet`), so
there a 503 is overload alone.
"""

from __future__ import annotations

import enum

from udfs.errors import InferenceError, ResponseTooLarge, RetryableError


class Outcome(enum.Enum):
    """What one attempt came to, and what that means: `retryable` (another attempt may succeed),
    `overload` (the server pushes back: that endpoint's AIMD limit shrinks and its `Retry-After`
    pauses it), `circuit_failure` (counts towards that endpoint's circuit). See the module's table.
    The `label` keeps members whose flags are alike (`SUCCESS`, `NEUTRAL`) distinct."""

    SUCCESS = ("success", False, False, False)
    OVERLOAD = ("overload", True, True, False)
    UNAVAILABLE = ("unavailable", True, True, True)
    FAILURE = ("failure", True, False, True)
    NEUTRAL = ("neutral", False, False, False)

    def __init__(self, label: str, retryable: bool, overload: bool, circuit_failure: bool) -> None:
        self.label = label
        self.retryable = retryable
        self.overload = overload
        self.circuit_failure = circuit_failure


_BY_STATUS = {408: Outcome.FAILURE, 409: Outcome.FAILURE, 429: Outcome.OVERLOAD, 503: Outcome.UNAVAILABLE}
"""The statuses the ranges below do not settle."""


def of_status(status: int | None) -> Outcome:
    """The outcome of an attempt answered with `status`; `None`: no answer came (a connection
    error or a timeout)."""
    if status is None:
        return Outcome.FAILURE
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if 200 <= status < 300:
        return Outcome.SUCCESS
    if 500 <= status <= 599:
        return Outcome.FAILURE
    return Outcome.NEUTRAL


def of_error(err: InferenceError) -> Outcome:
    """The outcome of an attempt that ended in `err`: a retryable error's by its status; any other
    (a permanent refusal, a TLS failure, an unreadable answer) says nothing of the endpoint's
    health or load, so `NEUTRAL`. An answer cut off for its size counts as no answer at all,
    whatever status it came with, and so does a 2xx that failed anyway (an error object where the
    answer belongs): its status says success, the server says it failed."""
    if isinstance(err, ResponseTooLarge):
        return Outcome.FAILURE
    if isinstance(err, RetryableError) and err.status is not None and 200 <= err.status < 300:
        return Outcome.FAILURE
    return of_status(err.status) if isinstance(err, RetryableError) else Outcome.NEUTRAL
