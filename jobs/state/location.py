"""The state directory a command was told to use (`jobs/state/snapshots.py`), checked before anything starts.

A path that is a file, or cannot be created, would otherwise fail deep inside a run or after a
job was already stopped. And an explicit ``--state-dir`` given to a command that continues a job
(``stop``, ``upgrade``, ``status``) must exist: a mistyped one would put the savepoint where the
next ``submit`` does not look, which resumes from an older snapshot and writes output again.
"""

from __future__ import annotations

import os
from pathlib import Path

from jobs.state.snapshots import StateDir
from jobs.state.storage import StoreError
from udfs.config import JobConfig
from udfs.errors import ConfigError

__all__ = ["checked_state_dir"]


def checked_state_dir(config: JobConfig, override: str | Path | None, *, create: bool) -> StateDir:
    """The job's `StateDir` (``override`` is ``--state-dir``). Raises a `ConfigError` naming
    ``--state-dir`` (or ``checkpointing.directory``, which chose it otherwise) if it is not a
    directory; if ``create`` (the command writes to it), one that does not exist yet is made (a
    first run) and it must be writable, else an explicit one must already exist. One on S3 must
    answer (and take writes if ``create``) with the job's ``s3.*`` settings, checked here before any
    JVM starts: one line naming the setting, the endpoint and what went wrong. A directory on a
    file system llmstream cannot read is not checked."""
    state = StateDir.for_job(config, override)
    path = state.path
    key = "--state-dir" if override else "checkpointing.directory"
    if path is None:
        if state.store is not None:
            try:
                state.store.check(create=create)
                empty = not create and override and next(iter(state.store.list("")), None) is None
            except StoreError as err:
                raise ConfigError(key, f"{state.location} {err}") from None
            if empty:
                raise ConfigError(key, f"{state.location} holds nothing; give the state directory the job was "
                                       "started with (or leave --state-dir out to use checkpointing.directory)")
        return state
    if path.exists() and not path.is_dir():
        raise ConfigError(key, f"{path} is not a directory")
    if not path.exists():
        if create:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(key, f"cannot create the state directory {path}: {err.strerror or err}") from None
        elif override:
            raise ConfigError(key, f"{path} does not exist; give the state directory the job was started with "
                                   "(or leave --state-dir out to use checkpointing.directory)")
    elif create and not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(key, f"the state directory {path} is not writable")
    return state
