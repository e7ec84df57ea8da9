"""One verdict for every run: what a downstream exactly-once consumer saw, against what went in.

The fault and restart tests, the estate's fault table and ``python -m jobs.dev.history`` all count
through this module, so every run is judged the same way (after Jepsen's checkers: read the
history, never the job's own metrics):

- **every id once**: each expected id appears exactly once in output ∪ dead letters, read
  ``read_committed`` (`lost`, `duplicates`, `unexpected`);
- **per-key order** (only for ``ordering: per_key``): within each Kafka key, results appear in
  the output topic in the order of their input offsets (`order_violations`). A result carries
  its input's ``source`` (topic, partition, offset); dead letters go to another topic and have no
  order relative to results, so they are not part of it;
- **calls per record**: the model calls the server answered (the simulator's ``/stats``
  ``served``; it keeps no per-id log) per input record, when given.

`History` holds what was read (a `CommittedRecord` each), `History.check` gives the `Verdict`;
`read_history` reads a job's two topics. The command line::

    python -m jobs.dev.history --config job.yaml --ids ids.txt [--model-stats URL] [--json]

``--ids`` is a file of expected ids, one a line, or ``input`` to take every id of the input topic
(committed records whose JSON has an ``id``). Exit 0 when the verdict holds, 1 when it does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CommittedRecord",
    "History",
    "SourceOffset",
    "Verdict",
    "read_history",
    "served_calls",
]

SAMPLE = 10
"""How many ids a verdict names for each kind of problem."""

Ordering = Literal["none", "per_key"]


@dataclass(frozen=True, order=True)
class SourceOffset:
    """Where a record was read: input topic, partition and offset."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class CommittedRecord:
    """One committed record of the output or dead-letter topic, as a consumer reads it.

    ``partition``/``offset`` are the record's place in its own topic (-1 when unknown, e.g. a
    tally from bare ids); ``source`` its input's place, from the record's ``source`` field.
    """

    id: str | None
    dead: bool = False
    key: bytes | None = None
    partition: int = -1
    offset: int = -1
    source: SourceOffset | None = None
    reason: str | None = None
    cached: bool = False

    @classmethod
    def from_body(cls, body: Any, *, dead: bool, key: bytes | None = None, partition: int = -1,
                  offset: int = -1) -> CommittedRecord:
        """A committed record from its decoded JSON (anything that is not an object has no id)."""
        if not isinstance(body, dict):
            return cls(None, dead=dead, key=key, partition=partition, offset=offset)
        source = body.get("source")
        where = None
        if isinstance(source, dict) and isinstance(source.get("offset"), int):
            where = SourceOffset(str(source.get("topic")), int(source.get("partition") or 0), int(source["offset"]))
        rid = body.get("id")
        return cls(None if rid is None else str(rid), dead=dead, key=key, partition=partition, offset=offset,
                   source=where, reason=str(body.get("reason")) if dead else None,
                   cached=body.get("cached") is True)

    @classmethod
    def from_record(cls, record: Any, *, dead: bool) -> CommittedRecord:
        """A committed record from a kafka-python ``ConsumerRecord`` (``key``, ``value``, ``partition``, ``offset``)."""
        try:
            body = json.loads(record.value)
        except (ValueError, TypeError):
            body = None
        return cls.from_body(body, dead=dead, key=record.key, partition=record.partition, offset=record.offset)


