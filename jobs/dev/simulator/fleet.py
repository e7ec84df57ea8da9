"""Several simulated endpoints in one process, and a control port that kills, revives and
misconfigures each: the stand-in for a model fleet (`model.endpoints`, `udfs/inference/fleet.py`).

``llmstream model-server --fleet 16,8,4`` serves one endpoint per number, each with the other
flags' settings and that concurrency limit, on its own free port (a killed endpoint refuses
connections like a dead replica, so its own ``/admin`` is gone with it: hence the control
port, ``--port``). The control routes::

    GET  /health             200 {"status": "ok"}
    GET  /fleet              {"endpoints": [{"index", "url", "up", "stats"}]}
    POST /fleet/reset        zero every endpoint's counters (as POST /stats/reset)
    POST /fleet/{i}          one of: {"state": "down"} (kill: stop listening, drop connections),
                             {"state": "up"} (revive on the same port), {"faults": {...}} (as
                             POST /admin/faults: e.g. {"error_rate": 1} answers 500 to everything,
                             {"rate_limit_rate": 1} 429, {"hostile": "all", "hostile_rate": 0.2}
                             a hostile answer to a fifth of the requests, each kind in turn:
                             hostile.py), {"config": {...}} (as POST /admin/config)

The stdout line ``FLEET_PREFIX`` + JSON ``{"control", "endpoints"}`` comes before the usual
listening line (which names the control port), so ``launch.spawn_fleet`` finds both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Collection
from typing import Any

from aiohttp import web

from jobs.dev.simulator.config import SimulatorConfig
from jobs.dev.simulator.server import SimulatorServer, dumps, serve

FLEET_PREFIX = "llmstream model-server (simulator) fleet: "
"""The stdout line naming the control URL and each endpoint's ``/v1`` URL, as JSON."""


def parse_fleet(spec: str) -> list[int]:
    """``16,8,4`` -> [16, 8, 4]: one endpoint per concurrency limit (0 = unlimited)."""
    try:
        limits = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--fleet {spec!r}: give concurrency limits separated by commas, e.g. 16,8,4") from None
    if not limits or any(n < 0 for n in limits):
        raise ValueError(f"--fleet {spec!r}: give one or more limits >= 0, e.g. 16,8,4")
    return limits


class SimulatorFleet:
    """Endpoints on one event loop and the control server; create it with ``await serve_fleet(...)``."""

    def __init__(self, servers: list[SimulatorServer], host: str) -> None:
        self.servers = servers
        self.host = host
        self.port = 0
        self._web = web.Server(self._handle, access_log=None)
        self._listener: asyncio.Server | None = None

    @property
    def control_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    async def _listen(self, port: int) -> None:
        self._listener = await asyncio.get_running_loop().create_server(self._web, self.host, port)
        self.port = self._listener.sockets[0].getsockname()[1]

    def view(self) -> dict[str, Any]:
        return {"simulator": True, "endpoints": [
            {"index": i, "url": server.url, "up": server.up, "stats": server.stats()}
            for i, server in enumerate(self.servers)]}

    async def apply(self, index: int, body: dict[str, Any]) -> dict[str, Any]:
        """One control change to endpoint ``index``; raises ValueError/TypeError/IndexError on a bad one."""
        server = self.servers[index]
        if set(body) - {"state", "faults", "config"} or len(body) != 1:
            raise ValueError('give one of {"state": "down"|"up"}, {"faults": {...}}, {"config": {...}}')
        if "state" in body:
            if body["state"] == "down":
                server.kill()
            elif body["state"] == "up":
                server.revive()
                for _ in range(200):  # listening again takes a moment (the port may linger)
                    if server.up:
                        break
                    await asyncio.sleep(0.01)
            else:
                raise ValueError(f'state must be "down" or "up", got {body["state"]!r}')
        elif "faults" in body:
            server.set_faults(dict(body["faults"]))
        else:
            server.update_config(dict(body["config"]))
        return {"index": index, "url": server.url, "up": server.up, "stats": server.stats()}

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path, method = request.path, request.method
        try:
            if path == "/health" and method == "GET":
                return _json(200, {"status": "ok", "simulator": True})
            if path == "/fleet" and method == "GET":
                return _json(200, self.view())
            if path == "/fleet/reset" and method == "POST":
                for server in self.servers:
                    server.reset_stats()
                return _json(200, self.view())
            if path.startswith("/fleet/") and method == "POST":
                body = json.loads(await request.read() or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                return _json(200, await self.apply(int(path[len("/fleet/"):]), body))
        except (ValueError, TypeError, IndexError) as exc:
            return _json(400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
        return _json(404, {"error": {"message": f"Unknown request URL: {method} {path}"}})

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self._web.shutdown(1.0)
        for server in self.servers:
            await server.close()

    def stats(self) -> dict[str, Any]:
        return self.view()


def _json(status: int, data: Any) -> web.Response:
    return web.Response(status=status, body=dumps(data).encode(), content_type="application/json")


async def serve_fleet(base: SimulatorConfig, limits: list[int],
                      hostile_on: Collection[int] | None = None) -> SimulatorFleet:
    """Endpoints with ``base``'s settings and each its concurrency limit, on free ports; the control
    server on ``base.port`` (0: a free one). Each endpoint gets its own seed (``base.seed`` + i).
    ``hostile_on``: the indices of the endpoints ``base.faults.hostile`` applies to (None: all);
    the others answer as usual (``POST /fleet/{i}`` with ``{"faults": {"hostile": ...}}`` changes
    that at runtime)."""
    if hostile_on is not None and not all(0 <= i < len(limits) for i in hostile_on):
        raise ValueError(f"hostile endpoints {sorted(hostile_on)}: the fleet has endpoints 0 to {len(limits) - 1}")
    servers = []
    for i, limit in enumerate(limits):
        seed = None if base.seed is None else base.seed + i
        faults = base.faults
        if hostile_on is not None and i not in hostile_on:
            faults = dataclasses.replace(faults, hostile=())
        servers.append(await serve(dataclasses.replace(base, port=0, concurrency=limit, seed=seed, faults=faults)))
    fleet = SimulatorFleet(servers, base.host)
    await fleet._listen(base.port)
    return fleet
