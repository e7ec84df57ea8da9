"""docker-compose.yml run for real on a Docker engine, with the image the repo's Dockerfile builds.

The image is built on a base made here (debootstrap + ``docker import``, jobs/dev/containers.py),
because no image registry is reachable; ``make test`` starts that build in the background, and
the fixture below waits for it (a file lock) instead of building twice.

One compose project (unique name, free host ports) serves the module, in file order, with two
TaskManagers and the job at parallelism 2 (``LLMSTREAM_PARALLELISM=2 up --scale taskmanager=2``):
500 records exactly once; the TaskManager running the most of the job killed mid-stream (the other
has room for all of it) and started again by compose, every id still exactly once; then ``down
-v`` leaves no container, volume or network behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests

from jobs.clients import kafka_admin
from jobs.dev import containers
from jobs.runtime import jars
from jobs.runtime.ports import free_port
from tests.support.committed import Tally, check_exactly_once, tally
from tests.support.job_setup import unique_records
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.containers]

ROOT = jars.repo_root()
TOPICS = ("llm-requests", "llm-results", "llm-dead-letter")
TASKMANAGERS = 2
_IP = re.compile(r"@([0-9.]+):")


def compose_command() -> list[str]:
    """Debian's ``docker-compose`` (1.29), else the ``docker compose`` plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


