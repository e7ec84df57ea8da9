"""The job's state directory: retained checkpoints and savepoints, and which one a run resumes from.

Exactly-once holds across a restart only if the new run restores Flink state: the source's
offsets and the sink's pending transactions are committed by different operators after a
checkpoint, so a run that starts fresh from the consumer group's offsets can replay (or
skip) one checkpoint's output. So every run, local or on a cluster, writes its checkpoints
and savepoints under one directory per job and the next run resumes from the newest
complete one there:

    <state dir>/checkpoints/<flink job id>/chk-<n>/_metadata    retained checkpoints
    <state dir>/savepoints/savepoint-<...>/_metadata            savepoints (Ctrl-C, stop, upgrade)

A local run also records where its mini cluster answers, and its last figures, in
``<state dir>/run.json`` (`LocalRun`), so ``llmstream status`` finds it.

A snapshot is complete once its ``_metadata`` file exists: Flink writes it last, to a
temporary name it renames on success. The default directory is ``var/state/<job name>``;
``checkpointing.directory`` or ``--state-dir`` override it. Only local directories (a path
or a ``file://`` URI) can be searched; for any other file system (``s3://``...) pass the
snapshot to resume from explicitly.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Literal
from urllib.parse import urlparse

from jobs.runtime import jars
from udfs.config import JobConfig
from udfs.errors import ConfigError, LLMStreamError

log = logging.getLogger("llmstream.state")

METADATA = "_metadata"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class StateDirError(LLMStreamError):
    """The state directory cannot be used (another run holds it, or it is not searchable)."""


@dataclass(frozen=True)
class Snapshot:
    """One complete checkpoint or savepoint: the directory holding its ``_metadata``."""

    path: Path
    kind: Literal["checkpoint", "savepoint"]
    completed_at: float

    @property
    def uri(self) -> str:
        return self.path.as_uri()

    def describe(self, now: float | None = None) -> str:
        age = max(0.0, (now if now is not None else time.time()) - self.completed_at)
        where = f"{self.path.parent.name}/{self.path.name}" if self.kind == "checkpoint" else self.path.name
        return f"{self.kind} {where} ({_age(age)} old)"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def default_state_dir(job_name: str) -> Path:
    """``<repo>/var/state/<job name>``, the name made safe for a file system."""
    return jars.repo_root() / "var" / "state" / (_UNSAFE.sub("_", job_name).strip("._") or "job")


def local_path(location: str) -> Path | None:
    """The local directory a path or ``file:`` URI names; None for another file system."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and location[1:3] in (":\\", ":/")):
        return Path(location).expanduser().resolve()
    return None


class StateDir:
    """One job's state directory. ``location`` is a path or a URI; only local ones are searched."""

    def __init__(self, location: str | Path) -> None:
        self.location = str(location)
        self.path = local_path(self.location)
        self.uri = self.path.as_uri() if self.path is not None else self.location.rstrip("/")

    @classmethod
    def for_job(cls, config: JobConfig, override: str | Path | None = None) -> StateDir:
        """``override`` (``--state-dir``), else ``checkpointing.directory``, else the default."""
        chosen = override or config.checkpointing.directory or default_state_dir(config.name)
        return cls(chosen)

    @property
    def checkpoints_uri(self) -> str:
        return f"{self.uri}/checkpoints"

    @property
    def savepoints_uri(self) -> str:
        return f"{self.uri}/savepoints"

    @property
    def searchable(self) -> bool:
        return self.path is not None

    def snapshots(self) -> list[Snapshot]:
        """Every complete snapshot here, newest first."""
        if self.path is None:
            return []
        found: list[Snapshot] = []
        for kind, pattern in (("checkpoint", "checkpoints/*/chk-*/" + METADATA),
                              ("savepoint", "savepoints/*/" + METADATA)):
            for metadata in self.path.glob(pattern):
                with contextlib.suppress(OSError):
                    found.append(Snapshot(metadata.parent, kind, metadata.stat().st_mtime))  # type: ignore[arg-type]
        return sorted(found, key=lambda s: s.completed_at, reverse=True)

    def latest(self) -> Snapshot | None:
        """The newest complete snapshot: the one holding the most recently committed output."""
        snapshots = self.snapshots()
        return snapshots[0] if snapshots else None

    def prune(self, keep: int = 2) -> list[Path]:
        """Delete all but the ``keep`` newest snapshots (a job's own retained checkpoints are
        also pruned by Flink; these are older runs' leftovers). Returns what was removed."""
        removed = []
        for old in self.snapshots()[keep:]:
            shutil.rmtree(old.path, ignore_errors=True)
            removed.append(old.path)
            parent = old.path.parent
            if old.kind == "checkpoint" and not any(parent.glob("chk-*")):
                shutil.rmtree(parent, ignore_errors=True)
        if removed:
            log.info("pruned %d old snapshot(s) from %s", len(removed), self.location)
        return removed

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held by a local run for its whole life: two runs restoring and committing the same
        state would write each other's output twice."""
        if self.path is None:
            yield
            return
        self.path.mkdir(parents=True, exist_ok=True)
        handle: IO[str] = open(self.path / "run.lock", "w")  # noqa: SIM115 - held until the run ends
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StateDirError(f"another llmstream run is using the state directory {self.path}; "
                                    "stop it first (or give this run another --state-dir)") from None
            yield
        finally:
            handle.close()


