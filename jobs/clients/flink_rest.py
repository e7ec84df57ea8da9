"""A small client of Flink's REST API: the job operations llmstream needs on any cluster.

`LocalCluster` (jobs/dev/local_cluster.py) adds process control for the clusters llmstream starts
itself; `llmstream submit | stop | upgrade --jobmanager HOST:PORT` use this class alone.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import requests

from udfs.errors import LLMStreamError

TERMINAL_STATES = frozenset({"FINISHED", "CANCELED", "FAILED"})
# A job in one of these holds (or is about to hold) the job's state and transactions.
LIVE_STATES = frozenset({"INITIALIZING", "CREATED", "RUNNING", "FAILING", "CANCELLING", "RESTARTING",
                         "RECONCILING", "SUSPENDED"})


class ClusterError(LLMStreamError, RuntimeError):
    """The cluster could not be started, reached or told to do something; the message says why."""


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


def unreachable_reason(err: requests.RequestException) -> str:
    """A few words on why an HTTP request got no answer ("Connection refused", "timed out")."""
    if isinstance(err, requests.Timeout):
        return "timed out"
    found = _ERRNO.findall(str(err))
    return found[-1].strip() if found else type(err).__name__


SECONDARY_FAILURES = (
    "FlinkExpectedException",  # "The TaskExecutor is shutting down": the cluster closing after the failure
    "NoResourceAvailableException",  # a restart waiting for the slot the failed task still holds
    "Recovery is suppressed",  # the restart strategy giving up: the cause is what it wraps
    "JobExecutionException: Job execution failed",
    "CancelTaskException",
    "Disconnect from JobManager responsible for",  # a TaskManager stopping fails the tasks it still runs
)
"""Exceptions that follow a failure rather than cause it; a report names them only if it has nothing else."""


def is_secondary(line: str) -> bool:
    return any(marker in line for marker in SECONDARY_FAILURES)


def last_error_line(text: str) -> str:
    """The line of a Java or Python error report that names the root cause: the innermost "Caused
    by" of the chain (lines Java indents, a "Suppressed:" block and its causes, are not the chain),
    passing over exceptions that only follow a failure (`SECONDARY_FAILURES`): a failed job's
    report can end with "The TaskExecutor is shutting down" while the authorization error that
    failed it is earlier in the chain or among the suppressed ones. Else the first line."""
    raw = [line for line in text.splitlines() if line.strip()]
    chain = [line.strip() for line in raw if not line[0].isspace()]
    indented = [line.strip() for line in raw if line[0].isspace()]

    def named(lines: list[str]) -> list[str]:
        return [line for line in lines if "Exception:" in line or "Error:" in line]

    def primary(lines: list[str]) -> list[str]:
        return [line for line in named(lines) if not is_secondary(line)]

    candidates = primary(chain) or primary(indented) or named(chain) or named(indented)
    lines = [line.strip() for line in raw]
    chosen = candidates[-1] if candidates else lines[0] if lines else "(no output)"
    return chosen.removeprefix("Suppressed: ").removeprefix("Caused by: ")[:500]


TRACE_CHARS = 3000
"""How much of each failure's trace (frames left out) `FlinkRest.failures` keeps."""


def without_frames(trace: str) -> str:
    """A Java stack trace without its frames (``at …`` and ``... N more``): the exception lines,
    "Caused by" and "Suppressed" blocks keep their indentation. A Kafka send failure's root cause
    (an authorization error) comes after ~30 frames of ~200 characters; cut by length with its
    frames, the trace lost it (seen under load)."""
    return "\n".join(line for line in trace.splitlines()
                     if not (line[:1].isspace() and line.lstrip().startswith(("at ", "... "))))


