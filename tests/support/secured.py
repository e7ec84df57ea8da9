"""Jobs on the secured broker (`secure_broker`: TLS, SASL/SCRAM, mutual TLS, ACLs) and the hunt for
canary secrets in what a run left behind: the names one test's topics, group and transactional ids
take (``Names``; the ``secured`` fixture in tests/integration/conftest.py makes them), and where a
secret was found (``grep_secret`` over ``files_under`` a directory, records, REST pages, output)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

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


REST_PAGES = ("/jobmanager/config", "/jobs/overview")
JOB_PAGES = ("/config", "/exceptions", "/plan")


def rest_pages(rest_url: str, job_ids: list[str] | None = None) -> dict[str, bytes]:
    """What Flink's REST API serves about the cluster and its jobs (``job_ids``; None: every job it
    lists), by path: where a secret in a job's configuration or an exception would show."""
    pages = {path: requests.get(rest_url + path, timeout=10).content for path in REST_PAGES}
    if job_ids is None:
        job_ids = [job["id"] for job in requests.get(rest_url + "/jobs", timeout=10).json()["jobs"]]
    for job_id in job_ids:
        for suffix in JOB_PAGES:
            pages[f"/jobs/{job_id}{suffix}"] = requests.get(f"{rest_url}/jobs/{job_id}{suffix}", timeout=10).content
    return pages