@dataclass
class ComposeProject:
    """One `docker compose` project of the repo's file, on its own name and host ports."""

    name: str
    env: dict[str, str]
    produced: list[str] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.env['LLMSTREAM_KAFKA_HOST_PORT']}"

    def compose(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run([*compose_command(), "-f", str(ROOT / "docker-compose.yml"), "-p", self.name, *args],
                              cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        assert proc.returncode == 0, f"compose {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def rest(self, path: str) -> Any:
        answer = requests.get(f"http://127.0.0.1:{self.env['LLMSTREAM_FLINK_REST_PORT']}{path}", timeout=10)
        answer.raise_for_status()
        return answer.json()

    def busiest_taskmanager(self) -> tuple[str, int]:
        """The TaskManager container with the most of the job's slots, and how many it runs."""
        by_ip = {}
        for cid in self.compose("ps", "-q", "taskmanager").split():
            ip = subprocess.run(["docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                                 cid], capture_output=True, text=True, timeout=30, check=True).stdout.strip()
            by_ip[ip] = cid
        busy = []
        for tm in self.rest("/taskmanagers")["taskmanagers"]:
            match = _IP.search(str(tm["path"]))
            if match and match.group(1) in by_ip:
                busy.append((int(tm["slotsNumber"]) - int(tm["freeSlots"]), by_ip[match.group(1)]))
        assert len(busy) == TASKMANAGERS, f"TaskManagers {self.rest('/taskmanagers')} vs containers {by_ip}"
        slots, cid = max(busy)
        return cid, slots

    def state(self, container: str) -> tuple[str, int]:
        out = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", container],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        return out[0], int(out[1])

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.name}"
        found = {}
        for kind, cmd in (("containers", ["docker", "ps", "-a", "-q"]), ("volumes", ["docker", "volume", "ls", "-q"]),
                          ("networks", ["docker", "network", "ls", "-q"])):
            found[kind] = subprocess.run([*cmd, "--filter", label], capture_output=True, text=True, timeout=30,
                                         check=True).stdout.split()
        return found

    def logs(self) -> str:
        try:
            return self.compose("logs", "--tail=40", timeout=120)[-6000:]
        except AssertionError as exc:
            return str(exc)


def produce(project: ComposeProject, n: int, prefix: str) -> list[str]:
    records = unique_records(n, prefix)
    assert kafka_admin.produce(project.bootstrap, TOPICS[0], records) == n
    ids = [key.decode() for key, _ in records]
    project.produced += ids
    return ids


def committed(project: ComposeProject) -> Tally:
    """What a read_committed consumer sees now in output ∪ dead letters, against every id produced."""
    out = kafka_admin.consume_committed(project.bootstrap, TOPICS[1], timeout_s=30)
    dead = kafka_admin.consume_committed(project.bootstrap, TOPICS[2], timeout_s=30)
    return tally(project.produced, [json.loads(r.value).get("id") for r in out], [json.loads(r.value) for r in dead])


def wait_for_all(project: ComposeProject, timeout: float = 300) -> Tally:
    """`committed` once nothing is lost, or as it stands at the timeout: the caller's exactly-once
    check then names the ids lost."""
    return wait_until(lambda: committed(project), timeout, interval=2, done=lambda result: result.lost == 0,
                      or_last=True)


@pytest.fixture(scope="module")
def llmstream_image() -> str:
    if not containers.docker_ready():
        message = "no Docker engine (make docker installs and starts one, as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return containers.ensure_image(log=True)


@pytest.fixture(scope="module")
def project(llmstream_image: str) -> Iterator[ComposeProject]:
    env = {**os.environ,
           "LLMSTREAM_PARALLELISM": str(TASKMANAGERS),
           "LLMSTREAM_KAFKA_HOST_PORT": str(free_port()),
           "LLMSTREAM_FLINK_REST_PORT": str(free_port()),
           "LLMSTREAM_BASE_IMAGE": containers.BASE_IMAGE}
    proj = ComposeProject(f"llmstream-test-{uuid.uuid4().hex[:8]}", env)
    try:
        proj.compose("up", "-d", "--scale", f"taskmanager={TASKMANAGERS}", timeout=900)
        submitter = proj.container("submitter")

        def exited() -> tuple[str, int] | None:
            state = proj.state(submitter)
            return state if state[0] == "exited" else None

        state = wait_until(exited, timeout=300, interval=2,
                           message=lambda: f"the submitter to exit (still {proj.state(submitter)[0]})\n{proj.logs()}")
        assert state[1] == 0, f"submitter exited {state[1]}\n{proj.logs()}"
        yield proj
    finally:
        proj.compose("down", "-v", "--remove-orphans", timeout=300)


def test_compose_up_500_records_exactly_once(project: ComposeProject) -> None:
    produce(project, 500, "compose")
    result = wait_for_all(project)
    check_exactly_once(result)
    assert result.out > 0, "the simulator answers: most records reach the output topic"
    running = [job["id"] for job in project.rest("/jobs")["jobs"] if job["status"] == "RUNNING"]
    assert len(running) == 1, project.rest("/jobs")
    vertices = project.rest(f"/jobs/{running[0]}")["vertices"]
    assert max(v["parallelism"] for v in vertices) == TASKMANAGERS, [(v["name"], v["parallelism"]) for v in vertices]
    assert len(project.rest("/taskmanagers")["taskmanagers"]) == TASKMANAGERS


@pytest.mark.fault
def test_taskmanager_killed_mid_stream_every_id_exactly_once(project: ComposeProject) -> None:
    before = len(project.produced)
    # 2,000: the simulator answers at most ~160/s (32 at a time, ~0.2 s each), so the batch spans
    # several 5 s checkpoints whatever the CPU; 500 were once all committed by the first (loaded machine).
    ids = produce(project, 2000, "killed")

    def some_new_visible() -> int | None:
        seen = committed(project)
        visible_new = len(project.produced) - seen.lost - before
        return visible_new if visible_new > 0 else None

    visible_new = wait_until(some_new_visible, timeout=240, interval=1,
                             message=lambda: f"output for the new records\n{project.logs()}")
    assert visible_new < len(ids), "the whole batch was committed before the kill: not mid-stream"
    taskmanager, slots = project.busiest_taskmanager()
    assert slots >= 1, "neither TaskManager runs a slot of the job"
    subprocess.run(["docker", "kill", taskmanager], capture_output=True, timeout=60, check=True)
    assert project.state(taskmanager)[0] == "exited"
    # `docker kill` is a manual stop to Docker, so the restart policy stays out of it: compose starts it.
    project.compose("start", "taskmanager")
    states = [project.state(cid)[0] for cid in project.compose("ps", "-q", "taskmanager").split()]
    assert states == ["running"] * TASKMANAGERS, states
    result = wait_for_all(project, timeout=420)
    check_exactly_once(result)


def test_compose_down_leaves_nothing(project: ComposeProject) -> None:
    project.compose("down", "-v", "--remove-orphans", timeout=300)
    assert project.leftovers() == {"containers": [], "volumes": [], "networks": []}
