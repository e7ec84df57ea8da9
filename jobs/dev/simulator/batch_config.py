"""The settings of the simulator's provider batch APIs (``BatchSettings``) and their ``--batch-*`` flags.

Every value is checked at construction, so a bad flag or ``POST /admin/batches`` body fails with a
message naming the key. Durations are ranges: each batch draws its own value, uniformly, when it
is created (``10:120`` or ``[10, 120]``; one number is a fixed duration).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

Range = tuple[float, float]

COMPLETION_WINDOW_S = 24 * 3600.0
"""Both providers' window: a batch not ended 24 h after its creation expires."""
MIB = 1024 * 1024


def check_number(name: str, value: Any, *, minimum: float = 0.0, maximum: float | None = None,
                 integer: bool = False) -> None:
    """As ``config.check_number`` (which imports this module, so it is not imported here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if integer and not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def parse_range(name: str, value: Any) -> Range:
    """``"10:120"``, ``"5"``, ``5``, ``[10, 120]`` -> (low, high) seconds, 0 <= low <= high."""
    parts: list[Any]
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(":")]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        parts = [value]
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        numbers = [float(p) if isinstance(p, str) else p for p in parts]
        for number in numbers:
            check_number(name, number)
    except (ValueError, TypeError):
        raise ValueError(f"{name} must be seconds or a range LOW:HIGH of seconds >= 0, got {value!r}") from None
    low, high = float(numbers[0]), float(numbers[-1])
    if high < low:
        raise ValueError(f"{name}: the range {value!r} ends before it starts")
    return low, high


def format_range(value: Range) -> str:
    low, high = value
    return f"{low:g}" if low == high else f"{low:g}:{high:g}"


@dataclass(frozen=True)
class BatchSettings:
    """How the simulator's batches behave (``batch_engine.BatchEngine`` runs them).

    ``validating_s``, ``delay_s`` and ``finalizing_s`` are drawn per batch: how long it validates,
    how long answering its requests takes (spread evenly over that time, in random order), and how
    long it stays ``finalizing`` (Anthropic: still ``in_progress``, every request answered) before
    its results are out; a cancelled batch also takes ``finalizing_s`` in ``cancelling``.
    ``error_rate`` of the requests fail with ``error_status`` (a per-request failure, in the
    error file / an ``errored`` result). ``time_scale`` shortens the 24 h completion window to
    24 h / time_scale on the real clock (``expires_at`` says so), so expiry can be seen quickly.
    The limits are the providers' own unless a test lowers them.
    """

    validating_s: Range = (0.5, 0.5)
    delay_s: Range = (1.0, 5.0)
    finalizing_s: Range = (0.5, 0.5)
    error_rate: float = 0.0
    error_status: int = 500
    time_scale: float = 1.0
    openai_max_requests: int = 50_000
    openai_max_bytes: int = 200 * MIB
    anthropic_max_requests: int = 100_000
    anthropic_max_bytes: int = 256 * MIB

    def __post_init__(self) -> None:
        for name in ("validating_s", "delay_s", "finalizing_s"):
            object.__setattr__(self, name, parse_range(name, getattr(self, name)))
        check_number("error_rate", self.error_rate, maximum=1.0)
        check_number("error_status", self.error_status, minimum=400, maximum=599, integer=True)
        check_number("time_scale", self.time_scale, minimum=1e-6)
        for name in ("openai_max_requests", "openai_max_bytes", "anthropic_max_requests", "anthropic_max_bytes"):
            check_number(name, getattr(self, name), minimum=1, integer=True)
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "error_rate", float(self.error_rate))
        object.__setattr__(self, "error_status", int(self.error_status))
        object.__setattr__(self, "time_scale", float(self.time_scale))

    @property
    def window_s(self) -> float:
        """The completion window on the real clock: 24 h / ``time_scale``."""
        return COMPLETION_WINDOW_S / self.time_scale

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("validating_s", "delay_s", "finalizing_s"):
            data[name] = format_range(getattr(self, name))
        data["window_s"] = round(self.window_s, 3)
        return data

    def updated(self, changes: dict[str, Any]) -> BatchSettings:
        """Apply a ``POST /admin/batches`` body (partial; ``-`` or ``_`` in names); unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(self)}
        clean = {k.replace("-", "_"): v for k, v in changes.items()}
        unknown = set(clean) - names
        if unknown:
            raise ValueError(f"unknown batch settings: {sorted(unknown)} (known: {sorted(names)})")
        for key, value in list(clean.items()):
            if isinstance(value, float) and value.is_integer() and isinstance(getattr(self, key), int):
                clean[key] = int(value)
        return dataclasses.replace(self, **clean)


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--batch-*`` flags of ``llmstream model-server``."""
    d = BatchSettings()
    group = parser.add_argument_group(
        "provider batch APIs (OpenAI /v1/files + /v1/batches, Anthropic /v1/messages/batches; "
        "change at runtime with POST /admin/batches, force a batch's outcome with POST /admin/batches/ID)")
    group.add_argument("--batch-delay-s", default=format_range(d.delay_s), metavar="LOW:HIGH",
                       help="how long a batch takes to answer its requests, drawn per batch, e.g. 10:120 "
                            "(default %(default)s)")
    group.add_argument("--batch-validating-s", default=format_range(d.validating_s), metavar="LOW:HIGH",
                       help="how long an OpenAI batch stays 'validating' (default %(default)s)")
    group.add_argument("--batch-finalizing-s", default=format_range(d.finalizing_s), metavar="LOW:HIGH",
                       help="how long a batch stays 'finalizing' (and 'cancelling') before its results are "
                            "out (default %(default)s)")
    group.add_argument("--batch-error-rate", type=float, default=d.error_rate,
                       help="fraction of batched requests that fail (error file / 'errored' result) "
                            "(default %(default)s)")
    group.add_argument("--batch-error-status", type=int, default=d.error_status,
                       help="HTTP status of those failures (default %(default)s)")
    group.add_argument("--batch-time-scale", type=float, default=d.time_scale,
                       help="the 24 h completion window lasts 24 h / this on the real clock, e.g. 1440: one "
                            "minute (default %(default)s)")


def batch_settings_from_args(args: argparse.Namespace) -> BatchSettings:
    return BatchSettings(
        validating_s=parse_range("--batch-validating-s", args.batch_validating_s),
        delay_s=parse_range("--batch-delay-s", args.batch_delay_s),
        finalizing_s=parse_range("--batch-finalizing-s", args.batch_finalizing_s),
        error_rate=args.batch_error_rate,
        error_status=args.batch_error_status,
        time_scale=args.batch_time_scale,
    )


def sample(value: Range, rng: Any) -> float:
    """A duration drawn from a range (its low end when the range is one value)."""
    low, high = value
    return low if high <= low else float(rng.uniform(low, high))
