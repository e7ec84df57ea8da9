"""The OpenAI Batch API of the simulator: ``/v1/files`` and ``/v1/batches``, as OpenAI documents them.

A client uploads a JSONL file (``purpose=batch``, one ``{custom_id, method, url, body}`` a line),
creates a batch from it, polls it, and downloads ``output_file_id`` (the successes) and
``error_file_id`` (every other request). The answers are the simulator's own synthetic bodies
for that endpoint (``endpoints.Chat``, ``Completions``, ``Embeddings``: the same code as its
realtime answers), in random order. The file is read when the batch is created; what is wrong
with it fails the batch once it has validated (``status: failed``, ``errors.data[]`` naming
``line``, ``code`` and ``message``), as OpenAI reports it. A request whose ``body`` is wrong
is not a validation error: it is answered 400 in the error file, as it would be realtime.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import BodyPartReader, web

from jobs.dev.simulator.batch_config import MIB, BatchSettings
from jobs.dev.simulator.batch_engine import (
    FINISH_CHUNK,
    Batch,
    BatchEngine,
    Flavor,
    Item,
    RequestResult,
)
from jobs.dev.simulator.batch_http import (
    MIB_BODY,
    HttpError,
    bytes_response,
    continue_100,
    dumps,
    json_response,
    loads,
    not_found,
    page,
    query_int,
    read_json,
)
from jobs.dev.simulator.endpoints import BadRequest, Call, Chat, Completions, Embeddings

ENDPOINTS: dict[str, type[Call]] = {
    "/v1/chat/completions": Chat, "/v1/completions": Completions, "/v1/embeddings": Embeddings,
}
"""The endpoints a batch may use: the simulator's own."""
FILE_MAX_BYTES = 512 * MIB
"""OpenAI's limit on any uploaded file."""
FILE_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
FILE_TTL_S = 30 * 24 * 3600
"""A batch file expires 30 days after its upload (``expires_at``; nothing is deleted)."""
MAX_ERRORS = 1000
"""``errors.data`` of a failed batch names at most this many lines."""
_PARSE_CHUNK = 2000
_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


@dataclass(eq=False, slots=True)
class StoredFile:
    id: str
    filename: str
    purpose: str
    created_at: float
    content: bytes

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": len(self.content), "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": int(self.created_at + FILE_TTL_S) if self.purpose.startswith("batch") else None,
                "status_details": None}


def _line_error(code: str, line: int | None, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "line": line, "message": message, "param": param}


async def parse_input(content: bytes, endpoint: str) -> tuple[list[Item], list[dict[str, Any]], int]:
    """The requests of a batch input file, the errors of its lines (``errors.data`` entries) and
    its number of lines (a final newline ends the last line; it adds none). Yields to the event
    loop every ``_PARSE_CHUNK`` lines: 50,000 lines take a second or so of CPU here."""
    lines = content.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()
    items: list[Item] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, 1):
        if number % _PARSE_CHUNK == 0:
            await asyncio.sleep(0)
        try:
            request = loads(raw)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            errors.append(_line_error("invalid_json_line", number, "This line is not parseable as valid JSON."))
            continue
        problem = _line_problem(request, endpoint)
        if problem is not None:
            errors.append(_line_error(*problem[:1], number, *problem[1:]))
            continue
        custom_id = request["custom_id"]
        if custom_id in seen:
            errors.append(_line_error(
                "duplicate_custom_id", number, f"The custom_id {custom_id!r} of this request is a duplicate of "
                "another request's. The custom_id parameter must be unique for each request in a batch.",
                "custom_id"))
            continue
        seen.add(custom_id)
        items.append(Item(custom_id, request["body"], number))
    return items, errors, len(lines)


def _line_problem(request: dict[str, Any], endpoint: str) -> tuple[str, str, str] | None:
    """(code, message, param) of what is wrong with one line's envelope, or None."""
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "invalid_request", "custom_id is required and must be a non-empty string.", "custom_id"
    if request.get("method") != "POST":
        return "invalid_method", f"method must be POST, got {request.get('method')!r}.", "method"
    url = request.get("url")
    if url not in ENDPOINTS:
        served = ", ".join(ENDPOINTS)
        return "invalid_url", f"url must be one of {served} (the endpoints the simulator serves), got {url!r}.", "url"
    if url != endpoint:
        message = (f"The URL {url} of this request does not match the endpoint {endpoint} of the batch: every "
                   "line of a batch uses the batch's endpoint.")
        return "mismatched_url", message, "url"
    if not isinstance(request.get("body"), dict):
        return "invalid_request", "body is required and must be a JSON object.", "body"
    return None


