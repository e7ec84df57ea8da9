"""`llmstream kafka start|stop|status [--secure]`: the command line of the local brokers.

The plain broker is `jobs/dev/local_kafka.py`, the secured one (TLS, SASL/SCRAM, mutual TLS, ACLs)
`jobs/dev/secure_kafka.py`, which builds on it; this module is the one that knows both. ``--brokers N``
(N > 1) starts, stops or inspects a KRaft cluster of N such nodes instead (`LocalKafkaCluster`,
`SecureKafkaCluster`), in its own data dir and on its own ports.
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
    CLUSTER_HEAP,
    DEFAULT_CLUSTER_PORT,
    DEFAULT_HEAP,
    DEFAULT_PORT,
    PORT_STRIDE,
    BrokerConfig,
    BrokerError,
    ClusterConfig,
    LocalBroker,
    LocalKafkaCluster,
    default_cluster_dir,
    default_data_dir,
)

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``start|stop|status`` command and broker options (dests are ``kafka_*`` to avoid clashes)."""
    parser.add_argument("kafka_command", metavar="{start,stop,status}", choices=["start", "stop", "status"])
    parser.add_argument("--secure", dest="kafka_secure", action="store_true",
                        help="TLS, SASL/SCRAM, mutual TLS and ACLs (jobs/dev/secure_kafka.py); start prints "
                             "the client properties, passwords as ${file:...} references")
    parser.add_argument("--brokers", dest="kafka_brokers", type=int, default=1,
                        help="how many nodes (default 1); N > 1: a KRaft cluster of N nodes, each broker and "
                             "controller, replication 3 (N < 3: N) and min.insync.replicas one less for new and "
                             f"internal topics; node i's ports start at port + {PORT_STRIDE}*(i-1) (default port "
                             f"{DEFAULT_CLUSTER_PORT}, with --secure {secure_kafka.DEFAULT_CLUSTER_PORT}), its "
                             "state in <data-dir>/node-<i> (default data dir <repo>/var/kafka-cluster[-secure]); "
                             "stop and status need the same --brokers")
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
    parser.add_argument("--heap", dest="kafka_heap", default=None,
                        help=f"JVM heap (default {DEFAULT_HEAP}; per node of a cluster {CLUSTER_HEAP})")
    parser.add_argument("--timeout", dest="kafka_timeout", type=float, default=60.0,
                        help="seconds to wait for start/stop (default 60)")
    parser.add_argument("--json", dest="kafka_json", action="store_true", help="print status as JSON")


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``add_arguments`` namespace; returns the exit code (status: 0 running, 1 not)."""
    if args.kafka_brokers != 1:
        return _run_cluster(args)
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
            heap=args.kafka_heap or DEFAULT_HEAP,
        ))
    if args.kafka_ssl_port or args.kafka_wrong_host_port:
        raise ValueError("--ssl-port and --wrong-host-port need --secure")
    return LocalBroker(BrokerConfig(
        port=args.kafka_port or DEFAULT_PORT,
        controller_port=args.kafka_controller_port or 0,
        data_dir=args.kafka_data_dir if args.kafka_data_dir is not None else default_data_dir(),
        heap=args.kafka_heap or DEFAULT_HEAP,
    ))


def _cluster(args: argparse.Namespace) -> LocalKafkaCluster:
    if args.kafka_brokers < 2:
        raise ValueError(f"--brokers must be 1 or more than 1, got {args.kafka_brokers}")
    if args.kafka_controller_port or args.kafka_ssl_port or args.kafka_wrong_host_port:
        raise ValueError("with --brokers, every node's ports follow from --port (node i from port + "
                         f"{PORT_STRIDE}*(i-1)); --controller-port, --ssl-port and --wrong-host-port are for one broker")
    secure = args.kafka_secure
    config = ClusterConfig(
        brokers=args.kafka_brokers,
        port=args.kafka_port or (secure_kafka.DEFAULT_CLUSTER_PORT if secure else DEFAULT_CLUSTER_PORT),
        data_dir=args.kafka_data_dir if args.kafka_data_dir is not None
        else secure_kafka.default_cluster_dir() if secure else default_cluster_dir(),
        heap=args.kafka_heap or CLUSTER_HEAP,
    )
    return secure_kafka.SecureKafkaCluster(config) if secure else LocalKafkaCluster(config)


def _run_cluster(args: argparse.Namespace) -> int:
    """`run` for ``--brokers N``: every node started, stopped or reported together."""
    try:
        cluster = _cluster(args)
    except ValueError as exc:
        print(f"kafka: error: {exc}", file=sys.stderr)
        return 2
    n = len(cluster.nodes)
    try:
        if args.kafka_command == "start":
            started = time.monotonic()
            already = all(pid is not None for pid in cluster.pids())
            cluster.start(timeout=max(args.kafka_timeout, 120.0))
            state = "already running" if already else f"started in {time.monotonic() - started:.1f}s"
            print(f"kafka: {n} brokers {state}: pids {','.join(map(str, cluster.pids()))} bootstrap {cluster.bootstrap_servers} "
                  f"logs {cluster.data_dir}/node-*/logs/server.log")
            if isinstance(cluster, secure_kafka.SecureKafkaCluster):
                print(cluster.client_snippet(), end="")
            return 0
        if args.kafka_command == "stop":
            running = [pid for pid in cluster.pids() if pid is not None]
            cluster.stop(timeout=args.kafka_timeout)
            print(f"kafka: stopped {len(running)} of {n} brokers (pids {','.join(map(str, running))})" if running
                  else "kafka: not running")
            return 0
        status = cluster.status()
        if args.kafka_json:
            print(json.dumps(status, indent=2))
        else:
            for node_id, node in enumerate(status["nodes"], start=1):
                state = f"running pid {node['pid']} ready {node['ready']}" if node["running"] else "not running"
                print(f"kafka: node {node_id}: {state} bootstrap {node['bootstrap']} log {node['log_file']}")
            print(f"kafka: bootstrap {status['bootstrap']}")
        return 0 if status["running"] else 1
    except (BrokerError, KafkaError, OSError) as exc:
        print(f"kafka: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmstream kafka", description="Local KRaft Kafka: one broker, or --brokers N.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
