"""Flink's key-group assignment of the inference stage's bucket keys, in plain Python.

The stage is keyed by a one-field `Row(Integer)` (`jobs.graph.pipeline.keyed_requests`). Choosing the
bucket keys so that every subtask gets the same number takes a few hundred candidate keys per
parallelism, and the job ticks the keys of every parallelism from 1 to 16: asked of the JVM over
Py4J (four calls per candidate) that was seconds of every job's start (docs/performance.md, "Job
start"). These functions
are Flink's own arithmetic (`KeyGroupRangeAssignment`, `MathUtils.murmurHash`, `Row.hashCode`);
`tests/integration/test_plan.py` checks them against the JVM's.
"""

from __future__ import annotations

DEFAULT_LOWER_BOUND_MAX_PARALLELISM = 128
UPPER_BOUND_MAX_PARALLELISM = 32768
ROW_HASH_BASE = 62
"""`Row.hashCode()` of an INSERT row holding one Integer `i` is `62 + i` (32-bit), on Flink 2.2 and 2.3 alike
(`tests/integration/test_plan.py` checks it against the running JVM's): a bucket keeps its key group across the upgrade."""

_MASK = 0xFFFFFFFF


def _int32(value: int) -> int:
    value &= _MASK
    return value - (1 << 32) if value >= 1 << 31 else value


def _rotl(value: int, bits: int) -> int:
    value &= _MASK
    return ((value << bits) | (value >> (32 - bits))) & _MASK


def murmur_hash(code: int) -> int:
    """`MathUtils.murmurHash(int)`: a non-negative int."""
    code = (code * 0xCC9E2D51) & _MASK
    code = (_rotl(code, 15) * 0x1B873593) & _MASK
    code = (_rotl(code, 13) * 5 + 0xE6546B64) & _MASK
    code ^= 4
    code ^= code >> 16
    code = (code * 0x85EBCA6B) & _MASK
    code ^= code >> 13
    code = (code * 0xC2B2AE35) & _MASK
    code ^= code >> 16
    signed = _int32(code)
    if signed >= 0:
        return signed
    return -signed if signed != -(1 << 31) else 0


def row_key_hash(key: int) -> int:
    """`Row.hashCode()` of the stage's key `Row(Integer(key))`."""
    return _int32(ROW_HASH_BASE + key)


def key_group(key: int, max_parallelism: int) -> int:
    """`KeyGroupRangeAssignment.assignToKeyGroup(Row(key), max_parallelism)`."""
    return murmur_hash(row_key_hash(key)) % max_parallelism


def subtask(key: int, max_parallelism: int, parallelism: int) -> int:
    """`KeyGroupRangeAssignment.assignKeyToParallelOperator(Row(key), max_parallelism, parallelism)`."""
    return key_group(key, max_parallelism) * parallelism // max_parallelism


def default_max_parallelism(parallelism: int) -> int:
    """`KeyGroupRangeAssignment.computeDefaultMaxParallelism(parallelism)`."""
    wanted = parallelism + parallelism // 2
    power = 1 if wanted <= 1 else 1 << (wanted - 1).bit_length()
    return min(max(power, DEFAULT_LOWER_BOUND_MAX_PARALLELISM), UPPER_BOUND_MAX_PARALLELISM)