class OpenAIBatches(Flavor):
    """Files and batches over HTTP, and what an OpenAI batch does in ``BatchEngine``."""

    api = "openai"

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine
        self.files: dict[str, StoredFile] = engine.files

    # ----------------------------------------------------------------- routing

    async def handle(self, request: web.BaseRequest, parts: list[str]) -> web.Response:
        """``parts``: the path after ``/v1/``, split at ``/`` (``["files", ID, "content"]``)."""
        method = request.method
        kind, rest = parts[0], parts[1:]
        routes: dict[str, Any]
        if kind == "files":
            if not rest:
                routes = {"GET": self._list_files, "POST": self._upload}
            elif len(rest) == 1:
                routes = {"GET": self._file, "DELETE": self._delete_file}
            elif len(rest) == 2 and rest[1] == "content":
                routes = {"GET": self._content}
            else:
                routes = {}
        elif not rest:
            routes = {"GET": self._list_batches, "POST": self._create}
        elif len(rest) == 1:
            routes = {"GET": self._retrieve}
        elif len(rest) == 2 and rest[1] == "cancel":
            routes = {"POST": self._cancel}
        else:
            routes = {}
        if not routes:
            raise HttpError(404, f"Unknown request URL: {method} {request.path}", code="unknown_url")
        handler = routes.get(method)
        if handler is None:
            raise HttpError(405, f"Method {method} not allowed on {request.path}", code="method_not_allowed")
        response: web.Response = await handler(request, *rest[:1])
        return response

    @staticmethod
    def error(exc: HttpError) -> web.Response:
        kind = exc.kind if exc.kind in ("invalid_request_error", "server_error") else "invalid_request_error"
        return json_response(exc.status, {"error": {"message": exc.message, "type": kind, "param": exc.param,
                                                    "code": exc.code}})

    # ----------------------------------------------------------------- files

    def _get_file(self, file_id: str) -> StoredFile:
        stored = self.files.get(file_id)
        if stored is None:
            raise not_found(f"No such File object: {file_id}")
        return stored

    def store(self, filename: str, purpose: str, content: bytes) -> StoredFile:
        stored = StoredFile(self.engine.new_id("file-sim"), filename, purpose, time.time(), content)
        self.files[stored.id] = stored
        return stored

    async def _upload(self, request: web.BaseRequest) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise HttpError(400, "POST /v1/files takes multipart/form-data with 'purpose' and 'file'")
        await continue_100(request)
        purpose: str | None = None
        filename, content = "", None
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                filename = part.filename or "upload"
                chunks, size = [], 0
                while chunk := await part.read_chunk(1 << 20):
                    size += len(chunk)
                    if size > FILE_MAX_BYTES:
                        raise HttpError(413, f"The file is over the maximum of {FILE_MAX_BYTES} bytes for a file",
                                        code="file_too_large", param="file")
                    chunks.append(chunk)
                content = b"".join(chunks)
            else:
                await part.release()
        if content is None:
            raise HttpError(400, "'file' is required", code="missing_required_parameter", param="file")
        if purpose not in FILE_PURPOSES:
            raise HttpError(400, f"'purpose' must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}",
                            param="purpose")
        if purpose == "batch":
            if not filename.endswith(".jsonl"):
                raise HttpError(400, f"Invalid file format for Batch API: {filename!r}. Must be .jsonl",
                                code="invalid_file_format", param="file")
            limit = self.engine.settings().openai_max_bytes
            if len(content) > limit:
                raise HttpError(400, f"The file is {len(content)} bytes, larger than the {limit} bytes maximum "
                                "for the Batch API", code="file_too_large", param="file")
        stored = self.store(filename, purpose, content)
        self.engine.bump(self.api, "files_uploaded")
        self.engine.bump(self.api, "bytes_uploaded", len(content))
        return json_response(200, stored.view())

    async def _list_files(self, request: web.BaseRequest) -> web.Response:
        limit = query_int(request, "limit", 10_000, 1, 10_000)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise HttpError(400, f"order must be asc or desc, got {order!r}", param="order")
        purpose = request.query.get("purpose")
        files = [f for f in self.files.values() if purpose is None or f.purpose == purpose]
        if order == "desc":
            files.reverse()
        chosen, more = page(files, lambda f: f.id, limit, request.query.get("after"))
        return json_response(200, _list([f.view() for f in chosen], more))

    async def _file(self, request: web.BaseRequest, file_id: str) -> web.Response:
        return json_response(200, self._get_file(file_id).view())

    async def _delete_file(self, request: web.BaseRequest, file_id: str) -> web.Response:
        self._get_file(file_id)
        del self.files[file_id]
        return json_response(200, {"id": file_id, "object": "file", "deleted": True})

    async def _content(self, request: web.BaseRequest, file_id: str) -> web.Response:
        return bytes_response(self._get_file(file_id).content, "application/octet-stream")

    # ----------------------------------------------------------------- batches

    def _get_batch(self, batch_id: str) -> Batch:
        batch = self.engine.batches.get(batch_id)
        if batch is None or batch.flavor is not self:
            raise not_found(f"No batch found with id '{batch_id}'.")
        return batch

    async def _create(self, request: web.BaseRequest) -> web.Response:
        body = await read_json(request, MIB_BODY)
        for name in ("input_file_id", "endpoint", "completion_window"):
            if name not in body:
                raise HttpError(400, f"Missing required parameter: '{name}'.", code="missing_required_parameter",
                                param=name)
        endpoint, window, file_id = body["endpoint"], body["completion_window"], body["input_file_id"]
        if endpoint not in ENDPOINTS:
            raise HttpError(400, f"endpoint must be one of {', '.join(ENDPOINTS)} (the endpoints the simulator "
                            f"serves), got {endpoint!r}", code="invalid_value", param="endpoint")
        if window != "24h":
            raise HttpError(400, f"completion_window must be '24h', got {window!r}", code="invalid_value",
                            param="completion_window")
        metadata = body.get("metadata")
        _check_metadata(metadata)
        if not isinstance(file_id, str):
            raise HttpError(400, "input_file_id must be a string", param="input_file_id")
        stored = self.files.get(file_id)
        if stored is None:
            raise not_found(f"No such File object: {file_id}")
        if stored.purpose != "batch":
            raise HttpError(400, f"File {file_id} has purpose {stored.purpose!r}; a batch needs purpose 'batch'",
                            param="input_file_id")
        items, errors, lines = await parse_input(stored.content, endpoint)
        model = next((item.request.get("model") for item in items if isinstance(item.request.get("model"), str)),
                     self.engine.config().models[0])
        extra = {"input_file_id": file_id, "endpoint": endpoint, "metadata": metadata, "line_errors": errors,
                 "lines": lines, "model": model}
        batch = self.engine.create(self, items, "batch_sim", extra, submitted=lines)
        return json_response(200, self.view(batch))

    async def _retrieve(self, request: web.BaseRequest, batch_id: str) -> web.Response:
        return json_response(200, self.view(self._get_batch(batch_id)))

    async def _list_batches(self, request: web.BaseRequest) -> web.Response:
        limit = query_int(request, "limit", 20, 1, 100)
        mine = [b for b in reversed(self.engine.batches.values()) if b.flavor is self]
        chosen, more = page(mine, lambda b: b.id, limit, request.query.get("after"))
        return json_response(200, _list([self.view(b) for b in chosen], more))

    async def _cancel(self, request: web.BaseRequest, batch_id: str) -> web.Response:
        batch = self._get_batch(batch_id)
        try:
            self.engine.cancel(batch)
        except ValueError:
            raise HttpError(409, f"Cannot cancel a batch with status '{batch.status}'.",
                            code="batch_not_cancellable") from None
        return json_response(200, self.view(batch))

    # ----------------------------------------------------------------- the batch object

    def view(self, batch: Batch) -> dict[str, Any]:
        counts = batch.counts()
        counted = batch.status not in ("validating", "failed")
        completed = counts["succeeded"]
        failed = counts["errored"] + counts["expired"] + counts["cancelled"]
        extra = batch.extra
        stamps = {name: int(value) for name, value in batch.stamps.items()}
        return {
            "id": batch.id, "object": "batch", "endpoint": extra["endpoint"],
            "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
            "input_file_id": extra["input_file_id"], "completion_window": "24h", "status": batch.status,
            "output_file_id": extra.get("output_file_id"), "error_file_id": extra.get("error_file_id"),
            "created_at": int(batch.created_at), "in_progress_at": stamps.get("in_progress_at"),
            "expires_at": int(batch.expires_at), "finalizing_at": stamps.get("finalizing_at"),
            "completed_at": stamps.get("completed_at"), "failed_at": stamps.get("failed_at"),
            "expired_at": stamps.get("expired_at"), "cancelling_at": stamps.get("cancelling_at"),
            "cancelled_at": stamps.get("cancelled_at"),
            "request_counts": {"total": len(batch.items) if counted else 0, "completed": completed,
                               "failed": failed},
            "metadata": extra["metadata"], "model": extra["model"], "usage": extra.get("usage"),
            "simulator": True,
        }

    # ----------------------------------------------------------------- the engine's calls

    def validate(self, batch: Batch, settings: BatchSettings) -> list[dict[str, Any]]:
        lines = batch.extra["lines"]
        errors: list[dict[str, Any]] = []
        if lines == 0:
            errors.append(_line_error("empty_file", None, "The batch input file is empty."))
        elif lines > settings.openai_max_requests:
            errors.append(_line_error("too_many_requests", settings.openai_max_requests + 1,
                                      f"The batch input file has {lines} requests, more than the maximum of "
                                      f"{settings.openai_max_requests}."))
        errors.extend(batch.extra.pop("line_errors"))
        return errors[:MAX_ERRORS]

    def failed(self, batch: Batch, engine: BatchEngine) -> None:
        batch.extra.pop("line_errors", None)

    def answer(self, batch: Batch, item: Item, engine: BatchEngine) -> RequestResult:
        request_id = engine.request_id()
        config = engine.config()
        try:
            call = ENDPOINTS[batch.extra["endpoint"]](config, item.request)
        except BadRequest as exc:
            return RequestResult("errored", {"error": {"message": str(exc), "type": "invalid_request_error",
                                                 "param": exc.param, "code": None}}, 400, request_id)
        settings = engine.settings()
        if settings.error_rate and engine.rng.random() < settings.error_rate:
            status = settings.error_status
            return RequestResult("errored", {"error": {
                "message": f"Simulated error {status} (simulator: batch fault injection)",
                "type": "server_error" if status >= 500 else "invalid_request_error", "param": None,
                "code": "simulated_fault"}}, status, request_id)
        if isinstance(call, (Chat, Completions)) and call.schema is not None:
            call.spoil = engine.rng.random() < config.invalid_json_rate
        body = call.respond(lambda prefix: f"{prefix}-{engine.new_id('simb')}")
        engine.bump(self.api, "prompt_tokens", call.prompt_tokens)
        engine.bump(self.api, "completion_tokens", call.completion_tokens)
        return RequestResult("succeeded", body, 200, request_id)

    def finish(self, batch: Batch, engine: BatchEngine) -> Iterator[None]:
        """Write the output file (successes) and the error file (the rest), each in random order."""
        output: list[bytes] = []
        errors: list[bytes] = []
        prompt = completion = 0
        order = list(batch.items)
        engine.rng.shuffle(order)
        for number, item in enumerate(order, 1):
            if number % FINISH_CHUNK == 0:
                yield
            decided = item.result
            if decided is None:
                continue
            line: dict[str, Any] = {"id": engine.new_id("batch_req_sim"), "custom_id": item.custom_id}
            if decided.kind in ("succeeded", "errored"):
                line["response"] = {"status_code": decided.status, "request_id": decided.request_id,
                                    "body": decided.body}
                line["error"] = None
                usage = (decided.body or {}).get("usage") or {}
                prompt += usage.get("prompt_tokens", 0)
                completion += usage.get("completion_tokens", 0)
            elif decided.kind == "expired":
                line["response"] = None
                line["error"] = {"code": "batch_expired",
                                 "message": "This request could not be executed before the completion window expired."}
            else:
                line["response"] = None
                line["error"] = {"code": "batch_cancelled",
                                 "message": "This request was not executed because the batch was cancelled."}
            (output if decided.kind == "succeeded" else errors).append(dumps(line))
            decided.body = None  # the file holds it now
        if output:
            batch.extra["output_file_id"] = self.store(f"{batch.id}_output.jsonl", "batch_output",
                                                       b"\n".join(output) + b"\n").id
        if errors:
            batch.extra["error_file_id"] = self.store(f"{batch.id}_error.jsonl", "batch_output",
                                                      b"\n".join(errors) + b"\n").id
        batch.extra["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                                "total_tokens": prompt + completion}


def _list(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > _METADATA_KEYS:
        raise HttpError(400, f"metadata must be an object of at most {_METADATA_KEYS} keys", param="metadata")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > _METADATA_VALUE_CHARS:
            raise HttpError(400, f"metadata keys are strings of at most {_METADATA_KEY_CHARS} characters and "
                            f"values strings of at most {_METADATA_VALUE_CHARS}; {key!r} is not", param="metadata")
