"""The HTTP transport alone: in-process CPU a call and calls/s for each client, against the simulator.

    python -m jobs.dev.bench.transport CLIENT --endpoint URL [--seconds S] [--concurrency N]
    llmstream bench --transport-probe [--transport-clients aiohttp,pycurl,...] [--transport-concurrency 64,256]

Each client posts the benchmark's chat request (`workload.chat_payload`, bytes made with orjson)
back to back with N calls in flight, reads the body and takes the answer's text out of it with
orjson: the same work for every client, so what differs is the transport. CPU is the probe
process's own (every thread: a Rust client's runtime threads and libcurl's count), per call; the
simulator is another process. The first second (connections opening) is not counted.

Clients: `aiohttp` (what the job uses today), `curl-cffi` (libcurl's multi interface driven from
the asyncio loop: `curl_cffi.requests.AsyncSession`), `pycurl` (libcurl's multi interface driven
by its own loop, no asyncio: the least Python a call can cost with libcurl), `pyreqwest` and
`rnet` (Rust's reqwest/hyper on a tokio runtime of their own, awaited from asyncio). A client
that is not installed is reported as such: these are measured, not dependencies of the job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from jobs.dev.bench.workload import chat_payload

CLIENTS = ("aiohttp", "curl-cffi", "pycurl", "pyreqwest", "rnet")
CONCURRENCIES = (64, 256)
WARM_UP_S = 1.0
HEADERS = {"Content-Type": "application/json"}


def _cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def _body(seq: int) -> bytes:
    return orjson.dumps(chat_payload(f"Which transport costs the least CPU a call? (request {seq})"))


def _answer(raw: bytes) -> str:
    text: str = orjson.loads(raw)["choices"][0]["message"]["content"]
    return text


class Tally:
    """Calls and CPU from the end of the warm-up to the end of the run."""

    def __init__(self, seconds: float) -> None:
        now = time.monotonic()
        self.warm_until = now + WARM_UP_S
        self.deadline = self.warm_until + seconds
        self.counted = 0
        self.errors = 0
        self.started: float | None = None
        self.cpu0 = 0.0

    def running(self) -> bool:
        now = time.monotonic()
        if self.started is None and now >= self.warm_until:
            self.started, self.cpu0 = now, _cpu_s()
        return now < self.deadline

    def done(self, ok: bool) -> None:
        if self.started is not None:
            self.counted += 1
            self.errors += 0 if ok else 1

    def figures(self, client: str, concurrency: int) -> dict[str, Any]:
        elapsed = time.monotonic() - (self.started or time.monotonic())
        cpu = _cpu_s() - self.cpu0
        return {"client": client, "concurrency": concurrency, "calls": self.counted, "errors": self.errors,
                "seconds": round(elapsed, 2), "rate": round(self.counted / max(elapsed, 1e-9), 1),
                "cpu_us_per_call": round(cpu / max(self.counted, 1) * 1e6, 1)}


async def _drive(call: Callable[[int], Awaitable[bool]], tally: Tally, concurrency: int) -> None:
    async def loop(worker: int) -> None:
        seq = worker
        while tally.running():
            ok = False
            try:
                ok = await call(seq)
            except Exception:  # noqa: BLE001 - counted as an error, as the floor's "not 200" row
                ok = False
            tally.done(ok)
            seq += concurrency

    await asyncio.gather(*(loop(i) for i in range(concurrency)))


async def _aiohttp(url: str, tally: Tally, concurrency: int) -> None:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def call(seq: int) -> bool:
            async with session.post(url, data=_body(seq), headers=HEADERS) as response:
                raw = await response.read()
                if response.status != 200:
                    return False
            return bool(_answer(raw))

        await _drive(call, tally, concurrency)


async def _curl_cffi(url: str, tally: Tally, concurrency: int) -> None:
    from curl_cffi.requests import AsyncSession

    async with AsyncSession(max_clients=concurrency) as session:

        async def call(seq: int) -> bool:
            response = await session.post(url, data=_body(seq), headers=HEADERS)
            return response.status_code == 200 and bool(_answer(response.content))

        await _drive(call, tally, concurrency)


async def _pyreqwest(url: str, tally: Tally, concurrency: int) -> None:
    from pyreqwest.client import ClientBuilder

    async with ClientBuilder().max_connections(concurrency).build() as client:

        async def call(seq: int) -> bool:
            request = client.post(url).header("Content-Type", "application/json").body_bytes(_body(seq)).build()
            response = await request.send()
            raw = await response.bytes()
            return response.status == 200 and bool(_answer(bytes(raw)))

        await _drive(call, tally, concurrency)


async def _rnet(url: str, tally: Tally, concurrency: int) -> None:
    import rnet

    client = rnet.Client()

    async def call(seq: int) -> bool:
        response = await client.post(url, body=_body(seq), headers=HEADERS)
        raw = await response.bytes()
        status = response.status  # an int in rnet 2.4; a StatusCode in some releases
        return (status if isinstance(status, int) else status.as_int()) == 200 and bool(_answer(bytes(raw)))

    await _drive(call, tally, concurrency)


def _pycurl(url: str, tally: Tally, concurrency: int) -> None:
    """libcurl's multi interface with `concurrency` easy handles, each sent again as soon as it
    ends, from a plain loop (`perform` + `select`): no asyncio at all."""
    import io

    import pycurl

    multi = pycurl.CurlMulti()
    handles = []
    for worker in range(concurrency):
        handle = pycurl.Curl()
        handle.setopt(pycurl.URL, url)
        handle.setopt(pycurl.HTTPHEADER, ["Content-Type: application/json", "Expect:"])
        handle.setopt(pycurl.NOSIGNAL, 1)
        handle.seq = worker  # type: ignore[attr-defined]
        handles.append(handle)

    def start(handle: Any) -> None:
        handle.buffer = io.BytesIO()
        handle.setopt(pycurl.POSTFIELDS, _body(handle.seq))
        handle.setopt(pycurl.WRITEDATA, handle.buffer)
        multi.add_handle(handle)

    for handle in handles:
        start(handle)
    active = concurrency
    while active:
        while multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
            pass
        _, ok_list, err_list = multi.info_read()
        running = tally.running()
        for handle in ok_list:
            multi.remove_handle(handle)
            ok = handle.getinfo(pycurl.RESPONSE_CODE) == 200 and bool(_answer(handle.buffer.getvalue()))
            tally.done(ok)
            if running:
                handle.seq += concurrency
                start(handle)
            else:
                active -= 1
        for handle, _code, _message in err_list:
            multi.remove_handle(handle)
            tally.done(False)
            if running:
                start(handle)
            else:
                active -= 1
        if active:
            multi.select(0.05)
    for handle in handles:
        handle.close()
    multi.close()


ASYNC_CLIENTS: dict[str, Callable[[str, Tally, int], Coroutine[Any, Any, None]]] = {
    "aiohttp": _aiohttp, "curl-cffi": _curl_cffi, "pyreqwest": _pyreqwest, "rnet": _rnet}
MODULES = {"aiohttp": "aiohttp", "curl-cffi": "curl_cffi", "pycurl": "pycurl", "pyreqwest": "pyreqwest",
           "rnet": "rnet"}


def installed(client: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(MODULES[client]) is not None


def measure(client: str, endpoint: str, seconds: float, concurrency: int) -> dict[str, Any]:
    """One client for `seconds` (after a warm-up second) at `concurrency` calls in flight."""
    if not installed(client):
        return {"client": client, "concurrency": concurrency, "error": f"{MODULES[client]} is not installed"}
    url = endpoint.rstrip("/") + "/chat/completions"
    tally = Tally(seconds)
    if client == "pycurl":
        _pycurl(url, tally, concurrency)
    else:
        asyncio.run(ASYNC_CLIENTS[client](url, tally, concurrency))
    return tally.figures(client, concurrency)


def version(client: str) -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(MODULES[client])
    except PackageNotFoundError:
        return None


def run_probe(out_dir: Path, clients: Sequence[str], concurrencies: Sequence[int], seconds: float, rounds: int,
              say: Callable[[str], None] = print) -> int:
    """`llmstream bench --transport-probe`: each client at each concurrency, `rounds` times interleaved
    (client after client, so a change of load hits them all), each in a process of its own, against
    one simulator with scenario (d)'s settings (an instant model, 1,024 slots); writes
    `transport.md` and `transport.json` to `out_dir`. 0 when every client that is installed answered."""
    from jobs.dev.bench.harness import REPO_ROOT, child_environment
    from jobs.dev.bench.scenarios import SCENARIOS
    from jobs.dev.simulator import spawn as spawn_simulator

    scenario = SCENARIOS["d"]
    simulator = spawn_simulator(scenario.simulator_args())
    found: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    try:
        say(f"bench: transport probe against {simulator.url} ({scenario.summary()}), load {load_before:.2f}")
        for round_ in range(1, rounds + 1):
            for concurrency in concurrencies:
                for client in clients:
                    command = [sys.executable, "-m", "jobs.dev.bench.transport", client, "--endpoint", simulator.url,
                               "--seconds", f"{seconds:g}", "--concurrency", str(concurrency)]
                    try:
                        done = subprocess.run(command, cwd=REPO_ROOT, env=child_environment(), capture_output=True,
                                              text=True, timeout=seconds + 60, check=True)
                        row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
                    except (subprocess.SubprocessError, ValueError, IndexError) as err:
                        row = {"client": client, "concurrency": concurrency, "error": str(err)[:300]}
                    row |= {"round": round_, "load": round(os.getloadavg()[0], 2)}
                    found.append(row)
                    say(f"[transport] round {round_}: {json.dumps(row)}")
    finally:
        simulator.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "seconds": seconds, "rounds": rounds,
            "load_before": load_before, "cpus": os.cpu_count(), "simulator": scenario.simulator_args()}
    (out_dir / "transport.json").write_text(json.dumps({**meta, "runs": found}, indent=2) + "\n")
    text = transport_markdown(found, meta)
    (out_dir / "transport.md").write_text(text)
    say(text)
    return 0 if all("error" not in r or "not installed" in r["error"] for r in found) else 1


def transport_markdown(runs: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """One row a client and concurrency: CPU µs a call and calls/s, each round's figure, and the
    CPU a call over aiohttp's at the same concurrency in the same round (the ratio that survives
    a loaded machine)."""
    base = {(r["round"], r["concurrency"]): r["cpu_us_per_call"] for r in runs
            if r.get("client") == "aiohttp" and "cpu_us_per_call" in r}
    lines = [f"# Transport probe, {meta['generated']}", "",
             (f"{meta['rounds']} interleaved rounds of {meta['seconds']:g} s a client (after a warm-up second), "
              f"{meta['cpus']} CPUs, load average {meta['load_before']:.2f} before; the simulator at "
              f"`{' '.join(meta['simulator'])}`."), "",
             "| client | version | concurrency | CPU µs a call | calls/s | CPU ÷ aiohttp's | errors |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["concurrency"], r["client"]) for r in runs}, key=lambda k: (k[0], CLIENTS.index(k[1])))
    for concurrency, client in keys:
        rows = [r for r in runs if r["client"] == client and r["concurrency"] == concurrency]
        ok = [r for r in rows if "cpu_us_per_call" in r]
        if not ok:
            lines.append(f"| {client} | – | {concurrency} | – | – | – | {rows[0].get('error', '')} |")
            continue
        ratios = [r["cpu_us_per_call"] / base[(r["round"], concurrency)] for r in ok
                  if base.get((r["round"], concurrency))]
        lines.append(f"| {client} | {ok[0].get('version')} | {concurrency} | "
                     + " / ".join(f"{r['cpu_us_per_call']:g}" for r in ok) + " | "
                     + " / ".join(f"{r['rate']:,.0f}" for r in ok) + " | "
                     + " / ".join(f"{x:.2f}" for x in ratios) + " | "
                     + str(sum(r.get("errors", 0) for r in ok)) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.transport", description=__doc__.splitlines()[0])
    parser.add_argument("client", choices=CLIENTS)
    parser.add_argument("--endpoint", required=True, help="the model server's base URL, ending in /v1")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    found = measure(args.client, args.endpoint, args.seconds, args.concurrency)
    found["version"] = version(args.client)
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
