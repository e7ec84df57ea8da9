"""Your own Python around the model (`model.preprocess`, `output.postprocess`,
udfs/lanes/user_functions.py): through the real keyed stage on the fake PyFlink runtime
(tests/support/fake_flink.py) against the simulator over HTTP, plus the launch's loading and shipping.

What a user sees is asserted: the output records their functions make, and for bad user code a
`user_function_error` dead letter naming the function and what happened, never a raise.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.dev.simulator import ThreadedSimulator
from jobs.launch.plan import user_modules
from tests.support.fake_flink import Harness
from udfs.config import JobConfig, config_from_dict
from udfs.errors import ConfigError

EXAMPLE_DIR = Path(__file__).resolve().parents[4] / "jobs" / "examples" / "user_functions"

# One module of user functions, good and bad, written where the test's config points `python.path`.
MODULE = '''
import time


def preprocess(record):
    kind = record.get("kind")
    if kind == "skip":
        return None
    if kind == "raise":
        raise KeyError("subject")
    if kind == "int":
        return 42
    if kind == "both":
        return {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    if kind == "extra":
        return {"prompt": "a", "temperature": 0.2}
    if kind == "bad-messages":
        return [{"role": "robot", "content": "x"}]
    if kind == "surrogate":
        return "Ask \\ud800"
    if kind == "slow":
        time.sleep(30)
    if kind == "messages":
        return [{"role": "user", "content": "Ask " + record["text"]}]
    return {"id": "ticket-" + str(record["n"]), "prompt": "Ask " + record["text"], "params": {"max_tokens": 5}}


def postprocess(record, result):
    kind = record.get("kind")
    if kind == "post-raise":
        raise ValueError("no label in " + result["output"][:20])
    if kind == "post-list":
        return ["not", "a", "dict"]
    if kind == "post-none":
        return None
    if kind == "post-set":
        return {"n": record["n"], "tags": {1, 2}}
    if kind == "post-surrogate":
        return {"n": record["n"], "answer": "\\ud800"}
    if result is None:
        return {"n": record.get("n"), "skipped": True}
    return {"n": record["n"], "answer": result["output"], "id": result["id"], "tokens": result["usage"]["total_tokens"]}
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """`usermod.py` in a directory of its own, importable as the launch makes it (`python.path`)."""
    directory = tmp_path / "code"
    directory.mkdir()
    (directory / "usermod.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(directory))
    sys.modules.pop("usermod", None)
    yield directory
    sys.modules.pop("usermod", None)


def _config(endpoint: str, *, model: dict[str, Any] | None = None, output: dict[str, Any] | None = None,
            deadline_s: float = 20.0) -> JobConfig:
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": endpoint, "model": "sim", "max_tokens": 8, **(model or {})},
        "output": output or {},
        "async": {"capacity": 8, "request_timeout_s": min(5.0, deadline_s), "record_deadline_s": deadline_s},
        "retry": {"max_attempts": 2, "initial_backoff_s": 0.001, "max_backoff_s": 0.005},
    })


def _run(config: JobConfig, records: list[dict[str, Any]], harnesses: list[Harness]) -> Harness:
    h = Harness(config)
    harnesses.append(h)
    for i, value in enumerate(records):
        h.element(i % 4, json.dumps(value).encode(), offset=i, key=f"k{i}".encode())
    h.end_of_input()
    return h


BOTH = {"model": {"preprocess": "usermod:preprocess"}, "output": {"postprocess": "usermod:postprocess"}}


def test_the_functions_make_the_call_and_the_output_record(user_module: Path, sim: ThreadedSimulator,
                                                           harnesses: list[Harness]) -> None:
    h = _run(_config(sim.url, **BOTH), [{"n": i, "text": f"question {i}"} for i in range(6)], harnesses)
    out = sorted(h.bodies("out"), key=lambda b: b["n"])
    assert [b["n"] for b in out] == list(range(6)) and h.bodies("dlq") == []
    assert set(out[0]) == {"n", "answer", "id", "tokens"}  # the user's record, not llmstream's envelope
    assert out[3]["answer"].startswith("Simulated answer to: Ask question 3")
    assert out[3]["id"] == "ticket-3"  # the id the preprocess gave
    assert [bytes(r[0]) for r in h.out if r[2] == "out"] and all(bytes(r[0]).startswith(b"k") for r in h.out)


def test_preprocess_alone_keeps_the_record_contract_result(user_module: Path, sim: ThreadedSimulator,
                                                           harnesses: list[Harness]) -> None:
    h = _run(_config(sim.url, model={"preprocess": "usermod:preprocess"}),
             [{"n": 1, "text": "hello"}, {"kind": "messages", "text": "by chat"}], harnesses)
    out = {b["id"]: b for b in h.bodies("out")}
    assert set(out) == {"ticket-1", "k1"}  # no id from the function: the Kafka key
    assert out["ticket-1"]["output"].startswith("Simulated answer to: Ask hello")
    assert out["k1"]["output"].startswith("Simulated answer to: Ask by chat")
    assert out["ticket-1"]["source"]["offset"] == 0


@pytest.mark.parametrize(("skipped", "postprocess", "expected"), [
    ("drop", False, None),
    ("forward", False, {"kind": "skip", "n": 9}),
    ("forward", True, {"n": 9, "skipped": True}),
])
def test_a_record_the_preprocess_skips_is_dropped_or_forwarded(
        user_module: Path, sim: ThreadedSimulator, harnesses: list[Harness],
        skipped: str, postprocess: bool, expected: dict[str, Any] | None) -> None:
    config = _config(sim.url, model={"preprocess": "usermod:preprocess", "skipped": skipped},
                     output={"postprocess": "usermod:postprocess"} if postprocess else None)
    h = _run(config, [{"kind": "skip", "n": 9}, {"n": 1, "text": "x"}], harnesses)
    skipped_out = [b for b in h.bodies("out") if b.get("n") == 9 or b.get("kind") == "skip"]
    assert skipped_out == ([] if expected is None else [expected])
    assert len(h.bodies("out")) == (1 if expected is None else 2) and h.bodies("dlq") == []
    assert sim.stats()["requests_total"] == 1  # the skipped record cost no call
    assert h.metric("dropped") == (1 if expected is None else 0)
    assert h.state.snapshot() == {}


BAD_CODE = [
    ("raise", "model.preprocess usermod:preprocess raised KeyError: 'subject'"),
    ("int", "model.preprocess usermod:preprocess returned a int; expected a prompt (str), chat messages (list)"),
    ("both", "model.preprocess usermod:preprocess returned a dict without exactly one of 'prompt' and 'messages'"),
    ("extra", "model.preprocess usermod:preprocess returned a dict with 'temperature'; expected only id, messages"),
    ("bad-messages", "model.preprocess usermod:preprocess returned messages[0].role must be one of"),
    ("surrogate", "model.preprocess usermod:preprocess returned a string with a lone surrogate (\\ud800-\\udfff)"),
    ("post-raise", "output.postprocess usermod:postprocess raised ValueError: no label in Simulated answer"),
    ("post-list", "output.postprocess usermod:postprocess returned a list; expected a dict (the output value) or None"),
    ("post-set", "output.postprocess usermod:postprocess returned a dict the output format (json) cannot write"),
    ("post-surrogate", "output.postprocess usermod:postprocess returned a dict the output format (json) cannot write"),
]


def test_bad_user_code_is_a_dead_letter_naming_the_function(user_module: Path, sim: ThreadedSimulator,
                                                            harnesses: list[Harness]) -> None:
    records = [{"kind": kind, "n": i, "text": "t"} for i, (kind, _) in enumerate(BAD_CODE)]
    h = _run(_config(sim.url, **BOTH), [*records, {"kind": "post-none", "n": 99, "text": "t"},
                                        {"n": 100, "text": "fine"}], harnesses)
    letters = {json.loads(letter["original"]["value"])["kind"]: letter for letter in h.bodies("dlq")}
    assert set(letters) == {kind for kind, _ in BAD_CODE}
    for kind, words in BAD_CODE:
        letter = letters[kind]
        assert letter["reason"] == "user_function_error", letter
        assert words in letter["error"], (kind, letter["error"])
        assert "Traceback" not in letter["error"]
    assert letters["post-raise"]["attempts"] == 1 and letters["raise"]["attempts"] == 0
    assert [b["n"] for b in h.bodies("out")] == [100]  # post-none wrote nothing, the good one its record
    assert h.metric("dead_lettered") == len(BAD_CODE) and h.metric("dropped") == 1
    assert h.state.snapshot() == {}


def test_a_function_past_the_record_deadline_is_given_up_and_the_rest_go_on(
        user_module: Path, sim: ThreadedSimulator, harnesses: list[Harness]) -> None:
    config = _config(sim.url, deadline_s=1.0, **BOTH)
    h = _run(config, [{"kind": "slow", "n": 0}, *({"n": i, "text": "q"} for i in range(1, 9))], harnesses)
    letters = h.bodies("dlq")
    assert [letter["reason"] for letter in letters] == ["user_function_error"]
    assert "model.preprocess usermod:preprocess did not return within async.record_deadline_s (1 s)" \
        in letters[0]["error"]
    assert sorted(b["n"] for b in h.bodies("out")) == list(range(1, 9))


def test_the_example_module_triages_a_ticket(sim: ThreadedSimulator, harnesses: list[Harness],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """jobs/examples/user_functions/triage.py, the module docs/user-functions.md builds."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    config = _config(sim.url, model={"preprocess": "triage:build_request"}, output={"postprocess": "triage:to_output"})
    tickets = [{"ticket_id": 7, "tier": "pro", "status": "open", "subject": "Charged twice", "body": "Card ..."},
               {"ticket_id": 8, "status": "closed", "subject": "Thanks", "body": "All good"}]
    h = _run(config, tickets, harnesses)
    assert h.bodies("out") == [{"ticket_id": 7, "label": "other", "confidence": 0.0}]  # the simulator echoes
    assert h.bodies("dlq") == [] and sim.stats()["requests_total"] == 1


