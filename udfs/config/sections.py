"""The job config's sections: one frozen dataclass per concern, each value's rules in its type.

A rule on one value sits in its field's type (`capacity: PositiveInt`, see `udfs/config/loader.py`);
a rule relating fields of one section is that section's `validate`; rules across sections are
in `udfs/config/rules.py`. The objects are pickled to the Python workers with the functions
that use them, so they live in `udfs/`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from udfs import secret_refs
from udfs.config import kafka_security
from udfs.config.json_schema import load_avro_schema, load_schema
from udfs.config.loader import Loaded, Rule, is_file, join_key, require
from udfs.errors import ConfigError
from udfs.records.format_names import FORMATS
from udfs.records.result import RESULT_FIELDS


class _AnyField:
    """A field's value as the template check sees it: any attribute, index and format spec, since
    what a field holds is the record's business (`fill_template` dead-letters what does not fit)."""

    def __getattr__(self, name: str) -> _AnyField:
        return self

    def __getitem__(self, key: object) -> _AnyField:
        return self

    def __format__(self, spec: str) -> str:
        return ""


class _FieldProbe(dict[str, _AnyField]):
    """Accepts any field name so a template can be checked for syntax alone."""

    def __missing__(self, key: str) -> _AnyField:
        return _AnyField()


def _template_error(text: str) -> str | None:
    """Why `text` is not a `str.format` template (fields are not checked, only the syntax)."""
    try:
        text.format_map(_FieldProbe())
    except (ValueError, IndexError) as err:
        return str(err)
    return None


def _http_url(text: str) -> bool:
    """An http(s) URL whose host and port can be read (`urlsplit` raises for `[::1` or port 99999)."""
    try:
        urlsplit(text).port  # noqa: B018 - read for the ValueError it raises
    except ValueError:
        return False
    return text.startswith(("http://", "https://"))


POSITIVE = Rule(lambda v: v > 0, "must be > 0, got {value}")
NON_NEGATIVE = Rule(lambda v: v >= 0, "must be >= 0, got {value}")
NOT_EMPTY = Rule(lambda v: v.strip() != "", "must not be empty")
TCP_PORT = Rule(lambda v: v < 65536, "must be a TCP port (1-65535), got {value}")
HTTP_URL = Rule(_http_url, "must be an http(s) URL, got {value!r}")
REDIS_URL = Rule(lambda v: v.startswith(("redis://", "rediss://", "unix://", "${")),
                 "must be a redis://, rediss:// or unix:// URL (or a ${{env:...}}/${{file:...}} placeholder), got {value!r}")