@dataclass
class Verdict:
    """The checks' result. Field names are the ones the fault report and the tests read."""

    records_in: int
    out: int
    dead: int
    duplicates: int
    lost: int
    unexpected: int
    dead_reasons: dict[str, int] = field(default_factory=dict)
    lost_sample: list[str] = field(default_factory=list)
    cached: int = 0
    duplicate_sample: list[str] = field(default_factory=list)
    unexpected_sample: list[str] = field(default_factory=list)
    ordering: Ordering = "none"
    order_violations: int = 0
    order_sample: list[str] = field(default_factory=list)
    model_calls: int | None = None

    @property
    def calls_per_record(self) -> float | None:
        return None if self.model_calls is None or not self.records_in else self.model_calls / self.records_in

    def problems(self) -> list[str]:
        """What is wrong, one line each; empty when every id is there once (and in order, if asked)."""
        found = []
        if self.lost:
            found.append(f"lost {self.lost}: {self.lost_sample}")
        if self.duplicates:
            found.append(f"duplicates {self.duplicates}: {self.duplicate_sample}")
        if self.unexpected:
            found.append(f"unexpected {self.unexpected}: {self.unexpected_sample}")
        if not found and self.out + self.dead != self.records_in:
            found.append(f"{self.out} out + {self.dead} dead letters for {self.records_in} records in")
        if self.order_violations:
            found.append(f"per-key order violated {self.order_violations} times: {self.order_sample}")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems()

    def summary(self) -> str:
        calls = "" if self.calls_per_record is None else f", {self.calls_per_record:.3f} calls/record"
        order = f", order {self.order_violations} violations" if self.ordering == "per_key" else ""
        head = (f"{self.records_in} in: {self.out} out, {self.dead} dead, {self.duplicates} duplicates, "
                f"{self.lost} lost, {self.unexpected} unexpected{order}{calls}")
        problems = self.problems()
        return head + ("; " + "; ".join(problems) if problems else "; every id once")

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "calls_per_record": self.calls_per_record, "ok": self.ok}


class History:
    """Every committed output and dead-letter record of a run, in the order they were read."""

    def __init__(self, records: Iterable[CommittedRecord], *, model_calls: int | None = None) -> None:
        self.records = list(records)
        self.model_calls = model_calls

    @classmethod
    def from_ids(cls, out_ids: Iterable[str | None], dead: Iterable[dict[str, Any] | None], *,
                 model_calls: int | None = None) -> History:
        """A history from bare output ids and dead-letter bodies (no keys, no order to check)."""
        records = [CommittedRecord(i) for i in out_ids]
        records += [CommittedRecord.from_body(body or {}, dead=True) for body in dead]
        return cls(records, model_calls=model_calls)

    @classmethod
    def from_records(cls, out: Iterable[Any], dead: Iterable[Any], *, model_calls: int | None = None) -> History:
        """A history from kafka-python records of the output and the dead-letter topic."""
        records = [CommittedRecord.from_record(r, dead=False) for r in out]
        records += [CommittedRecord.from_record(r, dead=True) for r in dead]
        return cls(records, model_calls=model_calls)

    def check(self, expected_ids: Iterable[str], *, ordering: Ordering = "none") -> Verdict:
        expected = set(expected_ids)
        results = [o for o in self.records if not o.dead]
        letters = [o for o in self.records if o.dead]
        seen = Counter(o.id for o in self.records)
        doubled = sorted(i for i, c in seen.items() if c > 1 and i is not None)
        lost = sorted(expected - set(seen))
        unexpected = sorted(str(i) for i in seen if i not in expected)
        verdict = Verdict(
            records_in=len(expected), out=len(results), dead=len(letters),
            duplicates=sum(seen[i] - 1 for i in doubled), lost=len(lost), unexpected=len(unexpected),
            dead_reasons=dict(Counter(str(o.reason) for o in letters)),
            lost_sample=lost[:SAMPLE], duplicate_sample=doubled[:SAMPLE], unexpected_sample=unexpected[:SAMPLE],
            cached=sum(1 for o in results if o.cached), ordering=ordering, model_calls=self.model_calls,
        )
        if ordering == "per_key":
            violations = order_violations(results)
            verdict.order_violations = len(violations)
            verdict.order_sample = violations[:SAMPLE]
        return verdict


