"""The one exception tree of llmstream.

Everything a record can go through ends in one of three ways: a result, a retry, or a
dead letter. The tree mirrors that: `RetryableError` may succeed on another attempt,
`PermanentError` will not, `BadInput` never reached the model at all. Configuration
problems are `ConfigError` and stop the job before it starts.
"""

from __future__ import annotations


class LLMStreamError(Exception):
    """Base of every error raised by llmstream code."""


class ConfigError(LLMStreamError, ValueError):
    """The job configuration is invalid; the message names the key path."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


class BadInput(LLMStreamError):
    """An input record cannot become a request; `reason` is a stable machine-readable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class InferenceError(LLMStreamError):
    """A call to the model server failed; carries what the dead letter needs to explain it."""

    reason = "inference_failed"

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        retry_after_s: float | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.retry_after_s = retry_after_s
        self.attempts = attempts


class RetryableError(InferenceError):
    """May succeed on a later attempt: connection errors, timeouts, 408/409/429/5xx."""

    reason = "inference_retries_exhausted"


class RateLimited(RetryableError):
    """The server said 429 (or 503): slow down, and retry after its hint."""


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


class ResultTooLarge(PermanentError):
    """The model's answer makes an output record larger than `limits.max_result_bytes`; written
    to the sink it would exceed the producer's max.request.size and fail the job instead."""

    reason = "result_too_large"


class ContextTooLong(PermanentError):
    """The prompt exceeds the configured input-token budget and truncation is off."""

    reason = "context_too_long"


class InvalidModelOutput(PermanentError):
    """The model's answers did not validate against `model.response_format`, also after
    `model.max_invalid_retries` more tries; `last_output` is the last answer, kept for the
    dead letter (`detail` holds the validator's message)."""

    reason = "invalid_model_output"

    def __init__(self, detail: str, *, last_output: object = None, status: int | None = 200,
                 retry_after_s: float | None = None, attempts: int = 1) -> None:
        super().__init__(detail, status=status, retry_after_s=retry_after_s, attempts=attempts)
        self.last_output = last_output
