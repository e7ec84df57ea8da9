"""Every restart resumes from Flink state: a user's Ctrl-C, kill -9, resubmit, stop and upgrade.

Each test sends records with unique ids, restarts the job the way a user would, lets it
finish, and then counts what a read_committed consumer sees: every id exactly once in
output ∪ dead letters. Model calls per record come from the simulator's own count. The
numbers go to ``var/fault-report.md`` beside the other fault tests'.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.clients import kafka_admin
from jobs.dev import simulator
from jobs.dev.local_cluster import LocalCluster
from jobs.dev.local_kafka import LocalBroker
from jobs.launch import submit as submit_mod
from jobs.launch.plan import RunOptions
from tests.support.cluster import heal
from tests.support.committed import Tally, check_exactly_once, final_tally
from tests.support.fault_report import FaultReport, FaultResult
from tests.support.job_setup import (
    LATER_LANE,
    JobSetup,
    SpawnSimulator,
    lane_sections,
    make_job,
    unique_records,
)
from tests.support.runs import LocalRun, restarts_by_job, total_restarts
from tests.support.waiting import wait_until
from udfs.config import load_config, to_dict, with_overrides
from udfs.errors import ConfigError

pytestmark = [pytest.mark.integration, pytest.mark.fault]

STARTED = "started in a local mini cluster"


def _record(fault_report: FaultReport, name: str, result: Tally, *, started: float, restarts: int, notes: str,
            ended: float | None = None, **extra: object) -> None:
    """A row of the fault report: `result` for the part of a run from `started` to `ended` (default now)."""
    duration_s = round((ended or time.monotonic()) - started, 1)
    fault_report.add(FaultResult.counted(
        name, result, restarts=restarts, recovery_s=None, duration_s=duration_s, notes=notes, extra=extra))


# ---------------------------------------------------------------------- llmstream run (mini cluster)


def _variant(config_path: Path, name: str, **sections: Any) -> Path:
    """The job's config with `sections` changed (a section's keys merged, a top-level value
    replaced), saved beside it as ``<job>-<name>.yaml``: the same job, state directory and topics."""
    changed = with_overrides(load_config(config_path), **sections)
    path = config_path.with_name(f"{config_path.stem}-{name}.yaml")
    path.write_text(yaml.safe_dump(to_dict(changed), sort_keys=False))
    return path


def _ran(config_path: Path, log_path: Path, *extra: str) -> tuple[int, str]:
    """`llmstream run` with `extra` to its end: its exit code and what it printed."""
    run = LocalRun(config_path, log_path, *extra)
    code = run.wait(timeout=600)
    return code, run.output()


INTERRUPTED_RUNS = int(os.environ.get("LLMSTREAM_INTERRUPTED_RUNS", "15"))
"""How many times the interrupted-runs test stops `llmstream run`: 15 in the documented fault run,
fewer in `make test` (its Makefile sets 6: the same moments' spread, a third of the time)."""


def interrupted_records(runs: int) -> int:
    """How many ids the interrupted-runs test sends with `runs` interruptions: 5,000 with 15, 200 an
    interruption with fewer (1,200 with `make test`'s 6, 1,000 at least). Each interrupted run answers
    only a few dozen of them (most of its life is the start), and the final backfill does the rest,
    which is most of the test's time and adds no interruption.
    The fault report gives how many ids' input offsets were committed before the final run (0 of 1,200
    and 5–155 of 1,000 at load 3–20: the interrupted runs' faults land with ids to answer). Capacity 48
    (~40/s at 16) triples the pace at which they go and puts 48 calls in flight at each kill."""
    return 5000 if runs >= 15 else max(1000, 200 * runs)


VECTORIZED_INTERRUPTED_RUNS = max(4, INTERRUPTED_RUNS * 2 // 3)
"""The same test in the vectorized lane stops its runs fewer times (4 in `make test`): what it adds
is the lane's own stop and restore paths, which a few of each kind already take."""


@pytest.mark.parametrize(("stage", "runs"), [("keyed", INTERRUPTED_RUNS), ("vectorized", VECTORIZED_INTERRUPTED_RUNS)])
def test_run_interrupted_many_times_loses_and_duplicates_nothing(
        kafka_broker: LocalBroker, tmp_path: Path, fault_report: FaultReport, stage: str, runs: int) -> None:
    """`interrupted_records(runs)` ids, a model at 100-500 ms, `llmstream run` interrupted `runs` times (15 in
    the keyed lane's documented run: SIGINT at 10 random moments, SIGKILL of the whole process group at 5;
    two thirds SIGINT in general) and restarted with the same command each time, then finished with
    `--until-end`: every id exactly once. In both lanes (the vectorized one with Arrow batches of 100:
    a Ctrl-C's savepoint waits for the batch in progress, a kill sends its calls again)."""
    sim = simulator.spawn(["--latency", "lognormal:200:500", "--seed", "11"])
    run: LocalRun | None = None
    try:
        setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name="interrupted",
                         async_={"capacity": 48}, checkpointing={"interval_ms": 1000}, **lane_sections(stage))
        records = unique_records(interrupted_records(runs), "int")
        kafka_admin.produce(setup.bootstrap, setup.input_topic, records)
        rng = random.Random(20261130)
        kills = max(1, runs // 3)
        kinds = ["SIGINT"] * (runs - kills) + ["SIGKILL"] * kills
        rng.shuffle(kinds)
        started = time.monotonic()
        outcomes = []
        for i, kind in enumerate(kinds):
            run = LocalRun(setup.path, tmp_path / f"run-{i:02d}.log")
            def job_started(r: LocalRun = run) -> bool:
                return STARTED in r.output() or r.process.poll() is not None

            wait_until(job_started, timeout=180, message=f"run {i} to start its job")
            assert run.process.poll() is None, f"run {i} exited early:\n{run.output()[-3000:]}"
            time.sleep(rng.uniform(0.5, 8.0))  # a random moment: the point is where it lands, not how long
            if kind == "SIGINT":
                run.signal_group(signal.SIGINT)
                code = run.wait(timeout=300)
                assert code == 0, f"run {i} (SIGINT) exited {code}:\n{run.output()[-3000:]}"
            else:
                run.signal_group(signal.SIGKILL)
                run.wait(timeout=60)
            text = run.output()
            outcomes.append((kind, "resuming from" in text, "savepoint" in text.split("received")[-1]))
            if i > 0:
                assert "resuming from" in text or "no snapshot" in text, text[-2000:]
        consumed = sum(kafka_admin.committed_offsets(setup.bootstrap, setup.config.kafka.group_id,
                                                     setup.input_topic).values())
        # The group's offsets move with each completed checkpoint: reported, not asserted (a fast
        # machine may answer every id before the last interruption; that is not a loss or a duplicate).
        code, out = _ran(setup.path, tmp_path / "run-final.log", "--until-end")
        assert code == 0, out[-3000:]
        served = int(sim.stats()["served"])
        result = final_tally(setup, [k.decode() for k, _ in records], model_calls=served)
    finally:
        if run is not None:  # a run a failed assertion left running: its JVM, not the next test's
            run.kill_if_running()
        sim.stop()
    resumed = sum(1 for _, r, _ in outcomes if r)
    stopped_with_savepoint = sum(1 for k, _, s in outcomes if k == "SIGINT" and s)
    scenario = "r1." if stage == "keyed" else "r1v. vectorized lane,"
    _record(fault_report, f"{scenario} llmstream run: SIGINT x{kinds.count('SIGINT')} + SIGKILL x{kinds.count('SIGKILL')}, "
            "restarted each time", result,
            started=started, restarts=len(kinds),
            notes=f"model calls per record {served / len(records):.2f}; "
                  f"resumed from state {resumed + 1}/{len(kinds) + 1} runs; "
                  f"input offsets committed before the final run {consumed} of {len(records)}",
            calls_per_record=round(served / len(records), 3), runs_resumed=resumed,
            sigint_with_savepoint=stopped_with_savepoint, offsets_committed_before_final=consumed)
    check_exactly_once(result)
    # The first run has nothing to resume from; a run killed before its first checkpoint leaves none.
    assert resumed >= (2 * len(kinds)) // 3, f"only {resumed} of {len(kinds)} runs resumed from a snapshot: {outcomes}"


def test_ctrl_c_while_a_budget_is_paused_stops_with_a_savepoint_and_a_run_without_it_resumes(
        kafka_broker: LocalBroker, tmp_path: Path, fault_report: FaultReport) -> None:
    """A budget of one call an hour: the stage pauses and its admission gate holds the input
    back. A savepoint's barrier is aligned and waits behind that input, so Ctrl-C opens the gate
    for the stop (`jobs.graph.gate_operator.open_for_stop`; the stage parks what comes in) and the run stops
    with a savepoint instead of cancelling after `--stop-timeout`. A run without the budget then
    restores it, leaving the gated ticks' state behind, and answers every id once (row r5).

    That run is a drain (`--until-end`), and the same job then takes the documented change of lane
    (docs/tuning.md, "Which lane"; row r6): 400 more ids sent; the job with `stage: vectorized` is
    refused its keyed savepoint at start (exit 2, one line naming `stage`, the drain and `--fresh`);
    started with `--fresh` it reads on from the group's offsets that the drain committed with its
    output. Every id of both halves once, each paid for once.

    These were two tests with a job, a simulator and a keyed drain each (r5, r6: ~160 worker-seconds
    in `make test`); the lane change starts from r5's drain, every assertion kept, both rows written
    (from the one tally)."""
    sim = simulator.spawn(["--latency", "fixed:20", "--seed", "5"])
    try:
        setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name="paused-stop", stage="keyed",
                         async_={"capacity": 4}, budget={"max_tokens_per_hour": 1, "window_s": 3600})
        first, second = unique_records(400, "ps"), unique_records(400, "lv")
        kafka_admin.produce(setup.bootstrap, setup.input_topic, first)
        started = time.monotonic()
        tmp = tmp_path / "tmp"  # this run's own gate directories
        tmp.mkdir()
        paused = LocalRun(setup.path, tmp_path / "paused.log", "--stop-timeout", "120", env={"TMPDIR": str(tmp)})
        wait_until(lambda: any(tmp.glob("llmstream-gate/*/*.closed")) or paused.process.poll() is not None,
                   timeout=240, message="the budget to pause and the gate to close")
        assert paused.process.poll() is None, paused.output()[-3000:]
        paused.signal_group(signal.SIGINT)
        code = paused.wait(timeout=300)
        out = paused.output()
        assert code == 0, out[-3000:]
        assert "no savepoint in time" not in out and "resumes from savepoint" in out, out[-3000:]
        assert not list(tmp.glob("llmstream-gate/*")), "the run left its gate directory"

        plain = _variant(setup.path, "plain", budget={"max_tokens_per_hour": None})
        code, out = _ran(plain, tmp_path / "plain.log", "--until-end")
        assert code == 0, out[-3000:]
        assert "resuming from savepoint" in out and "left behind" in out, out[-3000:]
        drained = time.monotonic()

        # r6. The drained keyed job moves to the vectorized lane.
        kafka_admin.produce(setup.bootstrap, setup.input_topic, second)
        vectorized = _variant(plain, "vectorized", stage="vectorized")
        code, out = _ran(vectorized, tmp_path / "refused.log", "--until-end")
        assert code == 2, out[-3000:]
        assert "llmstream: config error: stage: runs the vectorized lane, but the snapshots" in out, out[-3000:]
        assert "--until-end" in out and "--fresh" in out and "Traceback" not in out, out[-3000:]
        assert STARTED not in out, out[-3000:]

        code, out = _ran(vectorized, tmp_path / "moved.log", "--fresh", "--until-end")
        assert code == 0, out[-3000:]
        assert "starting FRESH from the consumer group's committed offsets" in out, out[-3000:]
        served = int(sim.stats()["served"])
    finally:
        sim.stop()
    ids = [k.decode() for k, _ in first + second]
    result = final_tally(setup, ids, model_calls=served)
    calls_per_record = round(served / len(ids), 3)
    _record(fault_report, "r5. llmstream run: Ctrl-C while the budget is paused, then a run without the budget",
            result, started=started, ended=drained, restarts=0,
            notes="stopped with a savepoint during the pause; in one run with r6 (its drain is r6's keyed half)",
            calls_per_record=calls_per_record)
    _record(fault_report, "r6. llmstream run: a keyed job drained, then moved to the vectorized lane with --fresh",
            result, started=drained, restarts=0,
            notes=f"model calls per record {served / len(ids):.2f}; the keyed half drained in r5's run",
            calls_per_record=calls_per_record)
    check_exactly_once(result)
    assert result.dead == 0, result.dead_reasons
    assert served == len(ids), f"{served} model calls for {len(ids)} records: the pause or the move paid for some twice"


# ---------------------------------------------------------------------- the cluster path


class ClusterRun:
    """One job config on the shared standalone cluster, with the ids sent and the jobs it ran."""

    def __init__(self, cluster: LocalCluster, setup: JobSetup, n: int, prefix: str) -> None:
        self.cluster = cluster
        self.setup = setup
        self.records = unique_records(n, prefix)
        self.ids = [k.decode() for k, _ in self.records]
        self.started = time.monotonic()
        self.jobs: list[str] = []

    def produce(self, part: slice) -> None:
        kafka_admin.produce(self.setup.bootstrap, self.setup.input_topic, self.records[part])

    def live_job(self) -> str:
        jobs = self.cluster.live_jobs(self.setup.config.name)
        assert len(jobs) == 1, f"expected one live job, got {jobs}"
        job_id = str(jobs[0]["jid"])
        if job_id not in self.jobs:
            self.jobs.append(job_id)
        return job_id

    def submit(self, capsys: pytest.CaptureFixture[str], config_path: Path | None = None, **kwargs: object) -> str:
        code = submit_mod.submit(str(config_path or self.setup.path), jobmanager=self.cluster.address,
                                  options=RunOptions(**kwargs))  # type: ignore[arg-type]
        out, err = capsys.readouterr()
        assert code == 0, out + err
        job_id = self.live_job()
        self.cluster.wait_for_job_state(job_id, "RUNNING", timeout=180)
        return out

    def backfill(self, capsys: pytest.CaptureFixture[str], config_path: Path | None = None) -> str:
        """``llmstream submit --until-end``: resumes, waits for the input present now, stops with a savepoint."""
        code = submit_mod.submit(str(config_path or self.setup.path), jobmanager=self.cluster.address,
                                  options=RunOptions(until_end=True))
        out, err = capsys.readouterr()
        assert code == 0 and "backfill done" in out, out + err
        return out

    def committed_output(self) -> int:
        ends = kafka_admin.end_offsets(self.setup.bootstrap, self.setup.output_topic, committed_only=True)
        return sum(ends.values())

    def wait_output(self, at_least: int, timeout: float = 240) -> None:
        def enough() -> bool:
            for job in self.jobs:
                state = self.cluster.job_status(job)
                assert state != "FAILED", self.cluster.failure(job)
            return self.committed_output() >= at_least
        wait_until(enough, timeout, message=f"{at_least} committed outputs")

    def restarts(self) -> int:
        return total_restarts(self.cluster, self.jobs)

    def upgrade(self, capsys: pytest.CaptureFixture[str], config_path: Path) -> str:
        """``llmstream upgrade`` to `config_path`; the new job once it runs."""
        assert submit_mod.upgrade(str(config_path), jobmanager=self.cluster.address) == 0, capsys.readouterr()
        capsys.readouterr()
        job = self.live_job()
        self.cluster.wait_for_job_state(job, "RUNNING", timeout=180)
        return job

    def first_runs(self, capsys: pytest.CaptureFixture[str], outputs: tuple[int, int, int]) -> None:
        """The lifecycle's start: submit (nothing to resume), cancel -> submit (resumes from the retained
        checkpoint), `llmstream stop` -> submit (from the savepoint), each run until `outputs` committed."""
        first, after_cancel, after_stop = outputs
        out = self.submit(capsys)
        assert "no snapshot" in out
        self.wait_output(first)

        self.cluster.cancel(self.live_job())
        out = self.submit(capsys)
        assert "resuming from checkpoint" in out, out
        self.wait_output(after_cancel)

        assert submit_mod.stop_job(str(self.setup.path), jobmanager=self.cluster.address) == 0
        assert "savepoint" in capsys.readouterr().out
        out = self.submit(capsys)
        assert "resuming from savepoint" in out, out
        self.wait_output(after_stop)


LIFECYCLE_SIM_ARGS = ["--latency", "fixed:100", "--seed", "3"]


def test_cluster_cancel_stop_upgrades_and_a_dead_jobmanager_all_resume_from_state(
        cluster: LocalCluster, kafka_broker: LocalBroker, spawn_simulator: SpawnSimulator, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], fault_report: FaultReport) -> None:
    """One job, one stream of ids, every way a cluster job is restarted, each with calls in flight:
    cancel -> submit (auto-resume from the retained checkpoint); `llmstream stop` -> submit;
    `llmstream upgrade` with a changed capacity and to parallelism 2, then back to 1 and to a spend
    budget, then away from the budget (rows r2 and r4); the JobManager SIGKILLed (no HA) and the
    cluster replaced by a new one on the same state directory, where a backfill `submit --until-end`
    resumes from the dead cluster's last retained checkpoint (row r3) and finishes. Every id exactly once.

    The faults follow each other in one run (one job, simulator and stream instead of one each), each
    row written from the one tally. Three upgrades carry the four changes, each still made with calls
    in flight and checked: the capacity with the widening, the narrowing with the budget. The new
    cluster's job is the backfill itself, from the dead cluster's checkpoint. An upgrade that changes
    the capacity alone, and `stop` then `submit --until-end` from the savepoint on a cluster, are
    `test_s3_state.py::test_a_cluster_job_on_s3_upgrades_stops_and_backfills_from_savepoints_there`
    (keyed, in `make test`; the vectorized lifecycle below too, in the full fault run); `stop` ->
    `submit` from the savepoint is still this test's first runs. The backfilled job's restarts are
    not in the rows' count (it has finished when asked): its tally judges it."""
    sim = spawn_simulator(LIFECYCLE_SIM_ARGS)
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name="lifecycle", partitions=2,
                     async_={"capacity": 8}, parallelism={"default": 1})
    # ~40 ids a second on a loaded machine: the ids, not the restarts, were most of this test's time.
    # Each fault waits for its job's output to grow by 200-300 and lands with ids still to answer
    # (1,100 or more sent and not yet committed): more are sent before the later faults, so that
    # holds whatever the pace.
    run = ClusterRun(cluster, setup, 2800, "life")
    run.produce(slice(0, 2100))
    run.first_runs(capsys, (200, 450, 700))

    # A larger capacity and a second subtask in one upgrade.
    wider = setup.path.with_name("lifecycle-parallelism.yaml")
    wider.write_text(setup.path.read_text().replace("capacity: 8", "capacity: 16")
                     .replace("inference: 1", "inference: 2").replace("sink: 1", "sink: 2"))
    job = run.upgrade(capsys, wider)
    assert max(cluster.vertex_parallelism(job).values()) == 2
    run.wait_output(1000)
    run.produce(slice(2100, 2500))

    # Back to one subtask: the calls in flight at the savepoint sit under bucket keys of the
    # second subtask, which the narrower job must still find and start again.
    # r4. And to a budget, which adds the admission gate and moves the ticks to a FLIP-27 source
    # (`jobs/graph/gate_operator.py`), whose snapshots hold state the job without a budget has no
    # operator for: an upgrade to a budget, then away from it, each with calls in flight; the one
    # that drops the budget says what it leaves behind.
    narrow = setup.path.with_name("lifecycle-narrow.yaml")
    narrow.write_text(setup.path.read_text().replace("capacity: 8", "capacity: 16"))
    budget_from = len(run.jobs)
    data = yaml.safe_load(narrow.read_text())
    data["budget"] = {**(data.get("budget") or {}), "max_tokens_per_hour": 1e9}  # gated, never binding
    budgeted = setup.path.with_name("lifecycle-budgeted.yaml")
    budgeted.write_text(yaml.safe_dump(data, sort_keys=False))
    assert submit_mod.upgrade(str(budgeted), jobmanager=cluster.address) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "left behind" not in out, out
    job = run.live_job()
    cluster.wait_for_job_state(job, "RUNNING", timeout=180)
    assert max(cluster.vertex_parallelism(job).values()) == 1
    assert any("admission gate" in name for name in cluster.vertex_parallelism(job)), cluster.vertex_parallelism(job)
    run.wait_output(1300)

    assert submit_mod.upgrade(str(narrow), jobmanager=cluster.address) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "budget" in out and "left behind" in out, out
    job = run.live_job()
    cluster.wait_for_job_state(job, "RUNNING", timeout=180)
    run.wait_output(1600)
    # While the cluster that ran them answers.
    by_job = restarts_by_job(cluster, run.jobs)
    budget_restarts = sum(by_job[j] for j in run.jobs[budget_from:])
    restarts = sum(by_job.values())

    # r3. The JobManager is SIGKILLed mid-stream (no HA); the TaskManagers and their Python workers
    # go with the cluster, and a new cluster on the same state directory replaces it.
    run.produce(slice(2500, 2800))
    at_kill = run.committed_output()
    run.wait_output(at_kill + 100)
    jobmanager = cluster.jobmanager_pid()
    assert jobmanager is not None
    os.kill(jobmanager, signal.SIGKILL)
    cluster.stop()
    run.jobs.clear()
    cluster.start(taskmanagers=1, timeout=180)
    heal(cluster)
    # The backfill `submit --until-end` on the new cluster resumes from that checkpoint and finishes.
    out = run.backfill(capsys, narrow)
    assert "resuming from checkpoint" in out, out
    served = int(sim.stats()["served"])
    result = final_tally(setup, run.ids, model_calls=served)
    calls_per_record = round(served / len(run.ids), 3)
    _record(fault_report, "r2. cluster: cancel/stop -> submit resumes; upgrade capacity, parallelism 1->2->1", result,
            started=run.started, restarts=restarts,
            notes="one run with r3 and r4, every job resumed from state; capacity and 1->2 in one upgrade, "
                  "2->1 in r4's upgrade to a budget",
            calls_per_record=calls_per_record)
    _record(fault_report, "r4. cluster: upgrade to a spend budget and back (gate and ticks added, removed)", result,
            started=run.started, restarts=budget_restarts, notes="in r2's run, each job resumed from state",
            calls_per_record=calls_per_record)
    _record(fault_report, "r3. cluster: JobManager SIGKILL, new cluster, submit resumes", result,
            started=run.started, restarts=restarts,
            notes="in r2's run: the backfill resumed from the dead cluster's last retained checkpoint",
            calls_per_record=calls_per_record)
    check_exactly_once(result)
    assert budget_restarts == 0


