"""Operator ids as Flink derives them from uids, looked up in a snapshot's `_metadata`, the one
restore that must leave state behind (a job whose admission gate was removed, `jobs/graph/gate_operator.py`),
and the gate's directories.

The real round trip (a gated snapshot restored by a job without a budget, and back) is
`tests/integration/test_restarts.py::test_cluster_cancel_stop_upgrades_and_a_dead_jobmanager_all_resume_from_state`
(its budget steps, row r4)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from jobs.graph import gate_operator as gate
from jobs.state.operator_ids import holds_operator, murmur3_128, operator_id
from tests.support.configs import job_config
from udfs.config import BudgetConfig


def test_murmur3_matches_the_published_vectors() -> None:
    assert murmur3_128(b"") == bytes(16)
    assert murmur3_128(b"The quick brown fox jumps over the lazy dog").hex() == "6c1b07bc7bbc4be347939ac4a93c437a"


def test_operator_ids_are_the_ones_flink_wrote() -> None:
    """Read from a gated job's retained checkpoint (`chk-82/_metadata`, Flink 2.2): each of these
    16-byte ids is in it; the uids are the stage's, the gate's and the gated ticks'."""
    assert operator_id("inference").hex() == "94cfedcd37a2ffb9d5afd50fb6c72c5f"
    assert operator_id("admission-gate").hex() == "09e4a3aafad89bbaf1447750ca1d8139"
    assert operator_id(gate.TICKS_UID).hex() == "da122bb625c521cc69b62ee23652c204"


def _snapshot(tmp_path: Path, *uids: str) -> Path:
    directory = tmp_path / "chk-7"
    directory.mkdir()
    (directory / "_metadata").write_bytes(b"\x00\x00\x00\x04" + b"".join(operator_id(u) + b"\x01" * 9 for u in uids))
    return directory


def test_holds_operator_reads_paths_and_file_uris_and_never_raises(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path, "inference", gate.TICKS_UID)
    assert holds_operator(str(snapshot), gate.TICKS_UID)
    assert holds_operator(snapshot.as_uri(), "inference")
    assert holds_operator(str(snapshot / "_metadata"), "inference")
    assert not holds_operator(str(snapshot), "admission-gate")
    assert not holds_operator(str(tmp_path / "gone"), "inference")
    assert not holds_operator("s3://bucket/state/chk-7", "inference")  # not readable here: Flink decides


def test_only_a_job_that_dropped_its_budget_leaves_the_gated_ticks_behind(tmp_path: Path) -> None:
    ungated = job_config("http://127.0.0.1:9/v1")
    gated = dataclasses.replace(ungated, budget=BudgetConfig(max_tokens_per_hour=1000.0))
    with_ticks = str(_snapshot(tmp_path, "inference", gate.TICKS_UID))
    (tmp_path / "sql-ticks").mkdir()
    without = str(_snapshot(tmp_path / "sql-ticks", "inference"))
    reason = gate.left_behind(ungated, with_ticks)
    assert reason is not None and "budget" in reason and "\n" not in reason
    assert gate.left_behind(gated, with_ticks) is None  # the operator is still there
    assert gate.left_behind(ungated, without) is None
    assert gate.left_behind(gated, without) is None  # a budget added: the SQL ticks kept no state
    assert gate.left_behind(ungated, None) is None  # a first run


def test_killed_jobs_empty_gate_directories_are_swept_and_a_live_one_comes_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGKILLed job leaves its empty gate directory; the next gated job sweeps those older than
    a day (never one with a pause file in it), and a live stage whose empty directory was swept
    makes it again when it next closes its gate."""
    import os
    import tempfile

    from udfs.lanes.admission import GateSignal

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / "llmstream-gate"
    old, fresh, paused = root / "old", root / "fresh", root / "paused"
    for directory in (old, fresh, paused):
        directory.mkdir(parents=True)
    (paused / "0.closed").touch()
    day_ago = time.time() - gate.GATE_DIR_SWEEP_S - 60
    for directory in (old, paused):
        os.utime(directory, (day_ago, day_ago))
    signal = GateSignal(str(old), 0)  # a live stage whose directory is empty and a day old
    os.utime(old, (day_ago, day_ago))
    new = Path(gate.job_directory())
    assert new.parent == root and not new.exists()
    assert not old.exists() and fresh.exists() and (paused / "0.closed").exists()
    signal.set("the spend budget is paused")
    assert (old / "0.closed").exists()
    signal.close()
    assert not old.exists()
