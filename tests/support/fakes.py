"""The fake PyFlink metric group: what the metrics register, readable by a test."""

from __future__ import annotations

from collections.abc import Callable


class MetricGroup:
    """Records gauges and sub-groups as PyFlink's metric group takes them (`udfs.metrics.MetricGroup`).

    ``add_group`` covers both of PyFlink's forms, a named group and a key/value (label) group, and
    returns the same sub-group for the same arguments, so a test reads ``groups[("reason", r)]``.
    """

    def __init__(self) -> None:
        self.gauges: dict[str, Callable[[], int]] = {}
        self.groups: dict[tuple[str, str | None], MetricGroup] = {}

    def gauge(self, name: str, obj: Callable[[], int]) -> None:
        self.gauges[name] = obj

    def add_group(self, name: str, extra: str | None = None) -> MetricGroup:
        return self.groups.setdefault((name, extra), MetricGroup())
