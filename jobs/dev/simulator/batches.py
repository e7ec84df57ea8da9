"""The provider batch APIs of one simulator, behind one hook: ``SimulatorServer`` hands ``BatchApis.handle``
every request its own routes do not take, and adds ``BatchApis.stats`` to ``/stats``.

Routes (``jobs/dev/simulator/batch_openai.py``, ``batch_anthropic.py``; shapes in docs/models.md)::

    POST /v1/files  GET /v1/files  GET|DELETE /v1/files/{id}  GET /v1/files/{id}/content
    POST /v1/batches  GET /v1/batches  GET /v1/batches/{id}  POST /v1/batches/{id}/cancel
    POST /v1/messages/batches  GET /v1/messages/batches  GET|DELETE /v1/messages/batches/{id}
    GET /v1/messages/batches/{id}/results  POST /v1/messages/batches/{id}/cancel
    GET /admin/batches             settings, every batch (newest first), the batch counters
    POST /admin/batches            change settings (partial: delay_s, validating_s, finalizing_s,
                                   error_rate, error_status, time_scale, *_max_requests, *_max_bytes)
    POST /admin/batches/{id}       force an outcome: {"action": "expire" | "cancel" | "delete" |
                                   "fail" [, "line", "message", "code"] | "process" [, "requests"]}

With ``--api-key`` the OpenAI routes want ``Authorization: Bearer KEY`` and the Anthropic ones
``x-api-key: KEY`` (or the same Bearer header); ``anthropic-version`` is accepted, never required.
"""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any, Protocol

from aiohttp import web

from jobs.dev.simulator.batch_anthropic import AnthropicBatches
from jobs.dev.simulator.batch_engine import BatchEngine
from jobs.dev.simulator.batch_http import MIB_BODY, HttpError, json_response, read_json
from jobs.dev.simulator.batch_openai import OpenAIBatches
from jobs.dev.simulator.config import SimulatorConfig

_ANTHROPIC = "/v1/messages/batches"
_OPENAI = ("/v1/files", "/v1/batches")
_ADMIN = "/admin/batches"


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


class BatchHost(Protocol):
    """What the batch APIs need of the simulator that serves them (``SimulatorServer``): its settings,
    which ``POST /admin/batches`` replaces, and its check of the ``Authorization`` header."""

    config: SimulatorConfig

    def authorized(self, request: web.BaseRequest) -> bool: ...


class BatchApis:
    """Both batch APIs and their admin routes, on the server's loop and settings (``config.batch``)."""

    def __init__(self, server: BatchHost) -> None:
        self.server = server
        self.engine = BatchEngine(lambda: server.config.batch, lambda: server.config)
        self.openai = OpenAIBatches(self.engine)
        self.anthropic = AnthropicBatches(self.engine)

    async def handle(self, request: web.BaseRequest) -> web.Response | None:
        """The answer to a batch or batch-admin request; None for any other path."""
        path = request.path
        if _under(path, _ANTHROPIC):
            if not self._anthropic_key(request):
                return self.anthropic.error(HttpError(401, "invalid x-api-key (simulator)", "authentication_error"))
            rest = [part for part in path[len(_ANTHROPIC):].split("/") if part]
            try:
                return await self.anthropic.handle(request, rest)
            except HttpError as exc:
                return self.anthropic.error(exc)
        if any(_under(path, prefix) for prefix in _OPENAI):
            if not self.server.authorized(request):
                return self.openai.error(HttpError(401, "Incorrect or missing API key (simulator)",
                                                   code="invalid_api_key"))
            try:
                return await self.openai.handle(request, path[len("/v1/"):].split("/"))
            except HttpError as exc:
                return self.openai.error(exc)
        if _under(path, _ADMIN):
            try:
                return await self._admin(request, path[len(_ADMIN) + 1:])
            except HttpError as exc:
                return self.openai.error(exc)
        return None

    def _anthropic_key(self, request: web.BaseRequest) -> bool:
        key = self.server.config.api_key
        if key is None:
            return True
        given = request.headers.get("x-api-key")
        if given is not None:
            return hmac.compare_digest(given.encode("utf-8", "replace"), key.encode())
        return self.server.authorized(request)

    async def _admin(self, request: web.BaseRequest, batch_id: str) -> web.Response:
        method = request.method
        if not batch_id and method == "GET":
            return json_response(200, self.view())
        if not batch_id and method == "POST":
            try:
                settings = self.server.config.batch.updated(await read_json(request, MIB_BODY))
            except (ValueError, TypeError) as exc:
                raise HttpError(400, str(exc)) from None
            self.server.config = dataclasses.replace(self.server.config, batch=settings)
            return json_response(200, self.view())
        if batch_id and method == "POST":
            batch = self.engine.batches.get(batch_id)
            if batch is None:
                raise HttpError(404, f"No batch {batch_id!r} (deleted, or never created)", "not_found_error")
            try:
                return json_response(200, self.engine.force(batch, await read_json(request, MIB_BODY)))
            except ValueError as exc:
                raise HttpError(400, str(exc)) from None
        raise HttpError(405, f"Method {method} not allowed on {request.path}")

    def view(self) -> dict[str, Any]:
        """``GET /admin/batches``: settings, every batch (newest first) and the counters."""
        return {"simulator": True, "settings": self.server.config.batch.to_dict(),
                "batches": [batch.summary() for batch in reversed(self.engine.batches.values())],
                "stats": self.stats()}

    def stats(self) -> dict[str, Any]:
        """The ``batches`` part of ``/stats`` (see ``BatchEngine.stats``)."""
        return self.engine.stats([self.openai, self.anthropic])

    def reset_stats(self) -> None:
        self.engine.reset_stats()
