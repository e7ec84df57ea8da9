"""Reading what a Prometheus endpoint serves (Flink's reporter, in the mini cluster or standalone)."""

from __future__ import annotations

import math
import re

Samples = dict[str, list[tuple[dict[str, str], float]]]
"""Metric name -> [(labels, value)]."""

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> Samples:
    """Prometheus text format: metric name -> [(labels, value)]."""
    samples: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = dict(_LABEL.findall(match.group(3) or ""))
        samples.setdefault(match.group(1), []).append((labels, float(match.group(4))))
    return samples


def total(samples: Samples, name: str) -> float:
    """The sum of ``name`` over all its label sets (NaN left out: a gauge not yet set)."""
    return sum(value for _, value in samples.get(name, []) if not math.isnan(value))