TEMPLATE = Rule(lambda v: _template_error(v) is None, lambda v: f"not a valid template: {_template_error(v)}")
AVRO_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""An Avro field name (the spec's rule for names)."""
FUNCTION_REF = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
FUNCTION = Rule(lambda v: FUNCTION_REF.fullmatch(v) is not None,
                "expected 'package.module:function' (a function of an importable module), got {value!r}")
"""`model.preprocess` / `output.postprocess`: a user function by reference (`udfs/lanes/user_functions.py`)."""
FORMAT = Rule(lambda v: v in FORMATS, lambda v: f"expected one of {' | '.join(map(repr, FORMATS))}, got {v!r}")
"""`input.format` / `output.format`: a name in `FORMATS` (`udfs/records/format_names.py`)."""

PositiveInt = Annotated[int, POSITIVE]
PositiveFloat = Annotated[float, POSITIVE]
NonNegativeInt = Annotated[int, NON_NEGATIVE]
NonNegativeFloat = Annotated[float, NON_NEGATIVE]
Name = Annotated[str, NOT_EMPTY]
"""A name, topic, id or address: a string with something in it."""
Port = Annotated[int, POSITIVE, TCP_PORT]


@dataclass(frozen=True)
class KafkaConfig:
    """Where requests come from and where results and dead letters go.

    The input is one of `input_topic`, `input_topics` (a list) or `input_topic_pattern` (a Java
    regular expression; topics that appear later are picked up). `properties` are Kafka client
    properties (Java names) for every connection, Flink's and llmstream's own (`udfs/config/kafka_security.py`);
    secrets in them as `${env:NAME}` / `${file:PATH}`. `forward_headers`: which input record headers
    the output record and the dead letter carry (`all`, `none`, or a list of header names).
    `discovery_interval_ms`: how often the source looks for new partitions and, with a pattern,
    new topics.
    """

    bootstrap_servers: Name
    output_topic: Name
    dead_letter_topic: Name
    group_id: Name
    transactional_id_prefix: Name
    input_topic: Name | None = None
    input_topics: list[Name] | None = None
    input_topic_pattern: Name | None = None
    transaction_timeout_ms: PositiveInt = 900_000
    create_topics: bool = False
    topic_partitions: PositiveInt = 1
    properties: dict[str, str] = field(default_factory=dict)
    forward_headers: Literal["all", "none"] | list[Name] = "all"
    discovery_interval_ms: PositiveInt = 30_000

    def validate(self, path: str) -> None:
        given = [key for key in ("input_topic", "input_topics", "input_topic_pattern") if getattr(self, key)]
        require(len(given) == 1, join_key(path, given[1] if len(given) > 1 else "input_topic"),
                 "give exactly one of kafka.input_topic, kafka.input_topics, kafka.input_topic_pattern"
                 + (f" (got {', '.join(given)})" if given else ""))
        if self.input_topic_pattern is not None:
            try:
                pattern = re.compile(self.input_topic_pattern)
            except (re.error, OverflowError, RecursionError) as err:  # a repeat count or nesting too large
                raise ConfigError(join_key(path, "input_topic_pattern"), f"not a regular expression: {err}") from None
            for key in ("output_topic", "dead_letter_topic"):
                require(not pattern.fullmatch(getattr(self, key)), join_key(path, key),
                         "matches kafka.input_topic_pattern: the job would read its own output")
        for key in ("output_topic", "dead_letter_topic"):
            require(getattr(self, key) not in self.topics(), join_key(path, key),
                     "must differ from the input topic(s)")
        kafka_security.client_args(self.properties, join_key(path, "properties"))

    def topics(self) -> list[str]:
        """The input topics named in the config (none for a pattern)."""
        if self.input_topics:
            return list(self.input_topics)
        return [self.input_topic] if self.input_topic else []

    def input_description(self) -> str:
        """The input as one string: a topic, `a;b` for a list, `pattern:<regex>` for a pattern."""
        if self.input_topic_pattern is not None:
            return f"pattern:{self.input_topic_pattern}"
        return ";".join(self.topics())

    def client_args(self) -> dict[str, Any]:
        """kafka-python keyword arguments for this cluster (bootstrap and security, secrets resolved)."""
        return {"bootstrap_servers": self.bootstrap_servers,
                **kafka_security.client_args(self.properties, "kafka.properties")}


@dataclass(frozen=True)
class PriceConfig:
    """Prices per 1,000 tokens, in any currency; outputs then carry an estimated cost."""

    prompt_per_1k: NonNegativeFloat = 0.0
    completion_per_1k: NonNegativeFloat = 0.0


@dataclass(frozen=True)
class BatchConfig:
    """Micro-batching of `api: embeddings` calls (`udfs/inference/batching.py`): up to `max_size` inputs
    per request, a partial batch sent once its oldest record has waited `max_wait_ms`.
    `max_size: 1` (the default) sends one request per record. A lane that hands the client a
    whole batch (the vectorized lane's Arrow batch) waits for nothing: its records are cut into
    requests of `max_size` at once (`InferenceClient.complete_many`)."""

    max_size: PositiveInt = 1
    max_wait_ms: NonNegativeInt = 5


@dataclass(frozen=True)
class ModelTlsConfig:
    """TLS towards the model server: a CA bundle to trust (default: the system's), a client
    certificate and key for mutual TLS. Verification is on; `verify: false` is refused unless
    `allow_insecure: true` says so too (a test server with a self-signed certificate)."""

    ca_file: Name | None = None
    client_cert_file: Name | None = None
    client_key_file: Name | None = None
    verify: bool = True
    allow_insecure: bool = False

    def validate(self, path: str) -> None:
        require(self.verify or self.allow_insecure, join_key(path, "verify"),
                 "false turns off certificate checks towards the model server; set model.tls.allow_insecure: true "
                 "as well if that is really meant")
        require((self.client_cert_file is None) == (self.client_key_file is None),
                 join_key(path, "client_key_file" if self.client_cert_file else "client_cert_file"),
                 "client_cert_file and client_key_file go together (mutual TLS)")
        for key in ("ca_file", "client_cert_file", "client_key_file"):
            value = getattr(self, key)
            require(value is None or is_file(value), join_key(path, key), f"file {value} does not exist")


SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "api-key", "x-api-key"})
"""Model request headers whose value is a credential: only placeholders are accepted."""


def _check_credentials(path: str, api_key_env: str | None, api_key_file: str | None,
                       headers: dict[str, str]) -> None:
    """One key source at most, a key file that can be read, no literal credential in a header."""
    require(not (api_key_env and api_key_file), join_key(path, "api_key_file"),
             f"give {join_key(path, 'api_key_env')} or {join_key(path, 'api_key_file')}, not both")
    if api_key_file is not None:
        secret_refs.read_secret_file(api_key_file, join_key(path, "api_key_file"))
    for name, value in headers.items():
        require(name.lower() not in SECRET_HEADERS or secret_refs.has_placeholder(value), join_key(path, f"headers.{name}"),
                 "holds a literal credential; write ${file:PATH} or ${env:NAME} instead")
        secret_refs.check(value, join_key(path, f"headers.{name}"))


