"""Anthropic's Message Batches API on the simulator: ``/v1/messages/batches``, as Anthropic documents it.

A client posts ``{"requests": [{"custom_id", "params": {model, max_tokens, messages, system?}}]}``,
polls the batch until ``processing_status`` is ``ended`` and reads its ``results_url``: JSONL, one
``{custom_id, result}`` a request in random order, ``result`` being ``succeeded`` (an Anthropic
Message), ``errored``, ``canceled`` or ``expired``. The shape of the batch is checked when it is
created (400); a request's ``params`` are checked when it is answered, so a wrong one is an
``errored`` result, as Anthropic does it. The text of an answer is the simulator's chat answer
(``endpoints.Chat``, the same code as its realtime ``/v1/chat/completions``), in a Message.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from jobs.dev.simulator.batch_engine import (
    ENDED,
    FINISH_CHUNK,
    Batch,
    BatchEngine,
    Flavor,
    Item,
    RequestResult,
)
from jobs.dev.simulator.batch_http import (
    HttpError,
    bytes_response,
    dumps,
    json_response,
    not_found,
    page,
    query_int,
    read_json,
    rfc3339,
)
from jobs.dev.simulator.endpoints import BadRequest, Chat

CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}
"""Anthropic's error ``type`` of an HTTP status (other 4xx: invalid_request_error, other 5xx: api_error)."""


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _params_problem(params: dict[str, Any]) -> str | None:
    """What is wrong with one request's ``params`` (Anthropic's ``field: problem`` style), or None."""
    if not isinstance(params.get("model"), str) or not params["model"]:
        return "model: Field required (a non-empty string)"
    max_tokens = params.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return "max_tokens: Field required (an integer >= 1)"
    messages = params.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: Field required (a non-empty list)"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return f"messages.{index}.role: Input should be 'user' or 'assistant'"
        if not isinstance(message.get("content"), (str, list)):
            return f"messages.{index}.content: Field required (a string or a list of content blocks)"
    system = params.get("system")
    if system is not None and not isinstance(system, (str, list)):
        return "system: Input should be a string or a list of text blocks"
    if params.get("stream"):
        return "stream: streaming is not supported in Message Batches"
    return None


