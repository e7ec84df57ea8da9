"""The benchmark scenarios: model-server simulator settings and the throughput they allow.

The ceiling of any client of a server that holds `concurrency` requests at once for a
mean of `L` seconds each is Little's law, `concurrency / L` requests per second. For the
lognormal model the simulator uses (`mu = ln(median)`, `sigma = ln(p99 / median) / 2.326`)
the mean is `median * exp(sigma**2 / 2)`, well above the median for a heavy tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jobs.dev.bench.ml_predict import SQL_JOBS

UNBATCHED = "llmstream-unbatched"
"""llmstream with `model.batch.max_size: 1` in a batching scenario, for the comparison."""
VECTORIZED = "llmstream-vectorized"
"""llmstream with `stage: vectorized` (Arrow batches of `VECTORIZED_BATCH` records), beside the keyed
stage (`llmstream`) in every run unless `--approaches` leaves it out."""
VECTORIZED_BATCH = 1000
"""The lane's `vectorized.batch_size` in the bench: its default."""
VECTORIZED_FLOOR = "vectorized-floor"
"""The vectorized lane's floor with the model call (`jobs/dev/bench/vectorized_floor.py`): the lane's
source, Arrow-batched function and sink with one bare HTTP call a row, nothing of llmstream."""
FLOOR_SCENARIOS = ("d", "e")
"""Where `VECTORIZED_FLOOR` runs unless `--approaches` names it: the instant model and embeddings,
where the lane's own cost is what limits it."""
PER_KEY = "llmstream-per-key"
"""llmstream with `ordering: per_key` in a keyed scenario, beside llmstream unordered: the per-key cost."""
Z99 = 2.3263478740408408
"""The standard normal's 99th percentile, as in `jobs/dev/simulator/config.py`."""


@dataclass(frozen=True)
class Scenario:
    """One simulator setting and how the input arrives.

    `records` is the pre-loaded backlog of a full run (`--records` overrides it). With
    `overload_factor` set there is no backlog: a producer adds records at
    `overload_factor x limit` per second for `overload_seconds` while the approach runs,
    and the approach is stopped when the producer stops.
    """

    key: str
    name: str
    description: str
    latency: str
    concurrency: int
    records: int = 5000
    overload_factor: float | None = None
    overload_seconds: float = 60.0
    api: str = "chat"
    per_input_ms: float = 0.0
    """Simulator latency per input of an embeddings request, on top of `latency`."""
    batch_size: int = 1
    """llmstream's `model.batch.max_size`; above 1 the scenario also runs llmstream unbatched
    (`UNBATCHED`) to compare, and only llmstream and ml-predict (the baselines send chat requests)."""
    capacity: int | None = None
    """llmstream's `async.capacity` for this scenario, instead of the one derived from the server."""
    keys: int = 0
    """Distinct Kafka keys the input cycles through (`workload.keyed_request_record`); 0: each
    record's key is its id. A keyed scenario runs llmstream unordered and `PER_KEY` only."""
    fleet: tuple[int, ...] = ()
    """A model fleet (issue 21): one simulated endpoint per concurrency limit (`spawn_fleet`),
    llmstream with `model.endpoints`; `concurrency` is then their sum. llmstream only."""

    def approaches(self, requested: list[str], named: bool = True) -> list[str]:
        """The runs for this scenario out of the requested approaches; `named`: `--approaches` was
        given (else the default list, whose `VECTORIZED_FLOOR` runs in `FLOOR_SCENARIOS` only)."""
        if not named and self.key not in FLOOR_SCENARIOS:
            requested = [a for a in requested if a != VECTORIZED_FLOOR]
        if self.fleet:
            return [a for a in ("llmstream", VECTORIZED) if a in requested]
        if self.keys:
            return ["llmstream", PER_KEY] if "llmstream" in requested else []
        if self.batch_size > 1:
            runs = [UNBATCHED, "llmstream"] if "llmstream" in requested else []
            runs += [a for a in (VECTORIZED, VECTORIZED_FLOOR) if a in requested]
            # Flink's ML_PREDICT has an embeddings task too (one request per row, no batching);
            # the floors call no model.
            return runs + [a for a in requested if a in SQL_JOBS]
        return requested

    def fleet_model(self, endpoint: str) -> dict[str, Any]:
        """The `model` keys of a fleet scenario: `endpoint` is the fleet's URLs joined by commas
        (`SpawnedFleet.url`); each endpoint may hold twice its server's slots in flight (as
        `LlmstreamSettings.recommended` sizes capacity), weights left at their default."""
        urls = endpoint.split(",")
        return {"endpoint": None, "endpoints": [{"url": url, "max_concurrency": 2 * limit}
                                                for url, limit in zip(urls, self.fleet, strict=True)]}

    @property
    def mean_latency_ms(self) -> float:
        """The mean of the simulator's latency model, in ms (0 for an instant model)."""
        kind, *values = self.latency.split(":")
        if kind == "fixed":
            return float(values[0])
        if kind == "lognormal":
            median, p99 = float(values[0]), float(values[1])
            sigma = math.log(p99 / median) / Z99
            return median * math.exp(sigma**2 / 2)
        return 0.0

    @property
    def p99_latency_ms(self) -> float:
        """The latency a bundle end typically waits for: its slowest call, about the p99."""
        kind, *values = self.latency.split(":")
        if kind == "fixed":
            return float(values[0])
        if kind == "lognormal":
            return float(values[1])
        return 0.0

    @property
    def limit_per_s(self) -> float | None:
        """Little's law: concurrency / mean latency; None when the model is instant (no limit)."""
        mean_s = self.mean_latency_ms / 1000
        if mean_s <= 0 or self.concurrency <= 0:
            return None
        return self.concurrency / mean_s

    @property
    def ceiling_probe_concurrency(self) -> int | None:
        """Calls in flight for the bench's ceiling probe (bare aiohttp alone against this scenario's
        simulator, `jobs.dev.bench.probes http`): twice the server's slots, so none waits for the
        client. What it reaches is what any client reaches on this machine: the simulator's own CPU
        keeps (a) below its Little's-law limit even for bare aiohttp (docs/performance.md, "(a)
        against the simulator's own ceiling"). None where a short
        probe says nothing about the limit: no limit, a latency that varies (heavy tail), embeddings,
        a fleet."""
        if self.limit_per_s is None or not self.latency.startswith("fixed:") or self.api != "chat" or self.fleet:
            return None
        return 2 * self.concurrency

    @property
    def overload_rate_per_s(self) -> float | None:
        limit = self.limit_per_s
        return None if self.overload_factor is None or limit is None else self.overload_factor * limit

    def simulator_args(self) -> list[str]:
        return ["--latency", self.latency, "--per-input-ms", f"{self.per_input_ms:g}", "--concurrency", str(self.concurrency),
                "--per-token-ms", "0", "--seed", "7", "--stats-interval-s", "0", "--log-level", "WARNING"]

    def summary(self) -> str:
        limit = self.limit_per_s
        text = f"({self.key}) {self.name}: latency {self.latency}"
        if self.per_input_ms:
            text += f" + {self.per_input_ms:g} ms per input"
        text += f", server concurrency {self.concurrency or 'unlimited'}, "
        text += f"limit {limit:,.0f}/s" if limit else "no server limit"
        if self.overload_rate_per_s:
            text += f", input at {self.overload_rate_per_s:,.0f}/s for {self.overload_seconds:g} s"
        return text


