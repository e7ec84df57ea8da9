"""`llmstream submit`, `stop` and `upgrade`: the job on a Flink cluster, resuming from its own state.

A job is submitted with Flink's own ``bin/flink run -d -py jobs/inference_job.py``
(`jobs/clients/flink_cli.py`) after the launch sequence `llmstream run` shares (`jobs/launch/plan.py`), to ``--jobmanager HOST:PORT`` or by
default to the local cluster of ``llmstream cluster``, found through the address it records
(`jobs/clients/cluster_address.py`). Every submit
restores the newest snapshot in the job's state directory (`jobs/state/snapshots.py`); ``stop`` and
``upgrade`` go through a savepoint, so no restart writes output twice or skips input.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from kafka import TopicPartition  # type: ignore[import-untyped]

from jobs.clients.cluster_address import target
from jobs.clients.flink_cli import client_env, run_job_script
from jobs.clients.flink_rest import TERMINAL_STATES, ClusterError, FlinkRest
from jobs.clients.kafka_admin import GroupProgress
from jobs.graph import gate_operator as gate
from jobs.launch.driver import (
    Backfill,
    BackfillIncomplete,
    RestDriver,
    StopRequest,
    drive,
)
from jobs.runtime import jars
from jobs.state.location import checked_state_dir
from jobs.state.snapshots import StateDir, check_identity

if TYPE_CHECKING:
    from jobs.launch.plan import RunOptions
    from udfs.config import JobConfig

log = logging.getLogger("llmstream.submit")

__all__ = ["stop_job", "submit", "upgrade"]

STOP_TIMEOUT_S = 180.0
"""How long a stop-with-savepoint is asked for again while Flink refuses it."""


def _target(jobmanager: str | None) -> tuple[str, dict[str, str], FlinkRest]:
    """(``flink run -m`` address, environment for Flink's CLI, REST client) of the cluster to use:
    ``jobmanager``, else the local cluster (`jobs/clients/cluster_address.py`, which raises a `ConfigError`
    naming ``--jobmanager`` if it does not answer)."""
    cluster = target(jobmanager)
    return cluster.address, client_env(Path(cluster.conf_dir), Path(cluster.log_dir)), cluster.rest()


def load_job(config_path: str | None) -> tuple[Path, JobConfig]:
    """The config file a command names (default: jobs/inference.yaml), loaded."""
    from udfs.config import DEFAULT_CONFIG, load_config

    path = Path(config_path) if config_path else DEFAULT_CONFIG
    return path, load_config(path)


def live_job(rest: FlinkRest, config: JobConfig) -> str:
    """The id of the config's running job on the cluster; `ClusterError` when none runs."""
    live = rest.live_jobs(config.name)
    if not live:
        raise ClusterError(f"no running job called {config.name!r} at {rest.rest_url}")
    return str(live[0]["jid"])


def submit(config_path: str | None, jobmanager: str | None = None, options: RunOptions | None = None, *,
           drain_timeout_s: float | None = None) -> int:
    """``llmstream submit``: preflight, then submit to ``jobmanager`` (HOST:PORT; default the local
    cluster), resuming from the newest snapshot in the job's state directory (`jobs/state/snapshots.py`).

    Refuses while a job of the same name is live: two jobs committing the same state and
    transactional ids would duplicate output. With ``until_end`` it then waits until the group
    has committed the records present at submission and stops the job with a draining
    savepoint. Returns 0. Raises `ConfigError` for a setting (the state directory, the cluster's
    address, the broker; exit 2), `ClusterError` when the cluster refuses or the job fails (exit 1).
    """
    from jobs.launch.plan import RunOptions, prepare

    options = options or RunOptions()
    path, config = load_job(config_path)
    cluster = _Cluster(jobmanager, config)
    plan = prepare(config, options, cluster)
    state = plan.build.state
    job_id = run_job_script(path, cluster.address, env=cluster.env, savepoint=plan.restore, state_dir=state.location,
                            leave_behind=plan.leave_behind is not None, python_files=plan.build.python_files)
    print(f"llmstream: submitted job {config.name} as {job_id}")
    print(f"llmstream: web UI {cluster.rest.rest_url}/#/job/running/{job_id}/overview")
    if plan.end_offsets is not None:
        return _finish_backfill(cluster.rest, job_id, config, state, plan.end_offsets,
                                drain_timeout_s or config.longest_record_s())
    return 0


class _Cluster:
    """The launch sequence's `jobs.launch.plan.Site` of a submit: the cluster must answer
    (`_target`), and run no job of this name, since two jobs committing the same state and
    transactional ids would duplicate output. `address`, `env` and `rest` once reached."""

    address: str
    env: dict[str, str]
    rest: FlinkRest

    def __init__(self, jobmanager: str | None, config: JobConfig) -> None:
        self._jobmanager = jobmanager
        self._config = config

    def reach(self) -> None:
        self.address, self.env, self.rest = _target(self._jobmanager)

    def claim(self, state: StateDir) -> None:
        live = self.rest.live_jobs(self._config.name)
        if live:
            raise ClusterError(f"job {self._config.name!r} is already {live[0]['state']} as {live[0]['jid']}; "
                               "use `llmstream upgrade` to change it or `llmstream stop` first")


def _finish_backfill(rest: FlinkRest, job_id: str, config: JobConfig, state: StateDir,
                     targets: dict[TopicPartition, int], drain_timeout_s: float) -> int:
    """Waits until the group has committed ``targets`` and the stage holds no more records, then
    stops the job with a draining savepoint (`jobs.launch.driver.drive`, the loop `llmstream run`
    uses too). A drain that does not end in time cancels the job, whose last checkpoint the same
    command resumes from; raises `BackfillIncomplete` then, `ClusterError` if the job failed."""
    from jobs.observe.figures import JobMetrics, figures, held_of

    print(f"llmstream: backfill: waiting until the group has committed {sum(targets.values())} input records")
    with contextlib.closing(GroupProgress(config)) as progress:
        backfill = Backfill(progress, targets, drain_timeout_s,
                            held=lambda: held_of(figures(config, JobMetrics(rest, job_id).collect())))
        outcome = drive(RestDriver(rest, job_id), StopRequest.new(), savepoints_uri=state.savepoints_uri,
                        backfill=backfill, stop_timeout_s=STOP_TIMEOUT_S)
    if outcome.state == "FAILED":
        raise ClusterError(f"job {job_id} failed before the backfill was done: {outcome.cause}; the same command "
                           f"resumes it from the last checkpoint in {state.location}")
    if not outcome.drained:
        held = f"at most {outcome.held}" if outcome.held is not None else "the"
        where = outcome.savepoint or f"the last checkpoint in {state.location}"
        raise BackfillIncomplete(f"backfill not finished: job {job_id} ended {outcome.state} with {held} records "
                                 f"the stage held still in its state ({where}); the same command finishes them"
                                 + (f" (the draining savepoint: {outcome.stop_error})" if outcome.stop_error else ""))
    print(f"llmstream: backfill done; every record present at submission is in output or dead letters; "
          f"stopped with savepoint {outcome.savepoint}")
    return 0


def _stop_when_running(rest: FlinkRest, job_id: str, state: StateDir, *, drain: bool) -> str:
    """Stop-with-savepoint into the job's state directory, retried while Flink refuses it because
    a task is still starting or restarting. A stop that never completes leaves the job running,
    and the error says so: no timeout reads as a stop."""
    try:
        return RestDriver(rest, job_id).stop_with_savepoint(drain=drain, directory=state.savepoints_uri,
                                                            timeout_s=STOP_TIMEOUT_S)
    except ClusterError as err:
        try:
            ended = rest.job_status(job_id) in TERMINAL_STATES
        except ClusterError:
            ended = False  # the cluster does not answer: say what the stop left, as far as known
        if ended:
            raise
        raise ClusterError(f"{err}; job {job_id} is still running, unchanged (its checkpoints go on in "
                           f"{state.location}): ask again, or cancel it, which keeps its last checkpoint") from None


def stop_job(config_path: str | None, jobmanager: str | None = None, state_dir: str | None = None) -> int:
    """``llmstream stop``: stop the config's running job with a savepoint in its state directory.
    Returns 0; raises as `submit` does (``ClusterError`` also when no such job runs)."""
    _, config = load_job(config_path)
    state = checked_state_dir(config, state_dir, create=False)
    _, _, rest = _target(jobmanager)
    job_id = live_job(rest, config)
    print(f"llmstream: stopping job {config.name} ({job_id}) with a savepoint ...")
    savepoint = _stop_when_running(rest, job_id, state, drain=False)
    print(f"llmstream: stopped; savepoint {savepoint}")
    print("llmstream: `llmstream submit` resumes from it")
    return 0


def upgrade(config_path: str | None, jobmanager: str | None = None, state_dir: str | None = None) -> int:
    """``llmstream upgrade``: stop the running job with a savepoint and resubmit it from there with
    the (changed) config: capacity, retries, endpoint, parallelism. The config, the state directory,
    the broker and the cluster are checked first, so a broken one never stops a healthy job.
    Returns 0; raises as `submit` does."""
    from jobs.launch import preflight
    from jobs.launch.plan import user_modules

    path, config = load_job(config_path)
    state = checked_state_dir(config, state_dir, create=state_dir is None)
    python_files = user_modules(config)
    preflight.check(config)
    address, env, rest = _target(jobmanager)
    jars.ensure("connector")
    gate.ensure_for(config)
    job_id = live_job(rest, config)
    check_identity(state, config, fresh=False)
    print(f"llmstream: upgrading job {config.name} ({job_id}): stopping it with a savepoint ...")
    savepoint = _stop_when_running(rest, job_id, state, drain=False)
    print(f"llmstream: savepoint {savepoint}; resubmitting with {path}")
    leave_behind = gate.left_behind(config, savepoint)
    if leave_behind:
        print(f"llmstream: {leave_behind}")
    try:
        new_id = run_job_script(path, address, env=env, savepoint=savepoint, state_dir=state.location,
                                leave_behind=leave_behind is not None, python_files=python_files)
    except ClusterError as err:
        raise ClusterError(f"{err}; the job is stopped: `llmstream submit` resumes it from {savepoint}") from None
    print(f"llmstream: upgraded: job {config.name} runs as {new_id}, restored from {savepoint}")
    return 0