def read_api_key(env: str | None, key_file: str | None, path: str) -> str | None:
    """An API key from its file (`<path>.api_key_file`, checked as a secret file) or its environment
    variable, read where it is used and never stored: the one reader for the model's key and each
    fleet endpoint's."""
    if key_file:
        return secret_refs.read_secret_file(key_file, join_key(path, "api_key_file"))
    return os.environ.get(env) if env else None


@dataclass(frozen=True)
class EndpointConfig:
    """One replica or provider of a model fleet (`model.endpoints`, `model.fallback.endpoints`).

    `weight`: its share when routing (weighted least-outstanding requests, `udfs/inference/fleet.py`).
    `max_concurrency`: calls in flight to it per inference subtask (none: `async.capacity`);
    adaptive concurrency shrinks it on a 429 from this endpoint only. `requests_per_minute` /
    `tokens_per_minute`: its own limits, job-wide, each inference subtask taking its share as
    with `rate_limit`. `api_key_env` / `api_key_file`, `headers`: its credentials and headers
    (added to `model.headers`; credentials as placeholders only). `model`: the model name sent
    to it (none: `model.model`, or a record's own override). `name`: its label in metrics and
    `llmstream status` (none: host:port of `url`)."""

    url: Annotated[str, NOT_EMPTY, HTTP_URL]
    weight: PositiveFloat = 1.0
    max_concurrency: PositiveInt | None = None
    requests_per_minute: PositiveFloat | None = None
    tokens_per_minute: PositiveFloat | None = None
    api_key_env: str | None = None
    api_key_file: Name | None = None
    model: Name | None = None
    headers: dict[str, str] = field(default_factory=dict)
    name: Name | None = None

    def validate(self, path: str) -> None:
        _check_credentials(path, self.api_key_env, self.api_key_file, self.headers)

    @property
    def label(self) -> str:
        """`name`, else host:port of the URL."""
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)

    def api_key(self, path: str = "model.endpoints") -> str | None:
        """The endpoint's API key from the environment or its file, read where it is used, never stored."""
        return read_api_key(self.api_key_env, self.api_key_file, path)


@dataclass(frozen=True)
class CircuitConfig:
    """The circuit of each fleet endpoint (`udfs/inference/fleet.py`): it opens after `failures`
    consecutive connection errors, timeouts or 5xx answers, takes no traffic for `cooldown_s`,
    then lets one probe through (half-open); a failed probe opens it again for twice as long,
    up to `max_cooldown_s`; a success closes it."""

    failures: PositiveInt = 5
    cooldown_s: PositiveFloat = 5.0
    max_cooldown_s: PositiveFloat = 60.0

    def validate(self, path: str) -> None:
        require(self.max_cooldown_s >= self.cooldown_s, join_key(path, "max_cooldown_s"),
                 "must be >= model.circuit.cooldown_s")


