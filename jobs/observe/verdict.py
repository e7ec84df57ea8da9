"""Where a job's throughput is limited, and whether more inference subtasks would help.

A pure function over two consecutive status figures (`jobs/observe/figures.py`): the scaling
verdict `llmstream status` shows and `llmstream scale --auto` acts on. Flink's own autoscaler
reads busy time and backlog, so it would add subtasks to a stage that waits for a saturated
model, and more subtasks only send that model more calls; the verdict tells the two apart:

- ``pipeline-bound``: records wait (input lag) while the calls in flight stay below the limit,
  or the stage is full at its capacity while the model shows no strain. More subtasks help.
- ``model-bound``: the calls are at the AIMD limit the model's 429/503 answers cut, at an
  endpoint's limit, answered with 429s, held by an open circuit, or slower as more are sent.
  More subtasks do not help; more model replicas (or a higher rate limit) do.
- ``input-bound``: no lag worth the name: the job keeps up with its input.

`docs/tuning.md` ("Scaling") has the same rule as a Prometheus recording rule over the exported
gauges, for alerting and for autoscalers that read Prometheus.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

PIPELINE_BOUND = "pipeline-bound"
MODEL_BOUND = "model-bound"
INPUT_BOUND = "input-bound"
UNKNOWN = "unknown"

MIN_SPAN_S = 5.0
MAX_SPAN_S = 120.0
"""Two figures compare only this far apart (as their rates do, `figures.MIN_RATE_SPAN_S`): metric
values move in steps at bundle ends, so closer ones read noise."""


SHORT_REASONS = (("provider-batch", "the provider's batch API sets the pace"), ("AIMD limit", "calls at the AIMD limit its 429/503 answers set"), ("429s", "it answers 429s"),
                 ("latency", "its latency rises with load"), ("endpoint", "its endpoints are at their limits"))
"""The summary's few words for the first piece of evidence (the evidence says the rest)."""


@dataclass(frozen=True)
class Thresholds:
    """What counts as lag, as full and as rising latency."""

    lag_s: float = 10.0
    """Lag is worth the name above this many seconds of the current output (and above 0)."""
    full: float = 0.9
    """Calls in flight at this share of a limit count as at it."""
    latency_rise: float = 1.25
    """Latency p50 up by this factor while calls in flight rose: slower under load."""
    growth_per_s: float = 0.5
    growth_share: float = 0.05
    """Lag growing by more than `growth_per_s` records a second and this share of the output rate
    counts as growing: less is the noise of bundle ends and metric refreshes."""
    idle_share: float = 0.5
    """`idle`: the calls in flight would fill at most this share of one subtask fewer."""


@dataclass(frozen=True)
class Verdict:
    """The verdict with the evidence behind it (JSON-ready with `to_dict`, `status --json`'s `scaling`)."""

    verdict: str
    more_subtasks_help: bool | None
    subtasks: int
    per_subtask_per_s: float | None = None
    """What one inference subtask does now: about what one more would add when pipeline-bound."""
    lag_records: int | None = None
    lag_change_per_s: float | None = None
    """Input lag's change between the two figures, records a second (None: one figure only)."""
    lag_growing: bool | None = None
    endpoints_at_limit: tuple[str, ...] = ()
    """Endpoints of a fleet that are the limit: at their limit, answering 429s, or circuit not closed."""
    idle: bool = False
    """Input-bound, and one subtask fewer would still hold the calls in flight with room to spare."""
    evidence: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["endpoints_at_limit"] = list(self.endpoints_at_limit)
        out["evidence"] = list(self.evidence)
        out["summary"] = self.summary()
        return out

    def summary(self) -> str:
        """One line: would more subtasks help, and if not, what would."""
        if self.verdict == PIPELINE_BOUND:
            each = f", about {self.per_subtask_per_s:,.0f}/s each" if self.per_subtask_per_s else ""
            return f"more subtasks would help: yes{each}"
        if self.verdict == MODEL_BOUND:
            if self.endpoints_at_limit:
                names = ", ".join(self.endpoints_at_limit)
                return (f"more subtasks would help: no: the model is the limit — endpoint{'s' * (len(self.endpoints_at_limit) > 1)} "
                        f"{names} at {'their' if len(self.endpoints_at_limit) > 1 else 'its'} limit; add replicas there")
            first = self.evidence[0] if self.evidence else ""
            why = next((short for word, short in SHORT_REASONS if word in first), "it is saturated")
            return f"more subtasks would help: no: the model is the limit — {why}; add model replicas (or raise its rate limit)"
        if self.verdict == INPUT_BOUND:
            return "more subtasks would help: no: the input is the limit (no lag)" + (
                "; one subtask fewer would do" if self.idle else "")
        return f"more subtasks would help: unknown ({self.evidence[0] if self.evidence else 'no figures'})"


