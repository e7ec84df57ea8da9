"""The Python functions Flink runs: decode (with a dead-letter side output) and inference.

They are thin: each turns a Flink value into a call of a pure stage function and turns its
outcome, result or error, into a `SinkRow`. No exception escapes them, because an
exception inside a Flink operator restarts the job, and neither bad data nor a failing
model may do that; an unexpected one is dead-lettered as `internal_error` and logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from pyflink.common import Row, Types
from pyflink.datastream import AsyncFunction, ProcessFunction, RuntimeContext
from pyflink.datastream.output_tag import OutputTag

from udfs import dead_letter
from udfs.config import JobConfig
from udfs.decode import decode, record_id
from udfs.encode import result_row
from udfs.errors import BadInput, InferenceError
from udfs.records import Request, SinkRow, SourceRef

log = logging.getLogger("llmstream.udfs")

SINK_ROW_TYPE = Types.ROW_NAMED(
    ["k", "v", "topic"], [Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.STRING()]
)
DEAD_LETTERS = OutputTag("dead-letters", SINK_ROW_TYPE)


def _to_row(row: SinkRow) -> Row:
    return Row(row.key, row.value, row.topic)


def _epoch_ms(ts: Any) -> int | None:
    if ts is None:
        return None
    to_ms = getattr(ts, "to_epoch_milli", None)
    if to_ms is not None:
        return int(to_ms())
    timestamp = getattr(ts, "timestamp", None)
    return int(timestamp() * 1000) if timestamp is not None else None


def source_of(row: Row) -> SourceRef:
    """The Kafka coordinates of a row read by the input table."""
    return SourceRef(str(row["topic"]), int(row["partition"]), int(row["offset"]), _epoch_ms(row["ts"]))


class DecodeFunction(ProcessFunction):
    """Valid records go on as `Request`s; invalid ones leave by the `DEAD_LETTERS` side output."""

    def __init__(self, config: JobConfig) -> None:
        self._config = config

    def open(self, runtime_context: RuntimeContext) -> None:
        group = runtime_context.get_metrics_group().add_group("llmstream")
        self._records_in = group.counter("records_in")
        self._bad_input = group.counter("bad_input")

    def process_element(self, value: Row, ctx: ProcessFunction.Context) -> Iterator[Any]:
        self._records_in.inc()
        key, raw = value["k"], value["v"]
        source = source_of(value)
        try:
            yield decode(key, raw, source, self._config.limits)
            return
        except BadInput as err:
            failure = err
        except Exception as err:
            log.exception("unexpected error decoding %s-%s@%s", source.topic, source.partition, source.offset)
            failure = BadInput("internal_error", f"{type(err).__name__}: {err}"[:500])
        self._bad_input.inc()
        yield DEAD_LETTERS, _to_row(dead_letter.for_error(
            failure, key=key, value=raw, source=source, record_id=record_id(raw),
            job=self._config.name, topic=self._config.kafka.dead_letter_topic))


class InferenceFunction(AsyncFunction):
    """Calls the model for one request; returns the output row or the dead-letter row.

    The HTTP client is created on the first call because `async_invoke` runs on an event loop
    that PyFlink starts only after `open()`.
    """

    def __init__(self, config: JobConfig) -> None:
        self._config = config
        self._client: Any = None

    def open(self, runtime_context: RuntimeContext) -> None:
        from udfs.metrics import InferenceMetrics

        self._subtasks = runtime_context.get_number_of_parallel_subtasks()
        self._metrics = InferenceMetrics(runtime_context.get_metrics_group().add_group("llmstream"))
        self._client = None
        model = self._config.model
        log.info("inference subtask %s/%s: %s %s model=%s capacity=%s",
                 runtime_context.get_index_of_this_subtask() + 1, self._subtasks, model.api,
                 model.endpoint, model.model, self._config.async_.capacity)

    def _client_in_loop(self) -> Any:
        if self._client is None:
            from udfs.client import InferenceClient

            self._client = InferenceClient(self._config, subtasks=self._subtasks, metrics=self._metrics)
        return self._client

    async def async_invoke(self, value: Request) -> list[Row]:
        kafka = self._config.kafka
        failure: InferenceError | BadInput
        try:
            completion = await self._client_in_loop().complete(value)
            return [_to_row(result_row(value, completion, kafka.output_topic, self._config.limits.max_result_bytes))]
        except (InferenceError, BadInput) as err:
            failure = err
        except Exception as err:
            log.exception("unexpected error in inference for id=%s", value.id)
            failure = BadInput("internal_error", f"{type(err).__name__}: {err}"[:500])
        row = dead_letter.for_error(failure, key=value.key, value=value.raw, source=value.source,
                                    record_id=value.id, job=self._config.name, topic=kafka.dead_letter_topic)
        self._metrics.dead_lettered.inc()
        return [_to_row(row)]

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            asyncio.run(client.close())
        except Exception:
            log.debug("closing the inference client failed", exc_info=True)