class AnthropicBatches(Flavor):
    """Message batches over HTTP, and what one does in ``BatchEngine``."""

    api = "anthropic"
    statuses = ("in_progress", "canceling", "ended")

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine

    def status_of(self, batch: Batch) -> str:
        if batch.status in ENDED:
            return "ended"
        return "canceling" if batch.status == "cancelling" else "in_progress"

    # ----------------------------------------------------------------- routing

    async def handle(self, request: web.BaseRequest, rest: list[str]) -> web.Response:
        """``rest``: the path after ``/v1/messages/batches/``, split at ``/``."""
        method = request.method
        routes: dict[str, Any]
        if not rest:
            routes = {"GET": self._list, "POST": self._create}
        elif len(rest) == 1:
            routes = {"GET": self._retrieve, "DELETE": self._delete}
        elif len(rest) == 2 and rest[1] == "cancel":
            routes = {"POST": self._cancel}
        elif len(rest) == 2 and rest[1] == "results":
            routes = {"GET": self._results}
        else:
            routes = {}
        if not routes:
            raise not_found(f"Unknown request URL: {method} {request.path}")
        handler = routes.get(method)
        if handler is None:
            raise HttpError(405, f"Method {method} not allowed on {request.path}")
        response: web.Response = await handler(request, *rest[:1])
        return response

    def error(self, exc: HttpError) -> web.Response:
        request_id = self.engine.request_id()
        kind = exc.kind if exc.kind in ERROR_TYPES.values() else error_type(exc.status)
        return json_response(exc.status, {"type": "error", "error": {"type": kind, "message": exc.message},
                                          "request_id": request_id}, {"request-id": request_id})

    # ----------------------------------------------------------------- routes

    def _get(self, batch_id: str) -> Batch:
        batch = self.engine.batches.get(batch_id)
        if batch is None or batch.flavor is not self:
            raise not_found(f"No Message Batch with id {batch_id!r} (simulator)")
        return batch

    async def _create(self, request: web.BaseRequest) -> web.Response:
        settings = self.engine.settings()
        body = await read_json(request, settings.anthropic_max_bytes, "The Message Batch")
        requests = body.get("requests")
        if not isinstance(requests, list) or not requests:
            raise HttpError(400, "requests: Field required (a non-empty list)")
        if len(requests) > settings.anthropic_max_requests:
            raise HttpError(400, f"requests: a Message Batch holds at most {settings.anthropic_max_requests} "
                                 f"requests, got {len(requests)}")
        items: list[Item] = []
        seen: set[str] = set()
        for index, entry in enumerate(requests):
            if not isinstance(entry, dict):
                raise HttpError(400, f"requests.{index}: Input should be an object with custom_id and params")
            custom_id = entry.get("custom_id")
            if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
                raise HttpError(400, f"requests.{index}.custom_id: String should match pattern "
                                     f"'^[a-zA-Z0-9_-]{{1,64}}$', got {custom_id!r}")
            if custom_id in seen:
                raise HttpError(400, f"requests.{index}.custom_id: Duplicate custom_id {custom_id!r}; each "
                                     "request in a Message Batch needs a unique custom_id")
            seen.add(custom_id)
            if not isinstance(entry.get("params"), dict):
                raise HttpError(400, f"requests.{index}.params: Field required (an object)")
            items.append(Item(custom_id, entry["params"], index + 1))
        base = f"{request.scheme}://{request.host}"
        batch = self.engine.create(self, items, "msgbatch_sim", {"base_url": base}, validating=False)
        return json_response(200, self.view(batch))

    async def _retrieve(self, request: web.BaseRequest, batch_id: str) -> web.Response:
        return json_response(200, self.view(self._get(batch_id)))

    async def _list(self, request: web.BaseRequest) -> web.Response:
        limit = query_int(request, "limit", 20, 1, 1000)
        mine = [b for b in reversed(self.engine.batches.values()) if b.flavor is self]
        chosen, more = page(mine, lambda b: b.id, limit, request.query.get("after_id"),
                            request.query.get("before_id"))
        data = [self.view(b) for b in chosen]
        return json_response(200, {"data": data, "has_more": more, "first_id": data[0]["id"] if data else None,
                                   "last_id": data[-1]["id"] if data else None})

    async def _cancel(self, request: web.BaseRequest, batch_id: str) -> web.Response:
        batch = self._get(batch_id)
        if batch.status not in ENDED and batch.status != "cancelling":
            try:
                self.engine.cancel(batch)
            except ValueError as exc:  # finalizing: every request is answered already
                raise HttpError(409, f"Message Batch {batch_id} cannot be canceled now: {exc}") from None
        elif batch.status in ENDED:
            raise HttpError(409, f"Message Batch {batch_id} has already ended and cannot be canceled")
        return json_response(200, self.view(batch))

    async def _delete(self, request: web.BaseRequest, batch_id: str) -> web.Response:
        batch = self._get(batch_id)
        if not batch.ended:
            raise HttpError(400, f"Message Batch {batch_id} is still {self.status_of(batch)}: cancel it and "
                                 "wait for it to end before deleting it")
        self.engine.delete(batch)
        return json_response(200, {"id": batch_id, "type": "message_batch_deleted"})

    async def _results(self, request: web.BaseRequest, batch_id: str) -> web.Response:
        batch = self._get(batch_id)
        if not batch.ended:
            raise HttpError(400, f"Message Batch {batch_id} is still {self.status_of(batch)}: its results are "
                                 "available once processing_status is 'ended'")
        return bytes_response(batch.extra["results"], "application/x-jsonl")

    # ----------------------------------------------------------------- the batch object

    def view(self, batch: Batch) -> dict[str, Any]:
        ended = batch.status in ENDED
        counts = batch.counts()
        request_counts = {"processing": 0 if ended else len(batch.items),
                          "succeeded": counts["succeeded"] if ended else 0,
                          "errored": counts["errored"] if ended else 0,
                          "canceled": counts["cancelled"] if ended else 0,
                          "expired": counts["expired"] if ended else 0}
        ended_at = next((batch.stamps[f"{s}_at"] for s in ENDED if f"{s}_at" in batch.stamps), None)
        return {
            "id": batch.id, "type": "message_batch", "processing_status": self.status_of(batch),
            "request_counts": request_counts, "ended_at": rfc3339(ended_at),
            "created_at": rfc3339(batch.created_at), "expires_at": rfc3339(batch.expires_at),
            "archived_at": None, "cancel_initiated_at": rfc3339(batch.stamps.get("cancelling_at")),
            "results_url": f"{batch.extra['base_url']}/v1/messages/batches/{batch.id}/results" if ended else None,
            "simulator": True,
        }

    # ----------------------------------------------------------------- the engine's calls

    def _errored(self, status: int, message: str, request_id: str) -> RequestResult:
        return RequestResult("errored", {"type": "error", "error": {"type": error_type(status), "message": message},
                                   "request_id": request_id}, status, request_id)

    def answer(self, batch: Batch, item: Item, engine: BatchEngine) -> RequestResult:
        request_id = engine.request_id()
        params: dict[str, Any] = item.request
        problem = _params_problem(params)
        if problem is not None:
            return self._errored(400, problem, request_id)
        system = params.get("system")
        messages = ([{"role": "system", "content": system}] if system else []) + list(params["messages"])
        config = engine.config()
        try:
            call = Chat(config, {"model": params["model"], "max_tokens": params["max_tokens"], "messages": messages})
        except BadRequest as exc:
            return self._errored(400, f"{exc.param or 'params'}: {exc}", request_id)
        settings = engine.settings()
        if settings.error_rate and engine.rng.random() < settings.error_rate:
            status = settings.error_status
            return self._errored(status, f"Simulated error {status} (simulator: batch fault injection)", request_id)
        if call.schema is not None:
            call.spoil = engine.rng.random() < config.invalid_json_rate
        body = call.respond(lambda prefix: f"{prefix}-{engine.new_id('simb')}")
        engine.bump(self.api, "prompt_tokens", call.prompt_tokens)
        engine.bump(self.api, "completion_tokens", call.completion_tokens)
        message = {
            "id": engine.new_id("msg_sim"), "type": "message", "role": "assistant", "model": call.model,
            "content": [{"type": "text", "text": body["choices"][0]["message"]["content"]}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": call.prompt_tokens, "output_tokens": call.completion_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "service_tier": "batch"},
        }
        return RequestResult("succeeded", message, 200, request_id)

    def failed(self, batch: Batch, engine: BatchEngine) -> None:
        """A batch refused as a whole (forced): every request is an ``errored`` result naming why."""
        message = "; ".join(f"{e['message']}" for e in batch.errors[:3])
        for item in batch.items:
            item.result = self._errored(400, message, engine.request_id())
        for _ in self.finish(batch, engine):
            pass

    def finish(self, batch: Batch, engine: BatchEngine) -> Iterator[None]:
        """The results file: one line a request, in random order."""
        order = list(batch.items)
        engine.rng.shuffle(order)
        lines = []
        for number, item in enumerate(order, 1):
            if number % FINISH_CHUNK == 0:
                yield
            decided = item.result
            if decided is None:
                continue
            result: dict[str, Any] = {"type": "canceled" if decided.kind == "cancelled" else decided.kind}
            if decided.kind == "succeeded":
                result["message"] = decided.body
            elif decided.kind == "errored":
                result["error"] = decided.body
            lines.append(dumps({"custom_id": item.custom_id, "result": result}))
            decided.body = None
        batch.extra["results"] = b"\n".join(lines) + b"\n" if lines else b""
