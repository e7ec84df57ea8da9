"""The benchmark's input: identical records and model requests for every approach.

Every approach reads the same kind of record (`{"id", "prompt"}`, the llmstream record
contract) and sends the model the same chat request: the system prompt, the prompt and
`MAX_TOKENS`, exactly what llmstream builds from its config (see `harness.llmstream_config`).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from kafka import KafkaProducer  # type: ignore[import-untyped]

MODEL = "llmstream-sim"
SYSTEM_PROMPT = "You are a concise assistant. Answer in one or two sentences."
MAX_TOKENS = 64
PROMPT = "In one sentence, why does bounded concurrency keep a streaming LLM job stable? (request {seq})"


def record_id(seq: int) -> str:
    return f"r{seq:08d}"


def request_record(seq: int) -> tuple[bytes, bytes]:
    """(key, value) of input record `seq`; the key is its id."""
    rid = record_id(seq)
    return rid.encode(), json.dumps({"id": rid, "prompt": PROMPT.format(seq=seq)}).encode()


def keyed_request_record(seq: int, keys: int) -> tuple[bytes, bytes]:
    """(key, value) of input record `seq` when the input cycles through `keys` Kafka keys (a
    keyed scenario): record `seq` has key `seq mod keys`, so each key's records are `keys` apart."""
    _, value = request_record(seq)
    return f"key-{seq % keys:05d}".encode(), value


def chat_payload(prompt: str) -> dict[str, Any]:
    """The request body the baselines send (llmstream's `build_payload` builds the same one)."""
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
    }


class InputProducer:
    """Produces input records and remembers each id's offset, so losses can be told apart
    from records the approach never reached (see `measure.DeliveryTally`)."""

    def __init__(self, bootstrap: str, topic: str, *, keys: int = 0, delivery_timeout_s: float = 120.0) -> None:
        """`delivery_timeout_s`: how long a record may wait for the broker (retried meanwhile, the
        producer is idempotent); the soak, whose broker restarts take up to ~2 min under load,
        gives it 10 minutes."""
        self.topic = topic
        self.keys = keys  # a keyed scenario's distinct keys (`keyed_request_record`); 0: the key is the id
        self.offsets: dict[str, int] = {}
        self.delivery_timeout_s = delivery_timeout_s
        self._producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5,
                                       batch_size=64 * 1024, delivery_timeout_ms=int(delivery_timeout_s * 1000))
        self._futures: list[tuple[str, Any]] = []
        self._next = 0

    @property
    def produced(self) -> int:
        return self._next

    def send(self, count: int) -> None:
        for _ in range(count):
            key, value = (keyed_request_record(self._next, self.keys) if self.keys
                          else request_record(self._next))
            self._futures.append((record_id(self._next),
                                  self._producer.send(self.topic, key=key, value=value, partition=0)))
            self._next += 1

    def preload(self, count: int, timeout_s: float = 120.0) -> None:
        """`count` records, flushed and acknowledged before this returns."""
        self.send(count)
        self.settle(timeout_s)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Flush and record the offsets of everything sent so far; raises if a send failed."""
        self._producer.flush(timeout=timeout_s)
        for rid, future in self._futures:
            self.offsets[rid] = int(future.get(timeout=timeout_s).offset)
        self._futures.clear()

    def close(self) -> None:
        self._producer.close(timeout=10)


class PacedProducer(threading.Thread):
    """Adds records at `rate_per_s` for `seconds` (scenario c), in small batches every 20 ms."""

    def __init__(self, producer: InputProducer, rate_per_s: float, seconds: float) -> None:
        super().__init__(name="bench-paced-producer", daemon=True)
        self.producer = producer
        self.rate_per_s = rate_per_s
        self.seconds = seconds
        self.error: BaseException | None = None
        self._stop_event = threading.Event()
        self.finished = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        try:
            while not self._stop_event.is_set():
                elapsed = time.monotonic() - started
                due = int(min(elapsed, self.seconds) * self.rate_per_s)
                if due > self.producer.produced:
                    self.producer.send(due - self.producer.produced)
                if elapsed >= self.seconds:
                    break
                self._stop_event.wait(0.02)
            # As long as a record may take to be delivered: a broker restarting at the end of the
            # input (the soak) holds the last records back, it does not fail them.
            self.producer.settle(timeout_s=self.producer.delivery_timeout_s + 30)
        except BaseException as err:  # noqa: BLE001 - reported by the harness
            self.error = err
        finally:
            self.finished.set()

    def stop(self) -> None:
        self._stop_event.set()
