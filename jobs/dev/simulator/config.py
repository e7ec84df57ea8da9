"""The simulator's settings: the latency model, the fault scenario and ``SimulatorConfig``.

Every value is checked at construction, so a bad ``--flag`` or ``/admin`` body fails with a
message that names the key instead of misbehaving later.
"""

from __future__ import annotations

import dataclasses
import math
import random
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.dev.simulator.batch_config import BatchSettings

SIMULATOR_FINGERPRINT = "llmstream-simulator"
DEFAULT_MODEL = "llmstream-sim"
MAX_EMBEDDING_DIM = 8192
MAX_OUTPUT_TOKENS_CAP = 16384
MAX_CHOICES = 128

_Z99 = 2.3263478740408408

# The hostile kinds (`hostile.py` gives the answers; docs/operations.md, "Bad input from every side",
# says what llmstream's client makes of each).
ANSWER_KINDS: dict[str, str] = {
    # size and time
    "huge-body": "a 200 whose Content-Length says hostile_size_bytes (1 GiB), sent as fast as the client reads",
    "endless-body": "a 200, chunked, whose answer text never ends (until hang_max_s, then a reset)",
    "trickle-headers": "the status line, then one byte of a header every 50 ms, the headers never finished",
    "trickle-body": "a whole header, then one byte of the body every 50 ms",
    "header-flood": "header lines without end, as fast as the client reads, each quoting the request's headers",
    "reset-mid-body": "the headers and half the body of a usual answer, then a TCP reset",
    "redirect": "307 to another URL (the request's headers in its query)",
    # bytes and encodings
    "invalid-utf8": "a 200 whose answer text holds bytes that are not UTF-8",
    "not-json": "a 200 HTML page",
    "bad-charset": "a 500 whose text declares charset=base64, which is not a text encoding",
    "deep-json-error": "a 500 whose JSON body nests arrays 100,000 deep",
    # valid JSON, wrong answer
    "no-choices": "a 200 without choices (embeddings: without data)",
    "empty-choices": "a 200 with choices: [] (embeddings: data: [])",
    "null-content": "message.content null, with a refusal (completions: text; embeddings: embedding)",
    "number-content": "a number where the answer's text (embeddings: vector) belongs",
    "wrong-dimension": "embeddings: the last vector one number longer than the others (others: the usual answer)",
    "missing-index": "embeddings: the last item without its index",
    "repeated-index": "embeddings: the last item with the first one's index (one input: an extra item)",
    "index-out-of-range": "embeddings: the last item's index equal to the number of inputs",
    "absurd-usage": "usage of 2^63 - 1 prompt tokens and -1 completion tokens",
    "error-in-200": "a 200 whose body is an OpenAI error object, not an answer",
    # what to wait for
    "retry-after-zero": "429 with Retry-After: 0",
    "retry-after-negative": "429 with Retry-After: -30",
    "retry-after-huge": "429 with Retry-After: 1000000000 (31 years)",
    "retry-after-past-date": "429 with Retry-After: an HTTP date in 1970",
}
HANDSHAKE_KINDS: dict[str, str] = {
    "tls-cert-change": "the TLS handshake presents --hostile-tls-cert instead of --tls-cert (and every answer "
                       "closes its connection, so each request shakes hands anew)",
}
KINDS: dict[str, str] = {**ANSWER_KINDS, **HANDSHAKE_KINDS}


