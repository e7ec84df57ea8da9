"""Rules across sections, checked once a whole config is built: the numbers of each rule filled
in, and every key involved named, so a user sees why two settings cannot go together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from udfs.config.loader import require
from udfs.errors import ConfigError

if TYPE_CHECKING:
    from udfs.config.sections import JobConfig

# The Kafka producer's default `max.request.size`, and room for a record's headers and framing.
PRODUCER_MAX_REQUEST_BYTES = 1_048_576
RECORD_OVERHEAD_BYTES = 1024


def _transactions(config: JobConfig) -> None:
    """A sink transaction must be committed before `kafka.transaction_timeout_ms` runs out, or
    the broker aborts it and a completed checkpoint's output is lost on restore."""
    checkpoints = config.checkpointing
    lifetime = checkpoints.transaction_lifetime_ms()
    require(
        config.kafka.transaction_timeout_ms >= lifetime, "kafka.transaction_timeout_ms",
        f"{config.kafka.transaction_timeout_ms} ms is shorter than a transaction can stay open: "
        f"(checkpointing.tolerable_failed_checkpoints + 1) x (checkpointing.interval_ms + "
        f"checkpointing.timeout_ms) + checkpointing.max_restart_ms = "
        f"({checkpoints.tolerable_failed_checkpoints} + 1) x ({checkpoints.interval_ms} + {checkpoints.timeout_ms}) "
        f"+ {checkpoints.max_restart_ms} = {lifetime} ms; raise it (up to the broker's "
        "transaction.max.timeout.ms) or lower those")


def _formats(config: JobConfig) -> None:
    """Avro needs a registry; the typed-input settings mean nothing for JSON input; a wait for the
    registry ends before a checkpoint it holds times out."""
    for key in ("input", "output"):
        require(getattr(config, key).format != "avro" or config.schema_registry is not None, f"{key}.format",
                 "avro needs schema_registry.url (a Confluent-compatible Schema Registry)")
    require(config.input.id_field is None or config.input.format == "avro" or config.model.preprocess is not None,
             "input.id_field", "only for input.format: avro or with model.preprocess "
             "(a record-contract JSON record's id is its 'id' field)")
    output = config.output
    require(output.postprocess is None or not output.carry_fields, "output.carry_fields",
            "not with output.postprocess: the function decides the output record's fields")
    require(output.schema is None or output.postprocess is not None, "output.schema",
            "only with output.postprocess (without it the Avro result schema is derived from the config)")
    require(output.postprocess is None or output.format != "avro" or output.schema is not None, "output.schema",
            "output.postprocess with output.format: avro needs the Avro schema of what the function returns")
    require(not config.output.carry_fields or config.input.format == "avro", "output.carry_fields",
             "needs input.format: avro (the fields are copied from the typed input record)")
    require(not config.output.carry_fields or config.output.format == "avro", "output.carry_fields",
             "needs output.format: avro (the JSON result's fields are fixed by the record contract)")
    registry = config.schema_registry
    require(registry is None or registry.unavailable_timeout_s * 1000 < config.checkpointing.timeout_ms,
             "schema_registry.unavailable_timeout_s",
             f"{registry.unavailable_timeout_s if registry else 0:g} s is not shorter than checkpointing.timeout_ms "
             f"({config.checkpointing.timeout_ms} ms): a record waiting for the registry holds the next checkpoint, "
             "which would time out and restart the job")


def _vectorized_lane(config: JobConfig) -> None:
    """What the vectorized lane does not do (yet), refused at load rather than half done
    (`lane: auto` never refuses: it keeps the keyed lane for these)."""
    if config.written_lane()[0] != "vectorized":
        return
    refused = config.keyed_only()
    if refused:
        key, why = next(iter(refused.items()))
        raise ConfigError(key, why)


