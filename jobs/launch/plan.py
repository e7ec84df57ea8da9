"""The launch sequence `llmstream run` and `llmstream submit` share, and what the job graph is built from.

Both commands check and decide the same things, in the same order, before a job starts
(`prepare`); what differs is where the job runs, which each brings as a `Site`. What building
the graph needs besides the config (`JobBuild`) is decided here once, also by the cluster entry
point (`jobs/inference_job.py`), and handed on as values: nothing rewrites the config on the way.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kafka import TopicPartition  # type: ignore[import-untyped]

from jobs.clients.kafka_admin import GroupProgress
from jobs.graph import gate_operator as gate
from jobs.launch import preflight
from jobs.runtime import jars
from jobs.state.location import checked_state_dir
from jobs.state.snapshots import (
    StateDir,
    check_identity,
    default_state_dir,
    resume_point,
)
from udfs.config import JobConfig
from udfs.cost.cache import CACHE_FILE
from udfs.lanes.user_functions import (
    load_function,
    references,
    search_path,
    shipped_paths,
)

log = logging.getLogger("llmstream.launch")

__all__ = ["JobBuild", "LaunchPlan", "RunOptions", "Site", "job_build", "prepare", "result_cache_file", "user_modules"]


@dataclass(frozen=True)
class RunOptions:
    """How this run differs from the config.

    `until_end`: a backfill; the runner stops the job once the records present at start
    are committed (the source stays unbounded, so its state resumes like any other run's).
    `state_dir` overrides `checkpointing.directory`; `fresh` ignores the snapshots there;
    `from_savepoint` restores that snapshot instead of the newest (`jobs/state/snapshots.py`).
    """

    until_end: bool = False
    state_dir: str | None = None
    fresh: bool = False
    from_savepoint: str | None = None


@dataclass(frozen=True)
class JobBuild:
    """What building the job graph needs besides the config, decided where the job is launched.

    `state`: the job's state directory (checkpoints, savepoints). `jar_urls`: the Kafka connector's
    jars for ``pipeline.jars``. `cache_file`: the local result cache's file (`result_cache_file`),
    None for another backend; the stage takes it with it to its workers. `python_files`: the
    modules of the job's user functions, shipped to every worker (`user_modules`)."""

    state: StateDir
    jar_urls: tuple[str, ...]
    cache_file: str | None
    python_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    """Everything `prepare` checked and decided: the build, the snapshot to restore (`restore`,
    None for none) and the sentence that says so (`resume`), why state is left behind on that
    restore (`leave_behind`, None when nothing is: `jobs.graph.gate_operator.left_behind`), and with
    `until_end` the input's end offsets the backfill stops at (`end_offsets`, else None)."""

    build: JobBuild
    restore: str | None
    resume: str
    leave_behind: str | None
    end_offsets: dict[TopicPartition, int] | None


class Site(Protocol):
    """Where the job will run, as far as the launch sequence asks it."""

    def reach(self) -> None:
        """Raises unless the place the job runs can take it (the mini cluster's ports are free, the
        cluster answers). Called after the config and broker checks and before any jar is fetched."""

    def claim(self, state: StateDir) -> None:
        """Raises if another run of this job uses `state`; a local run holds it from here until it
        ends. Called before the state directory is read or its identity record written."""


def result_cache_file(config: JobConfig, state: StateDir) -> str | None:
    """The local result cache's file (`udfs/cost/cache.py`): `cache.path` as given, else
    ``result-cache.sqlite`` in the job's state directory; when that is not local (``s3://``), in
    the state directory the config alone names if that is local, else in the default one
    (`jobs.state.snapshots.default_state_dir`). None unless `cache.backend` is `local`.

    A state directory that is not local says the job may run on several hosts, which a file does
    not reach: the cache stays local (a cache, not state: a host without it calls the model again),
    and one line says that `cache.backend: redis` is the shared choice.

    Decided where the job is launched: the stage's workers may run from another copy of the code
    (a cluster ships `udfs/` to a temporary directory), so they are given the path."""
    cache = config.cache
    if cache.backend != "local":
        return None
    chosen = cache.path or str(((state.path or StateDir.for_job(config).path or default_state_dir(config.name))
                                / CACHE_FILE).resolve())
    if not state.local:
        log.warning("cache.backend: local keeps the result cache in %s on each host while the state is in %s; "
                    "on a multi-host cluster `cache.backend: redis` is the shared choice", chosen, state.location)
    return chosen


def user_modules(config: JobConfig) -> tuple[str, ...]:
    """Loads the job's user functions (`model.preprocess`, `output.postprocess`) here, looking in
    `python.path` and the current directory before the installed packages, and returns the files
    and package directories that ship them to the workers. A module or function that cannot be
    loaded is a `ConfigError` naming its key: one line at start, not a worker that fails to open."""
    named = references(config)
    if not named:
        return ()
    for path in reversed(search_path(config)):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    for key, ref in named:
        load_function(ref, key)
    return tuple(str(path) for path in shipped_paths(config))


def job_build(config: JobConfig, state: StateDir, jar_urls: Sequence[str],
              python_files: Sequence[str] | None = None) -> JobBuild:
    """The `JobBuild` of `config` with its state in `state`, connector jars `jar_urls` and the user
    functions' modules `python_files` (None: found here, `user_modules`)."""
    files = tuple(python_files) if python_files is not None else user_modules(config)
    return JobBuild(state=state, jar_urls=tuple(jar_urls), cache_file=result_cache_file(config, state),
                    python_files=files)


def prepare(config: JobConfig, options: RunOptions, site: Site, *,
            report: Callable[[str], None] = print) -> LaunchPlan:
    """The launch sequence, in this order: the state directory (`--state-dir`, else
    `checkpointing.directory`; made if missing), the user functions (`user_modules`), the config against the broker
    (`jobs.launch.preflight`), `site.reach()`, the connector's and the admission gate's jars,
    `site.claim(state)`, the state's identity (`jobs.state.snapshots.check_identity`), the
    snapshot to resume from and whether its gate state is left behind (both reported, and with
    `stage: auto` the lane it chose), and the input's end offsets for a backfill.

    Each check raises as it always has: a `ConfigError` naming the setting (exit 2), or the error
    of the jar, the cluster or the state directory that failed. Nothing is started."""
    state = checked_state_dir(config, options.state_dir, create=True)
    python_files = user_modules(config)
    preflight.check(config)
    site.reach()
    jars.ensure("connector")
    if state.searchable and not state.local:
        jars.ensure("s3")  # the mini cluster's S3 file system (jobs/graph/pipeline.py)
    gate.ensure_for(config)
    site.claim(state)
    check_identity(state, config, fresh=options.fresh, explicit=options.from_savepoint is not None)
    restore, resume = resume_point(state, fresh=options.fresh, explicit=options.from_savepoint)
    report(f"llmstream: {resume}")  # before any JVM starts: a run killed while it starts has said so
    if config.written_lane()[0] == "auto":
        report(f"llmstream: {config.lane_choice()[1]}")
    leave_behind = gate.left_behind(config, restore)
    if leave_behind:
        report(f"llmstream: {leave_behind}")
    end_offsets = _end_offsets(config) if options.until_end else None
    return LaunchPlan(build=job_build(config, state, jars.connector_jar_urls(), python_files),
                      restore=restore, resume=resume,
                      leave_behind=leave_behind, end_offsets=end_offsets)


def _end_offsets(config: JobConfig) -> dict[TopicPartition, int]:
    with contextlib.closing(GroupProgress(config)) as progress:
        return progress.end_offsets()
