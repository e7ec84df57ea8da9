"""The job's state directory: which snapshot a run resumes from, and what it refuses."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from jobs.state.snapshots import (
    StateDir,
    StateDirError,
    check_identity,
    default_state_dir,
    restore_refused,
    resume_point,
)
from udfs.config import load_config, with_overrides
from udfs.errors import ConfigError


def _snapshot(root: Path, relative: str, age_s: float, *, complete: bool = True) -> Path:
    directory = root / relative
    directory.mkdir(parents=True)
    if complete:
        metadata = directory / "_metadata"
        metadata.write_bytes(b"flink")
        when = time.time() - age_s
        os.utime(metadata, (when, when))
    return directory


def test_the_newest_complete_snapshot_wins_whatever_its_kind(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    _snapshot(tmp_path, "checkpoints/job-a/chk-7", 300)
    savepoint = _snapshot(tmp_path, "savepoints/savepoint-a-1", 120)
    newest = _snapshot(tmp_path, "checkpoints/job-b/chk-3", 10)
    _snapshot(tmp_path, "checkpoints/job-b/chk-4", 1, complete=False)  # being written: no _metadata yet
    assert [s.path for s in state.snapshots()][:2] == [newest, savepoint]
    restore, how = resume_point(state, fresh=False)
    assert restore == newest.as_uri()
    assert "resuming from checkpoint job-b/chk-3" in how


def test_first_run_fresh_and_explicit_snapshots_say_what_they_do(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "empty")
    assert resume_point(state, fresh=False) == (None, resume_point(state, fresh=False)[1])
    assert "first run" in resume_point(state, fresh=False)[1]
    _snapshot(state.path or tmp_path, "savepoints/savepoint-1", 5)
    restore, how = resume_point(state, fresh=True)
    assert restore is None
    assert "FRESH" in how and "1 snapshot(s)" in how and "written again" in how
    assert resume_point(state, fresh=False, explicit="file:///sp/x") == ("file:///sp/x", "resuming from file:///sp/x (given)")


def test_state_directories_llmstream_cannot_read_are_used_but_not_searched(tmp_path: Path) -> None:
    s3 = StateDir("s3://bucket/llmstream/job/")
    assert s3.checkpoints_uri == "s3://bucket/llmstream/job/checkpoints"
    assert s3.searchable and not s3.local  # read through jobs/state/storage.py (tests/integration/test_s3_state.py)
    state = StateDir("gs://bucket/llmstream/job")
    assert state.checkpoints_uri == "gs://bucket/llmstream/job/checkpoints"
    assert not state.searchable
    restore, how = resume_point(state, fresh=False)
    assert restore is None and "--from-savepoint" in how
    local = StateDir(f"file://{tmp_path}/x")
    assert local.path == tmp_path / "x" and local.savepoints_uri == (tmp_path / "x").as_uri() + "/savepoints"


def test_default_directory_is_named_from_the_job(tmp_path: Path) -> None:
    config = load_config()
    assert StateDir.for_job(config).path == default_state_dir("llmstream-inference")
    assert default_state_dir("my job/v2").name == "my_job_v2"
    configured = with_overrides(config, checkpointing={"directory": str(tmp_path / "s")})
    assert StateDir.for_job(configured).path == tmp_path / "s"
    assert StateDir.for_job(configured, tmp_path / "flag").path == tmp_path / "flag"


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    old = _snapshot(tmp_path, "checkpoints/job-a/chk-1", 300)
    middle = _snapshot(tmp_path, "savepoints/savepoint-1", 200)
    new = _snapshot(tmp_path, "checkpoints/job-b/chk-9", 100)
    assert state.prune(keep=2) == [old.as_uri()]
    assert not (tmp_path / "checkpoints" / "job-a").exists()
    assert middle.exists() and new.exists()


def test_one_run_at_a_time_per_state_directory(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    with state.exclusive(), pytest.raises(StateDirError, match="another llmstream run"), \
            StateDir(tmp_path).exclusive():
        pass
    with StateDir(tmp_path).exclusive():
        pass


@pytest.mark.parametrize(("change", "key", "says"), [
    ({"kafka": {"group_id": "another-group"}}, "kafka.group_id", "another-group"),
    ({"stage": "vectorized"}, "stage", "taken by the keyed lane"),
], ids=["another input", "the other lane"])
def test_state_of_another_job_or_lane_is_refused_unless_fresh(
        tmp_path: Path, change: dict[str, Any], key: str, says: str) -> None:
    """Another input, group or sink would read the old one's partitions too; another lane's
    snapshot Flink would refuse, after its JVM started. Both are refused at start, naming the key."""
    config = with_overrides(load_config(), stage="keyed", checkpointing={"directory": str(tmp_path)})
    state = StateDir.for_job(config)
    check_identity(state, config, fresh=False)  # records what the directory belongs to
    other = with_overrides(config, **change)
    check_identity(state, other, fresh=False)  # no snapshot yet: nothing to protect
    check_identity(state, config, fresh=False)
    _snapshot(tmp_path, "savepoints/savepoint-1", 1)
    with pytest.raises(ConfigError) as err:
        check_identity(state, other, fresh=False)
    assert err.value.key == key
    assert says in str(err.value) and "--fresh" in str(err.value)
    check_identity(state, other, fresh=True)
    check_identity(state, other, fresh=False)  # the record now names the other job or lane


def test_a_lane_change_says_how_and_a_savepoint_named_by_hand_is_not_judged_by_the_directory(tmp_path: Path) -> None:
    keyed = with_overrides(load_config(), stage="keyed", checkpointing={"directory": str(tmp_path)})
    vectorized = with_overrides(keyed, stage="vectorized")
    state = StateDir.for_job(vectorized)
    check_identity(state, vectorized, fresh=False)
    _snapshot(tmp_path, "savepoints/savepoint-1", 1)
    with pytest.raises(ConfigError, match="taken by the vectorized lane") as err:
        check_identity(state, keyed, fresh=False)
    assert "drain the job in the vectorized lane first" in str(err.value) and "--until-end" in str(err.value)
    check_identity(state, keyed, fresh=False, explicit=True)  # --from-savepoint: may come from anywhere


REFUSAL = ("An error occurred while calling o64.executeAsync.\n: org.apache.flink.util.FlinkException: Failed to "
           "execute job 'llmstream-off'.\n\tat org.apache.flink...\nCaused by: java.lang.IllegalStateException: "
           "Failed to rollback to checkpoint/savepoint file:/s/savepoints/savepoint-9a0332-2e134deb788d. Cannot map "
           "checkpoint/savepoint state for operator da122bb625c521cc69b62ee23652c204 to the new program, because the "
           "operator is not available in the new program. If you want to allow to skip this, you can set the "
           "--allowNonRestoredState option on the CLI.\n\tat org.apache.flink...")
"""The start of what `env.execute_async` raised when Flink refused a savepoint (2026-12-02)."""


def test_a_refused_restore_is_one_line_naming_where_the_snapshot_came_from() -> None:
    given = restore_refused(RuntimeError(REFUSAL), "/s/savepoints/savepoint-9a0332-2e134deb788d", "/s/sp", None)
    assert given is not None and given.key == "--from-savepoint"
    message = str(given)
    assert "\n" not in message and "Cannot map checkpoint/savepoint state for operator" in message
    assert "If you want" not in message and "--fresh" in message
    newest = restore_refused(REFUSAL, "file:/s/chk-3", None, None)
    assert newest is not None and newest.key == "checkpointing.directory"
    assert restore_refused(REFUSAL, "file:/s/chk-3", None, "/s").key == "--state-dir"  # type: ignore[union-attr]
    assert restore_refused(REFUSAL, None, None, None) is None  # nothing was restored: not this
    assert restore_refused(RuntimeError("Failed to execute job: NoResourceAvailable"), "/s/sp", None, None) is None


def test_a_provider_batch_directory_recorded_before_the_lane_key_stays_its_own(tmp_path: Path) -> None:
    """The provider-batch lane recorded itself as `keyed` before `lane`: its state still resumes."""
    import json

    from jobs.state.snapshots import IDENTITY_FILE, LANE_KEY, StateDir, check_identity
    from udfs.config import load_config, with_overrides

    config = with_overrides(load_config(), lane="provider-batch", checkpointing={"directory": str(tmp_path)})
    state = StateDir(tmp_path)
    check_identity(state, config, fresh=False)
    recorded = json.loads((tmp_path / IDENTITY_FILE).read_text())
    (tmp_path / IDENTITY_FILE).write_text(json.dumps({**recorded, LANE_KEY: "keyed"}))
    (tmp_path / "checkpoints" / "job-1" / "chk-3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "job-1" / "chk-3" / "_metadata").write_bytes(b"x")
    check_identity(state, config, fresh=False)  # no refusal
    assert json.loads((tmp_path / IDENTITY_FILE).read_text())[LANE_KEY] == "provider-batch"
