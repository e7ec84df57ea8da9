"""`llmstream kafka start|stop|status [--secure]`: the command line of the local brokers.

The plain broker is `jobs/dev/local_kafka.py`, the secured one (TLS, SASL/SCRAM, mutual TLS, ACLs)
`jobs/dev/secure_kafka.py`, which builds on it; this module is the one that knows both.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kafka.errors import KafkaError  # type: ignore[import-untyped]

from jobs.dev import secure_kafka
from jobs.dev.local_kafka import (
    DEFAULT_HEAP,
    DEFAULT_PORT,
    BrokerConfig,
    BrokerError,
    LocalBroker,
    default_data_dir,
)

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``start|stop|status`` command and broker options (dests are ``kafka_*`` to avoid clashes)."""
    parser.add_argument("kafka_command", metavar="{start,stop,status}", choices=["start", "stop", "status"])
    parser.add_argument("--secure", dest="kafka_secure", action="store_true",
                        help="TLS, SASL/SCRAM, mutual TLS and ACLs (jobs/dev/secure_kafka.py); start prints "
                             "the client properties, passwords as ${file:...} references")
    parser.add_argument("--port", dest="kafka_port", type=int, default=None,
                        help=f"PLAINTEXT listener port (default {DEFAULT_PORT}); with --secure the SASL_SSL one "
                             "(default 9192)")
    parser.add_argument("--controller-port", dest="kafka_controller_port", type=int, default=None,
                        help="KRaft controller port (default: port+1; with --secure port+2)")
    parser.add_argument("--ssl-port", dest="kafka_ssl_port", type=int, default=None,
                        help="with --secure: the mutual-TLS listener (default port+1)")
    parser.add_argument("--wrong-host-port", dest="kafka_wrong_host_port", type=int, default=None,
                        help="with --secure: a TLS listener whose certificate names another host (default port+3)")
    parser.add_argument("--data-dir", dest="kafka_data_dir", type=Path, default=None,
                        help="broker state, config and logs (default: <repo>/var/kafka, with --secure "
                             "<repo>/var/kafka-secure)")
    parser.add_argument("--heap", dest="kafka_heap", default=DEFAULT_HEAP, help=f"JVM heap (default {DEFAULT_HEAP})")
    parser.add_argument("--timeout", dest="kafka_timeout", type=float, default=60.0,
                        help="seconds to wait for start/stop (default 60)")
    parser.add_argument("--json", dest="kafka_json", action="store_true", help="print status as JSON")


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``add_arguments`` namespace; returns the exit code (status: 0 running, 1 not)."""
    try:
        broker = _broker(args)
    except ValueError as exc:
        print(f"kafka: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.kafka_command == "start":
            started = time.monotonic()
            already = broker.pid() is not None
            broker.start(timeout=args.kafka_timeout)
            state = "already running" if already else f"started in {time.monotonic() - started:.1f}s"
            print(f"kafka: {state}: pid {broker.pid()} bootstrap {broker.bootstrap_servers} log {broker.log_file}")
            if isinstance(broker, secure_kafka.SecureBroker):
                print(broker.client_snippet(), end="")
            return 0
        if args.kafka_command == "stop":
            pid = broker.pid()
            broker.stop(timeout=args.kafka_timeout)
            print(f"kafka: stopped pid {pid}" if pid else "kafka: not running")
            return 0
        status = broker.status()
        if args.kafka_json:
            print(json.dumps(status, indent=2))
        elif status["running"]:
            print(f"kafka: running pid {status['pid']} ready {status['ready']} "
                  f"bootstrap {status['bootstrap']} log {status['log_file']}")
        else:
            print(f"kafka: not running (data dir {status['data_dir']})")
        return 0 if status["running"] else 1
    except (BrokerError, KafkaError, OSError) as exc:
        print(f"kafka: error: {exc}", file=sys.stderr)
        return 1


def _broker(args: argparse.Namespace) -> LocalBroker:
    if args.kafka_secure:
        return secure_kafka.SecureBroker(secure_kafka.SecureBrokerConfig(
            port=args.kafka_port or secure_kafka.DEFAULT_PORT,
            ssl_port=args.kafka_ssl_port or 0,
            controller_port=args.kafka_controller_port or 0,
            wrong_host_port=args.kafka_wrong_host_port or 0,
            data_dir=args.kafka_data_dir if args.kafka_data_dir is not None else secure_kafka.default_data_dir(),
            heap=args.kafka_heap,
        ))
    if args.kafka_ssl_port or args.kafka_wrong_host_port:
        raise ValueError("--ssl-port and --wrong-host-port need --secure")
    return LocalBroker(BrokerConfig(
        port=args.kafka_port or DEFAULT_PORT,
        controller_port=args.kafka_controller_port or 0,
        data_dir=args.kafka_data_dir if args.kafka_data_dir is not None else default_data_dir(),
        heap=args.kafka_heap,
    ))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmstream kafka", description="Local single-node KRaft Kafka broker.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
