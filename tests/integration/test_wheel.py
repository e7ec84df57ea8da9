"""The installed product is the job without the development tools: `pip install` of llmstream's
wheel into a venv of its own gives a `llmstream` that runs a job, while `jobs/dev/` (simulator,
bench, local services) is not in it and its commands say in one line where they live.

The venv is new and holds only the wheel; its third-party packages (apache-flink and the rest,
the same pins setup.py names) come from the test's own environment through a path file, so the
test does not download a few hundred MB of wheels. The checkout is never on its path: the command
runs from a temporary directory, and the test checks where `jobs` is imported from.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from jobs.clients.kafka_admin import consume_committed, produce
from tests.conftest import SHELL_ENV
from tests.support.job_setup import JobConfigFactory, write_config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _wheel_venv(tmp_path: Path) -> Path:
    """A new venv with llmstream's wheel installed (no dependencies); returns its bin directory."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO), "-w", str(wheels)],
                   check=True, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    (wheel,) = wheels.glob("llmstream-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    # Only the directory: the .pth files inside it (this checkout's editable install among them)
    # are not processed from a path-file entry, so the checkout stays off the venv's path.
    (purelib / "llmstream-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    return venv / "bin"


def test_the_wheel_runs_a_job_without_the_development_tools(job_config: JobConfigFactory, tmp_path: Path) -> None:
    bin_dir = _wheel_venv(tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    # The wheel carries no jars: like the image, it finds pom-free/ (manifest, fetched jars) under LLMSTREAM_HOME.
    env = {**SHELL_ENV, "LLMSTREAM_HOME": str(REPO)}
    env.pop("PYTHONPATH", None)

    probe = "import importlib.util, jobs; print(jobs.__file__); print(importlib.util.find_spec('jobs.dev'))"
    where = subprocess.run([str(bin_dir / "python"), "-c", probe],
                           check=True, capture_output=True, text=True, cwd=work, env=env)
    jobs_file, dev_spec = where.stdout.split()
    assert Path(jobs_file).is_relative_to(bin_dir.parent), jobs_file
    assert dev_spec == "None"

    demo = subprocess.run([str(bin_dir / "llmstream"), "demo"], check=False, capture_output=True, text=True, cwd=work,
                          env=env, timeout=120)
    assert demo.returncode == 2
    assert demo.stderr.strip().count("\n") == 0 and "source checkout" in demo.stderr, demo.stderr

    config = job_config()
    records = [(f"w-{i}".encode(), json.dumps({"id": f"w-{i}", "prompt": f"Question {i}?"}).encode())
               for i in range(100)]
    produce(config.kafka.bootstrap_servers, config.kafka.input_topic, records)
    path = write_config(config, tmp_path)
    done = subprocess.run([str(bin_dir / "llmstream"), "run", "--config", str(path), "--until-end"],
                          check=False, capture_output=True, text=True, cwd=work, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "job finished; committed 100/100 input records" in done.stdout
    out = consume_committed(config.kafka.bootstrap_servers, config.kafka.output_topic, expected=100, timeout_s=60)
    assert sorted(json.loads(m.value)["id"] for m in out) == sorted(f"w-{i}" for i in range(100))