@dataclass(frozen=True)
class FallbackConfig:
    """Another endpoint group (perhaps another model) for when every primary circuit is open,
    or for a record's attempts after `after_attempts` (none: only when every primary is open)."""

    endpoints: list[EndpointConfig]
    after_attempts: PositiveInt | None = None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """An OpenAI-compatible endpoint (or a fleet of them) and how to turn a record into a request for it.

    `endpoint` is the one-endpoint shorthand; `endpoints` a fleet (`udfs/inference/fleet.py`: weighted
    routing, a circuit and adaptive concurrency per endpoint), with `circuit` and `fallback`.
    Give exactly one of `endpoint` and `endpoints`."""

    endpoint: Annotated[str, NOT_EMPTY, HTTP_URL] | None = None
    model: Name
    api: Literal["chat", "completions", "embeddings"] = "chat"
    api_key_env: str | None = None
    api_key_file: Name | None = None
    headers: dict[str, str] = field(default_factory=dict)
    system_prompt: str | None = None
    prompt_template: Annotated[str, NOT_EMPTY, TEMPLATE] = "{prompt}"
    # Your own Python (docs/user-functions.md): record -> prompt, messages or None; `skipped`: what
    # a record the function returns None for becomes (nothing, or the record itself on the output).
    preprocess: Annotated[str, FUNCTION] | None = None
    skipped: Literal["drop", "forward"] = "drop"
    # Deprecated: `lane: provider-batch` (batch) or any other lane (realtime). Reads "batch" in a
    # provider-batch job whichever key chose it. `provider`: whose batch API that lane speaks,
    # OpenAI's /v1/batches (and compatible hosts) or Anthropic's (docs/cost.md).
    mode: Literal["realtime", "batch"] | None = None
    provider: Literal["openai", "anthropic"] = "openai"
    max_input_tokens: PositiveInt = 8192
    on_context_overflow: Literal["dead-letter", "truncate"] = "dead-letter"
    max_tokens: PositiveInt | None = 256
    temperature: NonNegativeFloat | None = None
    prices: PriceConfig | None = None
    batch: BatchConfig = field(default_factory=BatchConfig)
    # The most bytes of one answer read from the server (`udfs/inference/transport.py`); past it the
    # attempt fails as `response_too_large` and the connection is closed (docs/operations.md).
    max_response_bytes: PositiveInt = 8_388_608
    # `api: embeddings`: the length every vector must have; an answer with another is
    # `unsupported_response` (udfs/inference/responses.py). None: any, as long as a batch's agree.
    embedding_dim: PositiveInt | None = None
    # Structured output (udfs/inference/structured.py): a JSON Schema, inline or a file path read at load
    # (the config then carries the schema itself); how the server is asked for it; how many
    # more answers an invalid one may be replaced by before the record is dead-lettered.
    response_format: Annotated[dict[str, Any] | str | None, Loaded(load_schema)] = None
    response_format_mode: Literal["native", "json_object", "prompt"] = "native"
    max_invalid_retries: NonNegativeInt = 2
    tls: ModelTlsConfig = field(default_factory=ModelTlsConfig)

    endpoints: list[EndpointConfig] | None = None
    circuit: CircuitConfig = field(default_factory=CircuitConfig)
    fallback: FallbackConfig | None = None

    @property
    def routed(self) -> bool:
        """Calls go through a fleet's routing (`udfs/inference/fleet.py`): `endpoints` or a `fallback`."""
        return self.endpoints is not None or self.fallback is not None

    def validate(self, path: str) -> None:
        require((self.endpoint is None) != (self.endpoints is None), join_key(path, "endpoint"),
                 "give exactly one of model.endpoint and model.endpoints"
                 + (" (got both)" if self.endpoint is not None else ""))
        _check_credentials(path, self.api_key_env, self.api_key_file, self.headers)
        for group, endpoints in (("endpoints", self.endpoints or []),
                                 ("fallback.endpoints", self.fallback.endpoints if self.fallback else [])):
            labels = [e.label for e in endpoints]
            for i, label in enumerate(labels):
                require(label not in labels[:i], join_key(path, f"{group}[{i}].name"),
                         f"another endpoint is labelled {label!r} already; give each a distinct name")
        require(self.batch.max_size == 1 or self.api == "embeddings", join_key(path, "batch.max_size"),
                 f"batching needs model.api: embeddings (got {self.api!r}); set it to 1")
        require(self.embedding_dim is None or self.api == "embeddings", join_key(path, "embedding_dim"),
                 f"checks the vectors of model.api: embeddings (got {self.api!r}); remove it")
        if self.response_format is not None:
            require(self.api != "embeddings", join_key(path, "response_format"),
                     "needs model.api: chat or completions (embeddings answer with vectors)")


@dataclass(frozen=True)
class AsyncConfig:
    """The async operator: `capacity` bounds in-flight calls per inference subtask.

    Timeouts are enforced inside the coroutine (per attempt and per record), never by the
    operator's own timeout, which costs one thread per record.
    """

    capacity: PositiveInt = 64
    request_timeout_s: PositiveFloat = 30.0
    record_deadline_s: PositiveFloat = 120.0

    def validate(self, path: str) -> None:
        require(self.record_deadline_s >= self.request_timeout_s, join_key(path, "record_deadline_s"),
                 "must be >= async.request_timeout_s")


@dataclass(frozen=True)
class RetryConfig:
    """Exponential backoff with full jitter; the only retry layer in llmstream."""

    max_attempts: PositiveInt = 10
    initial_backoff_s: PositiveFloat = 0.5
    max_backoff_s: PositiveFloat = 30.0
    max_retry_after_s: PositiveFloat = 60.0


@dataclass(frozen=True)
class RateLimitConfig:
    """Job-wide provider limits; each inference subtask takes its share by parallelism."""

    requests_per_minute: PositiveFloat | None = None
    tokens_per_minute: PositiveFloat | None = None
    adaptive_concurrency: bool = True
    min_concurrency: PositiveInt = 1

    @property
    def enabled(self) -> bool:
        """A requests- or tokens-per-minute limit is set."""
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class ParallelismConfig:
    """Parallelism of the job and of each stage; `None` means `default`."""

    default: PositiveInt = 1
    source: PositiveInt | None = None
    inference: PositiveInt | None = None
    sink: PositiveInt | None = None

    def of(self, stage: str) -> int:
        value = getattr(self, stage)
        return self.default if value is None else int(value)


