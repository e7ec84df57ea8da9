"""A fake of the PyFlink runtime the inference stage sees: keyed `MapState`, timers, metric groups
and the runtime context, and a `Harness` that drives one `InferenceStage` the way PyFlink's keyed
operation does. No JVM.

A fake checkpoint is a copy of the fake state at a moment between two function calls, which is
where Flink takes it (the Python worker finishes its bundle first).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pyflink.common import Row

from tests.support.fakes import MetricGroup
from udfs.config import JobConfig
from udfs.lanes.keyed import FLUSH_AT, InferenceStage

if TYPE_CHECKING:
    from pyflink.datastream import KeyedProcessFunction


class KeyedState:
    """Keyed MapState as PyFlink's backend serves it: one map per current key."""

    def __init__(self, data: dict[Any, dict[str, Any]] | None = None) -> None:
        self.data: dict[Any, dict[str, Any]] = data or {}
        self.current_key: Any = None

    def _map(self) -> dict[str, Any]:
        return self.data.setdefault(self.current_key, {})

    def put(self, key: str, value: Any) -> None:
        self._map()[key] = copy.deepcopy(value)

    def get(self, key: str) -> Any:
        return self._map().get(key)

    def remove(self, key: str) -> None:
        del self._map()[key]  # a KeyError here means a handle removed twice or never stored

    def values(self) -> Iterable[Any]:
        return list(self._map().values())

    def keys(self) -> Iterable[str]:
        return list(self._map().keys())

    def items(self) -> Iterable[tuple[str, Any]]:
        return list(self._map().items())

    def snapshot(self) -> dict[Any, dict[str, Any]]:
        return copy.deepcopy({k: v for k, v in self.data.items() if v})


class RuntimeContext:
    """`metrics=False`: no metric group, as PyFlink gives with `python.metric.enabled: false`.
    The inference stage's one map (`pending`) is `state`; any other descriptor gets a map of its
    own in `named` (the batch lane keeps three)."""

    def __init__(self, state: KeyedState, *, metrics: bool = True, named: dict[str, KeyedState] | None = None) -> None:
        self.state = state
        self.named = named if named is not None else {}
        self.group = MetricGroup() if metrics else None

    def get_metrics_group(self) -> MetricGroup | None:
        return self.group

    def get_map_state(self, descriptor: Any) -> KeyedState:
        name = descriptor.get_name()
        if name == "pending":
            return self.state
        return self.named.setdefault(name, KeyedState())

    def states(self) -> list[KeyedState]:
        return [self.state, *self.named.values()]

    def get_number_of_parallel_subtasks(self) -> int:
        return 1

    def get_index_of_this_subtask(self) -> int:
        return 0


class TimerService:
    def __init__(self) -> None:
        self.processing: set[tuple[Any, int]] = set()
        self.event: set[tuple[Any, int]] = set()
        self.key: Any = None

    def current_processing_time(self) -> int:
        return int(time.time() * 1000)

    def register_processing_time_timer(self, at: int) -> None:
        self.processing.add((self.key, at))

    def register_event_time_timer(self, at: int) -> None:
        self.event.add((self.key, at))


class Context:
    def __init__(self, timers: TimerService) -> None:
        self.timers = timers
        self.key: Any = None

    def get_current_key(self) -> Any:
        return self.key

    def timer_service(self) -> TimerService:
        return self.timers


class Harness:
    """Drives one function instance the way PyFlink's keyed operation does."""

    def __init__(self, config: JobConfig, state: KeyedState | None = None, *, gate_dir: str | None = None,
                 metrics: bool = True, function: KeyedProcessFunction | None = None,
                 named: dict[str, KeyedState] | None = None) -> None:
        """`function`: another keyed function than the inference stage (the batch lane); `named`: the
        maps of its other state descriptors (a fake checkpoint of them: `snapshot_named`)."""
        self.state = state or KeyedState()
        self.timers = TimerService()
        self.ctx = Context(self.timers)
        self.function = function if function is not None else InferenceStage(config, gate_dir=gate_dir)
        self.runtime = RuntimeContext(self.state, metrics=metrics, named=named)
        self.function.open(self.runtime)  # type: ignore[arg-type]
        self.out: list[Row] = []

    def _at(self, key: Any) -> None:
        for state in self.runtime.states():
            state.current_key = key
        self.ctx.key = self.timers.key = key

    def snapshot_named(self) -> dict[str, KeyedState]:
        """A fake checkpoint of the named maps, to open another instance on (`named=`)."""
        return {name: KeyedState(state.snapshot()) for name, state in self.runtime.named.items()}

    def element(self, bucket: int, value: bytes | None, offset: int, key: bytes | None = b"k", *,
                topic: str = "in", partition: int = 0, headers: dict[str, bytes | None] | None = None) -> None:
        """One input row as the source table hands it over (`udfs.lanes.keyed.INPUT_ROW_TYPE`):
        `headers` is the connector's header map (empty when the record has none)."""
        self._at(bucket)
        row = Row(key, value, topic, partition, offset, 1_700_000_000_000, {} if headers is None else headers)
        self.out.extend(self.function.process_element(row, self.ctx))  # type: ignore[arg-type]

    def tick(self, bucket: int) -> None:
        self._at(bucket)
        self.out.extend(self.function.process_element(None, self.ctx))  # type: ignore[arg-type]

    def fire(self, bucket: int, timestamp: int) -> None:
        self._at(bucket)
        self.out.extend(self.function.on_timer(timestamp, self.ctx))  # type: ignore[arg-type]

    def fire_due_processing_timers(self) -> None:
        due = sorted(self.timers.processing, key=lambda t: t[1])
        self.timers.processing.clear()
        for bucket, at in due:
            self.fire(bucket, at)

    def end_of_input(self) -> None:
        """The final MAX watermark: every event-time timer fires."""
        for bucket, at in sorted(self.timers.event):
            assert at == FLUSH_AT
            self.fire(bucket, at)
        self.timers.event.clear()

    def metric(self, name: str) -> int:
        return int(getattr(self.function._metrics, name).value)

    def close(self) -> None:
        self.function.close()

    def bodies(self, topic: str) -> list[dict[str, Any]]:
        return [json.loads(bytes(r[1])) for r in self.out if r[2] == topic]

    def headers(self, topic: str) -> list[dict[str, bytes | None] | None]:
        """The headers of each row written to `topic`, in order (None: no headers)."""
        return [r[3] for r in self.out if r[2] == topic]


def record(i: int) -> bytes:
    return json.dumps({"id": f"id-{i}", "prompt": f"question {i}"}).encode()
