"""The one table of what an answer means (`udfs/inference/statuses.py`), and the modules that ask
it agreeing with it: the retry layer's verdict and the error a non-2xx answer becomes."""

from __future__ import annotations

import pytest

from udfs.errors import (
    InferenceError,
    PermanentError,
    RateLimited,
    RetryableError,
    TlsError,
    UnsupportedResponse,
)
from udfs.inference.retry import classify
from udfs.inference.statuses import Outcome, of_error, of_status
from udfs.inference.transport import status_error

#                 retryable, overload, circuit failure
FLAGS = {Outcome.SUCCESS: (False, False, False),
         Outcome.OVERLOAD: (True, True, False),
         Outcome.UNAVAILABLE: (True, True, True),
         Outcome.FAILURE: (True, False, True),
         Outcome.NEUTRAL: (False, False, False)}


@pytest.mark.parametrize(("status", "outcome"), [
    (200, Outcome.SUCCESS), (204, Outcome.SUCCESS),
    (429, Outcome.OVERLOAD),
    (503, Outcome.UNAVAILABLE),
    (None, Outcome.FAILURE), (408, Outcome.FAILURE), (409, Outcome.FAILURE), (500, Outcome.FAILURE),
    (502, Outcome.FAILURE), (504, Outcome.FAILURE), (599, Outcome.FAILURE),
    (301, Outcome.NEUTRAL), (400, Outcome.NEUTRAL), (401, Outcome.NEUTRAL), (404, Outcome.NEUTRAL),
    (413, Outcome.NEUTRAL), (422, Outcome.NEUTRAL),
])
def test_each_status_has_one_outcome(status: int | None, outcome: Outcome) -> None:
    assert of_status(status) is outcome
    assert (outcome.retryable, outcome.overload, outcome.circuit_failure) == FLAGS[outcome]


@pytest.mark.parametrize("status", [None, *range(200, 600)])
def test_the_retry_layer_and_the_transport_follow_the_table(status: int | None) -> None:
    outcome = of_status(status)
    assert classify(status) == ("retryable" if outcome.retryable else "permanent")
    if status is None or 200 <= status < 300:
        return
    err = status_error(status, "message")
    assert err.status == status and err.retry_after_s is None  # a Retry-After travels beside it (`Reply`)
    assert isinstance(err, RateLimited) == outcome.overload
    assert isinstance(err, RetryableError) == outcome.retryable
    assert isinstance(err, PermanentError) == (not outcome.retryable)


@pytest.mark.parametrize(("err", "outcome"), [
    (RetryableError("connection reset"), Outcome.FAILURE),
    (RateLimited("HTTP 429", status=429), Outcome.OVERLOAD),
    (RateLimited("HTTP 503", status=503), Outcome.UNAVAILABLE),
    (TlsError("certificate not trusted"), Outcome.NEUTRAL),
    (UnsupportedResponse("HTTP 200 with a body that is not JSON", status=200), Outcome.NEUTRAL),
    (RetryableError("HTTP 200 with an error instead of an answer", status=200), Outcome.FAILURE),
    (PermanentError("HTTP 400", status=400), Outcome.NEUTRAL),
])
def test_an_error_has_its_status_outcome_when_retryable_else_neutral(
        err: InferenceError, outcome: Outcome) -> None:
    assert of_error(err) is outcome