def _num(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _span(current: dict[str, Any], previous: dict[str, Any] | None) -> float | None:
    """Seconds between two figures of the same job, if they compare (`MIN_SPAN_S`..`MAX_SPAN_S`)."""
    if not previous or previous.get("job", {}).get("id") != current.get("job", {}).get("id"):
        return None
    span = float(current.get("at") or 0) - float(previous.get("at") or 0)
    return span if MIN_SPAN_S <= span <= MAX_SPAN_S else None


def _delta(current: dict[str, Any], previous: dict[str, Any] | None, *path: str) -> float | None:
    def get(fig: dict[str, Any] | None) -> float | None:
        value: Any = fig
        for key in path:
            value = (value or {}).get(key) if isinstance(value, dict) else None
        return _num(value)

    now, before = get(current), get(previous)
    if now is None or before is None or now < before:  # a restart resets the gauges
        return None
    return now - before


def scaling_verdict(current: dict[str, Any], previous: dict[str, Any] | None = None, *, subtasks: int,
                    thresholds: Thresholds = Thresholds()) -> Verdict:
    """The verdict on `current` figures, with `previous` ones of the same job 5 to 120 s earlier
    for the trends (lag growth, 429s and latency in between; without them only what one figure
    shows: limits, circuits, lag). `subtasks`: the inference stage's parallelism."""
    subtasks = max(1, subtasks)
    state = str(current.get("job", {}).get("state", "UNKNOWN"))
    records, calls, inp = (current.get(k) or {} for k in ("records", "calls", "input"))
    if state != "RUNNING":
        return Verdict(UNKNOWN, None, subtasks, evidence=(f"the job is {state}",))
    if not records.get("processed"):
        return Verdict(UNKNOWN, None, subtasks, evidence=("nothing processed yet",))

    lag, out_rate = _num(inp.get("lag_records")), _num(records.get("out_per_s")) or 0.0
    admitted, capacity = _num(calls.get("admitted")), _num(calls.get("capacity"))
    limit = _num(calls.get("concurrency_limit"))
    span = _span(current, previous)
    lag_change = None
    if span is not None:
        moved = _num(inp.get("lag_records")), _num(((previous or {}).get("input") or {}).get("lag_records"))
        if moved[0] is not None and moved[1] is not None:
            lag_change = (moved[0] - moved[1]) / span
    growing = None if lag_change is None else lag_change > max(thresholds.growth_per_s,
                                                                thresholds.growth_share * out_rate)
    per_subtask = round(out_rate / subtasks, 1) if out_rate else None
    base = Verdict(UNKNOWN, None, subtasks, per_subtask_per_s=per_subtask,
                   lag_records=None if lag is None else int(lag),
                   lag_change_per_s=None if lag_change is None else round(lag_change, 1), lag_growing=growing)
    batch_lane = current.get("batch_lane")
    if batch_lane and (lag or 0) > 0:
        waiting = (f"provider-batch lane: records wait for the provider's batches "
                   f"({batch_lane.get('batches_open') or 0} open), which more subtasks do not speed up")
        return replace(base, verdict=MODEL_BOUND, more_subtasks_help=False, evidence=(waiting,))
    if lag is None or admitted is None or capacity is None:
        return replace(base, evidence=("the figures lack the input lag or the calls in flight",))

    model, endpoints = _model_evidence(current, previous, span, admitted, capacity, limit, thresholds)
    fleet = current.get("endpoints") or {}
    if endpoints and not any(not text.startswith("endpoint ") for text in model) and len(endpoints) < len(fleet):
        # Some endpoints of a fleet are at their limit, the others have room the router can use.
        model = (*model, "the other endpoints have room")
        saturated = False
    else:
        saturated = bool(model)
    lag_text = f"input lag {int(lag):,} records" + (f", {'growing' if growing else 'not growing'} "
                                                   f"({lag_change:+,.1f}/s)" if lag_change is not None else "")
    has_lag = lag > thresholds.lag_s * max(out_rate, 1.0)
    if not has_lag and not growing:
        fewer = capacity * (subtasks - 1) / subtasks
        idle = subtasks > 1 and admitted <= thresholds.idle_share * fewer
        evidence = (f"{lag_text}: under {thresholds.lag_s:g} s of output", *model)
        if idle:
            evidence += (f"{int(admitted)} calls in flight fit in {subtasks - 1} subtask(s) at under "
                         f"{thresholds.idle_share:.0%} of their capacity"),
        return replace(base, verdict=INPUT_BOUND, more_subtasks_help=False, idle=idle, endpoints_at_limit=endpoints,
                       evidence=evidence)
    if saturated:
        return replace(base, verdict=MODEL_BOUND, more_subtasks_help=False, endpoints_at_limit=endpoints,
                       evidence=(*model, lag_text))
    bound = min(capacity, limit) if limit else capacity
    if admitted < thresholds.full * bound:
        why = (f"{int(admitted)} calls in flight, below the limit of {int(bound)}, while records wait "
               "(the pipeline, not the model, keeps the calls from filling the slots)")
    else:
        why = (f"the stage is full ({int(admitted)} of {int(capacity)} calls in flight) and the model shows no "
               "strain: each subtask adds async.capacity calls (so would a larger async.capacity)")
    return replace(base, verdict=PIPELINE_BOUND, more_subtasks_help=True, endpoints_at_limit=endpoints,
                   evidence=(lag_text, why, *model))


def _model_evidence(current: dict[str, Any], previous: dict[str, Any] | None, span: float | None,
                    admitted: float, capacity: float, limit: float | None,
                    thresholds: Thresholds) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(what says the model is the limit, the fleet endpoints that are), from one figure and the trend."""
    calls = current.get("calls") or {}
    evidence: list[str] = []
    if limit is not None and limit < capacity and admitted >= thresholds.full * limit:
        evidence.append(f"{int(admitted)} calls in flight at the AIMD limit {int(limit)} "
                        f"(below the capacity of {int(capacity)}: cut by 429/503 answers, or the endpoints' own limits)")
    if span is not None:
        rejected = _delta(current, previous, "calls", "rate_limited")
        sent = _delta(current, previous, "calls", "requests")
        if rejected:
            share = f" ({rejected / sent:.0%} of calls)" if sent else ""
            evidence.append(f"{int(rejected)} 429s in the last {span:.0f} s{share}")
        before_p50 = _num(((previous or {}).get("calls") or {}).get("latency_p50_ms"))
        now_p50 = _num(calls.get("latency_p50_ms"))
        before_admitted = _num(((previous or {}).get("calls") or {}).get("admitted"))
        if (before_p50 and now_p50 and before_admitted is not None
                and now_p50 >= thresholds.latency_rise * before_p50 and admitted > before_admitted):
            evidence.append(f"latency p50 rose from {before_p50:,.0f} to {now_p50:,.0f} ms as calls in flight "
                            f"rose from {int(before_admitted)} to {int(admitted)}")
    endpoints: list[str] = []
    before_endpoints = ((previous or {}).get("endpoints") or {}) if span is not None else {}
    for label, figures in sorted((current.get("endpoints") or {}).items()):
        why = []
        circuit = figures.get("circuit")
        if circuit not in (None, "closed"):
            why.append(f"circuit {circuit}")
        in_flight, own_limit = _num(figures.get("in_flight")), _num(figures.get("limit"))
        if in_flight is not None and own_limit and in_flight >= thresholds.full * own_limit:
            why.append(f"{int(in_flight)} in flight at its limit {int(own_limit)}")
        before = before_endpoints.get(label) or {}
        rejected_now, rejected_before = _num(figures.get("rate_limited")), _num(before.get("rate_limited"))
        if rejected_now is not None and rejected_before is not None and rejected_now > rejected_before:
            why.append(f"{int(rejected_now - rejected_before)} 429s")
        if why:
            endpoints.append(label)
            evidence.append(f"endpoint {label}: " + ", ".join(why))
    return tuple(evidence), tuple(endpoints)


def subtask_verdicts(current: dict[str, Any], previous: dict[str, Any] | None = None, *,
                     thresholds: Thresholds = Thresholds()) -> list[dict[str, Any]]:
    """The verdict of each inference subtask (`figures`' `subtasks`), as `scaling_verdict` gives the
    job's, each with its `subtask` index; empty at one subtask. A subtask's own calls, limits, 429s,
    latency and endpoints decide; the input lag is the job's, shared out by the subtask's share of
    the records processed (the keyed lane's records wait upstream of the key-by, each subtask's in
    proportion to its buckets). One subtask model-bound while the others are not says its buckets
    carry more records, or its endpoints more load, than the others'."""
    subtasks = current.get("subtasks") or []
    if len(subtasks) < 2:
        return []
    before = (previous or {}).get("subtasks") or []
    before = before if len(before) == len(subtasks) else []
    total = sum(int((s.get("records") or {}).get("processed") or 0) for s in subtasks)

    def as_job(fig: dict[str, Any], sub: dict[str, Any], share: float) -> dict[str, Any]:
        lag = _num((fig.get("input") or {}).get("lag_records"))
        return {**fig, "records": sub.get("records") or {}, "calls": sub.get("calls") or {},
                "endpoints": sub.get("endpoints") or {},
                "input": {**(fig.get("input") or {}), "lag_records": None if lag is None else round(lag * share)}}

    out = []
    for index, sub in enumerate(subtasks):
        processed = int((sub.get("records") or {}).get("processed") or 0)
        share = processed / total if total else 1 / len(subtasks)
        mine = as_job(current, sub, share)
        theirs = as_job(previous, before[index], share) if previous and before else None
        verdict = scaling_verdict(mine, theirs, subtasks=1, thresholds=thresholds)
        out.append({"subtask": int(sub.get("index", index)), "share": round(share, 3), **verdict.to_dict()})
    return out


def subtask_summary(verdicts: list[dict[str, Any]]) -> str | None:
    """`0 model-bound, 1 pipeline-bound`-style: the subtasks by verdict, when they disagree."""
    kinds = {v["verdict"] for v in verdicts}
    if len(kinds) < 2:
        return None
    return ", ".join(f"{v['subtask']} {v['verdict']}" for v in verdicts)