SCENARIOS: dict[str, Scenario] = {
    s.key: s
    for s in (
        Scenario("a", "fixed 50 ms", "fixed 50 ms latency, server concurrency 64",
                 latency="fixed:50", concurrency=64, records=20_000),
        Scenario("b", "heavy tail", "lognormal latency, median 200 ms, p99 2 s, server concurrency 64",
                 latency="lognormal:200:2000", concurrency=64, records=10_000),
        # Fewer, slower slots than (a) so that 5x the limit (800/s) can be produced from this
        # process without the producer taking one of the machine's two cores from the approach.
        Scenario("c", "overload 5x", "fixed 100 ms, server concurrency 16, input at 5x the limit for 60 s",
                 latency="fixed:100", concurrency=16, overload_factor=5.0, overload_seconds=60.0),
        Scenario("d", "instant model", "latency 0, server concurrency 1024: the pipeline's own ceiling",
                 latency="0", concurrency=1024, records=30_000),
        Scenario("e", "embeddings batched", "embeddings, latency 20 ms + 0.2 ms per input, server concurrency "
                 "unlimited; llmstream with batches of up to 128 (capacity 1,024) and without batching (capacity 128)",
                 latency="fixed:20", per_input_ms=0.2, concurrency=0, records=60_000, api="embeddings",
                 batch_size=128, capacity=1024),
        # The per-key cost (issue 22): (b)'s heavy tail with keyed input, ordered against unordered.
        Scenario("f", "heavy tail, 1,000 keys", "as (b), the input's keys cycling through 1,000 keys; "
                 "llmstream unordered and with ordering: per_key",
                 latency="lognormal:200:2000", concurrency=64, records=5000, keys=1000),
        Scenario("g", "heavy tail, 10 hot keys", "as (b), the input's keys cycling through 10 keys; "
                 "llmstream unordered and with ordering: per_key",
                 latency="lognormal:200:2000", concurrency=64, records=5000, keys=10),
        # A model fleet (issue 21): three endpoints with limits 4:2:1 (fixed 100 ms, slots 16:8:4).
        Scenario("h", "fleet 4:2:1", "three simulated endpoints, fixed 100 ms, server concurrency 16, 8 and 4 "
                 "(limits 160, 80 and 40/s): llmstream with model.endpoints, each endpoint's share of the answers",
                 latency="fixed:100", concurrency=28, records=10_000, fleet=(16, 8, 4)),
        # The same fleet with a heavy tail: answers do not all come back in the same instant as with
        # a fixed latency, whose synchronized bursts the one call loop turns around one by one.
        Scenario("i", "fleet 4:2:1, heavy tail", "as (h) with lognormal latency, median 100 ms, p99 1 s "
                 "(limits ~98, 49 and 25/s)",
                 latency="lognormal:100:1000", concurrency=28, records=10_000, fleet=(16, 8, 4)),
    )
}

SMOKE_SCENARIO = "a"
SMOKE_RECORDS = 100
