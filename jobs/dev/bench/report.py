"""The benchmark's report: `latest.md` (tables and targets), `latest.json` (every number)
and `latest.png` (throughput and p99 per approach and scenario; RSS over time under overload)."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from jobs.dev.bench.harness import ALL_APPROACHES, LlmstreamSettings, RunResult
from jobs.dev.bench.measure import DeliveryTally, Latencies
from jobs.dev.bench.scenarios import SCENARIOS, UNBATCHED, VECTORIZED, VECTORIZED_FLOOR

RSS_FLAT_MB = 50.0
"""RSS drift (last quarter vs second quarter of the run) under which memory counts as flat."""


@dataclass(frozen=True)
class Target:
    scenario: str
    text: str
    met: bool | None
    detail: str

    reported: bool = False
    """A row with no bar to clear, only a measured figure (how far a lane falls where it is weak)."""

    @property
    def verdict(self) -> str:
        if self.reported:
            return "reported" if self.detail else "not measured"
        return {True: "met", False: "NOT met", None: "not measured"}[self.met]


def _find(results: Sequence[RunResult], scenario: str, approach: str) -> RunResult | None:
    return next((r for r in results if r.scenario == scenario and r.approach == approach), None)


def _ratio(run: RunResult | None, base: RunResult | None) -> float | None:
    """`run`'s steady rate over `base`'s, when both have one."""
    if run is None or base is None or not run.throughput_steady or not base.throughput_steady:
        return None
    return run.throughput_steady / base.throughput_steady


def _parallelism(run: RunResult) -> int:
    """The inference subtasks of `run` (1 for an approach without settings)."""
    return int((run.settings or {}).get("parallelism", 1))


def _checkpoint_ms(run: RunResult, stat: str) -> float | None:
    value = ((run.checkpoints or {}).get("duration_ms") or {}).get(stat)
    return None if value is None else float(value)


def ceiling(probes: dict[str, Any] | None, run: RunResult | None) -> str:
    """What bare aiohttp reached against `run`'s simulator (its scenario's ceiling probe), as a
    share of the limit: the most any client gets from that simulator on this machine. "" when
    the scenario has no such probe."""
    found = (probes or {}).get(f"ceiling_{run.scenario}") if run is not None else None
    if not found or run is None or not run.limit_per_s:
        return ""
    return f"bare aiohttp {found['rate']:,.0f}/s = {100 * found['rate'] / run.limit_per_s:.0f}% of the limit"


def targets(results: Sequence[RunResult], probes: dict[str, Any] | None = None) -> list[Target]:
    """The targets of issue 9, judged on these results (`probes`: the ceiling probes, quoted beside them)."""
    out = []
    for key, pct in (("a", 90), ("b", 95)):
        run = _find(results, key, "llmstream")
        met = None if run is None or run.pct_of_limit is None else run.pct_of_limit >= pct
        detail = "" if run is None or run.throughput_steady is None else (
            f"{run.throughput_steady:,.0f}/s = {run.pct_of_limit or 0:.0f}% of {run.limit_per_s:,.0f}/s")
        reached = ceiling(probes, run)
        if detail and reached:
            detail += f" (same simulator, {reached})"
        out.append(Target(key, f"llmstream >= {pct}% of the limit at steady state (default config)", met, detail))
    run = _find(results, "b", "llmstream")
    p50, worst = (None, None) if run is None else (_checkpoint_ms(run, "p50"), _checkpoint_ms(run, "max"))
    out.append(Target("b", "checkpoint duration under a backlog: p50 <= 0.5 s, max <= 2 s",
                      None if p50 is None or worst is None else p50 <= 500 and worst <= 2000,
                      "" if p50 is None else f"p50 {_secs(p50)} s, max {_secs(worst)} s"))
    if run is not None and run.pickup_ms.p50 is not None and run.settings:
        interval = float(run.settings.get("checkpoint_interval_ms", 5000))
        p99 = run.pickup_ms.p99 or 0
        out.append(Target("b", "pickup→visible p50 <= interval + 1 s, p99 <= interval + 3 s",
                          run.pickup_ms.p50 <= interval + 1000 and p99 <= interval + 3000,
                          f"p50 {_secs(run.pickup_ms.p50)} s, p99 {_secs(p99)} s, interval {interval / 1000:g} s"))
    else:
        out.append(Target("b", "pickup→visible p50 <= interval + 1 s, p99 <= interval + 3 s", None, ""))
    run, base = _find(results, "b", "llmstream"), _find(results, "b", "semaphore-gather")
    ratio = _ratio(run, base)
    if run is not None and base is not None and ratio is not None:
        out.append(Target("b", "llmstream >= 5x semaphore-gather", ratio >= 5,
                          f"{run.throughput_steady:,.0f}/s vs {base.throughput_steady:,.1f}/s = {ratio:.1f}x"))
    else:
        out.append(Target("b", "llmstream >= 5x semaphore-gather", None, ""))
    run = _find(results, "c", "llmstream")
    if run is not None:
        drift = run.rss_drift_mb
        flat = drift is not None and drift < RSS_FLAT_MB
        out.append(Target("c", f"flat RSS (drift < {RSS_FLAT_MB:g} MB) and nothing lost",
                          flat and run.outcome.seen > 0 and run.outcome.lost == 0 and run.outcome.duplicates == 0,
                          f"drift {_num(drift, 1)} MB, peak {_num(run.rss_peak_mb.get('approach'))} MB, "
                          f"lost {run.outcome.lost}, duplicates {run.outcome.duplicates}"))
    else:
        out.append(Target("c", "flat RSS and nothing lost", None, ""))
    run, base = _find(results, "d", "llmstream"), _find(results, "d", "semaphore-gather")
    if run is not None and run.throughput_steady:
        parallelism = _parallelism(run)
        per = run.throughput_steady / parallelism
        speedup = _ratio(run, base)
        out.append(Target("d", ">= 5,000 records/s per inference subtask and >= 2x semaphore-gather",
                          per >= 5_000 and (speedup is None or speedup >= 2),
                          f"{per:,.0f}/s per subtask (parallelism {parallelism})"
                          + (f", {speedup:.1f}x semaphore-gather" if speedup else "")))
        cpu = run.cpu_ms_per_record
        out.append(Target("d", "CPU per record at steady state <= 0.4 ms",
                          None if cpu is None else cpu <= 0.4,
                          "" if cpu is None else f"{cpu:.2f} ms (JVM + Python, whole process tree)"))
    else:
        out.append(Target("d", ">= 5,000 records/s per inference subtask and >= 2x semaphore-gather", None, ""))
        out.append(Target("d", "CPU per record at steady state <= 0.4 ms", None, ""))
    out.extend(_peer_targets(results))
    out.extend(_batching_targets(results))
    out.extend(_lane_targets(results, probes))
    out.extend(floor_targets(results))
    return out


FLOOR_CPU_RATIO = 1.3
FLOOR_RATE_RATIO = 0.8
EMBEDDINGS_PER_SUBTASK = 10_000
FLOOR_EMBEDDINGS_NEEDED = 12_500
"""Issue 57's targets: the vectorized lane against its floor with the model call (`VECTORIZED_FLOOR`),
same run. The 10,000 embeddings/s a subtask is judged only where the floor reaches 12,500/s: below
that it is the machine (or Flink) that falls short, not llmstream."""


def floor_ratios(results: Sequence[RunResult], scenario: str) -> dict[str, float | None]:
    """The vectorized lane over its floor in `scenario`: throughput, CPU a record; and over semaphore-gather."""
    lane, floor, base = (_find(results, scenario, a) for a in (VECTORIZED, VECTORIZED_FLOOR, "semaphore-gather"))
    cpu = None
    if lane is not None and floor is not None and lane.cpu_ms_per_record is not None and floor.cpu_ms_per_record:
        cpu = lane.cpu_ms_per_record / floor.cpu_ms_per_record
    return {"rate": _ratio(lane, floor), "cpu": cpu, "rate_vs_semaphore_gather": _ratio(lane, base),
            "floor_vs_semaphore_gather": _ratio(floor, base)}


def floor_targets(results: Sequence[RunResult]) -> list[Target]:
    """Issue 57: the vectorized lane's own cost, as ratios to `VECTORIZED_FLOOR` within one run."""
    out = []
    lane, floor = _find(results, "d", VECTORIZED), _find(results, "d", VECTORIZED_FLOOR)
    ratios = floor_ratios(results, "d")
    text = f"llmstream-vectorized CPU a record <= {FLOOR_CPU_RATIO:g}x vectorized-floor's (same run)"
    cpu = ratios["cpu"]
    out.append(Target("d", text, None if cpu is None else cpu <= FLOOR_CPU_RATIO, "" if cpu is None else (
        f"{lane.cpu_ms_per_record:.3f} vs {floor.cpu_ms_per_record:.3f} ms = {cpu:.2f}x")))  # type: ignore[union-attr]
    text = (f"llmstream-vectorized >= {FLOOR_RATE_RATIO:g}x vectorized-floor's throughput and >= 1.0x "
            "semaphore-gather (same run)")
    rate, over_base = ratios["rate"], ratios["rate_vs_semaphore_gather"]
    if rate is None:
        out.append(Target("d", text, None, ""))
    else:
        detail = f"{lane.throughput_steady:,.0f} vs {floor.throughput_steady:,.0f}/s = {rate:.2f}x"  # type: ignore[union-attr]
        if over_base is not None:
            detail += f"; {over_base:.2f}x semaphore-gather"
            if ratios["floor_vs_semaphore_gather"] is not None:
                detail += f" (the floor {ratios['floor_vs_semaphore_gather']:.2f}x)"
        out.append(Target("d", text, rate >= FLOOR_RATE_RATIO and (over_base is None or over_base >= 1.0), detail))
    lane, floor = _find(results, "e", VECTORIZED), _find(results, "e", VECTORIZED_FLOOR)
    rate = floor_ratios(results, "e")["rate"]
    text = f"llmstream-vectorized >= {FLOOR_RATE_RATIO:g}x vectorized-floor's embeddings/s (same run)"
    out.append(Target("e", text, None if rate is None else rate >= FLOOR_RATE_RATIO, "" if rate is None else (
        f"{lane.throughput_steady:,.0f} vs {floor.throughput_steady:,.0f}/s = {rate:.2f}x")))  # type: ignore[union-attr]
    text = (f"llmstream-vectorized >= {EMBEDDINGS_PER_SUBTASK:,} embeddings/s a subtask where the floor reaches "
            f"{FLOOR_EMBEDDINGS_NEEDED:,}")
    if lane is None or floor is None or not lane.throughput_steady or not floor.throughput_steady:
        out.append(Target("e", text, None, ""))
    else:
        per = lane.throughput_steady / _parallelism(lane)
        floor_per = floor.throughput_steady / _parallelism(floor)
        detail = f"{per:,.0f}/s a subtask; the floor {floor_per:,.0f}/s"
        if floor_per >= FLOOR_EMBEDDINGS_NEEDED:
            out.append(Target("e", text, per >= EMBEDDINGS_PER_SUBTASK, detail))
        else:
            out.append(Target("e", text, None, detail + f", under {FLOOR_EMBEDDINGS_NEEDED:,}: not judged",
                              reported=True))
    return out


