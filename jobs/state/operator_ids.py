"""Which operators a snapshot holds, read before any JVM starts.

Flink refuses to restore a snapshot that holds state for an operator the new job does not have
("Cannot map checkpoint/savepoint state for operator ... to the new program") unless the restore
allows non-restored state. llmstream knows the one case where that is expected, a job whose
spend budget was removed (`jobs/graph/gate_operator.py`), and must know it before the JVM starts, when the
restore settings are chosen. An operator's id is a hash of its uid; a snapshot's ``_metadata``
stores the ids of every operator it has state for, as 16 raw bytes each.
"""

from __future__ import annotations

from jobs.state.snapshots import METADATA, local_path

_MASK = (1 << 64) - 1
_C1 = 0x87C37B91114253D5
_C2 = 0x4CF5AD432745937F


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _fmix(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK
    return k ^ (k >> 33)


def _mix1(k1: int) -> int:
    return (_rotl((k1 * _C1) & _MASK, 31) * _C2) & _MASK


def _mix2(k2: int) -> int:
    return (_rotl((k2 * _C2) & _MASK, 33) * _C1) & _MASK


def murmur3_128(data: bytes, seed: int = 0) -> bytes:
    """MurmurHash3 x64 128-bit, as Guava's ``Hashing.murmur3_128(seed)`` returns it (``asBytes``)."""
    h1 = h2 = seed
    blocks = len(data) // 16
    for i in range(blocks):
        h1 ^= _mix1(int.from_bytes(data[16 * i:16 * i + 8], "little"))
        h1 = (((_rotl(h1, 27) + h2) & _MASK) * 5 + 0x52DCE729) & _MASK
        h2 ^= _mix2(int.from_bytes(data[16 * i + 8:16 * i + 16], "little"))
        h2 = (((_rotl(h2, 31) + h1) & _MASK) * 5 + 0x38495AB5) & _MASK
    tail = data[16 * blocks:]
    if len(tail) > 8:
        h2 ^= _mix2(int.from_bytes(tail[8:], "little"))
    if tail:
        h1 ^= _mix1(int.from_bytes(tail[:8], "little"))
    h1 ^= len(data)
    h2 ^= len(data)
    h1 = (h1 + h2) & _MASK
    h2 = (h2 + h1) & _MASK
    h1, h2 = _fmix(h1), _fmix(h2)
    h1 = (h1 + h2) & _MASK
    h2 = (h2 + h1) & _MASK
    return h1.to_bytes(8, "little") + h2.to_bytes(8, "little")


def operator_id(uid: str) -> bytes:
    """The id Flink gives the operator whose uid is `uid` (`StreamGraphHasherV2`: murmur3_128,
    seed 0, over the uid's UTF-8 bytes), as ``_metadata`` stores it (lower then upper half)."""
    return murmur3_128(uid.encode("utf-8"))


def holds_operator(snapshot: str, uid: str) -> bool:
    """Whether the snapshot at `snapshot` (its directory, as a path or a ``file:`` URI) lists the
    operator `uid`. False when it cannot be read here (another file system, gone): Flink then
    decides, and says so itself."""
    directory = local_path(snapshot)
    if directory is None:
        return False
    metadata = directory / METADATA if directory.is_dir() else directory
    try:
        return operator_id(uid) in metadata.read_bytes()
    except OSError:
        return False
