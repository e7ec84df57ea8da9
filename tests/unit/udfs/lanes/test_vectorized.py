"""The vectorized lane's pieces that need no JVM: what its config refuses at load, and how it reads
the columns of an Arrow batch (pandas values) back into the records both lanes work on."""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd
import pytest
import yaml

from udfs.config import DEFAULT_CONFIG, config_from_dict
from udfs.errors import ConfigError
from udfs.lanes.vectorized import VectorizedInference


def _vectorized(**overrides: Any) -> dict[str, Any]:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.pop("lane", None)  # the default config's own key: these tests spell the lane the old way
    data["stage"] = "vectorized"
    for key, value in overrides.items():
        data[key] = {**(data.get(key) or {}), **value} if isinstance(value, dict) else value
    return data


def test_the_vectorized_lane_loads_with_its_batch_size() -> None:
    config = config_from_dict(_vectorized(vectorized={"batch_size": 500}))
    assert config.lane == "vectorized" and config.vectorized.batch_size == 500
    assert config_from_dict(yaml.safe_load(DEFAULT_CONFIG.read_text())).lane == "keyed"


@pytest.mark.parametrize(("overrides", "key"), [
    ({"ordering": "per_key"}, "ordering"),
    ({"budget": {"max_tokens_per_hour": 1000}}, "budget"),
    ({"python": {"bundle_target_ms": 250}}, "python.bundle_target_ms"),
    ({"parallelism": {"default": 1, "inference": 2}}, "parallelism.inference"),
])
def test_what_the_vectorized_lane_does_not_do_is_one_line_naming_the_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_vectorized(**overrides))
    assert info.value.key == key and "\n" not in str(info.value)


def test_auto_chooses_the_vectorized_lane_for_embeddings_and_the_keyed_stage_for_chat() -> None:
    embeddings = config_from_dict(_vectorized(stage="auto", model={"api": "embeddings"}))
    assert embeddings.stage == "auto" and embeddings.lane == "vectorized"
    assert embeddings.lane_choice()[1] == "stage: auto, vectorized: model.api is embeddings"
    for api in ("chat", "completions"):
        chosen = config_from_dict(_vectorized(stage="auto", model={"api": api}))
        assert chosen.lane_choice() == ("keyed", f"stage: auto, keyed: model.api is {api}")
    assert config_from_dict(_vectorized(stage="vectorized")).lane_choice() == ("vectorized", "stage: vectorized")


@pytest.mark.parametrize(("overrides", "key"), [
    ({"ordering": "per_key"}, "ordering"),
    ({"budget": {"max_tokens_per_hour": 1000}}, "budget"),
    ({"python": {"bundle_target_ms": 250}}, "python.bundle_target_ms"),
    ({"parallelism": {"default": 1, "inference": 2}}, "parallelism.inference"),
])
def test_auto_keeps_the_keyed_stage_for_what_only_it_does_instead_of_refusing(overrides: dict[str, Any],
                                                                              key: str) -> None:
    config = config_from_dict(_vectorized(stage="auto", model={"api": "embeddings"}, **overrides))
    assert config.lane_choice() == ("keyed", f"stage: auto, keyed: {key} needs it")


def test_the_old_batch_mode_chooses_the_provider_batch_lane_over_an_old_auto_stage() -> None:
    config = config_from_dict(_vectorized(stage="auto", model={"api": "embeddings", "mode": "batch"}))
    assert config.lane_choice() == ("provider-batch", "model.mode: batch")
    with pytest.raises(ConfigError) as info:  # as written, the lanes still refuse each other
        config_from_dict(_vectorized(model={"api": "embeddings", "mode": "batch"}))
    assert info.value.key == "stage"


def test_an_unknown_stage_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_vectorized(stage="batched"))
    assert info.value.key == "stage"
    with pytest.raises(ConfigError) as info:
        config_from_dict(_vectorized(stage=None, lane="batched"))
    assert info.value.key == "lane"


def test_a_batch_reads_back_into_records() -> None:
    ts = pd.Series([pd.Timestamp(1_700_000_000_123, unit="ms", tz="UTC"), pd.NaT])
    records = VectorizedInference.records(
        pd.Series([b"k1", None], dtype=object), pd.Series([b'{"id": "a"}', None], dtype=object),
        pd.Series(["in", "in"]), pd.Series([0, 1], dtype="int32"), pd.Series([5, 6], dtype="int64"), ts,
        pd.Series([[("traceparent", b"00-1")], None], dtype=object))
    assert [(r.key, r.value, r.partition, r.offset, r.timestamp_ms, r.headers) for r in records] == [
        (b"k1", b'{"id": "a"}', 0, 5, 1_700_000_000_123, (("traceparent", b"00-1"),)),
        (None, None, 1, 6, None, None),
    ]


def test_the_bench_runs_the_vectorized_lane_as_an_approach_of_its_own(tmp_path: Any) -> None:
    from jobs.dev.bench.harness import (
        ALL_APPROACHES,
        LlmstreamSettings,
        Topics,
        llmstream_config,
    )
    from jobs.dev.bench.scenarios import SCENARIOS, VECTORIZED

    scenario = SCENARIOS["d"]
    assert VECTORIZED in ALL_APPROACHES and VECTORIZED in scenario.approaches(["llmstream", VECTORIZED])
    data = llmstream_config(Topics("i", "o", "d", "g"), "127.0.0.1:9", "http://127.0.0.1:9/v1",
                            LlmstreamSettings.recommended(scenario, 1), scenario, tmp_path, vectorized=True)
    config = config_from_dict(data)
    assert config.lane == "vectorized" and config.vectorized.batch_size == 1000
    tuned = llmstream_config(Topics("i", "o", "d", "g"), "127.0.0.1:9", "http://127.0.0.1:9/v1",
                             dataclasses.replace(LlmstreamSettings.recommended(scenario, 1), vectorized_batch_size=5000),
                             scenario, tmp_path, vectorized=True)
    assert config_from_dict(tuned).vectorized.batch_size == 5000