def _peer_targets(results: Sequence[RunResult]) -> list[Target]:
    """Issue 23: llmstream >= 2x Flink's own ML_PREDICT with an instant model (d), same run."""
    text = "llmstream >= 2x ML_PREDICT (same run)"
    run, peer = _find(results, "d", "llmstream"), _find(results, "d", "ml-predict")
    ratio = _ratio(run, peer)
    if run is None or peer is None or ratio is None:
        return [Target("d", text, None, "")]
    cpu = ""
    if run.cpu_ms_per_record is not None and peer.cpu_ms_per_record is not None:
        cpu = f"; CPU per record {run.cpu_ms_per_record:.2f} vs {peer.cpu_ms_per_record:.2f} ms"
    return [Target("d", text, ratio >= 2,
                   f"{run.throughput_steady:,.0f}/s vs {peer.throughput_steady:,.0f}/s = {ratio:.2f}x{cpu}")]


def _batching_targets(results: Sequence[RunResult]) -> list[Target]:
    """Issue 13's targets for (e): batched embeddings against the same job unbatched, same run."""
    text = ">= 10,000 embedded records/s per inference subtask with batching and >= 5x unbatched"
    run, base = _find(results, "e", "llmstream"), _find(results, "e", UNBATCHED)
    if run is None or not run.throughput_steady:
        return [Target("e", text, None, "")]
    per = run.throughput_steady / _parallelism(run)
    speedup = _ratio(run, base)
    cpu = [f"{r.cpu_ms_per_record:.2f} ms {label}" for r, label in ((run, "batched"), (base, "unbatched"))
           if r is not None and r.cpu_ms_per_record is not None]
    detail = f"{per:,.0f}/s per subtask batched"
    if base is not None and speedup is not None:
        detail += f", {base.throughput_steady:,.0f}/s unbatched = {speedup:.1f}x"
    if cpu:
        detail += "; CPU per record (JVM + Python) " + ", ".join(cpu)
    return [Target("e", text, per >= 10_000 and speedup is not None and speedup >= 5, detail)]


