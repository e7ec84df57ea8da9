"""Per-key order as a pure module (`udfs.lanes.ordering`): what is released when, and the key hash the
pipeline's SQL reproduces. The stage's use of it is in tests/unit/udfs/lanes/test_keyed.py."""

from __future__ import annotations

import random

import pytest

from udfs.lanes.ordering import KeyOrder, key_bucket, key_hash, restore_order
from udfs.records import PendingRecord


def test_an_outcome_waits_for_the_earlier_records_of_its_key_only() -> None:
    order = KeyOrder()
    for handle, key in [("a1", b"a"), ("b1", b"b"), ("a2", b"a"), ("a3", b"a")]:
        order.admit(0, key, handle)
    assert order.finish("a3", "A3") == []
    assert order.finish("a2", "A2") == []
    assert order.held == 2
    assert order.finish("b1", "B1") == [("b1", "B1")]  # another key is never held back
    assert order.finish("a1", "A1") == [("a1", "A1"), ("a2", "A2"), ("a3", "A3")]
    assert order.held == 0 and order.admitted == 0
    assert not order.waiting(0, b"a")


def test_a_null_key_or_an_unknown_handle_is_released_at_once() -> None:
    order = KeyOrder()
    order.admit(0, None, "n1")
    order.admit(0, b"a", "a1")
    assert order.finish("n1", "N1") == [("n1", "N1")]
    assert order.finish("x", "X") == [("x", "X")]
    assert not order.waiting(0, None)
    assert order.waiting(0, b"a")


def test_queues_are_per_bucket_and_key() -> None:
    """A key found in two buckets (state from before a switch to per_key) is two queues: the stage
    can only release a record under its own bucket."""
    order = KeyOrder()
    order.admit(1, b"a", "x")
    order.admit(2, b"a", "y")
    assert order.finish("y", "Y") == [("y", "Y")]
    assert order.waiting(1, b"a") and not order.waiting(2, b"a")


def test_a_handle_admitted_twice_is_a_bug() -> None:
    order = KeyOrder()
    order.admit(0, b"a", "a1")
    with pytest.raises(ValueError, match="twice"):
        order.admit(0, b"a", "a1")


def test_any_completion_order_releases_every_key_in_admission_order() -> None:
    rng = random.Random(5)
    order = KeyOrder()
    admitted = [(f"h{i}", rng.choice([b"a", b"b", b"c", None])) for i in range(300)]
    for handle, key in admitted:
        order.admit(0, key, handle)
    finishing = [h for h, _ in admitted]
    rng.shuffle(finishing)
    released = [h for h in finishing for h, _ in order.finish(h, h)]
    assert sorted(released) == sorted(finishing)
    for key in (b"a", b"b", b"c"):
        mine = [h for h, k in admitted if k == key]
        assert [h for h in released if h in set(mine)] == mine
    assert order.held == 0 and order.admitted == 0


def test_a_restore_admits_records_by_topic_partition_and_offset() -> None:
    def rec(topic: str, partition: int, offset: int) -> tuple[str, PendingRecord]:
        r = PendingRecord(b"k", b"v", topic, partition, offset)
        return r.handle, r

    stored = [rec("t", 1, 3), rec("t", 0, 10), rec("s", 5, 1), rec("t", 0, 9)]
    assert [h for h, _ in restore_order(stored)] == ["s:5:1", "t:0:9", "t:0:10", "t:1:3"]


def test_the_key_hash_is_the_md5_prefix_the_sql_computes() -> None:
    # MD5("k-1") = 14464ac1..., as Flink's MD5(DECODE(k, 'ISO-8859-1')) gave (measured, Flink 2.2.1);
    # the bytes 00 ff 41 hash as three ISO-8859-1 characters (measured: 9522cd35...).
    assert key_hash(b"k-1") == 0x14464a
    assert key_hash(b"\x00\xffA") == 0x9522cd
    assert key_bucket(b"k-1", 7, 32) == 0x14464a % 32
    assert key_bucket(None, 7, 32) == 7


def test_keys_spread_over_buckets() -> None:
    counts = [0] * 32
    for i in range(3200):
        counts[key_bucket(f"key-{i}".encode(), 0, 32)] += 1
    assert min(counts) > 50 and max(counts) < 160, counts
