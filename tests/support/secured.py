"""Jobs on the secured broker (`secure_broker`: TLS, SASL/SCRAM, mutual TLS, ACLs) and the hunt for
canary secrets in what a run left behind: the names one test's topics, group and transactional ids
take (``Names``; the ``secured`` fixture in tests/integration/conftest.py makes them), and where a
secret was found (``grep_secret`` over ``files_under`` a directory, records, REST pages, output)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from udfs.config import JobConfig


@dataclass(frozen=True)
class Names:
    """One test's topics, group and transactional prefix, all under one uuid tag."""

    tag: str

    @property
    def inputs(self) -> list[str]:
        return [f"sec-{self.tag}-in-a", f"sec-{self.tag}-in-b"]

    @property
    def output(self) -> str:
        return f"sec-{self.tag}-out"

    @property
    def dead_letter(self) -> str:
        return f"sec-{self.tag}-dlq"

    def kafka(self) -> dict[str, Any]:
        return {"output_topic": self.output, "dead_letter_topic": self.dead_letter,
                "group_id": f"sec-{self.tag}-group", "transactional_id_prefix": f"sec-{self.tag}-tx"}


Secured = Callable[..., tuple[JobConfig, Names]]


def grep_secret(secret: str, places: dict[str, bytes]) -> list[str]:
    """The names of the ``places`` whose bytes hold ``secret``."""
    needle = secret.encode()
    return [where for where, blob in places.items() if needle in blob]


def files_under(root: Path) -> dict[str, bytes]:
    """Every file below ``root``, by path, with its bytes."""
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