def order_violations(results: Sequence[CommittedRecord]) -> list[str]:
    """Each result that came out after a result of the same key read later from the same input
    partition, named ``key: id@offset after id@offset``.

    Results are taken in the output topic's order (by partition, then offset: one key's results
    share an output partition); a result without a ``source`` cannot be placed, nor one without a
    key be ordered against others, so both are skipped.
    """
    by_key: dict[tuple[bytes | None, str, int], list[CommittedRecord]] = defaultdict(list)
    for result in sorted(results, key=lambda o: (o.partition, o.offset)):
        if result.source is not None and result.key is not None:
            by_key[(result.key, result.source.topic, result.source.partition)].append(result)
    found = []
    for (key, _, _), seq in by_key.items():
        latest: CommittedRecord | None = None
        for result in seq:
            assert result.source is not None
            if latest is not None and latest.source is not None and result.source.offset < latest.source.offset:
                name = (key or b"").decode(errors="replace")
                found.append(f"{name}: {result.id}@{result.source.offset} after {latest.id}@{latest.source.offset}")
            else:
                latest = result
    return found


def read_history(bootstrap: Any, output_topic: str, dead_letter_topic: str, *, timeout_s: float = 60.0,
                 model_calls: int | None = None) -> History:
    """Both topics read ``read_committed`` from the beginning to their last stable offset
    (``bootstrap``: what `jobs.clients.kafka_admin` takes, a string or client arguments)."""
    from jobs.clients import kafka_admin

    out = kafka_admin.consume_committed(bootstrap, output_topic, timeout_s=timeout_s)
    dead = kafka_admin.consume_committed(bootstrap, dead_letter_topic, timeout_s=timeout_s)
    return History.from_records(out, dead, model_calls=model_calls)


def served_calls(stats_url: str, timeout_s: float = 5.0) -> int:
    """The model calls a simulator answered (``served`` of its ``/stats``; a base URL or the
    ``/stats`` URL itself)."""
    import requests

    url = stats_url.rstrip("/")
    if not url.endswith("/stats"):
        url = url.removesuffix("/v1") + "/stats"
    response = requests.get(url, timeout=timeout_s)
    response.raise_for_status()
    return int(response.json()["served"])


# ---------------------------------------------------------------------- command line


DESCRIPTION = ("Check a run's output and dead-letter topics (read_committed): every expected id once, "
               "per-key order (ordering: per_key), model calls per record.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the job's config YAML (topics, bootstrap, ordering)")
    parser.add_argument("--ids", required=True, metavar="FILE|input",
                        help="expected ids, one a line, or `input`: every id in the input topic")
    parser.add_argument("--bootstrap", default=None, help="brokers to read from (default: the config's)")
    parser.add_argument("--model-stats", default=None, metavar="URL",
                        help="the simulator's base URL (or /stats URL), for calls per record")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to read each topic (default 60)")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")


def _input_ids(bootstrap: Any, topics: Iterable[str], timeout_s: float) -> list[str]:
    """Every id in the input topics' committed records (records without one are not expected)."""
    from jobs.clients import kafka_admin

    ids = []
    for topic in topics:
        for record in kafka_admin.consume_committed(bootstrap, topic, timeout_s=timeout_s):
            read = CommittedRecord.from_record(record, dead=False)
            if read.id is not None:
                ids.append(read.id)
    return ids


def run(args: argparse.Namespace) -> int:
    from jobs.clients import kafka_admin
    from udfs.config import load_config
    from udfs.errors import ConfigError

    config = load_config(args.config)
    bootstrap: Any = args.bootstrap or kafka_admin.client_args(config.kafka)
    kafka = config.kafka
    if args.ids == "input":
        topics = [kafka.input_topic] if kafka.input_topic else list(kafka.input_topics or [])
        if not topics:
            raise ConfigError("--ids", "`input` needs kafka.input_topic or kafka.input_topics (not a pattern)")
        ids = _input_ids(bootstrap, topics, args.timeout)
    else:
        ids = [line.strip() for line in Path(args.ids).read_text().splitlines() if line.strip()]
    calls = served_calls(args.model_stats) if args.model_stats else None
    history = read_history(bootstrap, kafka.output_topic, kafka.dead_letter_topic, timeout_s=args.timeout,
                           model_calls=calls)
    verdict = history.check(ids, ordering=config.ordering)
    print(json.dumps(verdict.as_json(), indent=2) if args.json else verdict.summary())
    return 0 if verdict.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.history", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
