"""The launch sequence `llmstream run` and `submit` share (`jobs/launch/plan.py`): its order, what it
decides without touching the config, and where the local result cache goes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jobs.launch import plan as plan_mod
from jobs.launch.plan import RunOptions, job_build, prepare, result_cache_file
from jobs.state.snapshots import StateDir, default_state_dir
from udfs.config import JobConfig, load_config, with_overrides
from udfs.cost.cache import CACHE_FILE, LocalCache, open_cache
from udfs.errors import ConfigError
from udfs.metrics import InferenceMetrics


def _local_cache(tmp_path: Path, **cache: object) -> JobConfig:
    return with_overrides(load_config(), cache={"backend": "local", **cache},
                          checkpointing={"directory": str(tmp_path / "state")})


def test_the_cache_file_is_in_the_state_directory_unless_the_config_names_one(tmp_path: Path) -> None:
    config = _local_cache(tmp_path)
    assert result_cache_file(config, StateDir.for_job(config)) == str((tmp_path / "state" / CACHE_FILE).resolve())
    given = tmp_path / "elsewhere"
    assert result_cache_file(config, StateDir(given)) == str(given.resolve() / CACHE_FILE)
    assert result_cache_file(_local_cache(tmp_path, path="rel/cache.sqlite"), StateDir(given)) == "rel/cache.sqlite"
    assert result_cache_file(with_overrides(config, cache={"backend": "none"}), StateDir(given)) is None


def test_a_state_directory_elsewhere_keeps_the_cache_on_this_machine(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    config = _local_cache(tmp_path)
    remote = StateDir("s3://bucket/state")
    assert result_cache_file(config, remote) == str((tmp_path / "state" / CACHE_FILE).resolve())
    monkeypatch.setenv("LLMSTREAM_HOME", str(tmp_path / "home"))
    remote_only = with_overrides(config, checkpointing={"directory": "s3://bucket/state"})
    expected = default_state_dir(config.name) / CACHE_FILE
    assert expected.is_relative_to(tmp_path / "home")  # the one default rule, LLMSTREAM_HOME honoured
    assert result_cache_file(remote_only, StateDir.for_job(remote_only)) == str(expected)


def test_the_stage_opens_the_file_it_was_given_and_names_cache_path_without_one(tmp_path: Path) -> None:
    config = _local_cache(tmp_path)
    cache = open_cache(config, InferenceMetrics(), str(tmp_path / "given.sqlite"))
    assert cache is not None and isinstance(cache.inner, LocalCache)
    assert cache.inner.path == tmp_path / "given.sqlite"
    asyncio.run(cache.close())
    with pytest.raises(ConfigError, match=r"^cache\.path: "):
        open_cache(config, InferenceMetrics())
    named = open_cache(_local_cache(tmp_path, path=str(tmp_path / "named.sqlite")), InferenceMetrics())
    assert named is not None and isinstance(named.inner, LocalCache)
    assert named.inner.path == tmp_path / "named.sqlite"
    asyncio.run(named.close())


class _Site:
    def __init__(self, calls: list[str], *, unreachable: bool = False) -> None:
        self.calls = calls
        self.unreachable = unreachable

    def reach(self) -> None:
        self.calls.append("reach")
        if self.unreachable:
            raise ConfigError("--jobmanager", "nothing answers")

    def claim(self, state: StateDir) -> None:
        self.calls.append(f"claim {state.path is not None and state.path.is_dir()}")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The broker, jar and gate steps recorded instead of done."""
    made: list[str] = []
    monkeypatch.setattr(plan_mod.preflight, "check", lambda config: made.append("preflight"))
    monkeypatch.setattr(plan_mod.jars, "ensure", lambda name: made.append(f"jars {name}"))
    monkeypatch.setattr(plan_mod.jars, "connector_jar_urls", lambda: ["file:///connector.jar"])
    monkeypatch.setattr(plan_mod.gate, "ensure_for", lambda config: made.append("gate"))
    monkeypatch.setattr(plan_mod, "_end_offsets", lambda config: made.append("end offsets") or {})
    return made


def test_prepare_checks_in_order_and_leaves_the_config_alone(tmp_path: Path, calls: list[str]) -> None:
    config = _local_cache(tmp_path)
    said: list[str] = []
    plan = prepare(config, RunOptions(until_end=True), _Site(calls), report=said.append)
    assert calls == ["preflight", "reach", "jars connector", "gate", "claim True", "end offsets"]
    first_run = f"no snapshot in {tmp_path / 'state'} yet: first run, starting from the consumer group's offsets"
    assert said == [f"llmstream: {first_run}"]
    assert (tmp_path / "state" / "job.json").is_file()  # the identity record, written after the claim
    assert plan.build == job_build(config, plan.build.state, ["file:///connector.jar"])
    assert plan.build.cache_file == str((tmp_path / "state" / CACHE_FILE).resolve())
    assert config.cache.path is None
    assert (plan.restore, plan.leave_behind, plan.end_offsets) == (None, None, {})


def test_an_unreachable_site_stops_before_any_jar_or_state(tmp_path: Path, calls: list[str]) -> None:
    with pytest.raises(ConfigError, match="--jobmanager"):
        prepare(_local_cache(tmp_path), RunOptions(), _Site(calls, unreachable=True), report=print)
    assert calls == ["preflight", "reach"]
    assert not (tmp_path / "state" / "job.json").exists()


def test_a_state_directory_that_is_a_file_is_named_before_the_broker_is_asked(tmp_path: Path,
                                                                              calls: list[str]) -> None:
    (tmp_path / "state").write_text("not a directory\n")
    with pytest.raises(ConfigError, match=r"^checkpointing\.directory: "):
        prepare(_local_cache(tmp_path), RunOptions(), _Site(calls), report=print)
    assert calls == []


def test_prepare_says_which_lane_stage_auto_chose(tmp_path: Path, calls: list[str]) -> None:
    said: list[str] = []
    config = with_overrides(_local_cache(tmp_path), stage="auto", model={"api": "embeddings"})
    prepare(config, RunOptions(), _Site(calls), report=said.append)
    assert said[-1] == "llmstream: stage: auto, vectorized: model.api is embeddings"
    assert config.stage == "auto"  # chosen, not written back