class FlinkRest:
    """Job operations through the REST API at ``rest_url`` (``http://host:port``)."""

    def __init__(self, rest_url: str) -> None:
        self._rest_url = rest_url.rstrip("/")

    @property
    def rest_url(self) -> str:
        return self._rest_url

    def _diagnostics(self) -> str:
        """Extra context for a timeout message (LocalCluster adds its log tail)."""
        return ""

    def rest(self, path: str, *, method: str = "GET", body: Any = None, timeout: float = 10.0) -> Any:
        """One call to the REST API; returns the decoded JSON (or None for an empty body)."""
        try:
            response = requests.request(method, self.rest_url + path, json=body, timeout=timeout)
        except requests.RequestException as err:
            raise ClusterError(f"Flink REST API at {self.rest_url} does not answer ({unreachable_reason(err)})") from err
        if response.status_code >= 400:
            body = " ".join(response.text[:500].split())
            raise ClusterError(f"{method} {self.rest_url}{path}: HTTP {response.status_code}: {body}")
        return response.json() if response.content else None

    def why_unreachable(self) -> str | None:
        """None if the REST API answers, else a few words on why not ("Connection refused")."""
        try:
            self.rest("/overview", timeout=5.0)
        except ClusterError as err:
            cause = err.__cause__
            return unreachable_reason(cause) if isinstance(cause, requests.RequestException) else str(err)
        return None

    def overview(self) -> dict[str, Any] | None:
        """``/overview`` (TaskManagers, slots, job counts), or None if the REST API does not answer."""
        try:
            result: dict[str, Any] = self.rest("/overview", timeout=3.0)
            return result
        except ClusterError:
            return None


    def _wait(self, what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:g} s waiting for {what}{self._diagnostics()}")
            time.sleep(interval)


    def jobs(self) -> list[dict[str, Any]]:
        """``/jobs/overview``: id, name, state, start time, duration of every job the cluster knows."""
        return list(self.rest("/jobs/overview").get("jobs", []))

    def job(self, job_id: str) -> dict[str, Any]:
        """``/jobs/<id>``: state, vertices (name, parallelism, status), timestamps."""
        result: dict[str, Any] = self.rest(f"/jobs/{job_id}")
        return result

    def job_status(self, job_id: str) -> str:
        return str(self.job(job_id)["state"])

    def vertex_parallelism(self, job_id: str) -> dict[str, int]:
        """Operator chain name -> parallelism, as the cluster runs it."""
        return {v["name"]: int(v["parallelism"]) for v in self.job(job_id)["vertices"]}

    def num_restarts(self, job_id: str, *, settle_s: float = 0.0) -> int:
        """The job's ``numRestarts`` metric (full and partial restarts since submission).

        The REST API answers job metrics from its metric store and refreshes that store only when
        asked, at most every ``metrics.fetcher.update-interval`` (10 s): the first query after a
        quiet while answers an old value (0 after three TaskManager kills, in a soak's report) and
        starts the fetch. With ``settle_s`` the question is asked again after that long, for a
        figure that must be current (a report's last word); 0 answers what the store has."""
        return self.restarts_of([job_id], settle_s=settle_s)[job_id]

    def restarts_of(self, job_ids: Sequence[str], *, settle_s: float = 0.0) -> dict[str, int]:
        """`num_restarts` of each job, settled together: the store's one fetch takes every job's
        metrics, so every job is asked once, then all again after one ``settle_s`` (the larger
        answer kept); ten jobs wait ``settle_s`` once, not ten times."""
        def ask(job_id: str) -> int:
            metrics = self.rest(f"/jobs/{job_id}/metrics?get=numRestarts")
            for metric in metrics or []:
                if metric.get("id") == "numRestarts":
                    return int(float(metric["value"]))
            return 0

        first = {job_id: ask(job_id) for job_id in job_ids}
        if settle_s <= 0 or not first:
            return first
        time.sleep(settle_s)
        return {job_id: max(count, ask(job_id)) for job_id, count in first.items()}

    def jobmanager_config(self) -> dict[str, str]:
        """``/jobmanager/config``: the JobManager's effective settings, key -> value."""
        return {str(item["key"]): str(item["value"]) for item in self.rest("/jobmanager/config") or []}

    def scheduler(self) -> str:
        """The cluster's ``jobmanager.scheduler`` in lower case (``default`` when unset); only
        ``adaptive`` rescales a running job (`set_resource_requirements`)."""
        settings = self.jobmanager_config()
        if settings.get("scheduler-mode", "").lower() == "reactive":
            return "reactive"
        return settings.get("jobmanager.scheduler", "default").lower()

    def resource_requirements(self, job_id: str) -> dict[str, tuple[int, int]]:
        """``GET /jobs/<id>/resource-requirements`` (FLIP-291): vertex id -> (lower, upper) parallelism."""
        body = self.rest(f"/jobs/{job_id}/resource-requirements") or {}
        return {vertex: (int(req["parallelism"]["lowerBound"]), int(req["parallelism"]["upperBound"]))
                for vertex, req in body.items()}

    def set_resource_requirements(self, job_id: str, requirements: dict[str, tuple[int, int]]) -> None:
        """``PUT /jobs/<id>/resource-requirements``: every vertex's (lower, upper) parallelism. The
        adaptive scheduler rescales the running job to the upper bounds when it has the slots (at the
        next completed checkpoint, from that checkpoint), else to what it has, down to the lower bounds."""
        self.rest(f"/jobs/{job_id}/resource-requirements", method="PUT",
                  body={vertex: {"parallelism": {"lowerBound": low, "upperBound": high}}
                        for vertex, (low, high) in requirements.items()})

    def checkpoint_stats(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.rest(f"/jobs/{job_id}/checkpoints")
        return result

    def latest_checkpoint(self, job_id: str) -> str | None:
        """The external path of the job's latest completed checkpoint (retained on cancel)."""
        latest = (self.checkpoint_stats(job_id).get("latest") or {}).get("completed") or {}
        path = latest.get("external_path")
        return str(path) if path else None

    def completed_checkpoints(self, job_id: str) -> int:
        return int((self.checkpoint_stats(job_id).get("counts") or {}).get("completed", 0))

    def is_fully_running(self, job_id: str) -> bool:
        """RUNNING with every task deployed and running (the job state turns RUNNING before that)."""
        job = self.job(job_id)
        return job["state"] == "RUNNING" and all(v["status"] == "RUNNING" for v in job["vertices"])

    def wait_for_job_state(self, job_id: str, states: str | Iterable[str], timeout: float = 120.0,
                           *, all_tasks: bool = True) -> str:
        """Wait until the job is in one of ``states``; RUNNING also waits for every task unless
        ``all_tasks`` is false. Raises if it ends (FAILED/CANCELED/FINISHED) in another state."""
        wanted = {states} if isinstance(states, str) else set(states)

        def reached() -> str | None:
            job = self.job(job_id)
            state = str(job["state"])
            if state in wanted:
                if state == "RUNNING" and all_tasks and not all(v["status"] == "RUNNING" for v in job["vertices"]):
                    return None
                return state
            if state in TERMINAL_STATES:
                raise ClusterError(f"job {job_id} is {state}, expected {sorted(wanted)}: {self.failure(job_id)}")
            return None

        return str(self._wait(f"job {job_id} to be {sorted(wanted)}", reached, timeout))

    def failure(self, job_id: str) -> str:
        """The root exception of the job's latest failure, or '' if it has none."""
        history = self.failures(job_id, most=1)
        return history[-1] if history else ""

    def failures(self, job_id: str, *, most: int = 16) -> list[str]:
        """The stack traces of the job's failures, oldest first (Flink keeps the latest
        ``web.exception-history-size``, 16 by default); [] if it has none or the API does not answer."""
        with contextlib.suppress(ClusterError, AttributeError):
            exceptions = self.rest(f"/jobs/{job_id}/exceptions?maxExceptions={most}", timeout=3.0)
            history = (exceptions.get("exceptionHistory") or {}).get("entries") or []
            # An entry's concurrent exceptions (other tasks failing at the same moment) follow its own
            # trace: when the entry is only the cluster shutting down, one of them is the cause.
            return ["\n".join(without_frames(str(e.get("stacktrace", "")))[:TRACE_CHARS]
                              for e in [entry, *(entry.get("concurrentExceptions") or [])])
                    for entry in reversed(history)]
        return []

    def cancel(self, job_id: str, timeout: float = 60.0) -> None:
        """Cancel the job and wait until it is CANCELED (its last checkpoint is retained)."""
        self.rest(f"/jobs/{job_id}?mode=cancel", method="PATCH")
        self._wait(f"job {job_id} to cancel", lambda: self.job_status(job_id) in TERMINAL_STATES, timeout)

    def trigger_stop(self, job_id: str, target_dir: str | None = None, *, drain: bool = False) -> str:
        """Ask for a stop-with-savepoint; returns the trigger id that `stop_savepoint` follows.

        ``drain`` first flushes everything in flight (end of event time), as a finished backfill wants.
        ``target_dir`` None means the cluster's ``execution.checkpointing.savepoint-dir``.
        """
        body: dict[str, Any] = {"drain": drain}
        if target_dir:
            body["targetDirectory"] = target_dir
        return str(self.rest(f"/jobs/{job_id}/stop", method="POST", body=body)["request-id"])

    def stop_savepoint(self, job_id: str, trigger: str) -> str | None:
        """The savepoint path of a `trigger_stop` once it completed, None while it runs; raises a
        `ClusterError` if Flink refused or failed it (e.g. while a task is still starting)."""
        result = self.rest(f"/jobs/{job_id}/savepoints/{trigger}")
        if result["status"]["id"] != "COMPLETED":
            return None
        operation = result.get("operation") or {}
        if "failure-cause" in operation:
            raise ClusterError(f"stop-with-savepoint of {job_id} failed: "
                               f"{json.dumps(operation['failure-cause'])[:2000]}")
        return str(operation["location"])

    def stop_with_savepoint(self, job_id: str, target_dir: str | None = None, *, drain: bool = False,
                            timeout: float = 180.0) -> str:
        """Stop the job with a final savepoint (its transactions committed) and wait until it has
        ended; returns the savepoint path. Arguments as `trigger_stop`."""
        trigger = self.trigger_stop(job_id, target_dir, drain=drain)
        location = self._wait(f"the savepoint of job {job_id}", lambda: self.stop_savepoint(job_id, trigger), timeout)
        self._wait(f"job {job_id} to stop", lambda: self.job_status(job_id) in TERMINAL_STATES, 60)
        return str(location)

    def live_jobs(self, name: str) -> list[dict[str, Any]]:
        """Jobs called ``name`` that are not finished, cancelled or failed for good."""
        return [j for j in self.jobs() if j.get("name") == name and j.get("state") in LIVE_STATES]
