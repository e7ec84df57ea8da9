"""The two hand-written consumers llmstream is compared with, each run in its own process.

    python -m jobs.dev.bench.baselines sequential|semaphore-gather --bootstrap HOST:PORT \\
        --input T --output T --dead-letter T --group G --endpoint URL [--records N] [--max-seconds S]

`sequential` is the naive asyncio consumer: one record at a time, await the model, produce
the answer. `semaphore-gather` is the usual fix: a semaphore of 10 around the calls and the
tasks gathered every 100 records, then the answers produced. Both use kafka-python for
Kafka and aiohttp for HTTP, commit the group's offsets only for records whose answers
were flushed (so stopping them loses nothing), and write the same output fields llmstream
does (`id`, `output`, `timestamps.produced/started/completed`, epoch ms). They stop after
`--records` answers, after `--max-seconds`, or on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kafka import KafkaConsumer, KafkaProducer, TopicPartition  # type: ignore[import-untyped]
from kafka.structs import OffsetAndMetadata  # type: ignore[import-untyped]

from jobs.dev.bench.workload import chat_payload

APPROACHES = ("sequential", "semaphore-gather")
GATHER_CONCURRENCY = 10
GATHER_EVERY = 100
COMMIT_EVERY_S = 1.0
TOPIC_WAIT_S = 60.0
METADATA_MAX_AGE_MS = 10_000


def _subscribe_when_known(consumer: KafkaConsumer, topic: str) -> None:
    """Subscribes once the client's metadata lists the topic's partitions.

    kafka-python can send its first JoinGroup before the metadata for a just-created topic has
    arrived; the leader then assigns itself nothing ("No partition metadata for topic") and
    waits for a metadata change to rejoin. Once in a CI run that change never came within the
    run's 300 s, and the baseline answered nothing. Knowing the partitions before joining
    removes the race; the short metadata age bounds the wait if a rejoin is ever missed again.
    """
    deadline = time.monotonic() + TOPIC_WAIT_S
    while not consumer.partitions_for_topic(topic):
        if time.monotonic() >= deadline:
            raise SystemExit(f"baseline: topic {topic} has no partitions after {TOPIC_WAIT_S:g} s")
        time.sleep(0.2)
    consumer.subscribe([topic])


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Answer:
    """One record's outcome: the output value, or the error that sends it to the dead-letter topic."""

    topic: str
    key: bytes | None
    value: bytes


@dataclass
class Progress:
    done: int = 0
    offsets: dict[TopicPartition, int] = field(default_factory=dict)


