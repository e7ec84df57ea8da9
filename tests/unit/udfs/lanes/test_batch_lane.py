"""The provider-batch lane (`model.mode: batch`, udfs/lanes/provider_batch/lane.py) on the fake PyFlink runtime
(tests/support/fake_flink.py) against the simulator's batch APIs over loopback HTTP: every record
ends as one output or one dead letter with its reason, for each outcome a provider can give, and a
restore resumes the batches it knows instead of paying for them again.

What a user sees is asserted (the output and dead-letter records), and what they pay: the requests
submitted to the provider, counted at the simulator.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import requests

from jobs.dev.simulator import ThreadedSimulator
from jobs.dev.simulator.batch_config import BatchSettings
from tests.support.fake_flink import Harness, record
from tests.support.waiting import wait_until
from udfs.config import ConfigError, JobConfig, config_from_dict, to_dict
from udfs.lanes.provider_batch import lane as batch_lane
from udfs.lanes.provider_batch.lane import BATCHES, BatchStage

FAST = BatchSettings(validating_s=0.05, delay_s=(0.1, 0.4), finalizing_s=0.05)


def lane_config(endpoint: str, provider: str = "openai", retry_attempts: int = 3, **provider_batch: Any) -> JobConfig:
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": endpoint, "model": "sim", "max_tokens": 8, "mode": "batch", "provider": provider,
                  "prices": {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}},
        "provider_batch": {"max_requests": 40, "max_wait_s": 0.2, "poll_initial_s": 0.05, "poll_max_s": 0.2,
                           **provider_batch},
        "retry": {"max_attempts": retry_attempts, "initial_backoff_s": 0.001, "max_backoff_s": 0.005},
    })


def lane(config: JobConfig, harnesses: list[Harness], **named: Any) -> Harness:
    h = Harness(config, function=BatchStage(config), **named)
    harnesses.append(h)
    return h


def feed(h: Harness, ids: range, buckets: int = 2) -> None:
    for i in ids:
        h.element(i % buckets, record(i), offset=i, key=f"k{i}".encode())


def submitted(sim: ThreadedSimulator) -> int:
    return int(sim.stats()["batches"]["requests_submitted"])


def outcomes(h: Harness) -> tuple[Counter[str], dict[str, str]]:
    """Each id's count among the outputs, and each dead letter's reason by id."""
    out = Counter(b["id"] for b in h.bodies("out"))
    dead = {d["id"]: d["reason"] for d in h.bodies("dlq")}
    return out, dead


def admin(sim: ThreadedSimulator, path: str = "", body: dict[str, Any] | None = None) -> Any:
    url = sim.url.rsplit("/v1", 1)[0] + "/admin/batches" + path
    response = requests.post(url, json=body, timeout=10) if body is not None else requests.get(url, timeout=10)
    response.raise_for_status()
    return response.json()


REFUSED = {
    "stage": {"stage": "vectorized"},
    "ordering": {"ordering": "per_key"},
    "budget": {"budget": {"max_tokens_per_hour": 1000}},
    "model.provider": {"model": {"provider": "anthropic", "api": "embeddings"}},
    "model.response_format_mode": {"model": {"provider": "anthropic", "response_format": {"type": "object"}}},
    "provider_batch.on_expired": {"model": {"provider": "anthropic"}, "provider_batch": {"on_expired": "realtime"}},
    "provider_batch.on_cancelled": {"model": {"provider": "anthropic"},
                                    "provider_batch": {"on_cancelled": "realtime"}},
    "provider_batch.max_requests": {"provider_batch": {"max_requests": 50_001}},
}
"""What the lane does not do, each refused at load with one line naming its key."""


def _merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merged(out.get(key) or {}, value) if isinstance(value, dict) and key != "response_format" else value
    return out


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_what_the_lane_does_not_do_is_refused_at_load_naming_the_key(key: str) -> None:
    data = _merged(to_dict(lane_config("http://127.0.0.1:9/v1")), REFUSED[key])
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.key == key and "\n" not in str(info.value), str(info.value)


def test_the_combinations_the_lane_does_take_load() -> None:
    """Its neighbours that work: the result cache, embeddings one input a line, OpenAI's realtime
    fallback for expired and cancelled batches, Anthropic with batches made again."""
    base = to_dict(lane_config("http://127.0.0.1:9/v1"))
    for changes in ({"cache": {"backend": "local"}}, {"model": {"api": "embeddings"}},
                    {"model": {"response_format": {"type": "object"}}},
                    {"model": {"provider": "anthropic", "response_format": {"type": "object"},
                               "response_format_mode": "prompt"}},
                    {"model": {"api": "embeddings", "batch": {"max_size": 8}}},
                    {"provider_batch": {"on_expired": "realtime", "on_cancelled": "realtime"}},
                    {"model": {"endpoint": None, "endpoints": [{"url": "http://127.0.0.1:9/v1"},
                                                               {"url": "http://127.0.0.1:10/v1"}],
                               "fallback": {"endpoints": [{"url": "http://127.0.0.1:11/v1"}]}}},
                    {"model": {"provider": "anthropic"}, "provider_batch": {"on_cancelled": "resubmit"}}):
        assert config_from_dict(_merged(base, changes)).model.mode == "batch"


@pytest.fixture
def batch_sim(make_sim: Callable[..., ThreadedSimulator]) -> ThreadedSimulator:
    return make_sim(batch=FAST)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_every_record_is_answered_once_through_batches_at_the_batch_price(
        provider: str, batch_sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    h = lane(lane_config(batch_sim.url, provider), harnesses)
    feed(h, range(100))
    h.end_of_input()
    out, dead = outcomes(h)
    assert out == Counter({f"id-{i}": 1 for i in range(100)}) and dead == {}
    bodies = h.bodies("out")
    assert {b["lane"] for b in bodies} == {"batch"}
    assert bodies[0]["output"].startswith("Simulated answer to: question")
    full = (bodies[0]["usage"]["prompt_tokens"] * 1.0 + bodies[0]["usage"]["completion_tokens"] * 2.0) / 1000
    assert bodies[0]["cost"] == pytest.approx(full * 0.5)  # provider_batch.price_factor
    assert submitted(batch_sim) == 100  # requests paid for / records: 1.000
    assert h.metric("batch_requests") == 100
    assert all(not state.snapshot() for state in h.runtime.states())  # nothing left in state


def test_many_batches_made_at_once_are_each_made_once(batch_sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    """More batches of one bucket than the lane's provider calls at once (`OPERATIONS`): creations
    wait for slots while the answers of others are taken up, and each batch is made once."""
    h = lane(lane_config(batch_sim.url, max_requests=5, max_wait_s=60), harnesses)
    feed(h, range(160), buckets=1)
    h.end_of_input()
    out, dead = outcomes(h)
    assert out == Counter({f"id-{i}": 1 for i in range(160)}) and dead == {}
    assert submitted(batch_sim) == 160


def test_a_refused_request_goes_to_a_later_batch_then_to_a_dead_letter_with_the_providers_code(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    sim = make_sim(batch=BatchSettings(validating_s=0.05, delay_s=(0.1, 0.3), finalizing_s=0.05, error_rate=0.3,
                                       error_status=500))
    h = lane(lane_config(sim.url, retry_attempts=2), harnesses)
    feed(h, range(80))
    h.end_of_input()
    out, dead = outcomes(h)
    assert sum(out.values()) + len(dead) == 80 and max(out.values()) == 1 and not set(out) & set(dead)
    assert set(out) | set(dead) == {f"id-{i}" for i in range(80)}
    assert set(dead.values()) <= {"batch_request_failed"} and dead, "with 30% errors and 2 tries some fail twice"
    assert 80 < submitted(sim) < 160  # the refused ones once more, no one a third time
    letter = h.bodies("dlq")[0]
    assert letter["attempts"] == 2 and letter["last_status"] == 500


def test_a_wake_takes_up_one_slice_of_answers_and_leaves_the_rest_for_later(
        batch_sim: ThreadedSimulator, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint barrier waits for the Python bundle in progress, in which every element, tick
    and timer wakes the bucket: answers are taken up for a share of each window of time (here the
    least, one chunk a window), whatever has arrived, and the rest left for later wakes."""
    monkeypatch.setattr(batch_lane, "TAKE_UP_WINDOW_S", 0.05)
    monkeypatch.setattr(batch_lane, "TAKE_UP_SHARE_S", 1e-9)
    monkeypatch.setattr(batch_lane, "TAKE_UP_CHUNK", 10)
    # One provider batch of all 100 (made when the 100th arrives, however slowly they are fed), so
    # every wake but the last can find a whole chunk.
    h = lane(lane_config(batch_sim.url, max_requests=100, max_wait_s=600), harnesses)
    feed(h, range(100), buckets=1)
    per_wake: list[int] = []

    def wake() -> bool:
        before = len(h.out)
        h.tick(0)
        per_wake.append(len(h.out) - before)
        return len(h.bodies("out")) >= 100
    wait_until(wake, timeout=60, interval=0.01)
    assert Counter(b["id"] for b in h.bodies("out")) == Counter({f"id-{i}": 1 for i in range(100)})
    assert max(per_wake) == 10 and per_wake.count(10) == 10, per_wake