@dataclass(frozen=True)
class CheckpointConfig:
    """Exactly-once output is committed when a checkpoint completes: interval = output latency.

    `directory` is the job's state directory (retained checkpoints and savepoints; every
    run resumes from the newest snapshot in it); `None` means `var/state/<job name>`.
    `max_restart_ms` is the longest a restart (a failover, or a crashed run started again)
    may take before the Kafka transactions of the last checkpoint must still be committable;
    `tolerable_failed_checkpoints` are checkpoint failures tolerated before the job fails over.
    Both count towards the transaction-timeout rule (see `transaction_lifetime_ms`).
    """

    interval_ms: PositiveInt = 5_000
    timeout_ms: PositiveInt = 600_000
    min_pause_ms: NonNegativeInt = 0
    directory: str | None = None
    max_restart_ms: PositiveInt = 120_000
    tolerable_failed_checkpoints: NonNegativeInt = 0

    def transaction_lifetime_ms(self) -> int:
        """The longest a sink transaction can stay open before a checkpoint commits it.

        A transaction opens right after one checkpoint and is committed when the next one
        completes: one interval plus one checkpoint's duration, times one more for every
        failed checkpoint tolerated (the transaction stays open across it), plus a restart,
        after which the restored job commits the pending transaction of its checkpoint.
        """
        per_attempt = self.interval_ms + self.timeout_ms
        return (self.tolerable_failed_checkpoints + 1) * per_attempt + self.max_restart_ms


@dataclass(frozen=True)
class PythonConfig:
    """Python worker bundles and the checkpoint mode the inference stage needs.

    The stage keeps calls in flight across bundles, so a bundle end waits for nothing; a
    checkpoint waits for the records of the current bundle still queued for a free slot
    (about bundle_size / throughput), hence a small bundle. `unaligned_checkpoints` lets the
    barrier overtake the records buffered in front of the keyed stage (aligned: it queues
    behind them, tens of seconds under backpressure).

    `bundle_target_ms` > 0: the bundle size follows throughput instead, about that many ms of
    input records (ticks included, timers not), between `ADAPTIVE_MIN_BUNDLE` and `bundle_size` (`pom-free/gate/AdaptiveBundles.java`,
    which needs the gate's jar: a JDK's javac). Fast models get fewer bundle ends, slow ones
    short checkpoint waits; 0: the fixed `bundle_size`."""

    bundle_size: PositiveInt = 100
    bundle_time_ms: PositiveInt = 1000
    bundle_target_ms: NonNegativeInt = 0
    unaligned_checkpoints: bool = True
    # Directories the user functions' modules are found in (besides the current directory and
    # sys.path), shipped with the job to every worker (docs/user-functions.md).
    path: list[Name] | None = None


ADAPTIVE_MIN_BUNDLE = 10
"""The smallest bundle `python.bundle_target_ms` makes (a bundle end costs a few ms of CPU)."""


@dataclass(frozen=True)
class VectorizedConfig:
    """The vectorized lane (`lane: vectorized`, `udfs/lanes/vectorized.py`): Flink hands the
    Python function `batch_size` records at once (`python.fn-execution.arrow.batch.size`), and
    the Python bundle is the same size, so a checkpoint waits for about one batch, not for
    Flink's default 100,000 rows (docs/tuning.md, "Which lane")."""

    batch_size: PositiveInt = 1000


@dataclass(frozen=True)
class LimitsConfig:
    """Input guards: records beyond these go to the dead-letter topic, never to the model."""

    max_record_bytes: PositiveInt = 1_048_576
    max_prompt_chars: PositiveInt = 100_000
    max_id_chars: PositiveInt = 512
    # Output records larger than this (value + key) are dead-lettered as `result_too_large`
    # instead of failing the sink (the producer's max.request.size is 1 MiB by default).
    max_result_bytes: PositiveInt = 1_000_000


@dataclass(frozen=True)
class MetricsConfig:
    """How a local run (`llmstream run`) exposes its metrics; a cluster's reporters are set in
    its own configuration (flink-conf/config.yaml).

    `prometheus_port`: serve every Flink metric (llmstream's included) at
    http://127.0.0.1:<port>/metrics with Flink's Prometheus reporter; none (the default):
    no exporter, so two runs on one host never fight over a port. `rest_port`: the mini
    cluster's REST API (web UI, `llmstream status`); none: a free port, written to the
    state directory for `llmstream status` to find."""

    prometheus_port: Port | None = None
    rest_port: Port | None = None


@dataclass(frozen=True)
class CacheConfig:
    """The result cache in front of the model (`udfs/cost/cache.py`): a call whose answer is already
    stored is not made again, after a restart's replay or for a repeated request.

    `backend`: `local` (SQLite on this machine, shared by its subtasks; what
    jobs/inference.yaml sets), `redis` (a Redis/Valkey server shared by several machines)
    or `none` (the default for a config without a `cache` section). `only_deterministic`: cache
    only requests whose answer is meant to be reproducible (temperature 0 or a fixed seed;
    embeddings always). `path`: the local store's file; none = `result-cache.sqlite` in the
    job's state directory. `max_entries` / `max_bytes`: the local store's bounds (oldest
    entries are evicted). `ttl_s`: how long an answer is reused; none = until evicted."""

    backend: Literal["none", "local", "redis"] = "none"
    ttl_s: PositiveFloat | None = 604_800.0
    only_deterministic: bool = True
    path: str | None = None
    max_entries: PositiveInt = 1_000_000
    max_bytes: PositiveInt = 1_073_741_824
    redis_url: Annotated[str, NOT_EMPTY, REDIS_URL] = "redis://127.0.0.1:6379/0"
    key_prefix: Name = "llmstream:result:"

    def validate(self, path: str) -> None:
        if self.backend == "redis":
            secret_refs.check(self.redis_url, join_key(path, "redis_url"))


