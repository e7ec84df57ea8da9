"""The numbers the fault tests write to ``var/fault-report.md`` / ``.json`` for the README
(`FaultReport`, one `FaultResult` per scenario), safe with two pytest workers writing at once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobs.dev.history import Verdict
from jobs.runtime import jars

log = logging.getLogger("llmstream.tests.cluster")

REPORT_DIR = jars.repo_root() / "var"


@dataclass
class FaultResult:
    """One scenario's numbers, as they go into var/fault-report.md."""

    scenario: str
    records_in: int
    out: int
    dead: int
    duplicates: int
    lost: int
    restarts: int
    recovery_s: float | None
    duration_s: float
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    model_calls: int | None = None
    cache_hits: int | None = None

    @classmethod
    def counted(cls, scenario: str, verdict: Verdict, *, restarts: int, recovery_s: float | None,
                duration_s: float, notes: str = "", extra: dict[str, Any] | None = None) -> FaultResult:
        """A scenario's row with its counts from the history checker's verdict (`jobs/dev/history.py`),
        the same for every fault run: ids in, out, dead, doubled, lost, model calls; the dead-letter
        reasons and, for ``ordering: per_key``, the order violations among the details."""
        details: dict[str, Any] = {"dead_reasons": verdict.dead_reasons}
        if verdict.ordering == "per_key":
            details["order_violations"] = verdict.order_violations
        return cls(scenario=scenario, records_in=verdict.records_in, out=verdict.out, dead=verdict.dead,
                   duplicates=verdict.duplicates, lost=verdict.lost, restarts=restarts, recovery_s=recovery_s,
                   duration_s=duration_s, notes=notes, extra={**details, **(extra or {})},
                   model_calls=verdict.model_calls)

    @property
    def calls_per_record(self) -> float | None:
        """Model calls the server answered (the simulator's `served`) per input record."""
        return None if self.model_calls is None or not self.records_in else self.model_calls / self.records_in


class FaultReport:
    """Appends results to ``var/fault-report.json`` and re-renders ``var/fault-report.md`` after each."""

    def __init__(self, directory: Path = REPORT_DIR) -> None:
        self.json_path = directory / "fault-report.json"
        self.md_path = directory / "fault-report.md"

    def load(self) -> dict[str, dict[str, Any]]:
        try:
            data: dict[str, dict[str, Any]] = json.loads(self.json_path.read_text())
            return data
        except (OSError, ValueError):
            return {}

    def add(self, result: FaultResult) -> None:
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        entry = asdict(result)
        entry["recorded_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        # `make test` runs two workers, each with its own report object: read, add and write
        # under one lock so neither drops the other's entry.
        with open(self.json_path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.load()
            data[result.scenario] = entry
            self.json_path.write_text(json.dumps(data, indent=2, sort_keys=True))
            self.md_path.write_text(render_report(data))
        log.warning("fault report: %s", json.dumps(entry))


def render_report(data: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# llmstream fault and memory tests: measured results",
        "",
        "Written by tests/integration/test_faults.py (standalone Flink cluster from the pip package, real",
        "single-node Kafka broker, model-server simulator). Counts come from a read_committed consumer;",
        "`dup` = records beyond the first per id, `lost` = ids in neither output nor dead letters,",
        "`recovery` = seconds from the end of the fault until committed output flowed again.",
        "",
        "`calls/record` = model calls the server answered (the simulator's `served`) per input record,",
        "`cache hits` = output records answered from the result cache (`cached: true`).",
        "",
        ("| scenario | in | out | dead | dup | lost | restarts | recovery s | test s | calls/record | cache hits "
         "| notes |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(data):
        r = data[name]
        rec = "-" if r.get("recovery_s") is None else f"{r['recovery_s']:.1f}"
        calls = "-" if r.get("model_calls") is None else f"{r['model_calls'] / max(1, r['records_in']):.3f}"
        hits = "-" if r.get("cache_hits") is None else str(r["cache_hits"])
        lines.append(f"| {name} | {r['records_in']} | {r['out']} | {r['dead']} | {r['duplicates']} | {r['lost']} "
                     f"| {r['restarts']} | {rec} | {r['duration_s']:.0f} | {calls} | {hits} | {r.get('notes', '')} |")
    extras = [(n, data[n]["extra"]) for n in sorted(data) if data[n].get("extra")]
    if extras:
        lines += ["", "## Details", ""]
        for name, extra in extras:
            lines.append(f"- **{name}**: " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    return "\n".join(lines) + "\n"