def _lane_targets(results: Sequence[RunResult], probes: dict[str, Any] | None) -> list[Target]:
    """Issue 41's targets for the vectorized lane (`VECTORIZED`), each within this run: (d) against
    the hand-written consumer and ML_PREDICT, its CPU a record; (e) embeddings a subtask; (a) one
    lane or the other at 90% of what bare aiohttp gets from the same simulator; (b) how far the
    lane falls under the heavy tail, reported beside the keyed stage; checkpoints p99 on (a, d, e)."""
    out = []
    lane, base, peer = (_find(results, "d", a) for a in (VECTORIZED, "semaphore-gather", "ml-predict"))
    over_base, over_peer = _ratio(lane, base), _ratio(lane, peer)
    text = "llmstream-vectorized >= 2x semaphore-gather and >= 3x ML_PREDICT (same run)"
    if over_base is None and over_peer is None:
        out.append(Target("d", text, None, ""))
    else:
        parts = [f"{r:.2f}x {name}" for r, name in ((over_base, "semaphore-gather"), (over_peer, "ML_PREDICT"))
                 if r is not None]
        out.append(Target("d", text, (over_base or 0) >= 2 and (over_peer is None or over_peer >= 3),
                          f"{lane.throughput_steady:,.0f}/s: " + ", ".join(parts)))  # type: ignore[union-attr]
    text = "llmstream-vectorized CPU a record <= 0.6x semaphore-gather's"
    if lane is None or base is None or lane.cpu_ms_per_record is None or not base.cpu_ms_per_record:
        out.append(Target("d", text, None, ""))
    else:
        share = lane.cpu_ms_per_record / base.cpu_ms_per_record
        out.append(Target("d", text, share <= 0.6, f"{lane.cpu_ms_per_record:.2f} vs {base.cpu_ms_per_record:.2f} "
                                                    f"ms = {share:.2f}x"))
    lane = _find(results, "e", VECTORIZED)
    text = "llmstream-vectorized >= 10,000 embedded records/s per subtask"
    if lane is None or not lane.throughput_steady:
        out.append(Target("e", text, None, ""))
    else:
        per = lane.throughput_steady / _parallelism(lane)
        out.append(Target("e", text, per >= 10_000, f"{per:,.0f}/s per subtask"))
    found = (probes or {}).get("ceiling_a")
    lanes = [r for r in (_find(results, "a", "llmstream"), _find(results, "a", VECTORIZED))
             if r is not None and r.throughput_steady]
    text = ">= 90% of bare aiohttp against the same simulator, in one lane or the other"
    if not found or not found.get("rate") or not lanes:
        out.append(Target("a", text, None, ""))
    else:
        shares = {r.approach: r.throughput_steady / found["rate"] for r in lanes}  # type: ignore[operator]
        out.append(Target("a", text, max(shares.values()) >= 0.9,
                          ", ".join(f"{a} {100 * s:.0f}%" for a, s in shares.items())
                          + f" of bare aiohttp's {found['rate']:,.0f}/s"))
    lane, keyed = _find(results, "b", VECTORIZED), _find(results, "b", "llmstream")
    detail = ""
    if lane is not None and lane.throughput_steady:
        detail = f"{lane.throughput_steady:,.0f}/s = {lane.pct_of_limit or 0:.0f}% of the limit"
        if keyed is not None and keyed.pct_of_limit is not None:
            detail += f" (the keyed stage {keyed.pct_of_limit:.0f}%)"
        p50 = _checkpoint_ms(lane, "p50")
        if p50 is not None:
            detail += f"; checkpoints p50 {_secs(p50)} s, max {_secs(_checkpoint_ms(lane, 'max'))} s"
    out.append(Target("b", "llmstream-vectorized under the heavy tail: how far it falls", None, detail,
                      reported=True))
    for key in ("a", "d", "e"):
        lane = _find(results, key, VECTORIZED)
        p99 = None if lane is None else _checkpoint_ms(lane, "p99")
        out.append(Target(key, "llmstream-vectorized checkpoints p99 <= 1 s", None if p99 is None else p99 <= 1000,
                          "" if p99 is None else f"p99 {_secs(p99)} s"))
    return out


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _secs(ms: float | None) -> str:
    if ms is None:
        return "–"
    return f"{ms / 1000:,.2f}" if ms < 10_000 else f"{ms / 1000:,.1f}"


