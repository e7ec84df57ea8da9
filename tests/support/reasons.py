"""The dead-letter reasons the record contract documents: what a test may see in a dead letter."""

from __future__ import annotations

import re
from pathlib import Path

RECORD_CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "record-contract.md"


def documented_reasons() -> frozenset[str]:
    """Every reason code of the table in docs/record-contract.md."""
    reasons: set[str] = set()
    for line in RECORD_CONTRACT.read_text().splitlines():
        if line.startswith("| `"):
            reasons.update(re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]))
    return frozenset(reasons)
