"""`llmstream bench`: llmstream vs a sequential and a semaphore-gather consumer, same broker,
same simulator settings, same records; writes latest.md / latest.json / latest.png.

    llmstream bench                         # full run: scenarios a-d, all approaches (~13 min)
    llmstream bench --smoke              # ~30 s: scenario a, 100 records, results to a temp dir
    llmstream bench --scenarios b --approaches llmstream --bundle-size 2000   # a tuning run
    llmstream bench --render             # re-write latest.md/png from latest.json
    llmstream bench --profile --scenarios d --approaches llmstream   # CPU per record per stage
    llmstream bench --batch-lane 100000 [--inject]   # the provider-batch lane: kills, restarts, bad days
    llmstream bench --transport-probe    # CPU a call of each HTTP client (aiohttp, libcurl, Rust) alone

Exit status 0 when every run produced answers with no duplicates and nothing lost; speed
targets are reported, never enforced.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from jobs.dev import local_kafka
from jobs.dev.bench import batch_lane, report, scale_scenarios
from jobs.dev.bench import transport as transport_probe
from jobs.dev.bench.harness import (
    ALL_APPROACHES,
    APPROACHES,
    FLOORS,
    BenchContext,
    RunResult,
    probe,
    run_approach,
    wait_for_quiet,
)
from jobs.dev.bench.scale_scenarios import SCALE_SCENARIOS
from jobs.dev.bench.scenarios import (
    FLOOR_SCENARIOS,
    SCENARIOS,
    SMOKE_RECORDS,
    SMOKE_SCENARIO,
    VECTORIZED_FLOOR,
    Scenario,
)
from jobs.dev.bench.soak import DEFAULT_RATE, FAULT_NAMES, fault_kinds, run_soak
from jobs.dev.simulator import SpawnedFleet, spawn_fleet
from jobs.dev.simulator import spawn as spawn_simulator
from jobs.runtime import jars

TUNING_FLAGS = ("capacity", "bundle_size", "bundle_time_ms", "bundle_target_ms", "checkpoint_interval_ms",
                "checkpoint_timeout_ms", "parallelism", "cache", "vectorized_batch_size")
PROBE_KINDS = {"http": "bare aiohttp", "client": "llmstream's decode + InferenceClient + encode, no Flink",
               "lane": "the vectorized lane's function, no Flink"}
CEILING_PROBE_S = 10.0
"""How long the ceiling probe of a scenario with a fixed latency runs (`Scenario.ceiling_probe_concurrency`)."""
SMOKE_PROBE_S = 2.0
"""The smoke's ceiling probe: long enough to show the probe runs and is reported; its figure is not read."""
SMOKE_CHECKPOINT_INTERVAL_MS = 1000
"""The smoke's checkpoint interval (unless --checkpoint-interval-ms is given): a Flink approach's answers
become visible to the read_committed observer at the first checkpoint after them, so the bench's 5 s
interval was up to 5 s of waiting in each of the smoke's six Flink runs; the smoke measures nothing."""
RESULTS_DIR = Path(__file__).resolve().parent / "journal" / "results"
"""Where a run's report goes by default: the journal's data folder (not a Python package). `latest.*` there
is the newest run, ignored by git; a run worth keeping is copied under a name of its own and cited."""
SMOKE_MAX_SECONDS = 300.0
"""A deadline for each smoke run, not a pace: 100 records end every run on its own within seconds,
but on a loaded 2-core machine the job's start-up alone once took longer than the old 45 s cap."""


def _parse_list(text: str, allowed: list[str] | tuple[str, ...], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"{what}: unknown {unknown or text!r} (choose from {', '.join(allowed)})")
    return items