# ---------------------------------------------------------------------- the launch: load and ship


def _named(directory: Path, **model: Any) -> JobConfig:
    return config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "m", **model},
        "python": {"path": [str(directory)]},
    })


@pytest.fixture
def clean_modules() -> Iterator[None]:
    before = set(sys.modules)
    path = list(sys.path)
    yield
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)
    sys.path[:] = path


@pytest.mark.usefixtures("clean_modules")
def test_the_launch_finds_the_module_on_python_path_and_ships_its_package(tmp_path: Path) -> None:
    package = tmp_path / "mycode" / "teampkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "triage.py").write_text("def build(record):\n    return 'x'\n")
    assert user_modules(_named(tmp_path / "mycode", preprocess="teampkg.triage:build")) == (str(package),)
    single = tmp_path / "single"
    single.mkdir()
    (single / "onefile.py").write_text("def build(record):\n    return 'x'\n")
    assert user_modules(_named(single, preprocess="onefile:build")) == (str(single / "onefile.py"),)


@pytest.mark.usefixtures("clean_modules")
def test_an_installed_module_is_not_shipped(tmp_path: Path) -> None:
    assert user_modules(_named(tmp_path, preprocess="json:dumps")) == ()


@pytest.mark.parametrize(("source", "ref", "words"), [
    (None, "nosuchmodule:build", "no module named 'nosuchmodule'"),
    ("def other(record):\n    return 'x'\n", "brokenmod:build", "module 'brokenmod' has no 'build'"),
    ("build = 3\n", "brokenmod:build", "brokenmod:build is a int, not a function"),
    ("import nosuchdependency\n", "brokenmod:build", "importing 'brokenmod' failed: ModuleNotFoundError"),
    ("raise RuntimeError('needs TRIAGE_URL')\n", "brokenmod:build", "importing 'brokenmod' raised RuntimeError: needs"),
])
@pytest.mark.usefixtures("clean_modules")
def test_a_function_that_cannot_be_loaded_is_one_line_naming_the_key(tmp_path: Path, source: str | None,
                                                                      ref: str, words: str) -> None:
    if source is not None:
        (tmp_path / "brokenmod.py").write_text(source)
    with pytest.raises(ConfigError) as info:
        user_modules(_named(tmp_path, preprocess=ref))
    assert info.value.key == "model.preprocess" and words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("sections", "key"), [
    ({"model": {"preprocess": "not a reference"}}, "model.preprocess"),
    ({"output": {"postprocess": "mod.only"}}, "output.postprocess"),
    ({"output": {"schema": {"type": "record", "name": "R", "fields": []}}}, "output.schema"),
    ({"output": {"postprocess": "m:f", "format": "avro"},
      "schema_registry": {"url": "http://127.0.0.1:9"}}, "output.schema"),
    ({"output": {"postprocess": "m:f", "schema": {"type": "string"}}}, "output.schema"),
    ({"output": {"postprocess": "m:f", "schema": {"type": "record", "name": "R", "fields": [{"name": "x"}]}}},
     "output.schema"),
    ({"model": {"skipped": "keep"}}, "model.skipped"),
])
def test_what_the_config_refuses_names_the_key(sections: dict[str, Any], key: str) -> None:
    base: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"},
    }
    for name, section in sections.items():
        base[name] = {**base.get(name, {}), **section}
    with pytest.raises(ConfigError) as info:
        config_from_dict(base)
    assert info.value.key == key and "\n" not in str(info.value)


def test_an_avro_output_schema_with_a_postprocess_loads_from_a_file(tmp_path: Path) -> None:
    schema = {"type": "record", "name": "Label", "fields": [{"name": "ticket_id", "type": "long"},
                                                            {"name": "label", "type": "string"}]}
    path = tmp_path / "label.avsc"
    path.write_text(json.dumps(schema))
    config = config_from_dict({
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "input_topic": "in", "output_topic": "out",
                  "dead_letter_topic": "dlq", "group_id": "g", "transactional_id_prefix": "t"},
        "model": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"},
        "output": {"format": "avro", "postprocess": "m:f", "schema": str(path)},
        "schema_registry": {"url": "http://127.0.0.1:9"},
    })
    assert config.output.schema == schema
