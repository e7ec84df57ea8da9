"""``llmstream model-server``: the simulator's flags, and the command that serves until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from jobs.dev.simulator.batch_config import (
    add_batch_arguments,
    batch_settings_from_args,
)
from jobs.dev.simulator.config import (
    DEFAULT_MODEL,
    KINDS,
    FaultSettings,
    SimulatorConfig,
)
from jobs.dev.simulator.fleet import (
    FLEET_PREFIX,
    SimulatorFleet,
    parse_fleet,
    serve_fleet,
)
from jobs.dev.simulator.server import SimulatorServer, dumps, log, serve

LISTENING_PREFIX = "llmstream model-server (simulator) listening on "
"""The line ``spawn`` waits for on the child's stdout, followed by the ``/v1`` URL."""
FINAL_STATS_PREFIX = "llmstream model-server (simulator) final stats: "
"""The last stdout line on a clean stop, followed by the stats as JSON."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``llmstream model-server`` flags."""
    d = SimulatorConfig()
    f = d.faults
    net = parser.add_argument_group("server")
    net.add_argument("--host", default=d.host, help="interface to bind (default %(default)s)")
    net.add_argument("--port", type=int, default=d.port, help="port, 0 = pick a free one (default %(default)s)")
    net.add_argument("--model", dest="models", action="append", metavar="NAME",
                     help=f"model name listed by /v1/models, repeatable (default {DEFAULT_MODEL}); "
                          "any name in a request is accepted and echoed")
    net.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                     "(prefer --api-key-env: the command line is visible to other users)")
    net.add_argument("--api-key-env", default=None, metavar="VAR", help="read the API key from this env var")
    net.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate (chain)")
    net.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    net.add_argument("--tls-client-ca", default=None, metavar="PEM",
                     help="require a client certificate signed by this CA (mutual TLS); requests without one "
                          "are refused with 400, as nginx's ssl_verify_client does")
    net.add_argument("--fleet", default=None, metavar="LIMITS",
                     help="serve several endpoints, one per concurrency limit (e.g. 16,8,4), each on a free "
                          "port; --port is then the control port that kills, revives and faults each "
                          "(jobs/dev/simulator/fleet.py)")
    net.add_argument("--log-level", default="INFO", help="logging level on stderr (default %(default)s)")
    net.add_argument("--stats-interval-s", type=float, default=d.stats_log_interval_s,
                     help="log a stats line this often, 0 = never (default %(default)s)")

    perf = parser.add_argument_group("latency and limits")
    perf.add_argument("--latency", default=d.latency,
                      help="0 | instant | fixed:MS | lognormal:MEDIAN_MS:P99_MS (default %(default)s)")
    perf.add_argument("--per-token-ms", type=float, default=d.per_token_ms,
                      help="extra latency per completion token (default %(default)s)")
    perf.add_argument("--per-input-ms", type=float, default=d.per_input_ms,
                      help="extra latency per input of an embeddings request (default %(default)s)")
    perf.add_argument("--invalid-json-rate", type=float, default=d.invalid_json_rate,
                      help="share of answers to requests with a response_format schema made invalid on "
                           "purpose (prose around the JSON, a missing or wrong property) (default %(default)s)")
    perf.add_argument("--max-input-tokens", type=int, default=d.max_input_tokens,
                      help="embeddings inputs longer than this are refused with 400, 0 = no limit "
                           "(default %(default)s)")
    perf.add_argument("--seed", type=int, default=None, help="seed for latency and fault sampling")
    perf.add_argument("--concurrency", type=int, default=d.concurrency,
                      help="requests processed at once, 0 = unlimited (default %(default)s)")
    perf.add_argument("--reject-over-limit", action="store_true",
                      help="over the concurrency limit answer 429 at once instead of queueing")
    perf.add_argument("--retry-after-s", type=int, default=d.retry_after_s,
                      help="Retry-After of concurrency-limit 429s (default %(default)s)")
    perf.add_argument("--rpm", type=int, default=d.rpm, help="requests per minute, 0 = unlimited")
    perf.add_argument("--tpm", type=int, default=d.tpm,
                      help="tokens per minute (prompt + max_tokens), 0 = unlimited")
    perf.add_argument("--embedding-dim", type=int, default=d.embedding_dim,
                      help="embedding length (default %(default)s)")
    perf.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                      help="completion tokens when a request gives no max_tokens (default %(default)s)")
    perf.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens,
                      help="cap on completion tokens (default %(default)s)")

    faults = parser.add_argument_group("fault injection (initial values; change at runtime with POST /admin/faults)")
    faults.add_argument("--error-rate", type=float, default=f.error_rate, help="fraction answered --error-status")
    faults.add_argument("--error-status", type=int, default=f.error_status, help="default %(default)s")
    faults.add_argument("--rate-limit-rate", type=float, default=f.rate_limit_rate, help="fraction answered 429")
    faults.add_argument("--fault-retry-after-s", type=int, default=f.retry_after_s,
                        help="Retry-After of injected 429s (default %(default)s)")
    faults.add_argument("--hang-rate", type=float, default=f.hang_rate, help="fraction never answered")
    faults.add_argument("--hang-max-s", type=float, default=d.hang_max_s,
                        help="a hung connection is dropped after this long (default %(default)s)")
    faults.add_argument("--reset-rate", type=float, default=f.reset_rate,
                        help="fraction whose connection is reset without an answer")
    faults.add_argument("--fault-until-s", type=float, default=None,
                        help="the fault rates (and --hostile) revert to zero after this many seconds")

    hostile = parser.add_argument_group(
        "hostile answers: the simulator as a broken or malicious server (jobs/dev/simulator/hostile.py; what "
        "llmstream makes of each: docs/operations.md, 'Bad input from every side')")
    hostile.add_argument("--hostile", default=None, metavar="KIND[,KIND...]",
                         help="answer with these kinds in turn instead of the usual answer; 'all' is every kind "
                              "but tls-cert-change. Kinds: " + ", ".join(KINDS))
    hostile.add_argument("--hostile-rate", type=float, default=f.hostile_rate,
                         help="share of the requests (tls-cert-change: of the handshakes) answered with a hostile "
                              "kind (default %(default)s)")
    hostile.add_argument("--hostile-size-bytes", type=int, default=d.hostile_size_bytes,
                         help="the Content-Length of huge-body (default %(default)s)")
    hostile.add_argument("--hostile-tls-cert", default=None, metavar="PEM",
                         help="the other certificate tls-cert-change presents (with --tls-cert)")
    hostile.add_argument("--hostile-tls-key", default=None, metavar="PEM", help="the private key of --hostile-tls-cert")
    hostile.add_argument("--hostile-endpoints", default=None, metavar="I[,I...]",
                         help="with --fleet: the endpoints (0-based) --hostile applies to (default: all)")
    add_batch_arguments(parser)


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    """Build a config from parsed ``add_arguments`` flags; raises ValueError on bad values."""
    api_key = args.api_key
    if api_key is None and args.api_key_env:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            raise ValueError(f"--api-key-env {args.api_key_env}: variable is not set or empty")
    return SimulatorConfig(
        host=args.host,
        port=args.port,
        models=tuple(args.models or (DEFAULT_MODEL,)),
        latency=args.latency,
        per_token_ms=args.per_token_ms,
        per_input_ms=args.per_input_ms,
        invalid_json_rate=args.invalid_json_rate,
        max_input_tokens=args.max_input_tokens,
        seed=args.seed,
        concurrency=args.concurrency,
        reject_over_limit=args.reject_over_limit,
        retry_after_s=args.retry_after_s,
        rpm=args.rpm,
        tpm=args.tpm,
        embedding_dim=args.embedding_dim,
        default_max_tokens=args.default_max_tokens,
        max_output_tokens=args.max_output_tokens,
        hang_max_s=args.hang_max_s,
        api_key=api_key,
        stats_log_interval_s=args.stats_interval_s,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        hostile_size_bytes=args.hostile_size_bytes,
        hostile_tls_cert=args.hostile_tls_cert,
        hostile_tls_key=args.hostile_tls_key,
        faults=FaultSettings(
            error_rate=args.error_rate,
            error_status=args.error_status,
            rate_limit_rate=args.rate_limit_rate,
            retry_after_s=args.fault_retry_after_s,
            hang_rate=args.hang_rate,
            reset_rate=args.reset_rate,
            until_s=args.fault_until_s,
            hostile=args.hostile or (),
            hostile_rate=args.hostile_rate,
        ),
        batch=batch_settings_from_args(args),
    )


