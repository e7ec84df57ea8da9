"""Your own PyFlink job with llmstream's inference stage between your operators (docs/library.md).

Support tickets come in on Kafka as llmstream requests with two fields of their own,
``{"id": ..., "prompt": ..., "customer": "acme", "status": "open"}``. The job drops closed
tickets, puts the customer's tier in front of the prompt, asks the model, and writes the answers
(and the dead letters) with the exactly-once Kafka sink. The filter and the map are plain
PyFlink; everything between `infer` and the sink is llmstream's stage, with its guarantees.

    .venv/bin/python jobs/examples/enrich_and_infer.py --config my-job.yaml      # a local mini cluster
    flink run -py jobs/examples/enrich_and_infer.py --config my-job.yaml         # on a Flink cluster

The config is an ordinary llmstream config (jobs/inference.yaml): `kafka.*` names the topics read
and written, `model.*` the model, `async.*`, `ordering`, `cache`, `budget` the stage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pyflink.common import Row

from jobs.library import (
    INPUT_ROW_TYPE,
    check,
    environment,
    infer,
    read_kafka,
    write_kafka,
)
from udfs.config import JobConfig, load_config
from udfs.errors import ConfigError

TIERS = {"acme": "gold", "globex": "silver"}
"""The customers' tiers; a real job would join a table or a broadcast stream here."""


def _ticket(row: Any) -> dict[str, Any] | None:
    """The request's JSON object, or None when the value is not one (the stage dead-letters it)."""
    try:
        body = json.loads(row.v) if row.v is not None else None
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def is_open(row: Any) -> bool:
    """Keeps everything but closed tickets: bad records and tombstones go on to the stage, which
    dead-letters or forwards them as the config says."""
    ticket = _ticket(row)
    return ticket is None or ticket.get("status") != "closed"


def with_tier(row: Any) -> Row:
    """The ticket with its customer's tier in front of the prompt. The row keeps its Kafka topic,
    partition and offset: they are its name in the stage's state and its `source` in the output."""
    ticket = _ticket(row)
    if ticket is None or not isinstance(ticket.get("prompt"), str):
        return row
    tier = TIERS.get(str(ticket.get("customer")), "standard")
    ticket["prompt"] = f"[{tier} customer] {ticket['prompt']}"
    return Row(row.k, json.dumps(ticket).encode(), row.topic, row.partition, row.offset, row.ts, row.headers)


def build(env: Any, config: JobConfig) -> None:
    """The job's graph: Kafka → open tickets → with their tier → the inference stage → Kafka."""
    tickets = read_kafka(env, config)
    enriched = (tickets.filter(is_open).name("open tickets").uid("open-tickets")
                .map(with_tier, output_type=INPUT_ROW_TYPE).name("with tier").uid("with-tier"))
    write_kafka(infer(enriched, config), config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="an llmstream job config (default: jobs/inference.yaml)")
    parser.add_argument("--state-dir", default=None,
                        help="checkpoints and savepoints (default: checkpointing.directory, else var/state/<name>)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        check(config)  # the broker takes this config; topics made if kafka.create_topics
    except ConfigError as err:
        print(f"enrich_and_infer: config error: {err}", file=sys.stderr)
        return 2
    env = environment(config, state_dir=args.state_dir)
    build(env, config)
    env.execute(config.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