def parse_kinds(value: Any) -> tuple[str, ...]:
    """``"huge-body,redirect"``, ``["huge-body"]`` or ``"all"`` (every kind of an answer, not the
    handshake's, which needs a second certificate) -> the kinds; ValueError names an unknown one."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(part, str) for part in value):
        names = [part.strip() for part in value]
    else:
        raise TypeError(f"hostile must be a kind, a comma-separated list of kinds or a list, got {value!r}")
    kinds: list[str] = []
    for name in names:
        for kind in (ANSWER_KINDS if name == "all" else [name]):
            if kind not in KINDS:
                raise ValueError(f"unknown hostile kind {kind!r}; the kinds: all, {', '.join(KINDS)}")
            if kind not in kinds:
                kinds.append(kind)
    return tuple(kinds)


@dataclass(frozen=True)
class LatencyModel:
    """A parsed ``--latency`` spec; samples are milliseconds."""

    kind: str = "instant"
    median_ms: float = 0.0
    p99_ms: float = 0.0

    @property
    def instant(self) -> bool:
        return self.kind == "instant" or (self.kind == "fixed" and self.median_ms <= 0)

    @property
    def mu(self) -> float:
        return math.log(self.median_ms) if self.median_ms > 0 else 0.0

    @property
    def sigma(self) -> float:
        if self.kind != "lognormal" or self.median_ms <= 0:
            return 0.0
        return math.log(self.p99_ms / self.median_ms) / _Z99

    def sample_ms(self, rng: random.Random) -> float:
        if self.kind == "lognormal":
            return rng.lognormvariate(self.mu, self.sigma)
        if self.kind == "fixed":
            return self.median_ms
        return 0.0


def parse_latency(spec: str | float) -> LatencyModel:
    """Parse ``0`` | ``instant`` | ``fixed:MS`` | ``MS`` | ``lognormal:MEDIAN_MS:P99_MS``."""
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise TypeError(f"latency must be a string or a number, got {spec!r}")
    if isinstance(spec, (int, float)):
        spec = str(spec)
    text = spec.strip().lower()
    if text in ("", "0", "instant", "none", "fixed:0"):
        return LatencyModel("instant")
    parts = text.split(":")
    try:
        if parts[0] == "fixed" and len(parts) == 2:
            ms = float(parts[1])
            kind = "fixed"
            if not math.isfinite(ms) or ms < 0:
                raise ValueError
            return LatencyModel(kind, ms, ms) if ms > 0 else LatencyModel("instant")
        if parts[0] == "lognormal" and len(parts) == 3:
            median, p99 = float(parts[1]), float(parts[2])
            if not (math.isfinite(median) and math.isfinite(p99)) or median <= 0 or p99 < median:
                raise ValueError
            return LatencyModel("lognormal", median, p99)
        if len(parts) == 1:
            return parse_latency(f"fixed:{parts[0]}")
    except ValueError:
        pass
    raise ValueError(
        f"invalid latency {spec!r}: use 0, instant, fixed:MS or lognormal:MEDIAN_MS:P99_MS "
        "(median > 0, p99 >= median)"
    )


def check_number(name: str, value: Any, *, minimum: float = 0.0, maximum: float | None = None,
                  integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if integer and not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


@dataclass(frozen=True)
class FaultSettings:
    """A fault scenario; see the module docstring for what each key does."""

    error_rate: float = 0.0
    error_status: int = 500
    rate_limit_rate: float = 0.0
    retry_after_s: int = 1
    hang_rate: float = 0.0
    reset_rate: float = 0.0
    until_s: float | None = None
    # Hostile answers (`hostile.py`): the kinds, given in turn, to `hostile_rate` of the requests
    # that pass the faults above (a separate draw), or of the handshakes for tls-cert-change.
    hostile: tuple[str, ...] = ()
    hostile_rate: float = 1.0

    def __post_init__(self) -> None:
        for name in ("error_rate", "rate_limit_rate", "hang_rate", "reset_rate", "hostile_rate"):
            check_number(name, getattr(self, name), maximum=1.0)
        object.__setattr__(self, "hostile", parse_kinds(self.hostile))
        object.__setattr__(self, "hostile_rate", float(self.hostile_rate))
        check_number("error_status", self.error_status, minimum=400, maximum=599, integer=True)
        check_number("retry_after_s", self.retry_after_s, integer=True)
        if self.until_s is not None:
            check_number("until_s", self.until_s)
        for name in ("error_rate", "rate_limit_rate", "hang_rate", "reset_rate"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "error_status", int(self.error_status))
        object.__setattr__(self, "retry_after_s", int(self.retry_after_s))
        if self.total_rate > 1.0 + 1e-9:
            raise ValueError("error_rate + rate_limit_rate + hang_rate + reset_rate must be <= 1")

    @property
    def total_rate(self) -> float:
        return self.error_rate + self.rate_limit_rate + self.hang_rate + self.reset_rate

    @property
    def hostile_answers(self) -> tuple[str, ...]:
        """The hostile kinds that replace an answer (not a handshake's)."""
        return tuple(kind for kind in self.hostile if kind in ANSWER_KINDS)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["hostile"] = list(self.hostile)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultSettings:
        """Build from an admin body; unknown keys are an error so typos do not pass silently."""
        names = {f.name for f in dataclasses.fields(cls)}
        clean = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = set(clean) - names
        if unknown:
            raise ValueError(f"unknown fault keys: {sorted(unknown)}")
        return cls(**_integral(cls(), clean))


def _integral(defaults: Any, values: dict[str, Any]) -> dict[str, Any]:
    """JSON may carry 5.0 for 5: turn integral floats into ints where the field is an int."""
    out = dict(values)
    for key, value in values.items():
        default = getattr(defaults, key, None)
        if (isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float)
                and value.is_integer()):
            out[key] = int(value)
    return out


