"""The cluster supervisor's restart delay (`jobs/dev/cluster_supervisor.py`): a TaskManager that
keeps dying soon after its start is restarted ever more slowly, one that lived is restarted at once."""

from __future__ import annotations

from jobs.dev.cluster_supervisor import MAX_DELAY_S, STABLE_S, next_delay


def test_a_crash_loop_doubles_the_delay_up_to_the_cap() -> None:
    delays = [1.0]
    for _ in range(8):
        delays.append(next_delay(delays[-1], since_last_start_s=5.0))
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0]
    assert delays[-1] == MAX_DELAY_S


def test_a_taskmanager_that_lived_resets_the_delay() -> None:
    assert next_delay(32.0, since_last_start_s=STABLE_S + 1) == 1.0