DESCRIPTION = " ".join(__doc__.split("\n\n")[0].split())
EPILOG = "\n".join(__doc__.splitlines()[2:])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``llmstream bench`` flags."""
    parser.add_argument("--scenarios", default="a,b,c,d",
                        type=lambda t: _parse_list(t, [*SCENARIOS, *SCALE_SCENARIOS], "--scenarios"),
                        help="comma-separated: " + "; ".join(f"{s.key} = {s.name}" for s in SCENARIOS.values())
                             + "; and on a standalone cluster with the adaptive scheduler (scale.md/json, "
                               "jobs/dev/bench/scale_scenarios.py): "
                             + "; ".join(f"{s.key} = {s.name}" for s in SCALE_SCENARIOS.values()))
    parser.add_argument("--approaches", default=None,
                        type=lambda t: _parse_list(t, ALL_APPROACHES, "--approaches"),
                        help=f"comma-separated, from {', '.join(ALL_APPROACHES)} (default: all but "
                             f"{' and '.join(FLOORS)}, Flink and Kafka without a model; {VECTORIZED_FLOOR} "
                             f"in ({'), ('.join(FLOOR_SCENARIOS)}) only unless named)")
    parser.add_argument("--records", type=int, default=None,
                        help="input records per run in a, b, d (default per scenario: "
                             + ", ".join(f"{s.key} {s.records:,}" for s in SCENARIOS.values() if not s.overload_factor)
                             + ")")
    parser.add_argument("--max-seconds", type=float, default=90.0,
                        help="bound on each run, from its process start; throughput counts what completed "
                             "(default %(default)s)")
    parser.add_argument("--overload-seconds", type=float, default=None,
                        help="length of scenario c's overload (default 60)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where latest.md/json/png go (default {RESULTS_DIR}; with --smoke a temp dir)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"CI variant under 60 s: scenario {SMOKE_SCENARIO}, {SMOKE_RECORDS} records, all approaches")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (per-run logs, configs, broker)")
    parser.add_argument("--render", action="store_true",
                        help="only re-write latest.md and latest.png from the latest.json in --out")
    parser.add_argument("--profile", action="store_true",
                        help="profile each Flink run for 10 s once 15%% of its records are answered (py-spy on "
                             "Python, JFR on the JVM); tables and flame graphs go to --out as profile-*.md/svg")
    parser.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                        help="instead of the scenarios: the job on a standalone cluster for MINUTES at a steady "
                             "input rate while fleet endpoints, the TaskManager and the broker fail at random "
                             "moments (jobs/dev/bench/soak.py); soak.md/json go to --out")
    parser.add_argument("--soak-rate", type=float, default=None, metavar="PER_S",
                        help="the soak's input records per second (default 60)")
    parser.add_argument("--soak-faults", default="all", metavar="KINDS",
                        help="the soak's kinds of fault, comma-separated: " + ", ".join(FAULT_NAMES)
                             + ", or all (default) or none")
    parser.add_argument("--seed", type=int, default=1, help="the soak's fault schedule (default %(default)s)")
    lane = parser.add_argument_group(
        "the provider-batch lane (instead of the scenarios: jobs/dev/bench/batch_lane.py; batch-lane.md/json "
        "go to --out)")
    lane.add_argument("--batch-lane", type=int, default=None, metavar="RECORDS",
                      help="RECORDS through `model.mode: batch` on a standalone cluster against the simulator's "
                           "OpenAI batch API, with TaskManager kills and a stop-with-savepoint and resubmit while "
                           "batches are live")
    lane.add_argument("--batch-size", type=int, default=10_000, help="provider_batch.max_requests (default %(default)s)")
    lane.add_argument("--batch-delay-s", default="10:120", metavar="LOW:HIGH",
                      help="how long the simulator takes to answer a batch (default %(default)s)")
    lane.add_argument("--kills", type=int, default=2, help="TaskManager SIGKILLs while batches are live (default %(default)s)")
    lane.add_argument("--inject", action="store_true",
                      help="5%% of batched requests refused, and one batch each expired, failed, deleted, cancelled")
    transport = parser.add_argument_group(
        "the HTTP transport alone (instead of the scenarios: jobs/dev/bench/transport.py; transport.md/json go to --out)")
    transport.add_argument("--transport-probe", action="store_true",
                           help="in-process CPU a call and calls/s of each HTTP client against the simulator")
    transport.add_argument("--transport-clients", default=",".join(transport_probe.CLIENTS),
                           type=lambda t: _parse_list(t, transport_probe.CLIENTS, "--transport-clients"),
                           help="comma-separated (default %(default)s)")
    transport.add_argument("--transport-concurrency", default=",".join(map(str, transport_probe.CONCURRENCIES)),
                           help="calls in flight, comma-separated (default %(default)s)")
    transport.add_argument("--transport-seconds", type=float, default=5.0, help="a client's run (default %(default)s)")
    transport.add_argument("--transport-rounds", type=int, default=2, help="interleaved rounds (default %(default)s)")
    parser.add_argument("--wait-for-quiet", type=float, default=None, metavar="LOAD",
                        help="first wait (at most 10 min) for the 1-minute load average to drop below LOAD")
    tuning = parser.add_argument_group(
        "llmstream settings (default: derived per scenario as the README recommends, see LlmstreamSettings)")
    for flag in TUNING_FLAGS:
        tuning.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=None)
    tuning.add_argument("--flink", action="append", default=[], metavar="KEY=VALUE", type=_flink_option,
                        help="a Flink option for llmstream's job config (`flink:`), e.g. "
                             "python.metric.enabled=false; repeatable")


def _flink_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _say(text: str) -> None:
    print(text, flush=True)


def _scenario(key: str, args: argparse.Namespace) -> Scenario:
    scenario = SCENARIOS[key]
    if scenario.overload_factor and args.overload_seconds:
        scenario = dataclasses.replace(scenario, overload_seconds=args.overload_seconds)
    return scenario


def run_all(args: argparse.Namespace, command: str) -> tuple[list[RunResult], dict[str, Path], list[str], dict[str, Any]]:
    named = args.approaches is not None
    approaches: list[str] = args.approaches if named else list(APPROACHES)
    overrides: dict[str, Any] = {flag: getattr(args, flag) for flag in TUNING_FLAGS if getattr(args, flag) is not None}
    if args.flink:
        overrides["flink"] = dict(args.flink)
    load_before = os.getloadavg()[0]
    if args.wait_for_quiet is not None:
        load_before = wait_for_quiet(args.wait_for_quiet, 600, _say)
    jars.ensure("broker")
    jars.ensure("connector")
    if "ml-predict" in approaches:
        jars.ensure("ml-predict")
    workdir = Path(tempfile.mkdtemp(prefix="llmstream-bench-"))
    out_dir = args.out or (workdir / "results" if args.smoke else RESULTS_DIR)
    broker: local_kafka.LocalBroker | None = None
    results: list[RunResult] = []
    probes: dict[str, Any] = {}
    failures: list[str] = []
    started = time.monotonic()
    try:
        _say(f"bench: starting a Kafka broker; load average {load_before:.2f} on {os.cpu_count()} CPUs")
        broker = _start_broker(workdir)
        ctx = BenchContext(broker=broker, workdir=workdir, overrides=overrides, say=_say,
                           profile_dir=out_dir if args.profile else None, smoke=args.smoke)
        for key in args.scenarios:
            scenario = _scenario(key, args)
            records = args.records or scenario.records
            _say(f"bench: scenario {scenario.summary()}")
            if "llmstream" in approaches:
                _say(f"bench: llmstream settings for ({key}): {ctx.settings_for(scenario).describe()}")
            simulator = (spawn_fleet(scenario.fleet, scenario.simulator_args()) if scenario.fleet
                         else spawn_simulator(scenario.simulator_args()))
            try:
                for approach in scenario.approaches(approaches, named):
                    try:
                        result = run_approach(ctx, simulator, scenario, approach, records, args.max_seconds)
                    except Exception:  # noqa: BLE001 - one broken run must not lose the others' numbers
                        _say(f"[{key}/{approach}] FAILED:\n{traceback.format_exc()}")
                        failures.append(f"{key}/{approach}")
                        continue
                    results.append(result)
                    if isinstance(simulator, SpawnedFleet):
                        _say(f"[{key}/{approach}] {simulator.shares()}")
                    o = result.outcome
                    _say(f"[{key}/{approach}] done in {result.elapsed_s:.0f}s: {o.seen:,}/{o.expected:,} answered, "
                         f"steady {report._num(result.throughput_steady, 1)}/s"
                         + (f" ({result.pct_of_limit:.0f}% of limit)" if result.pct_of_limit else "")
                         + f", e2e p99 {report._secs(result.e2e_ms.p99)} s, dup {o.duplicates}, lost {o.lost}, "
                         f"not reached {o.not_reached:,}; {time.monotonic() - started:.0f}s since bench start")
                ceiling = scenario.ceiling_probe_concurrency
                if ceiling and any(r.scenario == key for r in results):
                    probe_s = SMOKE_PROBE_S if args.smoke else CEILING_PROBE_S
                    _say(f"[{key}] probe: bare aiohttp alone against the simulator, {ceiling} concurrent, "
                         f"{probe_s:g} s: the most any client gets from it here ...")
                    probes[f"ceiling_{key}"] = probe("http", simulator.url, probe_s, ceiling)
                    _say(f"[{key}] probe ceiling: {probes[f'ceiling_{key}']}")
                if scenario.latency == "0" and any(r.scenario == key for r in results):
                    for kind, what in PROBE_KINDS.items():
                        _say(f"[{key}] probe: {what} alone against the simulator, 64 concurrent, 5 s ...")
                        probes[f"{kind}_{key}"] = probe(kind, simulator.url)
                        _say(f"[{key}] probe {kind}: {probes[f'{kind}_{key}']}")
            finally:
                simulator.stop()
        paths = report.write(out_dir, results, command, load_before, probes, overrides)
        return results, paths, failures, probes
    finally:
        if broker is not None:
            broker.stop()
        if args.keep:
            _say(f"bench: work dir kept at {workdir}")
        elif workdir in out_dir.resolve().parents:
            _drop_all_but(workdir, out_dir.resolve())
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _start_broker(workdir: Path, attempts: int = 2) -> local_kafka.LocalBroker:
    """A broker on fresh ephemeral ports; tried again once, on new ports, if start-up fails
    (a port taken between choosing and binding it, on a machine shared with other tests)."""
    for attempt in range(1, attempts + 1):
        broker = local_kafka.LocalBroker(local_kafka.BrokerConfig.ephemeral(workdir / f"kafka-{attempt}"))
        try:
            broker.start(timeout=90)
            return broker
        except local_kafka.BrokerError as err:
            if attempt == attempts:
                raise
            _say(f"bench: broker start failed ({str(err).splitlines()[0]}); trying again on new ports")
    raise AssertionError("unreachable")


def _drop_all_but(workdir: Path, keep: Path) -> None:
    """Removes the work dir except the smoke results inside it."""
    for child in workdir.iterdir():
        if child == keep or child in keep.parents:
            continue
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmstream bench", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = "llmstream bench " + shlex.join(argv)
    return run(args)


def _standalone_ready(args: argparse.Namespace) -> None:
    """Before the soak or the batch lane (each starts its own broker and standalone cluster): a
    quiet machine if asked, and the broker's and connector's jars."""
    if args.wait_for_quiet is not None:
        wait_for_quiet(args.wait_for_quiet, 600, _say)
    jars.ensure("broker")
    jars.ensure("connector")


def run(args: argparse.Namespace) -> int:
    """Execute parsed `add_arguments` flags: 0 if every run saw output with 0 lost and 0 duplicated."""
    if args.render:
        out = args.out or RESULTS_DIR
        if (out / "scale.json").exists():
            print(f"bench: re-rendered {scale_scenarios.rerender(out)}")
        if (out / "latest.json").exists() or not (out / "scale.json").exists():
            paths = report.render(out)
            print("bench: re-rendered " + ", ".join(str(p) for p in paths.values()))
        return 0
    # kafka-python logs every refused connection while the broker starts, at ERROR; the
    # harness raises on what matters, so its clients' chatter stays out of the progress lines.
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    if args.soak is not None:
        try:
            kinds = fault_kinds(args.soak_faults)
        except ValueError as err:
            _say(f"bench: {err}")
            return 2
        _standalone_ready(args)
        return run_soak(args.soak, args.soak_rate or DEFAULT_RATE, args.seed, args.out or RESULTS_DIR, args.keep, _say,
                        kinds)
    command = getattr(args, "command_line", "llmstream bench").strip()
    if args.transport_probe:
        if args.wait_for_quiet is not None:
            wait_for_quiet(args.wait_for_quiet, 600, _say)
        concurrencies = [int(c) for c in str(args.transport_concurrency).split(",") if c.strip()]
        return transport_probe.run_probe(args.out or RESULTS_DIR, args.transport_clients, concurrencies,
                                         args.transport_seconds, args.transport_rounds, _say)
    if args.batch_lane is not None:
        _standalone_ready(args)
        return batch_lane.run(args.batch_lane, args.batch_size, args.batch_delay_s, args.kills, args.inject,
                              args.out or RESULTS_DIR, command, _say)
    if args.smoke:
        args.scenarios = [SMOKE_SCENARIO]
        args.records = args.records or SMOKE_RECORDS
        args.max_seconds = max(args.max_seconds, SMOKE_MAX_SECONDS)
        if args.checkpoint_interval_ms is None:
            args.checkpoint_interval_ms = SMOKE_CHECKPOINT_INTERVAL_MS
    scaling = [key for key in args.scenarios if key in SCALE_SCENARIOS]
    if scaling:
        _standalone_ready(args)
        scaled = scale_scenarios.run(scaling, args.out or RESULTS_DIR, command, _say)
        args.scenarios = [key for key in args.scenarios if key not in SCALE_SCENARIOS]
        if not args.scenarios:
            return scaled
        args.wait_for_quiet = None
    started = time.monotonic()
    results, paths, failures, probes = run_all(args, command)
    print()
    print(report.table(results))
    print()
    for target in report.targets(results, probes):
        if target.met is not None:
            print(f"target ({target.scenario}) {target.text}: {target.verdict} — {target.detail}")
    print(f"\nbench: {len(results)} runs in {time.monotonic() - started:.0f} s; wrote "
          + ", ".join(str(p) for p in paths.values()))
    if failures:
        print(f"bench: FAILED runs: {', '.join(failures)}")
    ok = not failures and all(r.outcome.seen > 0 and r.outcome.duplicates == 0 and r.outcome.lost == 0
                              for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