IDENTITY_FILE = "job.json"
IDENTITY_KEYS = ("bootstrap_servers", "input_topic", "group_id", "transactional_id_prefix")
LANE_KEY = "stage"


def check_identity(state: StateDir, config: JobConfig, *, fresh: bool, explicit: bool = False) -> None:
    """Refuses to resume state written for another input, group or sink.

    Restoring a Kafka source's state restores its topic partitions and offsets; resuming a
    job that now reads another topic from it would read the old one too. So the state
    directory records what it belongs to, and a different config must use another
    directory (or `--fresh`, which rewrites the record).

    It records the lane too (`stage`, with `auto` resolved): a snapshot restores only into the
    lane that took it, and Flink would say so only after its JVM started, naming an operator
    hash, and for `llmstream upgrade` after the running job was stopped. Not with an explicit
    `--from-savepoint` (`explicit`), which need not come from this directory.
    """
    if state.path is None:
        return
    # `input_topic` stands for the whole input (a topic, `a;b`, `pattern:<regex>`): the key keeps
    # its name so that state directories of single-topic jobs stay theirs.
    wanted = {key: getattr(config.kafka, key) for key in IDENTITY_KEYS if key != "input_topic"}
    wanted["input_topic"] = config.kafka.input_description()
    lane = config.lane  # `stage` with `auto` resolved
    path = state.path / IDENTITY_FILE
    recorded: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads(path.read_text())
    if recorded and not fresh and state.snapshots():
        differs = [key for key in IDENTITY_KEYS if recorded.get(key) != wanted[key]]
        if differs:
            key = differs[0]
            raise ConfigError(f"kafka.{key}", f"is {wanted[key]!r}, but the state directory {state.path} holds the "
                                             f"state of a job with {key} {recorded.get(key)!r}; give this job its "
                                             "own checkpointing.directory (or --state-dir), or pass --fresh")
        took = recorded.get(LANE_KEY)
        if took is not None and took != lane and not explicit:
            raise ConfigError("stage", f"runs the {lane} lane, but the snapshots in {state.path} were taken "
                                       f"by the {took} lane, and a snapshot restores only into the lane that took it; "
                                       f"drain the job in the {took} lane first (`llmstream run --until-end`, or "
                                       "`llmstream submit --until-end` on a cluster), then start this config with --fresh")
    state.path.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**wanted, LANE_KEY: lane}, indent=2) + "\n")


def resume_point(state: StateDir, *, fresh: bool, explicit: str | None = None) -> tuple[str | None, str]:
    """What a run restores from, and the sentence that says so.

    ``explicit`` (``--from-savepoint``) wins; ``fresh`` ignores the state directory; else the
    newest snapshot there, or none on a first run.
    """
    if explicit:
        return explicit, f"resuming from {explicit} (given)"
    snapshots = state.snapshots()
    if fresh:
        ignored = f" ({len(snapshots)} snapshot(s) in {state.location} ignored)" if snapshots else ""
        return None, ("starting FRESH from the consumer group's committed offsets" + ignored +
                      ": records since the group's last commit may be written again, or skipped, "
                      "because offsets and output are committed separately")
    if not state.searchable:
        return None, (f"state directory {state.location} is not on a local file system and cannot be searched: "
                      "starting from the consumer group's committed offsets (pass --from-savepoint to resume)")
    if not snapshots:
        return None, f"no snapshot in {state.location} yet: first run, starting from the consumer group's offsets"
    return snapshots[0].uri, f"resuming from {snapshots[0].describe()} in {state.location}"


_REFUSED = re.compile(r"Failed to rollback to checkpoint/savepoint (\S+?)\.? (.+?)(?: If you want to allow|\n|$)")


def restore_refused(error: BaseException | str, restore: str | None, options_from: str | None,
                    state_dir: str | None) -> ConfigError | None:
    """Flink's refusal of the snapshot a run restores (it does not fit the job: state for an
    operator the job lacks, another max parallelism...) as one line naming where the snapshot
    came from (`--from-savepoint`, else the state directory), or None for any other error."""
    if restore is None:
        return None
    match = _REFUSED.search(str(error))
    if match is None:
        return None
    where = "--from-savepoint" if options_from else ("--state-dir" if state_dir else "checkpointing.directory")
    return ConfigError(where, f"Flink refused to restore {restore}: {match.group(2).strip()} "
                              "(pass --fresh to start from the consumer group's offsets instead)")


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