@dataclass(frozen=True)
class BudgetConfig:
    """A job-wide spend cap per window (an hour by default), each inference subtask taking
    its share; past it the stage waits (backpressure), it never fails or drops a record.
    `max_cost_per_hour` is priced from `model.prices`. `window_s` is the window's length and
    the caps apply per window. A pause lasts up to a window; the admission gate in front of the
    stage (`udfs/lanes/admission.py`) stops its input meanwhile without holding a checkpoint, which needs
    unaligned checkpoints (checked)."""

    max_cost_per_hour: PositiveFloat | None = None
    max_tokens_per_hour: PositiveFloat | None = None
    window_s: PositiveFloat = 3600.0

    @property
    def enabled(self) -> bool:
        return self.max_cost_per_hour is not None or self.max_tokens_per_hour is not None


@dataclass(frozen=True)
class InputConfig:
    """How an input record's value is read (issue 22: typed topics and change streams).

    `format`: `json` (llmstream's record contract, README) or `avro` (Confluent wire format, the
    writer's schema fetched by id from `schema_registry`; docs/formats.md). `id_field`: for typed
    input, the top-level field that is the record's id (none: the Kafka key, as UTF-8). `tombstones`: what a record with a null value
    becomes: `forward` (a null value with the same key on the output topic; a null key has nothing
    to delete and is a `null_value` dead letter), `dead-letter` or `skip`. `forward` by default: a
    null value is Kafka's delete (compacted topics, CDC), and a delete must reach the output as one.
    """

    format: Annotated[str, FORMAT] = "json"
    id_field: Name | None = None
    tombstones: Literal["forward", "dead-letter", "skip"] = "forward"


@dataclass(frozen=True)
class OutputConfig:
    """How a result record's value is written. `format`: `json` (the record contract) or `avro`
    (a schema derived from the job config, registered at start under `subject`; docs/formats.md).
    `carry_fields`: top-level fields of a typed input record copied into its result (avro output).
    `subject`: the registry subject of the output schema (none: `<kafka.output_topic>-value`,
    Confluent's TopicNameStrategy)."""

    format: Annotated[str, FORMAT] = "json"
    carry_fields: list[Name] | None = None
    subject: Name | None = None
    # Your own Python (docs/user-functions.md): (record, result) -> the output value, a dict the
    # format writes; with avro, `schema` is its Avro schema (inline, or a .avsc/.json file).
    postprocess: Annotated[str, FUNCTION] | None = None
    schema: Annotated[dict[str, Any] | str | None, Loaded(load_avro_schema)] = None

    def validate(self, path: str) -> None:
        taken = [f.name for f in RESULT_FIELDS]  # every field a result can have (udfs/records/result.py)
        for name in self.carry_fields or []:
            require(AVRO_NAME.fullmatch(name) is not None, join_key(path, "carry_fields"),
                     f"{name!r} is not an Avro field name ([A-Za-z_][A-Za-z0-9_]*)")
            require(name not in taken, join_key(path, "carry_fields"),
                     f"{name!r} is a field of the result itself ({', '.join(taken)})")


@dataclass(frozen=True)
class SchemaRegistryConfig:
    """A Confluent-compatible Schema Registry (Confluent, Apicurio's ccompat API, Karapace), for
    `input.format: avro` / `output.format: avro` (`udfs/records/registry.py`). `username` / `password`:
    basic auth, as `${env:NAME}` / `${file:PATH}` placeholders, never literal. `cache_size`:
    schemas kept by id per worker. `timeout_s`: one request's timeout. `unavailable_timeout_s`:
    how long a record whose schema is not cached waits for a registry that does not answer
    (retries with backoff; the stage admits nothing meanwhile, which is backpressure) before it
    is dead-lettered as `registry_unavailable`."""

    url: Annotated[str, NOT_EMPTY, HTTP_URL]
    username: Name | None = None
    password: Name | None = None
    cache_size: PositiveInt = 1000
    timeout_s: PositiveFloat = 5.0
    unavailable_timeout_s: PositiveFloat = 120.0

    def validate(self, path: str) -> None:
        require("@" not in urlsplit(self.url).netloc, join_key(path, "url"),
                 "holds credentials; give them as schema_registry.username and schema_registry.password")
        require((self.username is None) == (self.password is None),
                 join_key(path, "password" if self.username else "username"),
                 "username and password go together (basic auth)")
        require(self.password is None or secret_refs.has_placeholder(self.password), join_key(path, "password"),
                 "holds a literal credential; write ${file:PATH} or ${env:NAME} instead")
        for key in ("username", "password"):
            value = getattr(self, key)
            if value is not None:
                secret_refs.check(value, join_key(path, key))


