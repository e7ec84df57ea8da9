"""Rescaling on the estate: the job's parallelism changed twice mid-stream with ``llmstream upgrade``
(a savepoint, then the new config restored from it), its subtasks spread over both TaskManager
hosts (2 slots each), then judged by the history checker: every id once and, for ``ordering:
per_key``, each key's results in input order across both rescales.

Records share 64 keys (ids stay unique), so a key's records meet in one subtask at one parallelism
and in another after the rescale: the case per-key order has to survive.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import yaml

from jobs.clients import kafka_admin
from jobs.dev.estate.estate import Estate
from jobs.dev.estate.table import Row, committed_count, job_config, submit, wait_for
from jobs.dev.history import Verdict, read_history
from jobs.runtime import jars

log = logging.getLogger("llmstream.estate")

__all__ = ["RESCALES", "Rescale", "run_rescale"]

KEYS = 64


@dataclass(frozen=True)
class Rescale:
    name: str
    lane: str
    steps: tuple[int, ...]
    ordering: str = "none"
    sections: dict[str, Any] = field(default_factory=dict)

    @property
    def about(self) -> str:
        order = ", ordering: per_key" if self.ordering == "per_key" else ""
        return f"{self.lane} lane, parallelism {'→'.join(map(str, self.steps))} by llmstream upgrade{order}"


RESCALES: dict[str, Rescale] = {r.name: r for r in (
    Rescale("rescale-keyed", "keyed", (1, 4, 2), ordering="per_key"),
    Rescale("rescale-vectorized", "vectorized", (1, 3, 1), sections={"vectorized": {"batch_size": 100}}),
    Rescale("rescale-provider-batch", "provider-batch", (1, 2, 1), sections={
        "provider_batch": {"max_requests": 100, "max_wait_s": 1, "poll_initial_s": 0.5, "poll_max_s": 2}}),
)}


def keyed_records(n: int, prefix: str) -> list[tuple[bytes, bytes]]:
    """``n`` requests with unique ids over `KEYS` keys."""
    return [(f"key-{i % KEYS:02d}".encode(),
             json.dumps({"id": f"{prefix}-{i:06d}", "prompt": f"Summarise item {i} in one line.",
                         "params": {"max_tokens": 16}}).encode()) for i in range(n)]


def _llmstream(*args: str, timeout: float = 300) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=jars.repo_root(), check=False)
    return done.returncode, (done.stdout + done.stderr).strip()


def run_rescale(estate: Estate, rescale: Rescale, *, records: int = 3000, timeout: float = 900.0) -> tuple[Row, Verdict]:
    """Submit at ``steps[0]``, upgrade to each next parallelism after another share of the ids is
    out, wait for every id, stop with a savepoint; the row and the verdict."""
    estate.network.heal_all()
    estate.start()
    tag = f"{rescale.name}-{uuid.uuid4().hex[:6]}"
    directory = estate.work_dir / "runs"
    directory.mkdir(parents=True, exist_ok=True)
    base = job_config(estate, tag, **rescale.sections)
    base.pop("stage", None)
    base["lane"] = rescale.lane
    base["ordering"] = rescale.ordering
    if rescale.lane == "provider-batch":
        base["model"].pop("mode", None)
    paths = []
    for step in rescale.steps:
        data = {**base, "parallelism": {"default": step, "source": None, "inference": None, "sink": None}}
        path = directory / f"{tag}-p{step}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        paths.append(path)
    bootstrap = estate.bootstrap_servers
    batch = keyed_records(records, tag)
    kafka_admin.produce(bootstrap, base["kafka"]["input_topic"], batch)
    estate.model.configure("/stats/reset", {})
    out_topic, dead_topic = base["kafka"]["output_topic"], base["kafka"]["dead_letter_topic"]
    notes: list[str] = []
    started = time.monotonic()
    log_path = directory / f"{tag}.log"
    code = submit(paths[0], estate, log_path, until_end=False).wait(timeout=300)
    job_id = ""
    restarts = 0
    if code != 0:
        notes.append(f"submit exited {code}: {log_path.read_text(errors='replace').strip().splitlines()[-1:]}")
    else:
        def running() -> str:
            live = estate.rest.live_jobs(base["name"])
            return str(live[0]["jid"]) if live and estate.rest.is_fully_running(str(live[0]["jid"])) else ""

        for i, path in enumerate(paths):
            job_id = ""
            wait_for(lambda: bool(running()), 240)
            job_id = running()
            if not job_id:
                notes.append(f"the job at parallelism {rescale.steps[i]} was not running within 240 s")
                break
            parallelism = max(estate.rest.vertex_parallelism(job_id).values())
            notes.append(f"p{parallelism} on {'+'.join(estate.job_hosts(job_id))}")
            if i == len(paths) - 1:
                break
            share = records * (i + 1) / len(paths)

            def reached(share: float = share) -> bool:
                return committed_count(bootstrap, out_topic) >= share

            wait_for(reached, 300)
            restarts += estate.rest.num_restarts(job_id)
            code, said = _llmstream("upgrade", "--config", str(paths[i + 1]), "--jobmanager", estate.jobmanager_address)
            if code != 0:
                notes.append(f"upgrade to p{rescale.steps[i + 1]} exited {code}: {said.splitlines()[-1:]}")
                break

        def all_out() -> bool:
            history = read_history(bootstrap, out_topic, dead_topic, timeout_s=30)
            return len({o.id for o in history.records}) >= records

        if job_id and not wait_for(all_out, max(60.0, timeout - (time.monotonic() - started)), interval=5):
            notes.append(f"not every id out within {timeout:g} s")
        if job_id:
            restarts += estate.rest.num_restarts(job_id)
            code, said = _llmstream("stop", "--config", str(paths[-1]), "--jobmanager", estate.jobmanager_address)
            if code != 0:
                notes.append(f"stop exited {code}: {said.splitlines()[-1:]}")
    for job in estate.rest.live_jobs(base["name"]):
        estate.rest.cancel(str(job["jid"]))
    served = estate.model.calls()
    verdict = read_history(bootstrap, out_topic, dead_topic, model_calls=served).check(
        [json.loads(v)["id"] for _, v in batch], ordering="per_key" if rescale.ordering == "per_key" else "none")
    if rescale.ordering == "per_key":
        notes.append(f"{verdict.order_violations} per-key order violations")
    row = Row.of(rescale.name, verdict, restarts=restarts, exit_code=code, seconds=time.monotonic() - started,
                 notes="; ".join(notes))
    log.info("estate: %s: %s", rescale.name, verdict.summary())
    return row, verdict
