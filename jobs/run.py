"""`llmstream run`: the job in a local Flink mini cluster, with progress and a clean Ctrl-C.

The job is started asynchronously so this process can report progress (the consumer
group's committed offsets against the input's end offsets: exactly what has been
processed and committed) and, on Ctrl-C or SIGTERM, cancel it instead of dying under it.
Records not yet committed at cancellation are read again by the next run from the
group's committed offsets, and their uncommitted outputs were never visible: nothing is
lost, nothing is written twice.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from kafka import KafkaConsumer, TopicPartition

from jobs import jars, preflight
from jobs.pipeline import RunOptions, build_pipeline, create_environment
from udfs.config import JobConfig

log = logging.getLogger("llmstream.run")

TERMINAL_STATES = {"FINISHED", "CANCELED", "FAILED"}


class GroupProgress:
    """Committed offsets of the job's group vs the input's end offsets."""

    def __init__(self, config: JobConfig) -> None:
        self._topic = config.kafka.input_topic
        self._consumer = KafkaConsumer(
            bootstrap_servers=config.kafka.bootstrap_servers,
            group_id=config.kafka.group_id,
            enable_auto_commit=False,
            client_id="llmstream-progress",
        )

    def snapshot(self) -> tuple[int, int]:
        """(committed, end) summed over the input's partitions."""
        partitions = self._consumer.partitions_for_topic(self._topic) or set()
        tps = [TopicPartition(self._topic, p) for p in sorted(partitions)]
        end = self._consumer.end_offsets(tps) if tps else {}
        committed = sum((self._consumer.committed(tp) or 0) for tp in tps)
        return committed, sum(end.values())

    def close(self) -> None:
        self._consumer.close()


def _status(job_client: object) -> str:
    return str(job_client.get_job_status().result()).split(".")[-1]  # type: ignore[attr-defined]


def run_job(
    config: JobConfig,
    options: RunOptions = RunOptions(),
    *,
    progress_every_s: float = 5.0,
    report: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> str:
    """Runs the job until it finishes, fails, or `stop` is set / Ctrl-C; returns the final state."""
    preflight.check(config)
    jars.ensure("connector")
    env = create_environment(config, jars.connector_jar_urls())
    build_pipeline(env, config, options)
    job_client = env.execute_async(config.name)
    job_id = str(job_client.get_job_id())
    report(f"llmstream: job {config.name} ({job_id}) started in a local mini cluster; "
           f"{config.kafka.input_topic} -> {config.kafka.output_topic} | {config.kafka.dead_letter_topic}")
    stop = stop or threading.Event()
    previous: dict[int, Callable[..., object] | int | None] = {}

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        report(f"llmstream: {signal.Signals(signum).name} received, cancelling the job "
               "(uncommitted work is redone by the next run)")
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, request_stop)
    progress = GroupProgress(config)
    try:
        started, last_report, state = time.monotonic(), 0.0, "RUNNING"
        while True:
            state = _status(job_client)
            if state in TERMINAL_STATES:
                break
            if stop.is_set():
                job_client.cancel().result()
                stop.clear()
                continue
            now = time.monotonic()
            if progress_every_s and now - last_report >= progress_every_s:
                last_report = now
                try:
                    committed, end = progress.snapshot()
                    report(f"llmstream: {now - started:6.0f}s  {state:<9} committed {committed}/{end} "
                           f"input records (lag {max(end - committed, 0)})")
                except Exception as err:  # noqa: BLE001 - progress is best effort, the job is not
                    log.debug("progress unavailable: %s", err)
            time.sleep(0.5)
        if state == "FINISHED":
            committed, end = progress.snapshot()
            report(f"llmstream: job finished; committed {committed}/{end} input records")
        elif state == "FAILED":
            try:
                job_client.get_job_execution_result().result()
            except Exception as err:  # noqa: BLE001 - reported, then returned as the state
                report(f"llmstream: job failed: {str(err).splitlines()[0][:500]}")
        else:
            report(f"llmstream: job {state.lower()}")
        return state
    finally:
        progress.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def exit_code(state: str) -> int:
    """0 for a finished or deliberately cancelled job, 1 for a failed one."""
    return 1 if state == "FAILED" else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: llmstream run --config FILE")