def parse_endpoints(spec: str | None) -> list[int] | None:
    """``--hostile-endpoints 0,2`` -> [0, 2]; none: every endpoint."""
    if spec is None:
        return None
    try:
        return [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--hostile-endpoints {spec!r}: give endpoint indices separated by commas, e.g. 0,2") from None


async def _serve_until_signal(config: SimulatorConfig, fleet_limits: list[int] | None = None,
                              hostile_on: list[int] | None = None) -> int:
    server: SimulatorServer | SimulatorFleet
    try:
        if fleet_limits is not None:
            server = await serve_fleet(config, fleet_limits, hostile_on)
        else:
            server = await serve(config)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", config.host, config.port, exc)
        return 1
    if isinstance(server, SimulatorFleet):
        print(FLEET_PREFIX + dumps({"control": server.control_url, "endpoints": server.urls}), flush=True)
        print(LISTENING_PREFIX + server.control_url + "/v1", flush=True)
    else:
        print(LISTENING_PREFIX + server.url, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    stats = server.stats()
    await server.close()
    log.info("simulator stopped")
    print(FINAL_STATS_PREFIX + dumps(stats), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the simulator from parsed ``add_arguments`` flags until SIGINT/SIGTERM."""
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        config.ssl_context()
        config.hostile_ssl_context()
        fleet = parse_fleet(args.fleet) if getattr(args, "fleet", None) else None
        hostile_on = parse_endpoints(getattr(args, "hostile_endpoints", None))
        if hostile_on is not None and (fleet is None or not all(0 <= i < len(fleet) for i in hostile_on)):
            raise ValueError(f"--hostile-endpoints {args.hostile_endpoints}: needs --fleet, and indices "
                             f"from 0 to {len(fleet or [0]) - 1}")
    except (ValueError, TypeError) as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    return asyncio.run(_serve_until_signal(config, fleet, hostile_on))


DESCRIPTION = (
    "OpenAI-compatible model-server SIMULATOR (no real model: synthetic, deterministic answers) "
    "with configurable latency, concurrency limit, rate limits and fault injection, for llmstream "
    "benchmarks and tests."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmstream model-server", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m jobs.dev.simulator``: the simulator alone (``llmstream model-server`` also offers
    the REAL backends of `jobs.dev.real_models`)."""
    return run(build_parser().parse_args(argv))