def _force(sim: ThreadedSimulator, action: dict[str, Any], *, when: Callable[[dict[str, Any]], bool]) -> threading.Thread:
    """In the background: the first batch `when` accepts gets `action` (POST /admin/batches/ID)."""
    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for batch in admin(sim).get("batches", []):
                if when(batch):
                    admin(sim, f"/{batch['id']}", action)
                    return
            time.sleep(0.02)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("policy", ["resubmit", "realtime"])
def test_an_expired_batch_keeps_its_answers_and_the_rest_go_again_or_are_called_now(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness], policy: str) -> None:
    sim = make_sim(batch=BatchSettings(validating_s=0.05, delay_s=(2.0, 2.0), finalizing_s=0.05))
    h = lane(lane_config(sim.url, on_expired=policy), harnesses)
    forced = _force(sim, {"action": "expire"}, when=lambda b: b.get("status") == "in_progress")
    feed(h, range(40))
    h.end_of_input()
    forced.join(5)
    out, dead = outcomes(h)
    assert out == Counter({f"id-{i}": 1 for i in range(40)}) and dead == {}
    lanes = Counter(b["lane"] for b in h.bodies("out"))
    if policy == "resubmit":
        assert submitted(sim) > 40  # the unanswered part of the expired batch went again
        assert max(b["attempts"] for b in h.bodies("out")) == 2 and set(lanes) == {"batch"}
    else:
        assert submitted(sim) == 40 and lanes["realtime"] > 0  # called one by one, at the full price
        assert sim.stats()["requests_total"] == lanes["realtime"]


