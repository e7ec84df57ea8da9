"""`llmstream run`: the job in a local Flink mini cluster, with progress and a clean Ctrl-C.

The job is started asynchronously so this process can report progress (the consumer
group's committed offsets against the input's end offsets: exactly what has been
processed and committed) and, on Ctrl-C or SIGTERM, cancel it instead of dying under it.
Records not yet committed at cancellation are read again by the next run from the
group's committed offsets, and their uncommitted outputs were never visible: nothing is
lost, nothing is written twice.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from jobs import jars, preflight
from jobs.pipeline import RunOptions, build_pipeline, create_environment
from udfs.config import JobConfig

log = logging.getLogger("llmstream.run")

class GroupProgress:
    """The job's consumer group on the input topic: committed offsets vs end offsets."""

    def __init__(self, config: JobConfig) -> None:
        self._topic = config.kafka.input_topic
        self._consumer = KafkaConsumer(
            bootstrap_servers=config.kafka.bootstrap_servers,
            group_id=config.kafka.group_id,
            enable_auto_commit=False,
            client_id="llmstream-progress",
        )

    def _partitions(self) -> list[TopicPartition]:
        partitions = self._consumer.partitions_for_topic(self._topic) or set()
        return [TopicPartition(self._topic, p) for p in sorted(partitions)]

    def end_offsets(self) -> dict[int, int]:
        """The input's end offset per partition, now."""
        tps = self._partitions()
        return {tp.partition: offset for tp, offset in (self._consumer.end_offsets(tps) if tps else {}).items()}

    def snapshot(self) -> tuple[int, int]:
        """(committed, end) summed over the input's partitions."""
        tps = self._partitions()
        end = self._consumer.end_offsets(tps) if tps else {}
        committed = sum((self._consumer.committed(tp) or 0) for tp in tps)
        return committed, sum(end.values())

    def commit_at_least(self, offsets: dict[int, int]) -> None:
        """Moves the group's committed offsets forward to `offsets` (never back).

        Flink's Kafka source commits its final offsets asynchronously and can close before the
        commit is sent, so after a backfill FINISHED (every record up to `offsets` processed and
        its output committed by the final checkpoint) the runner makes the group say so too;
        otherwise the next run would read the tail again and write it twice.
        """
        forward = {}
        for partition, offset in offsets.items():
            tp = TopicPartition(self._topic, partition)
            if (self._consumer.committed(tp) or 0) < offset:
                forward[tp] = OffsetAndMetadata(offset, "llmstream backfill end", -1)
        if forward:
            log.info("committing backfill end offsets for the group: %s",
                     {tp.partition: om.offset for tp, om in forward.items()})
            self._consumer.commit(forward)

    def close(self) -> None:
        self._consumer.close()


def _status(job_client: Any) -> str:
    """The job's state, or "ENDED" once a mini cluster has shut down after the job."""
    try:
        return str(job_client.get_job_status().result()).split(".")[-1]
    except Exception:  # noqa: BLE001 - the mini cluster is gone: the job has ended
        return "ENDED"


@contextlib.contextmanager
def _cancel_on_signals(stop: threading.Event, report: Callable[[str], None]) -> Iterator[None]:
    """Turns SIGINT/SIGTERM into `stop` (a cancel request) instead of killing this process
    under a running job; handlers are restored afterwards."""
    def request_stop(signum: int, _frame: FrameType | None) -> None:
        report(f"llmstream: {signal.Signals(signum).name} received, cancelling the job "
               "(uncommitted work is redone by the next run)")
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_job(
    config: JobConfig,
    options: RunOptions | None = None,
    *,
    progress_every_s: float = 5.0,
    report: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> str:
    """Runs the job until it finishes, fails, or `stop` is set / Ctrl-C; returns the final state:
    FINISHED, CANCELED or FAILED."""
    options = options or RunOptions()
    stop = stop or threading.Event()
    preflight.check(config)
    jars.ensure("connector")
    with contextlib.closing(GroupProgress(config)) as progress, _cancel_on_signals(stop, report):
        if options.until_end and options.stop_offsets is None:
            options = RunOptions(until_end=True, stop_offsets=progress.end_offsets())
        env = create_environment(config, jars.connector_jar_urls())
        build_pipeline(env, config, options)
        job_client = env.execute_async(config.name)
        report(f"llmstream: job {config.name} ({job_client.get_job_id()}) started in a local mini cluster; "
               f"{config.kafka.input_topic} -> {config.kafka.output_topic} | {config.kafka.dead_letter_topic}")
        result = job_client.get_job_execution_result()
        started, last_report, cancelled = time.monotonic(), 0.0, False
        while not result.done():
            if stop.is_set() and not cancelled:
                cancelled = True
                job_client.cancel()
            now = time.monotonic()
            if progress_every_s and now - last_report >= progress_every_s:
                last_report = now
                try:
                    committed, end = progress.snapshot()
                    report(f"llmstream: {now - started:6.0f}s  {_status(job_client):<9} committed "
                           f"{committed}/{end} input records (lag {max(end - committed, 0)})")
                except Exception as err:  # noqa: BLE001 - progress is best effort, the job is not
                    log.debug("progress unavailable: %s", err)
            time.sleep(0.2)
        try:
            result.result()
        except Exception as err:  # noqa: BLE001 - reported, then returned as the state
            if cancelled:
                report("llmstream: job cancelled")
                return "CANCELED"
            report(f"llmstream: job failed: {_root_cause(err)}")
            return "FAILED"
        if options.stop_offsets:
            progress.commit_at_least(options.stop_offsets)
        committed, end = progress.snapshot()
        report(f"llmstream: job finished; committed {committed}/{end} input records")
        return "FINISHED"


def _root_cause(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if "Exception:" in line or "Error:" in line]
    return (lines[-1] if lines else str(err).splitlines()[0] if str(err) else type(err).__name__).strip()[:500]


def exit_code(state: str) -> int:
    """0 for a finished or deliberately cancelled job, 1 for a failed one."""
    return 1 if state == "FAILED" else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: llmstream run --config FILE")
