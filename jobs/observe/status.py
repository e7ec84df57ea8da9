"""`llmstream status`: one screen that says whether the job keeps up, whether the model is
the bottleneck, whether it is healthy and what it costs.

Built from the Flink REST API (job state, restarts, checkpoints, operator metrics,
llmstream's own included) and the Kafka consumer group and topics (input lag, dead letters by
reason), collected in `jobs/observe/figures.py`; this module renders them and parses the command's flags.
A local `llmstream run` records where its mini cluster's REST API listens in the job's state
directory (`run.json`, see `jobs.state.snapshots.LocalRun`), so `llmstream status --config FILE` finds
it; for a cluster job pass `--jobmanager HOST:PORT`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

from jobs.clients.cluster_address import target
from jobs.observe.figures import DeadLetterTally, Observer
from jobs.observe.verdict import scaling_verdict, subtask_summary, subtask_verdicts
from jobs.state.location import checked_state_dir
from jobs.state.snapshots import LocalRun, StateDir
from udfs.config import JobConfig

# ---------------------------------------------------------------------------------- display

def _fmt(value: Any, unit: str = "", none: str = "–") -> str:
    if value is None:
        return none
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}{unit}"
    return f"{int(value):,}{unit}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _bytes(size: float | None) -> str:
    if size is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return "–"  # pragma: no cover


def started(fig: dict[str, Any]) -> bool:
    """Whether the inference stage has processed a record yet (before: say "starting", not "0/185").
    The source may have emitted some already while the Python worker is still starting."""
    return bool(fig["records"].get("processed"))


def line(fig: dict[str, Any]) -> str:
    """The compact one-line form (`llmstream run`'s progress line)."""
    job, rec, calls, inp, chk = fig["job"], fig["records"], fig["calls"], fig["input"], fig["checkpoint"]
    state = str(job.get("state", "UNKNOWN"))
    if job.get("taskmanagers") == 0:
        return f"{state:<9} no TaskManager is registered: the job cannot run until one starts"
    if not started(fig):
        return f"{state:<9} starting (nothing processed yet; lag {_fmt(inp['lag_records'])})"
    dead = rec.get("dead_letters")
    parts = [
        f"{state:<9} in {_fmt(rec['in'])} ({_fmt(rec['in_per_s'])}/s)",
        f"out {_fmt(rec['results'])} +{_fmt(dead)} dead"
        + (f" +{_fmt(rec['dropped'])} dropped" if rec.get("dropped") else "") + f" ({_fmt(rec['out_per_s'])}/s)",
        f"lag {_fmt(inp['lag_records'])}" + (f" (~{_duration(inp['drain_s'])})" if inp["lag_records"] else ""),
        f"calls {_fmt(calls['admitted'])}/{_fmt(calls['capacity'])} limit {_fmt(calls['concurrency_limit'])}",
        f"p50/p99 {_fmt(calls['latency_p50_ms'])}/{_fmt(calls['latency_p99_ms'])} ms",
        f"retries {_fmt(calls['retries'])} 429s {_fmt(calls['rate_limited'])}",
        f"chk {_duration(chk['age_s'])} ago",
    ]
    return " | ".join(parts)


def render(fig: dict[str, Any]) -> Any:
    """The one-screen view, as a rich renderable."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    job, rec, calls, inp, chk, cost = (fig[k] for k in ("job", "records", "calls", "input", "checkpoint", "cost"))
    state = str(job.get("state", "UNKNOWN"))
    colour = {"RUNNING": "green", "FINISHED": "blue", "ENDED": "blue"}.get(state, "yellow" if state in (
        "INITIALIZING", "CREATED", "RESTARTING", "CANCELLING") else "red")
    title = f"[bold]{job.get('name')}[/bold]  [{colour}]{state}[/{colour}]"
    if not started(fig) and state not in ("ENDED", "FINISHED"):
        title += "  [yellow]starting: nothing processed yet[/yellow]"
    header = (f"job {job.get('id') or '–'}   up {_duration(job.get('uptime_s'))}   restarts {_fmt(job.get('restarts'))}"
              + (f"   {job['lane']} lane" if job.get("lane") else "")
              + (f"   REST {job['rest_url']}" if job.get("rest_url") else ""))
    if job.get("figures_as_of"):
        header += f"\n[dim]the run has ended: figures as last seen {_duration(fig['at'] - job['figures_as_of'])} " \
                  "before now; lag and dead letters are current[/dim]"
    if job.get("ended"):
        header += f"\n[bold]{job['ended']}[/bold]"
    if job.get("taskmanagers") == 0 and state not in ("ENDED", "FINISHED", "CANCELED", "FAILED"):
        header += "\n[red]no TaskManager is registered: the job cannot run until one starts[/red]"

    def table(title: str, rows: list[tuple[str, str]]) -> Table:
        t = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 1))
        t.add_column(style="dim")
        t.add_column(justify="right")
        for row in rows:
            t.add_row(*row)
        return t

    flow = table("Keeping up?", [
        ("input lag", f"{_fmt(inp['lag_records'])} records"),
        ("time to drain", _duration(inp["drain_s"]) if inp["lag_records"] else "–"),
        ("records in", f"{_fmt(rec['in'])}  ({_fmt(rec['in_per_s'])}/s)"),
        ("results out", f"{_fmt(rec['results'])}  ({_fmt(rec['out_per_s'])}/s incl. dead)"),
        *([("dropped by your functions", _fmt(rec["dropped"]))] if rec.get("dropped") else []),
        ("group committed", f"{_fmt(inp['group_committed'])} / {_fmt(inp['end_offset'])}"),
    ])
    model = table("Is the model the bottleneck?", [
        ("calls in flight", f"{_fmt(calls['admitted'])} / {_fmt(calls['capacity'])} capacity"),
        ("HTTP in flight", _fmt(calls["in_flight"])),
        ("records held by the stage", f"{_fmt(calls.get('held'))}"
         + (f"  (oldest {_duration(calls.get('held_oldest_s'))})" if calls.get("held") else "")),
        ("AIMD limit", _fmt(calls["concurrency_limit"])),
        ("latency p50 / p99", f"{_fmt(calls['latency_p50_ms'])} / {_fmt(calls['latency_p99_ms'])} ms"),
        ("calls / retries / 429s", f"{_fmt(calls['requests'])} / {_fmt(calls['retries'])} / {_fmt(calls['rate_limited'])}"),
        *([("invalid answers (asked again)", _fmt(calls["invalid_answers"]))] if calls.get("invalid_answers") else []),
    ])
    reasons = fig["dead_letters"]["by_reason"] or {}
    health = table("Healthy?", [
        ("last checkpoint", f"{_duration(chk['age_s'])} ago" if chk["age_s"] is not None else "none yet"),
        ("its duration / size", f"{_fmt(chk['duration_ms'])} ms / {_bytes(chk['size_bytes'])}"),
        ("checkpoints ok / failed", f"{_fmt(chk['completed'])} / {_fmt(chk['failed'])}"),
        ("dead letters", _fmt(rec["dead_letters"] if rec["dead_letters"] is not None else sum(reasons.values()))),
        *[(f"  {reason}", _fmt(count)) for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])],
    ])
    spend = table("Cost", [
        ("tokens / min", _fmt(cost["tokens_per_min"])),
        ("cost / hour", f"{cost['cost_per_hour']:.4f}" if cost["cost_per_hour"] is not None else "– (no model.prices)"),
        ("tokens prompt / completion", f"{_fmt(cost['prompt_tokens'])} / {_fmt(cost['completion_tokens'])}"),
    ])
    grid = Table.grid(padding=(0, 4))
    grid.add_row(flow, model)
    grid.add_row(health, spend)
    parts: list[Any] = [header, "", grid]
    if fig.get("scaling"):
        parts += ["", _scaling_text(fig["scaling"])]
    if fig.get("endpoints"):
        parts += ["", _endpoint_table(fig["endpoints"])]
    if fig.get("batch_lane"):
        parts += ["", _batch_table(fig["batch_lane"])]
    return Panel(Group(*parts), title=title, title_align="left")


def _scaling_text(scaling: dict[str, Any]) -> str:
    """The scaling verdict (`jobs/observe/verdict.py`): its one line, then the evidence behind it."""
    colour = {"pipeline-bound": "green", "model-bound": "yellow"}.get(scaling["verdict"], "default")
    text = f"[bold]Scaling?[/bold] [{colour}]{scaling['verdict']}[/{colour}]: {scaling['summary']}"
    for evidence in scaling.get("evidence") or []:
        text += f"\n[dim]  {evidence}[/dim]"
    per_subtask = subtask_summary(scaling.get("subtasks") or [])
    if per_subtask:
        text += f"\n  per subtask: {per_subtask}"
    return text


def _batch_table(lane: dict[str, Any]) -> Any:
    """The provider-batch lane (`model.mode: batch`): what waits to be batched, the batches out."""
    from rich.table import Table

    t = Table(title=f"Batch lane ({lane['provider']})", title_justify="left", box=None, padding=(0, 1),
              show_header=False)
    oldest = lane.get("oldest_age_s")
    stale = oldest is not None and oldest > lane["stale_after_s"]
    for name, value in (
            ("records waiting to be batched", _fmt(lane.get("records_waiting"))),
            ("batches at the provider", _fmt(lane.get("batches_open"))),
            ("oldest batch", (_duration(oldest) if oldest else "–") + ("  [red]STALE[/red]" if stale else "")),
            ("requests submitted", _fmt(lane.get("requests_submitted"))),
            ("saving on list price", f"{lane['saving']:.0%}")):
        t.add_row(name, value)
    return t


def _endpoint_table(endpoints: dict[str, dict[str, Any]]) -> Any:
    """One row per endpoint of a model fleet (`model.endpoints`)."""
    from rich.table import Table

    t = Table(title="Endpoints", title_justify="left", box=None, padding=(0, 1), header_style="dim")
    for column in ("endpoint", "circuit", "in flight / limit", "calls", "429s", "failures", "p50 / p99 ms"):
        t.add_column(column, justify="left" if column in ("endpoint", "circuit") else "right")
    for label, e in endpoints.items():
        t.add_row(label, str(e.get("circuit", "–")), f"{_fmt(e.get('in_flight'))} / {_fmt(e.get('limit'))}",
                  _fmt(e.get("requests")), _fmt(e.get("rate_limited")), _fmt(e.get("failures")),
                  f"{_fmt(e.get('latency_p50_ms'))} / {_fmt(e.get('latency_p99_ms'))}")
    return t


# ---------------------------------------------------------------------------------- command

DESCRIPTION = ("One screen: is the job keeping up, is the model the bottleneck, is it healthy, "
               "what does it cost. From the Flink REST API and the Kafka consumer group.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``llmstream status`` flags."""
    parser.add_argument("--config", default=None, help="job config YAML (default: jobs/inference.yaml)")
    parser.add_argument("--jobmanager", default=None, metavar="HOST:PORT",
                        help="a cluster's REST address (default: the local run recorded in the state directory, "
                             "else the local cluster)")
    parser.add_argument("--state-dir", default=None, metavar="DIR", help="the job's state directory")
    parser.add_argument("--watch", nargs="?", const=2.0, type=float, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--svg", default=None, metavar="FILE",
                        help="also save the screen as an SVG image (how the README's capture was made)")
    parser.add_argument("--no-topic", action="store_true",
                        help="dead letters by reason from the metrics only, without reading the dead-letter topic")


def _rest_url(args: argparse.Namespace, config: JobConfig, state: StateDir) -> tuple[str | None, LocalRun | None]:
    """The REST API to ask (None: a local run that has ended, shown from its record), and that run.
    Raises a `ConfigError` naming ``--jobmanager`` when no cluster answers."""
    if args.jobmanager:
        return target(args.jobmanager).rest_url, None
    run = LocalRun.load(state)
    if run is not None and run.job_name == config.name:
        return (None if run.ended_at else run.rest_url), run
    return target(None, also_absent=f"no local run of {config.name!r} is recorded in {state.location}").rest_url, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmstream status", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Execute parsed `add_arguments` flags."""
    from jobs.clients.kafka_admin import GroupProgress
    from udfs.config import load_config

    config = load_config(args.config)  # a ConfigError is the CLI's to report (exit 2, naming the key)
    state = checked_state_dir(config, args.state_dir, create=False)
    rest_url, run = _rest_url(args, config, state)
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(contextlib.closing(GroupProgress(config)))
        tally = None
        if not args.no_topic:
            tally = stack.enter_context(contextlib.closing(DeadLetterTally(config)))
        observer = Observer(config, rest_url, job_id=run.job_id if run else None, progress=progress,
                            dead_letters=tally, local_run=run)
        if args.json and not args.watch:
            print(json.dumps(_collect(observer), indent=2))
            return 0
        if args.json:
            return _watch_json(observer, args.watch)
        return _show(observer, args.watch, svg=args.svg)
    return 0  # pragma: no cover


def _collect(observer: Observer) -> dict[str, Any]:
    """The figures with the scaling verdict (`scaling`), against the oldest figures of the last 30 s
    (`--watch`; a single refresh has no trend: lag growth and recent 429s are then unknown)."""
    fig = observer.collect()
    previous = observer.history[0] if len(observer.history) > 1 else None
    per_subtask = observer.config.async_.capacity
    subtasks = max(1, int(fig["calls"].get("capacity") or per_subtask) // per_subtask)
    before = previous if previous is not fig else None
    fig["scaling"] = scaling_verdict(fig, before, subtasks=subtasks).to_dict()
    fig["scaling"]["subtasks"] = subtask_verdicts(fig, before)
    return fig


def _watch_json(observer: Observer, every: float) -> int:
    try:
        while True:
            print(json.dumps(_collect(observer)), flush=True)
            time.sleep(every)
    except KeyboardInterrupt:
        return 0


def _show(observer: Observer, every: float | None, *, svg: str | None = None) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console(record=svg is not None, width=110 if svg else None)
    if not every:
        console.print(render(_collect(observer)))
        if svg:
            console.save_svg(svg, title="llmstream status")
        return 0
    try:
        with Live(render(_collect(observer)), console=console, refresh_per_second=1, screen=False) as live:
            while True:
                time.sleep(every)
                live.update(render(_collect(observer)))
    except KeyboardInterrupt:
        return 0