@dataclass(frozen=True)
class ProviderBatchConfig:
    """The provider-batch lane (`lane: provider-batch`, `udfs/lanes/provider_batch/lane.py`, docs/cost.md): records
    are collected into a provider's batch (OpenAI `/v1/batches`, Anthropic Message Batches), sold
    at about half the price of the same calls, answered within `completion_window`.

    A bucket's collection becomes a batch at `max_requests` records, `max_bytes` of requests or
    once its oldest record has waited `max_wait_s`. A batch is polled `poll_initial_s` after its
    creation, then at doubling intervals up to `poll_max_s`. `on_expired` / `on_cancelled`: what
    the records a batch did not answer become (`resubmit`: a later batch; `realtime`: a call now;
    `dead-letter`). A batch older than `stale_after_s` is logged and shown by `llmstream status`.
    `price_factor`: the batch price against `model.prices` (0.5: half). `max_result_bytes`: the
    most of one batch's result files read (bounded like every other answer)."""

    max_requests: PositiveInt = 10_000
    max_bytes: PositiveInt = 100_000_000
    max_wait_s: PositiveFloat = 300.0
    poll_initial_s: PositiveFloat = 10.0
    poll_max_s: PositiveFloat = 300.0
    completion_window: Literal["24h"] = "24h"
    on_expired: Literal["resubmit", "realtime", "dead-letter"] = "resubmit"
    on_cancelled: Literal["resubmit", "realtime", "dead-letter"] = "dead-letter"
    stale_after_s: PositiveFloat = 26 * 3600.0
    price_factor: NonNegativeFloat = 0.5
    max_result_bytes: PositiveInt = 1_000_000_000

    def validate(self, path: str) -> None:
        require(self.poll_max_s >= self.poll_initial_s, join_key(path, "poll_max_s"),
                f"{self.poll_max_s:g} is below poll_initial_s ({self.poll_initial_s:g})")


COMPLETION_WINDOW_S = {"24h": 24 * 3600.0}
"""`provider_batch.completion_window` in seconds."""

LaneSetting = Literal["keyed", "vectorized", "provider-batch", "auto"]
"""The `lane` key: which lane runs the inference, or `auto` (`JobConfig.lane_choice` says how it picks)."""
Lane = Literal["keyed", "vectorized", "provider-batch"]
"""The lane a job runs (`JobConfig.lane`): `lane` as written, `auto` resolved."""

log = logging.getLogger("llmstream.config")
_deprecations_said: set[str] = set()


def _deprecated(old: str, new: str) -> None:
    """One warning line per process for a deprecated key, naming the key that replaces it."""
    if old not in _deprecations_said:
        _deprecations_said.add(old)
        log.warning("config: %s is deprecated; write %s instead", old, new)


