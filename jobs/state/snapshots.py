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
temporary name it renames on success (on S3 an object appears whole when its upload completes).
The default directory is ``var/state/<job name>``; ``checkpointing.directory`` or ``--state-dir``
override it. It may be local (a path or a ``file://`` URI) or on S3 (``s3://bucket/prefix``),
read and written through `jobs.state.storage`; on any other file system Flink writes the
snapshots but nothing here can read them: pass the snapshot to resume from explicitly.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from jobs.runtime import jars
from jobs.state.storage import StateStore, StoreError, local_path, store_for
from udfs.config import JobConfig
from udfs.errors import ConfigError, LLMStreamError

log = logging.getLogger("llmstream.state")

METADATA = "_metadata"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

__all__ = ["METADATA", "LocalRun", "Snapshot", "StateDir", "StateDirError", "check_identity", "default_state_dir",
           "local_path", "restore_refused", "resume_point"]


class StateDirError(LLMStreamError):
    """The state directory cannot be used (another run holds it, or it is not searchable)."""


@dataclass(frozen=True)
class Snapshot:
    """One complete checkpoint or savepoint: the directory holding its ``_metadata``, as a key in
    its state directory (``checkpoints/<job id>/chk-7``), a URI Flink restores from, and for a
    local one its path."""

    key: str
    kind: Literal["checkpoint", "savepoint"]
    completed_at: float
    uri: str
    path: Path | None = None

    def describe(self, now: float | None = None) -> str:
        age = max(0.0, (now if now is not None else time.time()) - self.completed_at)
        parts = self.key.split("/")
        where = "/".join(parts[-2:]) if self.kind == "checkpoint" else parts[-1]
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


class StateDir:
    """One job's state directory. ``location`` is a path or a URI; ``flink`` is the job's ``flink:``
    section, whose ``s3.*`` keys reach an S3 one (`jobs.state.storage.S3Settings`). ``path`` is set
    for a local directory only; ``store`` for any the commands can read (local or S3)."""

    def __init__(self, location: str | Path, flink: Mapping[str, str] | None = None) -> None:
        self.location = str(location)
        self.path = local_path(self.location)
        self.store: StateStore | None = store_for(self.location, flink)
        self.uri = self.store.uri if self.store is not None else self.location.rstrip("/")

    @classmethod
    def for_job(cls, config: JobConfig, override: str | Path | None = None) -> StateDir:
        """``override`` (``--state-dir``), else ``checkpointing.directory``, else the default."""
        chosen = override or config.checkpointing.directory or default_state_dir(config.name)
        return cls(chosen, config.flink)

    @property
    def checkpoints_uri(self) -> str:
        return f"{self.uri}/checkpoints"

    @property
    def savepoints_uri(self) -> str:
        return f"{self.uri}/savepoints"

    @property
    def searchable(self) -> bool:
        return self.store is not None

    @property
    def local(self) -> bool:
        """On this machine's file system (a cluster's other hosts may not see it)."""
        return self.path is not None

    def read_text(self, name: str) -> str | None:
        """A record file of the state directory (``job.json``, ``run.json``), None if absent or unreadable."""
        if self.store is None:
            return None
        try:
            data = self.store.read(name)
        except StoreError as err:
            log.warning("state directory %s: %s", self.location, err)
            return None
        return data.decode("utf-8", errors="replace") if data is not None else None

    def write_text(self, name: str, text: str) -> None:
        if self.store is not None:
            self.store.write(name, text.encode("utf-8"))

    def snapshots(self) -> list[Snapshot]:
        """Every complete snapshot here, newest first."""
        store = self.store
        if store is None:
            return []
        found: list[Snapshot] = []
        for kind, depth in (("checkpoint", 4), ("savepoint", 3)):
            for stored in store.list(f"{kind}s/"):
                parts = stored.key.split("/")
                if len(parts) != depth or parts[-1] != METADATA or (kind == "checkpoint" and not parts[2].startswith("chk-")):
                    continue
                key = "/".join(parts[:-1])
                found.append(Snapshot(key, kind, stored.modified, f"{self.uri}/{key}",  # type: ignore[arg-type]
                                      self.path / key if self.path is not None else None))
        return sorted(found, key=lambda s: s.completed_at, reverse=True)

    def latest(self) -> Snapshot | None:
        """The newest complete snapshot: the one holding the most recently committed output."""
        snapshots = self.snapshots()
        return snapshots[0] if snapshots else None

    def prune(self, keep: int = 2) -> list[str]:
        """Delete all but the ``keep`` newest snapshots (a job's own retained checkpoints are
        also pruned by Flink; these are older runs' leftovers). Returns the URIs removed."""
        store = self.store
        if store is None:
            return []
        removed = []
        for old in self.snapshots()[keep:]:
            store.delete(old.key + "/")
            removed.append(old.uri)
            parent = old.key.rpartition("/")[0]
            if old.kind == "checkpoint" and not any(f.key.split("/")[2].startswith("chk-")
                                                    for f in store.list(parent + "/")):
                store.delete(parent + "/")
        if removed:
            log.info("pruned %d old snapshot(s) from %s", len(removed), self.location)
        return removed

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held by a local run for its whole life: two runs restoring and committing the same
        state would write each other's output twice. A local directory is locked with ``flock``;
        an object store, which has no locks, holds a `Lease` object instead."""
        if self.store is not None and self.path is None:
            with Lease(self.store, self.location).held():
                yield
            return
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


LEASE_FILE = "run.lease"
LEASE_TTL_S = 30.0
"""A lease whose heartbeat is older than this is free: its run was killed without releasing it."""
LEASE_HEARTBEAT_S = 5.0
LEASE_SETTLE_S = 1.0
"""How long a new holder waits before reading its lease back (two runs starting together: the last writer wins)."""


class Lease:
    """Who runs the job on a state directory that has no locks (S3): the object ``run.lease``
    holding ``{"owner": host:pid:random, "heartbeat": unix time}``.

    A run takes it by reading it (refused while another owner's heartbeat is younger than
    `LEASE_TTL_S`), writing its own, waiting `LEASE_SETTLE_S` and reading it back (refused if
    another run's write came after its own: S3 keeps the last write, and s3proxy ignores
    conditional writes, so last-writer-wins plus a read-back is what every store supports). A
    thread rewrites the heartbeat every `LEASE_HEARTBEAT_S` while the run lives; the run deletes
    the lease when it ends. A run killed outright leaves it behind: the next run is refused until
    the heartbeat is `LEASE_TTL_S` old, and the message says so. Heartbeats are compared with this
    machine's clock: hosts sharing a state directory need clocks within a few seconds."""

    def __init__(self, store: StateStore, location: str) -> None:
        self._store = store
        self._location = location
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()

    def _current(self) -> dict[str, Any]:
        data = self._store.read(LEASE_FILE)
        try:
            current = json.loads(data) if data else {}
        except ValueError:
            return {}
        return current if isinstance(current, dict) else {}

    def _refuse_if_held(self, current: dict[str, Any]) -> None:
        age = time.time() - float(current.get("heartbeat", 0))
        if current.get("owner") not in (None, self.owner) and age < LEASE_TTL_S:
            owner = str(current["owner"]).rsplit(":", 1)[0]
            raise StateDirError(f"another llmstream run ({owner}) is using the state directory {self._location} "
                                f"(its lease was renewed {max(age, 0):.0f} s ago); stop it first, or give this run "
                                f"another --state-dir; a run killed outright frees it {LEASE_TTL_S:.0f} s after its "
                                "last renewal")

    def _write(self) -> None:
        self._store.write(LEASE_FILE, json.dumps({"owner": self.owner, "heartbeat": time.time()}).encode())

    def _beat(self) -> None:
        while not self._stop.wait(LEASE_HEARTBEAT_S):
            try:
                self._write()
            except StoreError as err:
                log.warning("state directory %s: cannot renew the run's lease: %s", self._location, err)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._refuse_if_held(self._current())
        self._write()
        time.sleep(LEASE_SETTLE_S)
        self._refuse_if_held(self._current())
        beat = threading.Thread(target=self._beat, name="state-lease", daemon=True)
        beat.start()
        try:
            yield
        finally:
            self._stop.set()
            beat.join(timeout=LEASE_HEARTBEAT_S + 5)
            with contextlib.suppress(StoreError):
                if self._current().get("owner") == self.owner:
                    self._store.delete(LEASE_FILE)


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
    if state.store is None:
        return
    # `input_topic` stands for the whole input (a topic, `a;b`, `pattern:<regex>`): the key keeps
    # its name so that state directories of single-topic jobs stay theirs.
    wanted = {key: getattr(config.kafka, key) for key in IDENTITY_KEYS if key != "input_topic"}
    wanted["input_topic"] = config.kafka.input_description()
    lane = config.lane  # `stage` with `auto` resolved
    recorded: dict[str, str] = {}
    with contextlib.suppress(ValueError):
        recorded = json.loads(state.read_text(IDENTITY_FILE) or "{}")
    if recorded and not fresh and state.snapshots():
        differs = [key for key in IDENTITY_KEYS if recorded.get(key) != wanted[key]]
        if differs:
            key = differs[0]
            raise ConfigError(f"kafka.{key}", f"is {wanted[key]!r}, but the state directory {state.location} holds the "
                                             f"state of a job with {key} {recorded.get(key)!r}; give this job its "
                                             "own checkpointing.directory (or --state-dir), or pass --fresh")
        took = recorded.get(LANE_KEY)
        if took == "keyed" and lane == "provider-batch":
            # Before `lane`, the provider-batch lane (`model.mode: batch`) recorded itself as the keyed
            # stage it rode in: its state directories stay its own. (A keyed job's directory is not
            # told apart from it, as before.)
            took = lane
        if took is not None and took != lane and not explicit:
            raise ConfigError("stage", f"runs the {lane} lane, but the snapshots in {state.location} were taken "
                                       f"by the {took} lane, and a snapshot restores only into the lane that took it; "
                                       f"drain the job in the {took} lane first (`llmstream run --until-end`, or "
                                       "`llmstream submit --until-end` on a cluster), then start this config with --fresh")
    state.write_text(IDENTITY_FILE, json.dumps({**wanted, LANE_KEY: lane}, indent=2) + "\n")


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
        return None, (f"state directory {state.location} is on a file system llmstream cannot read (local and s3:// are): "
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
        state.write_text(RUN_FILE, json.dumps(asdict(self), indent=2) + "\n")

    def ended(self, state: StateDir) -> None:
        self.ended_at = time.time()
        with contextlib.suppress(OSError, StoreError):
            self.record(state)

    @classmethod
    def load(cls, state: StateDir) -> LocalRun | None:
        try:
            text = state.read_text(RUN_FILE)
            return cls(**json.loads(text)) if text is not None else None
        except (ValueError, TypeError):
            return None
