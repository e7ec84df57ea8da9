"""`llmstream status`: one screen that says whether the job keeps up, whether the model is
the bottleneck, whether it is healthy and what it costs.

Built from the Flink REST API (job state, restarts, checkpoints, operator metrics,
llmstream's own included) and the Kafka consumer group and topics (input lag, dead letters by
reason). A local `llmstream run` records where its mini cluster's REST API listens in the
job's state directory (`run.json`, see `LocalRun`), so `llmstream status --config FILE` finds
it; for a cluster job pass `--jobmanager HOST:PORT`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from jobs.state import StateDir
from udfs.config import JobConfig

RUN_FILE = "run.json"


@dataclass
class LocalRun:
    """Where a local run's mini cluster answers, written to ``<state dir>/run.json`` at start and
    updated when the run ends (with the last figures seen while it ran)."""

    job_name: str
    job_id: str
    rest_url: str
    prometheus_url: str | None
    pid: int
    started_at: float
    ended_at: float | None = None
    last: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def starting(cls, config: JobConfig, job_id: str, rest_port: int) -> LocalRun:
        port = config.metrics.prometheus_port
        return cls(job_name=config.name, job_id=job_id, rest_url=f"http://127.0.0.1:{rest_port}",
                   prometheus_url=f"http://127.0.0.1:{port}/metrics" if port is not None else None,
                   pid=os.getpid(), started_at=time.time())

    def record(self, state: StateDir) -> None:
        if state.path is None:
            return
        state.path.mkdir(parents=True, exist_ok=True)
        tmp = state.path / (RUN_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, state.path / RUN_FILE)

    def ended(self, state: StateDir) -> None:
        self.ended_at = time.time()
        with contextlib.suppress(OSError):
            self.record(state)

    @classmethod
    def load(cls, state: StateDir) -> LocalRun | None:
        if state.path is None:
            return None
        try:
            data = json.loads((state.path / RUN_FILE).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None