def _pair(a: str, b: str) -> str:
    return f"{a} / {b}"


def table(results: Sequence[RunResult]) -> str:
    """One row per approach and scenario."""
    head = ("| scenario | approach | limit /s | answered / input | steady /s | % of limit | "
            "e2e p50 / p99 (s) | pickup→visible p50 / p99 (s) | server util. | "
            "checkpoints: n, p50 / max (s) | CPU ms / record | model calls / record | cache hits | peak RSS approach / all (MB) | RSS drift (MB) | dup | lost | "
            "not reached | stopped by |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        o = r.outcome
        rows.append("| " + " | ".join([
            f"({r.scenario}) {r.scenario_name}",
            r.approach,
            _num(r.limit_per_s),
            f"{o.seen:,} / {o.expected:,}" + (f" ({o.dead_lettered} DLQ)" if o.dead_lettered else ""),
            _num(r.throughput_steady, 1 if (r.throughput_steady or 0) < 100 else 0),
            _num(r.pct_of_limit) + ("%" if r.pct_of_limit is not None else ""),
            _pair(_secs(r.e2e_ms.p50), _secs(r.e2e_ms.p99)),
            _pair(_secs(r.pickup_ms.p50), _secs(r.pickup_ms.p99)),
            "–" if r.utilization is None else f"{100 * r.utilization:.0f}%",
            _checkpoints(r.checkpoints),
            _num(r.cpu_ms_per_record, 2),
            _calls_per_record(r),
            f"{o.cache_hits:,}",
            _pair(_num(r.rss_peak_mb.get("approach")), _num(r.rss_peak_mb.get("total"))),
            _num(r.rss_drift_mb, 1),
            str(o.duplicates),
            str(o.lost),
            f"{o.not_reached:,}",
            r.stopped_by,
        ]) + " |")
    return "\n".join(rows)


def _calls_per_record(run: RunResult) -> str:
    """Calls the model server answered (the simulator's `served`) per input record."""
    served = (run.server or {}).get("served")
    if not isinstance(served, (int, float)) or not run.outcome.expected:
        return "–"
    return f"{served / run.outcome.expected:.3f}"


def _describe(settings: dict[str, Any]) -> str:
    return LlmstreamSettings(**settings).describe()


def _checkpoints(summary: dict[str, Any] | None) -> str:
    if not summary:
        return "–"
    durations = summary.get("duration_ms") or {}
    text = f"{summary.get('completed') or 0}, {_secs(durations.get('p50'))} / {_secs(durations.get('max'))}"
    if not summary.get("failed"):
        return text
    failures = summary.get("failures") or {}
    if isinstance(failures, list):  # results written before the reasons were counted
        failures = dict.fromkeys(failures, 1)
    reasons = [f"{n}× {why}" for why, n in failures.items()]
    if summary.get("failed_untriggered"):
        reasons.append(f"{summary['failed_untriggered']}× refused at trigger, not counted by Flink")
    return text + f" ({summary['failed']} failed: {'; '.join(reasons)})"


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def markdown(results: Sequence[RunResult], meta: dict[str, Any], probes: dict[str, Any] | None = None,
             overrides: dict[str, Any] | None = None) -> str:
    scenarios = sorted({r.scenario for r in results})
    lines = [
        "# llmstream bench: latest results",
        "",
        (f"Generated {meta['generated']} by `{meta['command']}` on {meta['machine']['cpus']} CPUs, "
        f"{meta['machine']['memory_gb']} GB (load average before {meta['load_before']:.2f}, "
        f"after {meta['machine']['load_avg_at_end'][0]:.2f}). "
        "The model server is the SIMULATOR (`jobs/dev/simulator/`), not a model. "
        "The machine is shared with other test runs: expect ±15% between runs "
        "(see the tuning runs in `jobs/dev/bench/README.md`)."),
        "",
        "Scenarios, and the llmstream settings used in each"
        + (f" (set on the command line: {overrides})" if overrides else
           " (derived from the scenario as the README recommends; see `LlmstreamSettings.recommended`)") + ":",
        *[f"- {SCENARIOS[k].summary()}" + (f"; llmstream: {_describe(run.settings)}" if run and run.settings else "")
          for k in scenarios for run in [_find(results, k, "llmstream")]],
        "",
        table(results),
        "",
        ("How to read it: *steady /s* counts answers completed between the 10th and 90th percentile "
        "of completion times (start-up and drain left out). *e2e* is from the input record's "
        "timestamp to the answer being visible to a read_committed consumer; the input is a "
        "backlog produced before the approach starts (except in c), so e2e includes queueing "
        "in Kafka and grows with the run. *pickup→visible* starts when the approach sent the "
        "request: the call plus, for llmstream, the wait for the checkpoint that commits the "
        "answer. *server util.* is the simulator's time-weighted mean in flight over the "
        "steady window ÷ its concurrency limit. *lost* = never visible although the group "
        "committed its input offset; *not reached* = never visible because the run was "
        "stopped before it (time limit or overload)."),
        "",
        "## Targets",
        "",
        "| scenario | target | verdict | measured |",
        "|---|---|---|---|",
        *[f"| ({t.scenario}) | {t.text} | {t.verdict} | {t.detail} |" for t in targets(results, probes)],
        "",
        "![throughput and p99 latency per approach and scenario](latest.png)",
        "",
    ]
    notes = [f"- ({r.scenario}) {r.approach}: {n}" for r in results for n in r.notes]
    labels = {"http": "bare aiohttp", "client": "llmstream's decode + InferenceClient + encode, without Flink",
              "lane": "the vectorized lane's function over batches of {batch_size:,} rows, without Flink"}
    for name, probe in (probes or {}).items():
        kind, scenario = name.rsplit("_", 1)
        if probe and kind in labels:
            cpu = f", {probe['cpu_us_per_record']:g} µs CPU a record" if "cpu_us_per_record" in probe else ""
            label = labels[kind].format(**probe)  # the lane probe says its batch size
            notes.append(f"- ({scenario}) probe: {label}, {probe['concurrency']} concurrent, no Kafka, "
                         f"against the same simulator: {probe['rate']:,.0f} requests/s over {probe['seconds']:g} s{cpu}")
        run = next((r for r in results if r.scenario == scenario and r.limit_per_s), None)
        if probe and kind == "ceiling" and run is not None:
            notes.append(f"- ({scenario}) ceiling probe: bare aiohttp, {probe['concurrency']} concurrent (twice the "
                         f"server's slots), no Kafka, against the same simulator: {probe['rate']:,.0f} requests/s "
                         f"over {probe['seconds']:g} s, {100 * probe['rate'] / run.limit_per_s:.0f}% of the "
                         f"limit: the most any client gets from this simulator on this machine")
    if notes:
        lines += ["## Notes", "", *notes, ""]
    return "\n".join(lines)


def chart(results: Sequence[RunResult], path: Path) -> None:
    """Grouped bars of steady throughput (with the limit) and e2e p99, plus RSS under overload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({r.scenario for r in results})
    overload = [r for r in results if r.scenario == "c" and r.rss_series]
    panels = 3 if overload else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8))
    drawn = [a for a in ALL_APPROACHES if any(r.approach == a for r in results)]
    width = 0.8 / max(len(drawn), 1)
    colors = {"sequential": "#c44e52", "semaphore-gather": "#dd8452", "llmstream": "#4c72b0", "ml-predict": "#55a868",
              "flink-floor": "#8c8c8c", "pyflink-floor": "#b07aa1", "llmstream-vectorized": "#64b5cd",
              VECTORIZED_FLOOR: "#c9b3e6", UNBATCHED: "#937860", "llmstream-per-key": "#da8bc3"}
    for i, approach in enumerate(drawn):
        xs, tput, p99, pickup = [], [], [], []
        for j, key in enumerate(scenarios):
            run = _find(results, key, approach)
            if run is None:
                continue
            xs.append(j + (i - (len(drawn) - 1) / 2) * width)
            tput.append(run.throughput_steady or 0)
            p99.append((run.e2e_ms.p99 or 0) / 1000)
            pickup.append((run.pickup_ms.p99 or 0) / 1000)
        if not xs:
            continue
        bars = axes[0].bar(xs, tput, width, label=approach, color=colors[approach])
        axes[0].bar_label(bars, fmt="{:,.0f}", fontsize=7)
        bars = axes[1].bar(xs, p99, width, label=approach, color=colors[approach])
        axes[1].bar_label(bars, fmt="{:,.1f}", fontsize=7)
        axes[1].scatter(xs, [max(v, 0.01) for v in pickup], marker="_", s=300, color="black", zorder=3,
                        label="pickup→visible p99" if i == 0 else None)
    for j, key in enumerate(scenarios):
        limit = SCENARIOS[key].limit_per_s
        if limit:
            axes[0].hlines(limit, j - 0.45, j + 0.45, colors="black", linestyles="dashed",
                           label="limit (Little's law)" if j == 0 else None)
    labels = [f"({k}) {SCENARIOS[k].name}" for k in scenarios]
    for ax, title, unit in ((axes[0], "steady-state throughput", "records/s"),
                            (axes[1], "p99: produced → visible (bars), pickup → visible (—)", "seconds")):
        ax.set_xticks(range(len(scenarios)), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_ylabel(f"{unit} (log scale)")
        ax.grid(axis="y", alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8, loc="lower left")
    if overload:
        ax = axes[2]
        for run in overload:
            ts = [t for t, _ in run.rss_series]
            mb = [m for _, m in run.rss_series]
            ax.plot(ts, mb, label=run.approach, color=colors[run.approach])
        ax.set_title("(c) overload: RSS of the approach's process tree")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("MB")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("llmstream bench (model-server SIMULATOR, one machine)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(json_path: Path) -> tuple[list[RunResult], dict[str, Any]]:
    """The results and metadata of an earlier `latest.json`, to re-render its report."""
    data = json.loads(json_path.read_text())
    results = []
    for raw in data["results"]:
        fields = dict(raw)
        fields["outcome"] = DeliveryTally(**fields["outcome"])
        for name in ("e2e_ms", "pickup_ms", "commit_lag_ms"):
            fields[name] = Latencies(**fields[name])
        fields["load_avg"] = tuple(fields["load_avg"])
        fields["rss_series"] = [tuple(point) for point in fields["rss_series"]]
        results.append(RunResult(**fields))
    return results, data


def render(out_dir: Path) -> dict[str, Path]:
    """Re-writes latest.md and latest.png from `out_dir`/latest.json (after a report change)."""
    results, data = load(out_dir / "latest.json")
    meta = {k: data[k] for k in ("generated", "command", "machine", "load_before")}
    paths = {"md": out_dir / "latest.md", "png": out_dir / "latest.png"}
    paths["md"].write_text(markdown(results, meta, data.get("probes"), data.get("llmstream_overrides")))
    chart(results, paths["png"])
    return paths


def write(out_dir: Path, results: Sequence[RunResult], command: str, load_before: float,
          probes: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Path]:
    """Writes latest.md, latest.json and latest.png to `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "machine": machine(),
        "load_before": load_before,
    }
    paths = {"md": out_dir / "latest.md", "json": out_dir / "latest.json", "png": out_dir / "latest.png"}
    data = {
        **meta,
        "llmstream_overrides": overrides or {},
        "scenarios": {k: {**SCENARIOS[k].__dict__, "limit_per_s": SCENARIOS[k].limit_per_s,
                          "mean_latency_ms": SCENARIOS[k].mean_latency_ms}
                      for k in sorted({r.scenario for r in results})},
        "targets": [t.__dict__ | {"verdict": t.verdict} for t in targets(results, probes)],
        "probes": probes or {},
        "results": [r.to_json() for r in results],
    }
    paths["json"].write_text(json.dumps(data, indent=2, default=str) + "\n")
    paths["md"].write_text(markdown(results, meta, probes, overrides))
    chart(results, paths["png"])
    return paths