_RUNTIME_CONFIG_KEYS = (
    "latency", "per_token_ms", "per_input_ms", "max_input_tokens", "concurrency", "reject_over_limit", "retry_after_s", "rpm", "tpm",
    "embedding_dim", "default_max_tokens", "max_output_tokens", "hang_max_s", "seed", "invalid_json_rate",
)


@dataclass(frozen=True)
class SimulatorConfig:
    """Every setting of the simulator; ``api_key`` and the values of ``required_headers`` are kept out
    of ``repr`` and ``public_dict`` so they never land in logs.

    ``tls_cert``/``tls_key`` serve HTTPS; ``tls_client_ca`` also requires a client certificate
    signed by that CA (mutual TLS, see ``ssl_context``). ``required_headers`` are (name, value)
    pairs an inference request must carry, else 401 naming the header (not its value).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    latency: str = "0"
    per_token_ms: float = 0.0
    per_input_ms: float = 0.0
    max_input_tokens: int = 0
    seed: int | None = None
    concurrency: int = 0
    reject_over_limit: bool = False
    retry_after_s: int = 1
    rpm: int = 0
    tpm: int = 0
    embedding_dim: int = 16
    default_max_tokens: int = 32
    max_output_tokens: int = 1024
    hang_max_s: float = 600.0
    api_key: str | None = field(default=None, repr=False)
    faults: FaultSettings = field(default_factory=FaultSettings)
    stats_log_interval_s: float = 60.0
    # Share of schema-shaped answers (requests with response_format) made invalid on purpose.
    invalid_json_rate: float = 0.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    required_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # The provider batch APIs (``batches.BatchApis``); changed at runtime by POST /admin/batches.
    batch: BatchSettings = field(default_factory=BatchSettings)
    # Hostile answers (`hostile.py`; the kinds are in `faults`): the size huge-body announces,
    # and the other certificate tls-cert-change presents.
    hostile_size_bytes: int = 1 << 30
    hostile_tls_cert: str | None = None
    hostile_tls_key: str | None = None

    def __post_init__(self) -> None:
        parse_latency(self.latency)
        check_number("port", self.port, maximum=65535, integer=True)
        check_number("per_token_ms", self.per_token_ms)
        check_number("per_input_ms", self.per_input_ms)
        check_number("max_input_tokens", self.max_input_tokens, integer=True)
        check_number("concurrency", self.concurrency, integer=True)
        check_number("retry_after_s", self.retry_after_s, integer=True)
        check_number("rpm", self.rpm, integer=True)
        check_number("tpm", self.tpm, integer=True)
        check_number("embedding_dim", self.embedding_dim, minimum=1, maximum=MAX_EMBEDDING_DIM, integer=True)
        check_number("max_output_tokens", self.max_output_tokens, minimum=1,
                      maximum=MAX_OUTPUT_TOKENS_CAP, integer=True)
        check_number("default_max_tokens", self.default_max_tokens, minimum=1, integer=True)
        check_number("hang_max_s", self.hang_max_s)
        check_number("stats_log_interval_s", self.stats_log_interval_s)
        check_number("invalid_json_rate", self.invalid_json_rate, maximum=1.0)
        check_number("hostile_size_bytes", self.hostile_size_bytes, minimum=1024, integer=True)
        if self.seed is not None:
            check_number("seed", self.seed, minimum=-(2**63), integer=True)
        if not isinstance(self.reject_over_limit, bool):
            raise TypeError("reject_over_limit must be a boolean")
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ValueError("models must be a non-empty list of names")
        if not isinstance(self.faults, FaultSettings):
            raise TypeError("faults must be a FaultSettings")
        if not isinstance(self.batch, BatchSettings):
            raise TypeError("batch must be a BatchSettings")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (it requires client certificates over HTTPS)")
        if (self.hostile_tls_cert is None) != (self.hostile_tls_key is None):
            raise ValueError("hostile_tls_cert and hostile_tls_key go together")
        if self.hostile_tls_cert is not None and self.tls_cert is None:
            raise ValueError("hostile_tls_cert needs tls_cert and tls_key (it replaces that certificate)")
        if "tls-cert-change" in self.faults.hostile and self.hostile_tls_cert is None:
            raise ValueError("hostile kind tls-cert-change needs hostile_tls_cert and hostile_tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "hostile_tls_cert", "hostile_tls_key"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise ValueError(f"{name}: file {value} does not exist")
        if not all(isinstance(h, tuple) and len(h) == 2 and all(isinstance(x, str) and x for x in h)
                   for h in self.required_headers):
            raise ValueError("required_headers must be (name, value) pairs of non-empty strings")

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context, or None for plain HTTP; raises ValueError naming the setting
        when a file is not a usable certificate or key.

        With ``tls_client_ca`` a client certificate is verified when one is presented (an
        untrusted one fails the handshake) and requests that came without one are refused with
        400, as nginx's ``ssl_verify_client on`` does: asyncio's TLS server closes a failed
        handshake without sending the TLS alert, which a client could not tell from a dropped
        connection.
        """
        if self.tls_cert is None or self.tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"tls_cert/tls_key: {self.tls_cert} and {self.tls_key} are not a usable "
                             f"certificate and key ({exc})") from None
        if self.tls_client_ca is not None:
            try:
                context.load_verify_locations(self.tls_client_ca)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"tls_client_ca: {self.tls_client_ca} holds no usable CA certificate ({exc})") from None
            context.verify_mode = ssl.CERT_OPTIONAL
        return context

    def hostile_ssl_context(self) -> ssl.SSLContext | None:
        """The context of the other certificate that ``tls-cert-change`` presents, or None."""
        if self.hostile_tls_cert is None or self.hostile_tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.hostile_tls_cert, self.hostile_tls_key)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"hostile_tls_cert/hostile_tls_key: {self.hostile_tls_cert} and {self.hostile_tls_key} "
                             f"are not a usable certificate and key ({exc})") from None
        return context

    def public_dict(self) -> dict[str, Any]:
        """The settings as JSON-able data, without the API key or the required headers' values."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("api_key", "required_headers")}
        data["models"] = list(self.models)
        data["required_headers"] = [name for name, _ in self.required_headers]
        data["faults"] = self.faults.to_dict()
        data["batch"] = self.batch.to_dict()
        data["api_key_set"] = self.api_key is not None
        return data

    def updated(self, changes: dict[str, Any]) -> SimulatorConfig:
        """Apply an ``/admin/config`` body; only runtime-changeable keys are accepted."""
        clean = {k.replace("-", "_"): v for k, v in changes.items()}
        unknown = set(clean) - set(_RUNTIME_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown or read-only config keys: {sorted(unknown)}")
        if "latency" in clean and not isinstance(clean["latency"], str):
            parse_latency(clean["latency"])
            clean["latency"] = str(clean["latency"])
        return dataclasses.replace(self, **_integral(self, clean))


# --------------------------------------------------------------------------- helpers
