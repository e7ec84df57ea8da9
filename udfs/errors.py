"""The one exception tree of llmstream.

Everything a record can go through ends in one of three ways: a result, a retry, or a
dead letter. Every error that ends a record is a `RecordError` with a stable `reason` code
(the dead letter's `reason`, see README "Record contract"), in one of four kinds:

- `BadInput`: the record never reached the model (malformed, a template it cannot fill,
  over the token budget); sending it again cannot help.
- `RetryableError`: a call failed and another attempt may succeed (the retry layer's business;
  what reaches a dead letter has used up its attempts or its deadline, `DeadlineExceeded`).
- `PermanentError`: the model server refused or answered with something unusable.
- `InternalError`: a bug in llmstream. It still becomes a dead letter (`internal_error`) and
  is logged with its traceback: data never restarts the job.

Configuration problems are `ConfigError` and stop the job before it starts; the development
and operations tools in `jobs/` raise their own subclasses of `LLMStreamError`.
"""

from __future__ import annotations


class LLMStreamError(Exception):
    """Base of every error raised by llmstream code."""

    exit_code = 1
    """What a command that ends with it exits with (docs/operations.md, "When a command fails")."""


class ConfigError(LLMStreamError, ValueError):
    """The job configuration is invalid; the message names the key path."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


class RecordError(LLMStreamError):
    """A record gets no result: it becomes a dead letter saying `reason` (a stable machine-readable
    code) and `detail` (for a human), with the `attempts` made and the last HTTP `status`."""

    reason: str
    attempts: int = 0
    status: int | None = None

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class BadInput(RecordError):
    """An input record cannot become a request; it never reaches the model (0 attempts)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class ContextTooLong(BadInput):
    """The prompt exceeds `model.max_input_tokens` and `on_context_overflow` is not `truncate`."""

    def __init__(self, detail: str) -> None:
        super().__init__("context_too_long", detail)


class InternalError(RecordError):
    """A bug: something llmstream's own code did not expect. `detail` names the exception."""

    reason = "internal_error"

    @classmethod
    def from_exception(cls, err: BaseException) -> InternalError:
        return cls(f"{type(err).__name__}: {err}"[:500])


class UserFunctionError(RecordError):
    """A user function (`model.preprocess`, `output.postprocess`; udfs/lanes/user_functions.py)
    raised, returned what cannot be used, or did not return within `async.record_deadline_s`.
    `detail` names the setting, the function and what happened (the exception, or what was
    expected). Never a restart: the record is dead-lettered with reason `user_function_error`."""

    reason = "user_function_error"

    def __init__(self, detail: str, *, attempts: int = 0) -> None:
        super().__init__(detail[:1000])
        self.attempts = attempts


class ProviderBatchError(RecordError):
    """A record the provider-batch lane (`lane: provider-batch`) could not get answered: the batch
    failed validation (`batch_failed`), the provider refused the request in every batch it was in
    (`batch_request_failed`), its batch expired or was cancelled and `provider_batch.on_expired` /
    `on_cancelled` says dead-letter or its tries are used up (`batch_expired`, `batch_cancelled`),
    or the provider lost the batch twice (`batch_gone`). `detail` carries the provider's words."""

    def __init__(self, reason: str, detail: str, *, attempts: int = 0, status: int | None = None) -> None:
        super().__init__(detail[:1000])
        self.reason = reason
        self.attempts = attempts
        self.status = status


class InferenceError(RecordError):
    """A call to the model server failed; carries what the dead letter needs to explain it.
    Abstract: what is raised is one of its subclasses, each with its own `reason`."""

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        retry_after_s: float | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.retry_after_s = retry_after_s
        self.attempts = attempts


class RetryableError(InferenceError):
    """May succeed on a later attempt: connection errors, timeouts, 408/409/429/5xx, an answer
    over `model.max_response_bytes` (`ResponseTooLarge`)."""

    reason = "inference_retries_exhausted"


class RateLimited(RetryableError):
    """The server pushed back (an overload answer, 429 or 503: `udfs/inference/statuses.py`): the
    endpoint's concurrency shrinks and its `Retry-After` pauses it."""


class ResponseTooLarge(RetryableError):
    """The server's answer passed `model.max_response_bytes` (by its Content-Length, or while
    it was read); the rest was not read and the connection was closed, so one endpoint or
    proxy cannot fill the worker's memory. Retried like a 5xx, within `retry.*`: a proxy's
    glitch may pass, and in a fleet the endpoint's circuit counts it and the next attempt
    goes elsewhere; an answer that is always this large is dead-lettered with this reason
    once the attempts are used up."""

    reason = "response_too_large"


class PermanentError(InferenceError):
    """Will not succeed however often it is sent: 4xx other than 408/409/429, bad responses."""

    reason = "inference_rejected"


class DeadlineExceeded(InferenceError):
    """The record's overall deadline passed before an attempt succeeded."""

    reason = "inference_deadline_exceeded"


class UnsupportedResponse(PermanentError):
    """The server answered 200 with something llmstream cannot use as this api's output, e.g.
    one vector per token where `api: embeddings` needs one vector per input (llama.cpp's
    server with a model that has no pooling)."""

    reason = "unsupported_response"


class TlsError(PermanentError):
    """TLS towards the model server failed: its certificate is not trusted or does not name the
    host, it refused or required a client certificate, or the handshake failed. Settings, not
    luck, decide that, so the record is dead-lettered after one attempt instead of using up its
    retries; the `detail` says which `model.tls` setting to look at. A connection dropped
    mid-handshake is not this (it stays a `RetryableError`)."""

    reason = "tls_error"


class ResultTooLarge(PermanentError):
    """The model's answer makes an output record larger than `limits.max_result_bytes`; written
    to the sink it would exceed the producer's max.request.size and fail the job instead."""

    reason = "result_too_large"


class InvalidModelOutput(PermanentError):
    """The model's answers did not validate against `model.response_format`, also after
    `model.max_invalid_retries` more tries; `last_output` is the last answer, kept for the
    dead letter (`detail` holds the validator's message)."""

    reason = "invalid_model_output"

    def __init__(self, detail: str, *, last_output: object = None, status: int | None = 200,
                 retry_after_s: float | None = None, attempts: int = 1) -> None:
        super().__init__(detail, status=status, retry_after_s=retry_after_s, attempts=attempts)
        self.last_output = last_output
