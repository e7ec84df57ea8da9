"""Job configs and requests for the inference client alone, without a broker or a cluster.

The Kafka section names a port nobody listens on (the client never dials it); retries back off
for milliseconds, so a test of three attempts takes milliseconds too.
"""

from __future__ import annotations

from typing import Any

from udfs.config import JobConfig, config_from_dict
from udfs.records import Request, SourceRef

MINIMAL_KAFKA = {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                 "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"}
"""The Kafka section of a config that never dials its broker."""


def minimal_config(**sections: Any) -> JobConfig:
    """The smallest valid config (the model at a port nobody listens on); each keyword replaces a section."""
    return config_from_dict({"kafka": MINIMAL_KAFKA, "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"},
                             **sections})


def job_config(endpoint: str, *, model: dict[str, Any] | None = None, async_: dict[str, Any] | None = None,
               retry: dict[str, Any] | None = None, rate_limit: dict[str, Any] | None = None) -> JobConfig:
    """A config whose model is at ``endpoint``; each keyword updates its section."""
    return config_from_dict({
        "kafka": MINIMAL_KAFKA,
        "model": {"endpoint": endpoint, "model": "sim", "max_tokens": 16, **(model or {})},
        "async": {"capacity": 16, "request_timeout_s": 5.0, "record_deadline_s": 20.0, **(async_ or {})},
        "retry": {"max_attempts": 4, "initial_backoff_s": 0.001, "max_backoff_s": 0.005, **(retry or {})},
        "rate_limit": {**(rate_limit or {})},
    })


def request(prompt: str = "What is the capital of France?", **changes: Any) -> Request:
    """One request as the decode stage makes it from a record (id ``r-1`` at ``in``/0/42)."""
    fields = {"id": "r-1", "prompt": prompt}
    return Request(**{"id": "r-1", "key": b"k", "source": SourceRef("in", 0, 42), "prompt": prompt,
                      "fields": fields, **changes})
