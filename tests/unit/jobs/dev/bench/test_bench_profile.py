"""The record-path profile's arithmetic (`jobs/dev/bench/profile.py`), without a JVM: which stage
a stack belongs to, the collapsed-stack format, CPU per record per stage and the flame graph."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import psutil

from jobs.dev.bench.profile import (
    JVM_STAGES,
    OTHER,
    PYTHON_STAGES,
    ProcessProfile,
    ProfileResult,
    classify,
    flame_svg,
    jdk_tool,
    parse_collapsed,
)

BEAM = "process_bundle (apache_beam/runners/worker/sdk_worker.py:651)"
ELEMENT = "process_element (udfs/lanes/keyed.py:167)"


def test_a_stack_belongs_to_the_first_stage_any_of_its_frames_names() -> None:
    json_in_decode = (BEAM, ELEMENT, "decode (udfs/records/decode.py:80)", "loads (json/__init__.py:346)")
    assert classify(json_in_decode, PYTHON_STAGES) == "decode (JSON/Avro in, request)"
    socket_in_client = ("run_forever (asyncio/base_events.py:608)", "complete (udfs/inference/client.py:120)",
                        "_request (aiohttp/client.py:500)", "write (asyncio/selector_events.py:1000)")
    assert classify(socket_in_client, PYTHON_STAGES) == "client (HTTP, retries, limits)"
    assert classify((BEAM, ELEMENT, "submit (udfs/lanes/inflight.py:80)"), PYTHON_STAGES) == "stage (admission, timers, emit)"
    assert classify((BEAM, "decode_from_stream (pyflink/fn_execution/coder_impl_fast.py:1)"),
                    PYTHON_STAGES) == "Beam crossing (gRPC, coders)"
    assert classify(("<module> (x.py:1)",), PYTHON_STAGES) == OTHER
    fetch = ("java.lang.Thread.run", "org.apache.kafka.clients.consumer.internals.FetchCollector.collectFetch")
    assert classify(fetch, JVM_STAGES) == "Kafka source (fetch, records)"


def test_collapsed_stacks_are_read_and_per_record_cpu_splits_by_share() -> None:
    stacks = parse_collapsed(f"{BEAM};{ELEMENT};decode (udfs/records/decode.py:80) 30\n{BEAM} 70\nnot a line\n")
    assert stacks == Counter({(BEAM, ELEMENT, "decode (udfs/records/decode.py:80)"): 30, (BEAM,): 70})
    proc = ProcessProfile("python 1", cpu_s=2.0, stacks=stacks, rules=PYTHON_STAGES)
    per = proc.per_record_us(records=1000)  # 2 CPU-s over 1,000 records: 2,000 µs, split 30/70
    assert per == {"Beam crossing (gRPC, coders)": 1400.0, "decode (JSON/Avro in, request)": 600.0}
    table = ProfileResult("d-llmstream", 10.0, 1000, [proc], {"python flame graph": "p.svg"}).table()
    assert "| python 1 | decode (JSON/Avro in, request) | 30.0% | 600 |" in table
    assert "| **all** | | | **2000** |" in table


def test_the_flame_graph_has_a_box_per_frame_with_its_samples() -> None:
    svg = flame_svg(Counter({("a", "b"): 3, ("a", "c"): 1}), "t")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert "<title>a (4 samples, 100.0%)</title>" in svg
    assert "<title>b (3 samples, 75.0%)</title>" in svg and "<title>c (1 samples, 25.0%)</title>" in svg


def test_jdk_tools_come_from_beside_the_profiled_jvm(tmp_path: Path) -> None:
    """A JDK's jcmd attaches to its own version's JVMs: the profiler takes the one beside the target
    process's executable, and the PATH's only when there is none there."""
    jdk_bin = tmp_path / "jdk" / "bin"
    jdk_bin.mkdir(parents=True)
    java = jdk_bin / "java"
    shutil.copy2(shutil.which("sleep") or "/bin/sleep", java)  # a real process whose executable is "java"
    (jdk_bin / "jcmd").write_text("")
    process = subprocess.Popen([str(java), "30"])
    try:
        target = psutil.Process(process.pid)
        assert jdk_tool(target, "jcmd") == str(jdk_bin / "jcmd")
        assert jdk_tool(target, "sh") == shutil.which("sh")
    finally:
        process.kill()
        process.wait()