def test_the_library_call_refuses_the_vectorized_lane_however_it_was_chosen() -> None:
    from jobs.library import infer

    for stage in ("vectorized", "auto"):
        config = config_from_dict(_vectorized(stage=stage, model={"api": "embeddings"}))
        with pytest.raises(ConfigError) as info:
            infer(None, config)  # type: ignore[arg-type]  # refused before the stream is looked at
        assert info.value.key == "stage" and "infer() runs the keyed stage" in str(info.value)


def test_a_batchs_calls_keep_to_capacity_and_a_call_that_fails_or_outlives_the_batch_is_a_dead_letter() -> None:
    """`_batch` runs a batch's calls by `async.capacity` workers: never more at once, every other
    call answered in its row when one raises (a bug) or never ends (past the batch's guard)."""
    import asyncio

    from udfs.lanes.base import LaneParts
    from udfs.lanes.record_path import Settled
    from udfs.metrics import InferenceMetrics
    from udfs.records import PendingRecord, Request

    config = config_from_dict(_vectorized(**{"async": {"capacity": 3}}))
    function = VectorizedInference(config)
    running: list[int] = []
    peak = 0

    class Path:
        batches = False  # a call at a time, as with user functions: the workers are what is tested

        async def call(self, request: Request, record: PendingRecord) -> Any:
            nonlocal peak
            running.append(1)
            peak = max(peak, len(running))
            try:
                if request.id == "boom":
                    raise RuntimeError("a bug")
                if request.id == "hang":
                    await asyncio.Event().wait()  # never set
                await asyncio.sleep(0)
                return Settled(f"answer {request.id}")  # type: ignore[arg-type]  # a row stands in
            finally:
                running.pop()

        def dead_letter(self, err: Any, record: PendingRecord, request_id: str | None = None) -> Any:
            return Settled(f"dead {request_id}: {err.reason}", err.reason)  # type: ignore[arg-type]

    function._path = Path()  # type: ignore[assignment]
    function._metrics = InferenceMetrics(None)
    function._parts = LaneParts(config, function._metrics, None, None, function._path, None)  # type: ignore[arg-type]
    ids = [f"r{i}" for i in range(10)] + ["boom", "hang"] + [f"s{i}" for i in range(5)]
    calls = []
    for i, rid in enumerate(ids):
        record = PendingRecord(None, b"{}", "in", 0, i)
        calls.append((i, Request(id=rid, key=None, source=record.source), record))
    answers = asyncio.run(function._batch(calls, timeout_s=2.0))
    assert [a.row for a in answers] == [
        f"dead {rid}: internal_error" if rid in ("boom", "hang") else f"answer {rid}" for rid in ids]
    assert [a.dead_letter_reason for a in answers].count("internal_error") == 2
    assert peak == 3 and function._metrics.admitted == 0


@pytest.mark.parametrize("ending", ["hangs", "raises"])
def test_a_whole_batch_that_hangs_or_raises_keeps_its_answers_and_dead_letters_the_rest(ending: str) -> None:
    """Without user functions `_batch` hands the batch to `RecordPath.call_many` whole: what it
    answered before it hung past the guard or raised (a bug) is kept, each other row is an
    `internal_error` dead letter, and `admitted` is back to 0."""
    import asyncio

    from udfs.lanes.base import LaneParts
    from udfs.lanes.record_path import Settled
    from udfs.metrics import InferenceMetrics
    from udfs.records import PendingRecord, Request

    config = config_from_dict(_vectorized(**{"async": {"capacity": 3}}))
    function = VectorizedInference(config)

    class Path:
        batches = True

        async def call_many(self, calls: list[tuple[Request, PendingRecord]], into: list[Any]) -> None:
            for i, (request, _) in enumerate(calls[:4]):
                into[i] = Settled(f"answer {request.id}")  # type: ignore[arg-type]  # a row stands in
            if ending == "raises":
                raise RuntimeError("a bug")
            await asyncio.Event().wait()  # never set

        def dead_letter(self, err: Any, record: PendingRecord, request_id: str | None = None) -> Any:
            return Settled(f"dead {request_id}: {err.reason}", err.reason)  # type: ignore[arg-type]

    function._path = Path()  # type: ignore[assignment]
    function._metrics = InferenceMetrics(None)
    function._parts = LaneParts(config, function._metrics, None, None, function._path, None)  # type: ignore[arg-type]
    calls = []
    for i in range(7):
        record = PendingRecord(None, b"{}", "in", 0, i)
        calls.append((i, Request(id=f"r{i}", key=None, source=record.source), record))
    answers = asyncio.run(function._batch(calls, timeout_s=0.5))
    assert [a.row for a in answers] == [f"answer r{i}" for i in range(4)] + [
        f"dead r{i}: internal_error" for i in range(4, 7)]
    assert function._metrics.admitted == 0