@pytest.mark.parametrize(("action", "policy", "reason"), [
    ({"action": "cancel"}, {"on_cancelled": "dead-letter"}, "batch_cancelled"),
    ({"action": "fail", "line": 1, "message": "invalid model name"}, {}, "batch_failed"),
])
def test_a_cancelled_or_failed_batch_dead_letters_what_it_did_not_answer(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness],
        action: dict[str, Any], policy: dict[str, Any], reason: str) -> None:
    sim = make_sim(batch=BatchSettings(validating_s=0.5, delay_s=(2.0, 2.0), finalizing_s=0.05))
    h = lane(lane_config(sim.url, **policy), harnesses)
    forced = _force(sim, action, when=lambda b: b.get("status") in ("validating", "in_progress"))
    feed(h, range(30))
    h.end_of_input()
    forced.join(5)
    out, dead = outcomes(h)
    assert sum(out.values()) + len(dead) == 30 and set(out) | set(dead) == {f"id-{i}" for i in range(30)}
    assert dead and set(dead.values()) == {reason}
    assert submitted(sim) == 30
    if reason == "batch_failed":
        assert any("invalid model name" in d["error"] for d in h.bodies("dlq"))


def test_a_batch_the_provider_lost_is_made_again_once(make_sim: Callable[..., ThreadedSimulator],
                                                      harnesses: list[Harness]) -> None:
    sim = make_sim(batch=BatchSettings(validating_s=0.05, delay_s=(1.0, 1.0), finalizing_s=0.05))
    h = lane(lane_config(sim.url, max_requests=30, max_wait_s=60), harnesses)
    forced = _force(sim, {"action": "delete"}, when=lambda b: b.get("status") == "in_progress")
    feed(h, range(30), buckets=1)  # one batch of 30
    h.end_of_input()
    forced.join(5)
    out, dead = outcomes(h)
    assert out == Counter({f"id-{i}": 1 for i in range(30)}) and dead == {}
    assert submitted(sim) == 60  # the lost batch once more