def validate_job(config: JobConfig) -> None:
    """Rules across sections: transactions outlive checkpoints, batches fit the capacity, a budget
    can be priced and paused, a result fits the producer's request."""
    _transactions(config)
    require(config.model.batch.max_size <= config.async_.capacity, "model.batch.max_size",
             f"{config.model.batch.max_size} is over async.capacity ({config.async_.capacity}), which counts records: "
             "a batch could never fill")
    require(config.budget.max_cost_per_hour is None or config.model.prices is not None, "budget.max_cost_per_hour",
             "needs model.prices to price the calls")
    require(not config.budget.enabled or config.python.unaligned_checkpoints, "python.unaligned_checkpoints",
             "a spend budget (budget.*) needs unaligned checkpoints: while the budget is paused the admission gate "
             "stops the stage's input, and only an unaligned checkpoint barrier gets past a task that is not "
             "reading its input")
    require(str(config.flink.get("python.execution-mode", "process")).strip().lower() != "thread",
             "flink.python.execution-mode",
             "thread is not supported: the stage's calls run on a Python thread of its own, and in thread mode "
             "(PEMJA) every record and timer waits for that thread to let go of the GIL (measured: fewer than "
             "45 records/s; PEMJA also crashed the JVM once); use process, the default")
    _formats(config)
    _vectorized_lane(config)
    _batch_lane(config)
    size = config.kafka.properties.get("max.request.size", str(PRODUCER_MAX_REQUEST_BYTES))
    try:
        request_limit = int(size)
    except ValueError:
        raise ConfigError("kafka.properties.max.request.size", f"expected a number of bytes, got {size!r}") from None
    require(config.limits.max_result_bytes + RECORD_OVERHEAD_BYTES <= request_limit, "limits.max_result_bytes",
             f"must leave {RECORD_OVERHEAD_BYTES} bytes of headroom below the producer's max.request.size "
             f"({request_limit}), or an oversized result fails the sink instead of being dead-lettered")


def _batch_lane(config: JobConfig) -> None:
    """What a provider's batch cannot do, refused at load with why; and what Anthropic's Message
    Batches cannot take. Everything else (structured output, user functions, a fleet, embeddings
    batching for the realtime calls, the cache) goes through the same record path and client as the
    other lanes."""
    if config.lane != "provider-batch":
        return
    batch_lane = "not with lane: provider-batch: "
    model = config.model
    unsupported = {
        "ordering": (config.ordering == "per_key", batch_lane + "a provider answers a batch's lines in any order "
                                                                "and ends batches in any order"),
        "budget": (config.budget.enabled, batch_lane + "a batch is priced when it ends, hours after its calls were "
                                                       "made, so no call can be admitted against a window"),
        "model.provider": (model.provider == "anthropic" and model.api != "chat",
                           f"anthropic batches take chat messages only (model.api is {model.api!r})"),
        "model.response_format_mode": (
            model.provider == "anthropic" and model.response_format is not None
            and model.response_format_mode != "prompt",
            ("anthropic batches take no response_format parameter; with model.provider: anthropic use "
             "response_format_mode: prompt (the answers are still validated)")),
    }
    for policy in ("on_expired", "on_cancelled"):  # a realtime call speaks OpenAI's API, not Anthropic's
        unsupported[f"provider_batch.{policy}"] = (
            model.provider == "anthropic" and getattr(config.provider_batch, policy) == "realtime",
            ("not with model.provider: anthropic: a realtime call speaks OpenAI's chat completions, not "
             "Anthropic's Messages API (choose resubmit or dead-letter)"))
    for key, (refused, why) in unsupported.items():
        require(not refused, key, why)
    require(config.provider_batch.max_requests <= PROVIDER_MAX_REQUESTS[model.provider], "provider_batch.max_requests",
            f"{config.provider_batch.max_requests} is over {model.provider}'s limit of "
            f"{PROVIDER_MAX_REQUESTS[model.provider]} requests a batch")
    require(config.provider_batch.max_bytes <= PROVIDER_MAX_BYTES[model.provider], "provider_batch.max_bytes",
            f"{config.provider_batch.max_bytes} is over {model.provider}'s limit of "
            f"{PROVIDER_MAX_BYTES[model.provider]} bytes a batch")


PROVIDER_MAX_REQUESTS = {"openai": 50_000, "anthropic": 100_000}
PROVIDER_MAX_BYTES = {"openai": 200 * 1024 * 1024, "anthropic": 256 * 1024 * 1024}
"""The providers' own limits on one batch (OpenAI: a file; Anthropic: a request)."""