@LATER_LANE
def test_cluster_cancel_stop_and_upgrade_resume_the_vectorized_lane_from_state(
        cluster: LocalCluster, kafka_broker: LocalBroker, spawn_simulator: SpawnSimulator, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], fault_report: FaultReport) -> None:
    """The lifecycle above in the vectorized lane (Arrow batches of 50): cancel -> submit resumes
    from the retained checkpoint; `llmstream stop` -> submit from the savepoint; `llmstream upgrade`
    with a changed capacity, and one into the keyed stage, refused while the job runs on; then a backfill. Every id exactly once. Not its parallelism changes:
    the lane runs at `parallelism.default`, the source's subtasks included.

    In the full fault run only (`LATER_LANE`): in `make test` the same paths are proven by others.
    The vectorized lane's restore from a retained checkpoint (kill) and from a savepoint (Ctrl-C) is
    `test_run_interrupted_many_times_loses_and_duplicates_nothing[vectorized-4]` (same graph, same
    operators, on a mini cluster); the cluster's cancel/stop/upgrade -> submit wiring, which does not
    depend on the lane, is the keyed lifecycle above and
    `test_s3_state.py::test_a_cluster_job_on_s3_upgrades_stops_and_backfills_from_savepoints_there`;
    an `upgrade` into another lane refused while the job runs on is that S3 test (keyed -> vectorized,
    the same `check_identity`) and `tests/unit/jobs/state/test_state.py` (this direction's message);
    the lane's record rules are the lane contract suite (`tests/unit/udfs/lanes/test_lane_contract.py`)."""
    sim = spawn_simulator(LIFECYCLE_SIM_ARGS)
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, sim.url, name="lifecycle-vectorized", partitions=2,
                     async_={"capacity": 8}, parallelism={"default": 1}, stage="vectorized",
                     vectorized={"batch_size": 50})
    run = ClusterRun(cluster, setup, 2000, "lifev")
    run.produce(slice(0, 2000))
    run.first_runs(capsys, (200, 600, 1000))

    faster = _variant(setup.path, "capacity", async_={"capacity": 16})
    run.upgrade(capsys, faster)
    run.wait_output(1400)
    # An upgrade into the other lane is refused before it stops the job, not by Flink after.
    with pytest.raises(ConfigError, match="taken by the vectorized lane"):
        submit_mod.upgrade(str(_variant(faster, "keyed", stage="keyed")), jobmanager=cluster.address)
    assert cluster.job_status(run.live_job()) == "RUNNING"

    assert submit_mod.stop_job(str(faster), jobmanager=cluster.address) == 0
    capsys.readouterr()
    out = run.backfill(capsys, faster)
    assert "resuming from savepoint" in out, out
    result = final_tally(setup, run.ids, model_calls=int(sim.stats()["served"]))
    _record(fault_report, "r2v. vectorized lane, cluster: cancel/stop -> submit resumes; upgrade capacity", result,
            started=run.started, restarts=run.restarts(), notes=f"{len(run.jobs) + 1} jobs, each resumed from state",
            calls_per_record=round(int(sim.stats()["served"]) / len(run.ids), 3))
    check_exactly_once(result)
