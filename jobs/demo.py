"""`llmstream demo`: the whole system on one machine, from nothing, in about a minute.

Starts a throwaway Kafka broker and the model-server simulator, produces the bundled
sample prompts (with a few deliberately broken records), runs the job until the end of
the input, prints results and dead letters as a read_committed consumer sees them, then
the counts, and shuts everything down, also on Ctrl-C.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer

from jobs import jars, local_kafka, model_server
from jobs.pipeline import RunOptions
from jobs.run import run_job
from udfs.config import load_config, with_overrides

SAMPLE = Path(__file__).resolve().parent / "data" / "sample_prompts.jsonl"
SIMULATOR_ARGS = ["--latency", "lognormal:150:1200", "--per-token-ms", "2", "--concurrency", "32"]


def sample_records(limit: int | None = None) -> list[tuple[bytes | None, bytes]]:
    """The bundled prompts as (key, value); the key is the id where the line has one."""
    records = []
    for line in SAMPLE.read_text().splitlines()[:limit]:
        try:
            record_id = json.loads(line).get("id")
        except (ValueError, AttributeError):
            record_id = None
        records.append((record_id.encode() if isinstance(record_id, str) else None, line.encode()))
    return records


def _short(text: Any, width: int = 60) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


class ResultPrinter(threading.Thread):
    """Prints each output and dead letter as soon as it is committed (read_committed)."""

    def __init__(self, bootstrap: str, output: str, dead_letter: str) -> None:
        super().__init__(daemon=True, name="demo-results")
        self.counts = {"out": 0, "dead": 0}
        self.ids: set[str] = set()
        self._output = output
        self._stop_event = threading.Event()
        self._consumer = KafkaConsumer(
            output, dead_letter, bootstrap_servers=bootstrap, isolation_level="read_committed",
            auto_offset_reset="earliest", enable_auto_commit=False, consumer_timeout_ms=500,
        )

    def run(self) -> None:
        while not self._stop_event.is_set():
            for message in self._consumer:
                body = json.loads(message.value)
                if message.topic == self._output:
                    self.counts["out"] += 1
                    self.ids.add(body["id"])
                    print(f"  ok   {body['id']:<12} {_short(body['output'], 56):<56} "
                          f"{body['latency_ms']:7.0f} ms  {body['usage']['total_tokens']:4d} tok")
                else:
                    self.counts["dead"] += 1
                    print(f"  DEAD {body.get('id')!s:<12} {body['reason']}: {_short(body['error'], 50)}")
                if self._stop_event.is_set():
                    break
        self._consumer.close()

    def stop(self) -> None:
        self._stop_event.set()


def run_demo(records: int | None = None, keep: bool = False) -> int:
    """Runs the demo; returns 0 when every input record was answered or dead-lettered."""
    jars.ensure("broker")
    jars.ensure("connector")
    workdir = Path(tempfile.mkdtemp(prefix="llmstream-demo-"))
    broker = local_kafka.LocalBroker(local_kafka.BrokerConfig(
        port=local_kafka.free_port(), controller_port=local_kafka.free_port(), data_dir=workdir / "kafka"))
    simulator = None
    printer = None
    try:
        print(f"llmstream demo: starting a Kafka broker ({workdir / 'kafka'}) ...")
        broker.start()
        print("llmstream demo: starting the model-server SIMULATOR (lognormal latency, median 150 ms) ...")
        simulator = model_server.spawn(SIMULATOR_ARGS)
        config = with_overrides(
            load_config(),
            kafka={"bootstrap_servers": broker.bootstrap_servers, "create_topics": True},
            model={"endpoint": simulator.url},
            checkpointing={"interval_ms": 2000, "directory": str(workdir / "state")},
        )
        kafka = config.kafka
        local_kafka.create_topics(broker.bootstrap_servers,
                                  [kafka.input_topic, kafka.output_topic, kafka.dead_letter_topic],
                                  partitions=kafka.topic_partitions)
        sample = sample_records(records)
        local_kafka.produce(broker.bootstrap_servers, kafka.input_topic, sample)
        print(f"llmstream demo: produced {len(sample)} records to {kafka.input_topic}; running the job until "
              "the end of the input (results appear as checkpoints commit them)")
        printer = ResultPrinter(broker.bootstrap_servers, kafka.output_topic, kafka.dead_letter_topic)
        printer.start()
        started = time.monotonic()
        state = run_job(config, RunOptions(until_end=True), progress_every_s=5.0)
        deadline = time.monotonic() + 15
        while sum(printer.counts.values()) < len(sample) and time.monotonic() < deadline and state == "FINISHED":
            time.sleep(0.2)
        printer.stop()
        printer.join(timeout=5)
        out, dead = printer.counts["out"], printer.counts["dead"]
        print(f"\nllmstream demo: {state.lower()} in {time.monotonic() - started:.1f} s — in {len(sample)}, "
              f"out {out}, dead-lettered {dead}, missing {len(sample) - out - dead}")
        if simulator is not None:
            stats = simulator.stats()
            print(f"llmstream demo: simulator served {stats.get('served')} requests, "
                  f"max in flight {stats.get('max_in_flight')}")
        return 0 if state == "FINISHED" and out + dead == len(sample) else 1
    finally:
        if printer is not None:
            printer.stop()
        if simulator is not None:
            simulator.stop()
        if keep:
            print(f"llmstream demo: broker left running at {broker.bootstrap_servers} "
                  f"(stop: llmstream kafka stop --data-dir {workdir / 'kafka'})")
        else:
            broker.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        print("llmstream demo: shut down")