@dataclass(frozen=True)
class JobConfig:
    """The whole job. `name` is the Flink job name and part of log lines; `flink` holds any
    further Flink options for the job (e.g. `restart-strategy.type`), passed through as is."""

    kafka: KafkaConfig
    model: ModelConfig
    name: Name = "llmstream-inference"
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})
    retry: RetryConfig = field(default_factory=RetryConfig)
    rate_limit: RateLimitConfig = field(default_factory=RateLimitConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    python: PythonConfig = field(default_factory=PythonConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    schema_registry: SchemaRegistryConfig | None = None
    ordering: Literal["none", "per_key"] = "none"
    lane_setting: LaneSetting | None = field(default=None, metadata={"key": "lane"})
    stage: Literal["keyed", "vectorized", "auto"] | None = None  # deprecated: `lane`
    vectorized: VectorizedConfig = field(default_factory=VectorizedConfig)
    provider_batch: ProviderBatchConfig = field(default_factory=ProviderBatchConfig)
    flink: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # `model.mode` keeps its meaning for whoever still reads it: "batch" in a provider-batch job.
        if self.lane_setting == "provider-batch" and self.model.mode is None:
            object.__setattr__(self, "model", dataclasses.replace(self.model, mode="batch"))

    def validate(self, path: str) -> None:
        """The old keys for the lane (`stage`, `model.mode`) still work, each with one warning line
        naming `lane`; given beside `lane` (or each other) they must agree with it."""
        lane, stage, mode = self.lane_setting, self.stage, self.model.mode
        if lane is not None:
            require(stage is None or stage == lane, join_key(path, "stage"),
                    f"is the old name of lane; give only lane (lane: {lane}, stage: {stage})")
            require(mode is None or (mode == "batch") == (lane == "provider-batch"), join_key(path, "model.mode"),
                    f"is the old way to choose the provider-batch lane; give only lane (lane: {lane}, "
                    f"model.mode: {mode})")
            return
        if mode == "batch":
            require(stage != "vectorized", join_key(path, "stage"),
                    "not with model.mode: batch: that is the provider-batch lane (lane: provider-batch); "
                    "give only lane")
            _deprecated("model.mode: batch", "lane: provider-batch")
        elif mode is not None:
            _deprecated(f"model.mode: {mode}", "lane (keyed, vectorized or auto; keyed by default)")
        if stage is not None and mode != "batch":
            _deprecated(f"stage: {stage}", f"lane: {stage}")

    def fleet(self) -> tuple[list[EndpointConfig], list[EndpointConfig]]:
        """The primary and fallback endpoints; `model.endpoint` is a fleet of one whose
        credentials and model are the section's own."""
        model = self.model
        fallback = list(model.fallback.endpoints) if model.fallback else []
        if model.endpoints is not None:
            return list(model.endpoints), fallback
        assert model.endpoint is not None
        return [EndpointConfig(url=model.endpoint, api_key_env=model.api_key_env,
                               api_key_file=model.api_key_file)], fallback

    def api_key(self) -> str | None:
        """The API key from the environment or its file, read where it is used and never stored."""
        return read_api_key(self.model.api_key_env, self.model.api_key_file, "model")

    def keyed_only(self) -> dict[str, str]:
        """The settings of this config that only the keyed stage serves, each with why: the
        vectorized lane refuses them at load (`udfs/config/rules.py`), and `lane: auto` keeps
        the keyed stage for them."""
        keyed = "needs the keyed lane (lane: keyed): "
        settings = {
            "ordering": (self.ordering == "per_key",
                         keyed + "the vectorized lane does not route a key's records to one subtask"),
            "budget": (self.budget.enabled, keyed + "a paused budget would hold the batch in progress, "
                       "and with it every checkpoint, for up to its window"),
            "python.bundle_target_ms": (self.python.bundle_target_ms > 0,
                                        "is for the keyed stage; the vectorized lane's bundle is vectorized.batch_size"),
            "parallelism.inference": (self.parallelism.of("inference") != self.parallelism.default,
                                      "the vectorized lane runs at parallelism.default (set that instead)"),
        }
        return {key: why for key, (present, why) in settings.items() if present}

    def longest_record_s(self) -> float:
        """The longest the stage may hold one record once it is taken in, as the config bounds it: a
        `Retry-After` pause that held every call back before it was dispatched
        (`retry.max_retry_after_s`), then the record deadline (every attempt and wait of its call,
        `async.record_deadline_s`) and as much again for each user function around the call; in the
        provider-batch lane also a collection's wait (`provider_batch.max_wait_s`) and the provider's
        completion window. A backfill's drain waits this long (`jobs/launch/driver.py`). Waiting in
        line for an adaptive-concurrency slot is not bounded by the config: a drain that outlasts
        this is cut short, and the next run resumes the records it left."""
        user_functions = sum(ref is not None for ref in (self.model.preprocess, self.output.postprocess))
        longest = self.retry.max_retry_after_s + self.async_.record_deadline_s * (1 + user_functions)
        if self.lane == "provider-batch":
            longest += self.provider_batch.max_wait_s + COMPLETION_WINDOW_S[self.provider_batch.completion_window]
        return longest

    @property
    def lane(self) -> Lane:
        """The lane this job runs: `lane`, with `auto` resolved (`lane_choice`)."""
        return self.lane_choice()[0]

    def written_lane(self) -> tuple[LaneSetting, str]:
        """The `lane` as written, or as an old key stands for it (`model.mode: batch`, `stage`), and
        those words; `keyed` when none is given."""
        if self.lane_setting is not None:
            return self.lane_setting, f"lane: {self.lane_setting}"
        if self.model.mode == "batch":
            return "provider-batch", "model.mode: batch"
        if self.stage is not None:
            return self.stage, f"stage: {self.stage}"
        return "keyed", "lane: keyed"

    def lane_choice(self) -> tuple[Lane, str]:
        """The lane this job runs, and why, in words for the start-up line.

        `lane: auto` decides from the config alone, by what kind of call the model answers: the
        vectorized lane for embeddings (an input takes milliseconds, about what its crossing into
        Python costs, and a batch has no heavy tail), the keyed lane for chat and completions (calls
        take tens of milliseconds to minutes, with tails that would hold a vectorized batch and every
        checkpoint behind it) and whenever a setting needs it (`keyed_only`). Never the
        provider-batch lane: answers within hours at half the price is a choice about the job, not a
        speed, so only `lane: provider-batch` makes it. Not by a latency measured at start: the lane
        is fixed for a job's life (a savepoint restores only into the lane that took it), and what
        the first few calls of a cold server take says little about the rest. docs/tuning.md, "Which
        lane", has the measured rows."""
        written, words = self.written_lane()
        if written != "auto":
            return written, words
        held = self.keyed_only()
        if held:
            return "keyed", f"{words}, keyed: {', '.join(held)} {'needs' if len(held) == 1 else 'need'} it"
        if self.model.api == "embeddings":
            return "vectorized", f"{words}, vectorized: model.api is embeddings"
        return "keyed", f"{words}, keyed: model.api is {self.model.api}"