class Baseline:
    """Shared plumbing: Kafka in and out, the HTTP session, commits and the stop conditions."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url = args.endpoint.rstrip("/") + "/chat/completions"
        self.consumer = KafkaConsumer(
            bootstrap_servers=args.bootstrap, group_id=args.group, auto_offset_reset="earliest",
            enable_auto_commit=False, client_id=f"bench-{args.approach}", metadata_max_age_ms=METADATA_MAX_AGE_MS,
        )
        _subscribe_when_known(self.consumer, args.input)
        self.producer = KafkaProducer(bootstrap_servers=args.bootstrap, client_id=f"bench-{args.approach}")
        self.progress = Progress()
        self.stop = asyncio.Event()
        self.deadline = time.monotonic() + args.max_seconds if args.max_seconds > 0 else float("inf")
        self._last_commit = time.monotonic()

    def should_stop(self) -> bool:
        if self.stop.is_set() or time.monotonic() >= self.deadline:
            return True
        return bool(self.args.records) and self.progress.done >= self.args.records

    async def answer(self, session: aiohttp.ClientSession, message: Any) -> Answer:
        """Calls the model for one input record; a failure becomes a dead-letter answer."""
        started = _now_ms()
        try:
            record = json.loads(message.value)
            async with session.post(self.url, json=chat_payload(record["prompt"])) as response:
                response.raise_for_status()
                body = await response.json()
            output = body["choices"][0]["message"]["content"]
        except Exception as err:  # noqa: BLE001 - a failed call is reported as data, as llmstream does
            error = {"id": _record_id(message.value), "error": f"{type(err).__name__}: {err}"[:300],
                     "timestamps": {"produced": message.timestamp, "started": started, "completed": _now_ms()}}
            return Answer(self.args.dead_letter, message.key, json.dumps(error).encode())
        value = {"id": record["id"], "output": output, "approach": self.args.approach,
                 "timestamps": {"produced": message.timestamp, "started": started, "completed": _now_ms()}}
        return Answer(self.args.output, message.key, json.dumps(value).encode())

    def emit(self, message: Any, answer: Answer) -> None:
        self.producer.send(answer.topic, key=answer.key, value=answer.value)
        self.progress.offsets[TopicPartition(message.topic, message.partition)] = message.offset + 1
        self.progress.done += 1

    def commit(self, force: bool = False) -> None:
        """Flush the answers, then commit the offsets after them (at least once, never lost)."""
        if not self.progress.offsets or not (force or time.monotonic() - self._last_commit >= COMMIT_EVERY_S):
            return
        self.producer.flush()
        self.consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in self.progress.offsets.items()})
        self.progress.offsets.clear()
        self._last_commit = time.monotonic()

    def poll(self, max_records: int) -> list[Any]:
        batches = self.consumer.poll(timeout_ms=100, max_records=max_records)
        return [message for batch in batches.values() for message in batch]

    def close(self) -> None:
        self.commit(force=True)
        self.producer.close(timeout=30)
        self.consumer.close(autocommit=False)


async def sequential(baseline: Baseline) -> None:
    """One record at a time: await the model, produce the answer."""
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        while not baseline.should_stop():
            for message in baseline.poll(max_records=100):
                if baseline.should_stop():
                    break
                baseline.emit(message, await baseline.answer(session, message))
                baseline.commit()
            baseline.commit()


async def semaphore_gather(baseline: Baseline) -> None:
    """Up to 10 calls at once; every 100 records (or when the input runs dry) gather, produce, commit."""
    semaphore = asyncio.Semaphore(GATHER_CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=GATHER_CONCURRENCY)

    async with aiohttp.ClientSession(connector=connector) as session:

        async def bounded(message: Any) -> Answer:
            async with semaphore:
                return await baseline.answer(session, message)

        pending: list[Any] = []
        while not baseline.should_stop():
            wanted = GATHER_EVERY - len(pending)
            if baseline.args.records:
                wanted = min(wanted, baseline.args.records - baseline.progress.done - len(pending))
            fresh = baseline.poll(max_records=wanted) if wanted > 0 else []
            pending.extend(fresh)
            if pending and (len(pending) >= GATHER_EVERY or not fresh or wanted <= 0):
                answers = await asyncio.gather(*(bounded(m) for m in pending))
                for message, answer in zip(pending, answers, strict=True):
                    baseline.emit(message, answer)
                pending.clear()
                baseline.commit(force=True)


def _record_id(value: bytes | None) -> str | None:
    try:
        found = json.loads(value or b"").get("id")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


async def _run(args: argparse.Namespace) -> int:
    baseline = Baseline(args)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, baseline.stop.set)
    started = time.monotonic()
    try:
        await (sequential if args.approach == "sequential" else semaphore_gather)(baseline)
    finally:
        baseline.close()
    print(f"baseline {args.approach}: {baseline.progress.done} records in {time.monotonic() - started:.1f} s",
          flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.bench.baselines", description=__doc__.splitlines()[0])
    parser.add_argument("approach", choices=APPROACHES)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--dead-letter", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--endpoint", required=True, help="the model server's base URL, ending in /v1")
    parser.add_argument("--records", type=int, default=0, help="stop after this many answers (0: no limit)")
    parser.add_argument("--max-seconds", type=float, default=0, help="stop after this long (0: no limit)")
    return parser


def main(argv: list[str] | None = None) -> int:
    # kafka-python's group membership and assignment lines go to the run's log: a run that
    # answers nothing then says whether it ever joined its group and got its partition.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka.coordinator").setLevel(logging.INFO)
    logging.getLogger("kafka.consumer.subscription_state").setLevel(logging.INFO)
    return asyncio.run(_run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
