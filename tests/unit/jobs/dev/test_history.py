"""The history checker (`jobs.dev.history`) on synthetic topic contents: every id once, per-key
order, calls per record, and its command line on topics read through a stand-in consumer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.dev import history
from jobs.dev.history import CommittedRecord, History, SourceOffset
from udfs.config import load_config, to_dict


@dataclass
class Record:
    """What kafka-python's ConsumerRecord gives the checker."""

    key: bytes | None
    value: bytes
    partition: int
    offset: int


def result(rid: str, key: str | None, source_offset: int, *, partition: int = 0, offset: int = 0,
           source_partition: int = 0, cached: bool = False) -> Record:
    body = {"id": rid, "output": "x", "cached": cached,
            "source": {"topic": "in", "partition": source_partition, "offset": source_offset, "timestamp": None}}
    return Record(None if key is None else key.encode(), json.dumps(body).encode(), partition, offset)


def letter(rid: str | None, reason: str, *, offset: int = 0) -> Record:
    body = {"reason": reason, "id": rid, "source": {"topic": "in", "partition": 0, "offset": 99}}
    return Record(None, json.dumps(body).encode(), 0, offset)


def test_every_id_once_across_output_and_dead_letters() -> None:
    out = [result(f"r{i}", f"k{i}", i, offset=i) for i in range(4)]
    dead = [letter("r4", "invalid_json")]
    verdict = History.from_records(out, dead, model_calls=6).check([f"r{i}" for i in range(5)])
    assert verdict.ok, verdict.problems()
    assert (verdict.records_in, verdict.out, verdict.dead) == (5, 4, 1)
    assert verdict.dead_reasons == {"invalid_json": 1}
    assert verdict.calls_per_record == pytest.approx(1.2)
    assert "every id once" in verdict.summary()


def test_lost_duplicated_and_unexpected_ids_are_named() -> None:
    out = [result("a", "a", 0), result("a", "a", 0, offset=1), result("zz", "zz", 5, offset=2)]
    dead = [letter(None, "missing_field")]
    verdict = History.from_records(out, dead).check(["a", "b"])
    assert (verdict.lost, verdict.lost_sample) == (1, ["b"])
    assert (verdict.duplicates, verdict.duplicate_sample) == (1, ["a"])
    assert verdict.unexpected == 2 and set(verdict.unexpected_sample) == {"zz", "None"}
    assert not verdict.ok
    assert [p.split()[0] for p in verdict.problems()] == ["lost", "duplicates", "unexpected"]


def test_cached_results_are_counted() -> None:
    verdict = History.from_records([result("a", "a", 0, cached=True), result("b", "b", 1, offset=1)], []).check(
        ["a", "b"])
    assert verdict.cached == 1


def test_per_key_order_follows_input_offsets_within_each_key() -> None:
    """Key a's results must come out as its input offsets went in; key b may interleave freely."""
    out = [result("a1", "a", 0, offset=0), result("b2", "b", 3, offset=1), result("a3", "a", 2, offset=2),
           result("b1", "b", 1, offset=3), result("a2", "a", 1, offset=4)]
    verdict = History.from_records(out, []).check(["a1", "a2", "a3", "b1", "b2"], ordering="per_key")
    assert verdict.order_violations == 2
    assert verdict.order_sample == ["a: a2@1 after a3@2", "b: b1@1 after b2@3"]
    assert not verdict.ok


def test_order_is_read_per_output_partition_and_offset_and_skips_null_keys() -> None:
    """The topic's order is its partitions' offsets, whatever order the reader got them in; results
    without a key are released at once by the job, so they promise no order."""
    out = [result("a2", "a", 5, offset=7), result("a1", "a", 4, offset=3),
           result("n2", None, 9, offset=1), result("n1", None, 8, offset=2)]
    verdict = History.from_records(out, []).check(["a1", "a2", "n1", "n2"], ordering="per_key")
    assert verdict.order_violations == 0, verdict.order_sample


def test_order_is_not_checked_unless_asked() -> None:
    out = [result("a2", "a", 1, offset=0), result("a1", "a", 0, offset=1)]
    assert History.from_records(out, []).check(["a1", "a2"]).order_violations == 0
    assert History.from_records(out, []).check(["a1", "a2"], ordering="per_key").order_violations == 1


def test_keys_in_two_input_partitions_are_two_sequences() -> None:
    out = [result("p1", "a", 10, offset=0, source_partition=1), result("p0", "a", 2, offset=1, source_partition=0)]
    assert History.from_records(out, []).check(["p0", "p1"], ordering="per_key").order_violations == 0


def test_an_unreadable_record_counts_as_an_unexpected_outcome() -> None:
    out = [Record(b"k", b"\xff not json", 0, 0)]
    read = CommittedRecord.from_record(out[0], dead=False)
    assert read.id is None and read.source is None
    assert History.from_records(out, []).check([]).unexpected == 1


def test_from_ids_keeps_the_old_tally_shape() -> None:
    verdict = History.from_ids(["a", "b", None], [{"id": "c", "reason": "timeout"}, None]).check(["a", "b", "c"])
    assert (verdict.out, verdict.dead, verdict.unexpected) == (3, 2, 1)
    assert verdict.dead_reasons == {"timeout": 1, "None": 1}


def test_a_committed_record_reads_the_source_field() -> None:
    read = CommittedRecord.from_body({"id": "x", "source": {"topic": "t", "partition": 2, "offset": 41}}, dead=False)
    assert read.source == SourceOffset("t", 2, 41)


def test_the_command_line_reads_both_topics_and_exits_by_the_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    data = to_dict(load_config())
    data["kafka"].update(bootstrap_servers="127.0.0.1:1", input_topic="in", output_topic="out",
                         dead_letter_topic="dead")
    data["ordering"] = "per_key"
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(data))
    topics: dict[str, list[Any]] = {
        "in": [Record(b"a", json.dumps({"id": i}).encode(), 0, n) for n, i in enumerate(["a1", "a2"])],
        "out": [result("a2", "a", 1, offset=0), result("a1", "a", 0, offset=1)],
        "dead": [],
    }
    monkeypatch.setattr(history_admin(), "consume_committed", lambda cluster, topic, **kw: topics[topic])
    ids = tmp_path / "ids.txt"
    ids.write_text("a1\na2\n")
    assert history.main(["--config", str(config), "--ids", str(ids)]) == 1
    assert "per-key order violated 1 times" in capsys.readouterr().out
    topics["out"] = [result("a1", "a", 0, offset=0), result("a2", "a", 1, offset=1)]
    assert history.main(["--config", str(config), "--ids", "input", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] is True and printed["records_in"] == 2


def history_admin() -> Any:
    from jobs.clients import kafka_admin

    return kafka_admin
