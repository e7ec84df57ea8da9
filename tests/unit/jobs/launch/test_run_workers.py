"""Which Python worker mode `llmstream run` asks PyFlink for (jobs.launch.run.python_worker_processes)."""

from __future__ import annotations

import pytest

from jobs.launch.run import PYFLINK_WORKER_MODE, python_worker_processes
from udfs.config import config_from_dict


def _config(**parallelism: int):  # type: ignore[no-untyped-def]
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"},
        "parallelism": parallelism,
    })


def test_one_worker_process_per_inference_subtask_from_two_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYFLINK_WORKER_MODE, raising=False)
    assert python_worker_processes(_config()) == 0  # loopback: the stage in this process
    assert python_worker_processes(_config(inference=1, default=3)) == 0
    assert python_worker_processes(_config(default=2)) == 2
    assert python_worker_processes(_config(inference=3)) == 3
    # A mode the user chose is theirs.
    monkeypatch.setenv(PYFLINK_WORKER_MODE, "loopback")
    assert python_worker_processes(_config(inference=3)) == 0