def _created(h: Harness) -> bool:
    entries = [e for bucket in h.runtime.named[BATCHES.get_name()].data.values() for e in bucket.values()]
    return bool(entries) and all(e.provider_id is not None for e in entries)


def test_a_restore_polls_the_batches_it_knows_and_submits_nothing_again(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    sim = make_sim(batch=BatchSettings(validating_s=0.05, delay_s=(1.5, 1.5), finalizing_s=0.05))
    config = lane_config(sim.url)
    first = lane(config, harnesses)
    feed(first, range(60))

    def created() -> bool:
        for bucket in (0, 1):
            first.tick(bucket)
        return _created(first)
    wait_until(created, timeout=60, interval=0.05, message="the batches' ids in state")
    checkpoint = first.snapshot_named()
    first.close()  # the worker dies with its batches still running at the provider
    second = lane(config, harnesses, named=checkpoint)
    for bucket in (0, 1):
        second.tick(bucket)  # a restored instance takes its state up at its first element or tick
    second.end_of_input()
    out, dead = outcomes(second)
    assert out == Counter({f"id-{i}": 1 for i in range(60)}) and dead == {}
    assert submitted(sim) == 60


def test_a_batch_whose_creation_the_checkpoint_missed_is_found_not_made_again(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    """OpenAI: the batch's metadata names the lane's key, so a restore adopts it."""
    sim = make_sim(batch=BatchSettings(validating_s=0.05, delay_s=(1.0, 1.0), finalizing_s=0.05))
    config = lane_config(sim.url, max_requests=20, max_wait_s=60)
    first = lane(config, harnesses)
    feed(first, range(20), buckets=1)  # a full collection: sealed, its creation handed to the loop
    checkpoint = first.snapshot_named()  # taken before the creation's answer came back
    assert not _created(first)
    wait_until(lambda: submitted(sim) == 20, timeout=60, interval=0.05, message="the batch at the provider")
    first.close()
    second = lane(config, harnesses, named=checkpoint)
    for bucket in (0, 1):
        second.tick(bucket)  # a restored instance takes its state up at its first element or tick
    second.end_of_input()
    out, _ = outcomes(second)
    assert out == Counter({f"id-{i}": 1 for i in range(20)})
    assert submitted(sim) == 20


def fleet_config(sim_urls: list[str], *, weights: list[float] | None = None, fallback: list[str] | None = None,
                 circuit: dict[str, Any] | None = None, **provider_batch: Any) -> JobConfig:
    data = to_dict(lane_config(sim_urls[0], **provider_batch))
    data["model"]["endpoint"] = None
    data["model"]["endpoints"] = [{"url": url, "name": f"e{i}", "weight": (weights or [1.0] * len(sim_urls))[i]}
                                  for i, url in enumerate(sim_urls)]
    if fallback:
        data["model"]["fallback"] = {"endpoints": [{"url": url, "name": f"f{i}", "model": "sim-fallback"}
                                                   for i, url in enumerate(fallback)]}
    if circuit:
        data["model"]["circuit"] = circuit
    return config_from_dict(data)


def test_a_fleet_spreads_whole_batches_by_weight_and_reads_each_where_it_was_made(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    """Each batch is made whole at one endpoint, the fewest open batches per weight first (3:1
    here), and viewed and read there: every record answered once, nothing submitted twice."""
    sims = [make_sim(batch=FAST), make_sim(batch=FAST)]
    h = lane(fleet_config([s.url for s in sims], weights=[3.0, 1.0], max_requests=10, max_wait_s=60), harnesses)
    feed(h, range(160), buckets=1)  # 16 batches of 10, all sealed before the first is answered
    h.end_of_input()
    out, dead = outcomes(h)
    assert out == Counter({f"id-{i}": 1 for i in range(160)}) and dead == {}
    made = [submitted(s) for s in sims]
    assert sum(made) == 160 and made[0] > made[1] > 0, made
    assert {b["endpoint"].rsplit("/v1", 1)[0] for b in h.bodies("out")} == {s.url.rsplit("/v1", 1)[0] for s in sims}


def test_a_fleet_endpoint_whose_batch_api_fails_is_passed_over_by_its_circuit(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    """An endpoint that does not answer (nothing listens there) fails its creations until its circuit
    opens; the batches then go to the endpoint that answers, each made once."""
    sim = make_sim(batch=FAST)
    dead_url = "http://127.0.0.1:9/v1"
    config = fleet_config([dead_url, sim.url], max_requests=10, max_wait_s=60, poll_initial_s=0.01, poll_max_s=0.05,
                          circuit={"failures": 2, "cooldown_s": 600, "max_cooldown_s": 600})
    h = lane(config, harnesses)
    feed(h, range(60), buckets=1)
    h.end_of_input()
    out, dead = outcomes(h)
    assert out == Counter({f"id-{i}": 1 for i in range(60)}) and dead == {}
    assert submitted(sim) == 60


def test_the_fallback_group_makes_the_batches_once_every_primary_circuit_is_open(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    """With every primary down, batches go to the fallback endpoint, asking for its own model."""
    sim = make_sim(batch=FAST)
    config = fleet_config(["http://127.0.0.1:9/v1"], fallback=[sim.url], max_requests=10, max_wait_s=60,
                          poll_initial_s=0.01, poll_max_s=0.05,
                          circuit={"failures": 1, "cooldown_s": 600, "max_cooldown_s": 600})
    h = lane(config, harnesses)
    feed(h, range(30), buckets=1)
    h.end_of_input()
    out, dead = outcomes(h)
    assert out == Counter({f"id-{i}": 1 for i in range(30)}) and dead == {}
    assert submitted(sim) == 30
    assert {b["model"] for b in h.bodies("out")} == {"sim-fallback"}


def test_a_restore_reads_each_batch_at_the_fleet_endpoint_that_made_it(
        make_sim: Callable[..., ThreadedSimulator], harnesses: list[Harness]) -> None:
    sims = [make_sim(batch=BatchSettings(validating_s=0.05, delay_s=(1.5, 1.5), finalizing_s=0.05)) for _ in range(2)]
    config = fleet_config([s.url for s in sims], max_requests=10, max_wait_s=60)
    first = lane(config, harnesses)
    feed(first, range(40), buckets=1)

    def created() -> bool:
        first.tick(0)
        return _created(first)
    wait_until(created, timeout=60, interval=0.05, message="the batches' ids in state")
    entries = [e for bucket in first.runtime.named[BATCHES.get_name()].data.values() for e in bucket.values()]
    assert {e.endpoint for e in entries} == {"e0", "e1"}
    checkpoint = first.snapshot_named()
    first.close()
    second = lane(config, harnesses, named=checkpoint)
    second.tick(0)
    second.end_of_input()
    out, dead = outcomes(second)
    assert out == Counter({f"id-{i}": 1 for i in range(40)}) and dead == {}
    assert [submitted(s) for s in sims] == [20, 20]


def test_the_result_cache_answers_before_a_batch_and_is_filled_from_one(
        batch_sim: ThreadedSimulator, harnesses: list[Harness], tmp_path: Any) -> None:
    base = to_dict(lane_config(batch_sim.url))
    base["model"]["temperature"] = 0  # a deterministic request: the cache may answer it (cache.only_deterministic)
    config = config_from_dict({**base, "cache": {"backend": "local", "path": str(tmp_path / "cache.sqlite")}})
    first = lane(config, harnesses)
    feed(first, range(30))
    first.end_of_input()
    assert submitted(batch_sim) == 30
    again = lane(config, harnesses)
    feed(again, range(30))
    again.end_of_input()
    out, dead = outcomes(again)
    assert out == Counter({f"id-{i}": 1 for i in range(30)}) and dead == {}
    assert {b["cached"] for b in again.bodies("out")} == {True}
    assert submitted(batch_sim) == 30  # the repeat never reached the provider


def test_preflight_takes_a_fleet_while_one_endpoint_serves_the_batch_api(batch_sim: ThreadedSimulator) -> None:
    """At launch every endpoint that answers must serve the batch API; one that does not answer is
    left to its circuit, unless none answers: then one line naming `model.endpoints`."""
    from udfs.lanes.provider_batch import providers

    providers.preflight(fleet_config(["http://127.0.0.1:9/v1", batch_sim.url]), timeout_s=5)
    with pytest.raises(ConfigError) as info:
        providers.preflight(fleet_config(["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]), timeout_s=5)
    assert info.value.key == "model.endpoints" and "e0" in str(info.value) and "\n" not in str(info.value)


OLD_PATH_ENTRY = (
    "gASVtwAAAAAAAACMG3VkZnMucHJvdmlkZXJfYmF0Y2guZW50cmllc5SMCkJhdGNoRW50cnmUk5QpgZR9lCiMA2tleZSMBGtleTGUjAdoYW5k"
    "bGVzlIwCaDGUjAJoMpSGlIwJc2VhbGVkX21zlEsFjAtwcm92aWRlcl9pZJSMB2JhdGNoXzGUjApjcmVhdGVkX21zlEsGjAVwb2xsc5RLAowM"
    "bmV4dF9wb2xsX21zlEsHjAlyZXN1Ym1pdHOUSwB1Yi4=")
OLD_PATH_HELD = (
    "gASV5AAAAAAAAACMG3VkZnMucHJvdmlkZXJfYmF0Y2guZW50cmllc5SMBEhlbGSUk5QpgZR9lCiMBnJlY29yZJSMDHVkZnMucmVjb3Jkc5SM"
    "DVBlbmRpbmdSZWNvcmSUk5QpgZR9lCiMA2tleZRDAmsxlIwFdmFsdWWUQxp7ImlkIjoiaWQtMSIsInByb21wdCI6InEifZSMBXRvcGljlIwC"
    "aW6UjAlwYXJ0aXRpb26USwCMBm9mZnNldJRLAYwMdGltZXN0YW1wX21zlIoGAGjlz4sBjAdoZWFkZXJzlE51YowFdHJpZXOUSwF1Yi4=")
"""A `BatchEntry` and a `Held` as a savepoint of this lane from before `udfs/lanes/` holds them
(pickled under `udfs.provider_batch.entries`; the entry from before it named its fleet endpoint)."""


def test_state_pickled_under_the_lanes_old_module_path_still_loads() -> None:
    import base64
    import pickle

    from udfs.lanes.provider_batch.entries import BatchEntry, Held

    entry = pickle.loads(base64.b64decode(OLD_PATH_ENTRY))
    assert type(entry) is BatchEntry and entry.provider_id == "batch_1" and entry.handles == ("h1", "h2")
    assert entry.endpoint is None  # written before the fleet: read at the first endpoint
    held = pickle.loads(base64.b64decode(OLD_PATH_HELD))
    assert type(held) is Held and held.tries == 1 and held.record.offset == 1
