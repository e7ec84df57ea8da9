"""A backfill that says it finished has finished: `llmstream run --until-end` exits 0 only when every
record present at start is in output or dead letters, in each lane.

The model never answers a share of the records near the end of the backfill (hung calls in the keyed
lane, provider batches that do not end in the provider-batch lane), and the run's drain is bounded
for the test (`--drain-timeout`, otherwise as long as one record may take by the config): the
first run must not exit 0 with an id missing; it exits 3 saying how many records its state keeps and
that the same command finishes them. The model then answers, and the same command ends with exit 0
and every id once. The vectorized lane holds no calls across a checkpoint (a batch's calls end within
the record deadline before its offsets commit), so there the first run may end either way, and what
holds is the same rule: no exit 0 with an id missing, every id once after at most two runs.
`make test` runs the keyed lane; the full fault run (`make fault`) all three.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from jobs.clients import kafka_admin
from jobs.dev import local_kafka
from jobs.dev.simulator import SpawnedSimulator
from jobs.dev.simulator.batch_engine import LIVE
from tests.conftest import SHELL_ENV
from tests.support.committed import check_exactly_once, final_tally
from tests.support.job_setup import (
    LATER_LANE,
    LLMSTREAM,
    SpawnSimulator,
    lane_sections,
    make_job,
    unique_records,
)

pytestmark = [pytest.mark.integration, pytest.mark.fault]

RECORDS = 200
DRAIN_S = "20"
"""The test's drain bound, the same in both runs (the same command): the stage's last records are waited
for 20 s once every task runs, then the draining savepoint 20 s more. The first run exhausts both waits
(its hung calls outlast them by half an hour, whatever the machine's speed), so each second here is paid
twice in it. The second run needs far less: its first wait starts once every task runs (restored, the
Python worker up) and ends when the stage is seen to hold nothing, i.e. once the restored calls, 5 ms
each, are answered; and even if that wait ran out, the draining savepoint itself waits for them. It exits
3 again only if those calls are not answered within both waits, or the draining savepoint of 200 records
takes over 20 s: at load average 25-33 it went straight to the savepoint, which with the restored calls
took ~10 s, half the bound (the printed line says what each run took)."""
NOT_FINISHED = re.compile(r"backfill not finished: at most (\d+) records in the job's state, kept in (.+?); "
                          r"the same command finishes them")


def _backfill(setup_path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command a user runs, the same both times."""
    return subprocess.run([str(LLMSTREAM), "run", "--config", str(setup_path), "--until-end",
                           "--drain-timeout", DRAIN_S, "--progress-every", "2"],
                          cwd=cwd, env=SHELL_ENV, capture_output=True, text=True, timeout=600, check=False)


def _live_batch_ids(sim: SpawnedSimulator) -> list[str]:
    return [b["id"] for b in sim.batches() if b.get("status") in LIVE]


@pytest.mark.parametrize("lane", ["keyed", pytest.param("vectorized", marks=LATER_LANE),
                                  pytest.param("provider-batch", marks=LATER_LANE)])
def test_a_backfill_exits_0_only_with_every_record_out_and_the_same_command_finishes_it(
        tmp_path: Path, kafka_broker: local_kafka.LocalBroker, spawn_simulator: SpawnSimulator, lane: str) -> None:
    if lane == "provider-batch":
        # Batches that would take half an hour: none ends during the first run.
        sim = spawn_simulator(["--latency", "fixed:5", "--batch-validating-s", "0.2", "--batch-delay-s", "1800",
                               "--batch-finalizing-s", "0.2"])
        sections = {"model": {"mode": "batch"},
                    "provider_batch": {"max_requests": 100, "max_wait_s": 1, "poll_initial_s": 0.5, "poll_max_s": 1}}
    else:
        # A third of the attempts hang (held open for half an hour); in the keyed lane an attempt may
        # take ten minutes, so a hung record stays in flight through the first run; in the
        # vectorized lane attempts end after 2 s and records after 8 s, within their Arrow batch.
        sim = spawn_simulator(["--latency", "fixed:5", "--hang-rate", "0.3", "--hang-max-s", "1800", "--seed", "7"])
        timeouts = {"request_timeout_s": 600, "record_deadline_s": 1200} if lane == "keyed" else \
            {"request_timeout_s": 2, "record_deadline_s": 8}
        # Every record in flight at once, and no AIMD cut on a timed-out attempt: the hung calls
        # wait beside the answered ones instead of holding every other record in line.
        sections = {"async_": {"capacity": 256, **timeouts}, "rate_limit": {"adaptive_concurrency": False},
                    **lane_sections(lane)}
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name=f"backfill-end-{lane}",
                     checkpointing={"interval_ms": 1000}, **sections)
    records = unique_records(RECORDS, "be")
    ids = [k.decode() for k, _ in records]
    kafka_admin.produce(setup.bootstrap, setup.input_topic, records)

    first_started = time.monotonic()
    first = _backfill(setup.path, tmp_path)
    first_s = time.monotonic() - first_started
    said = first.stdout + first.stderr
    after_first = final_tally(setup, ids)
    if first.returncode == 0:
        assert lane == "vectorized", f"the {lane} lane's first run cannot have finished:\n{said[-3000:]}"
        check_exactly_once(after_first)  # exit 0: nothing may be missing
    else:
        assert first.returncode == 3, said[-3000:]
        left = NOT_FINISHED.search(said)
        assert left is not None, said[-3000:]
        assert int(left.group(1)) > 0 and "Traceback" not in said, said[-3000:]
        assert after_first.lost > 0 and after_first.duplicates == 0, after_first  # the rest is in its state

    # The model answers now: hung attempts no more, live batches processed at once.
    if lane == "provider-batch":
        live = _live_batch_ids(sim)
        assert live, "no batch was left live at the provider"
        for batch_id in live:
            sim.force_batch(batch_id, {"action": "process"})
        sim.configure_batches({"delay_s": "0.5"})  # and a batch the first run sealed but did not make
    else:
        sim.admin({"hang_rate": 0.0})

    second_started = time.monotonic()
    second = _backfill(setup.path, tmp_path)
    said = second.stdout + second.stderr
    # Seen with -s: what each run took against the drain bound, which the second run must stay within.
    print(f"\nbackfill {lane}: first run {first_s:.0f} s (exit {first.returncode}), second "
          f"{time.monotonic() - second_started:.0f} s (exit {second.returncode}); drain bound {DRAIN_S} s twice")
    assert second.returncode == 0, said[-3000:]
    assert "every record present at start is in output or dead letters" in said, said[-3000:]
    result = final_tally(setup, ids)
    check_exactly_once(result)
    if lane == "provider-batch":
        submitted = int(sim.stats()["batches"]["requests_submitted"])
        assert submitted == RECORDS, f"{submitted} requests paid for {RECORDS} records"
