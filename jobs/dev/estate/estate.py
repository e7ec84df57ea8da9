"""`Estate`: the hosts, their services and the faults, started and stopped as one.

The estate's machines (`HOSTS`): a JobManager host, two TaskManager hosts (2 slots each), three
broker hosts (one KRaft node each, replication 3, min ISR 2), a model-server host and an ``objects``
host running s3proxy (`jobs/dev/object_store.py`): the daemons load Flink's S3 file system and
carry the store's endpoint and key pair, so a job's ``checkpointing.directory`` may be
``s3://llmstream/…`` there. Their state
lives under ``var/estate/`` (git-ignored): ``kafka/``, ``flink/<host>/`` (conf, logs, pids), the
shared ``flink/checkpoints`` and ``flink/savepoints`` every host reads (a shared file system's part),
``model/``, ``objects/`` (the store's buckets).

Faults, as a Python API (tests) and as ``llmstream estate fault`` (a person):

- `partition` / `heal` two hosts or groups (``tm1`` from ``kafka1,kafka2,kafka3``), `isolate` /
  `rejoin` one host, each also `partitioned` / `isolated` for a while (a context manager);
- `kill_host` (every process on it, SIGKILL) and `restart_host` (its services again);
- `kill_leader` of a topic partition: the broker host leading it killed;
- a slow or stalled link to the model: `model_proxy` (toxiproxy on the model host, which a job
  reaches instead of the model server when its config says so).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from jobs.clients.flink_rest import FlinkRest
from jobs.dev.estate.network import EstateError, Host, Network
from jobs.dev.estate.services import (
    MODEL_PORT,
    EstateKafka,
    FlinkDaemon,
    FlinkLayout,
    ModelServer,
    prepare_flink,
)
from jobs.dev.estate.toxiproxy import Toxiproxy
from jobs.dev.object_store import (
    DEFAULT_BUCKET,
    DEFAULT_PORT,
    ObjectStore,
    ObjectStoreConfig,
)
from jobs.runtime import jars

log = logging.getLogger("llmstream.estate")

__all__ = ["HOSTS", "MODEL_ARGS", "Estate", "default_work_dir"]

HOSTS: tuple[Host, ...] = (
    Host("jm", "10.77.0.10"),
    Host("tm1", "10.77.0.11"),
    Host("tm2", "10.77.0.12"),
    Host("kafka1", "10.77.0.21"),
    Host("kafka2", "10.77.0.22"),
    Host("kafka3", "10.77.0.23"),
    Host("model", "10.77.0.30"),
    Host("objects", "10.77.0.40"),
)
MODEL_ARGS = ["--latency", "fixed:40", "--seed", "7"]
"""The simulator's settings: ~40 ms a call, as the fault tests' (tests/support/job_setup.py)."""
FLINK_SETTINGS: dict[str, Any] = {"taskmanager.slot.timeout": "60 s"}
"""Changed from flink-conf/ for the estate: on two loaded cores a JobManager took over 10 s (the
default) from allocating a slot to deploying into it, the TaskManager freed the slot as inactive
and the job restarted once before it had read anything; the fault table would count that restart."""


def default_work_dir() -> Path:
    return jars.repo_root() / "var" / "estate"


class Estate:
    """Start, stop, inspect and fault the estate whose files are in ``work_dir``."""

    def __init__(self, work_dir: Path | None = None, *, model_args: Sequence[str] = MODEL_ARGS,
                 flink_settings: dict[str, Any] | None = None) -> None:
        self.work_dir = Path(work_dir or default_work_dir()).resolve()
        self.network = Network(HOSTS)
        host = self.network.host
        self.objects = ObjectStore(ObjectStoreConfig(host=host("objects").address, data_dir=self.work_dir / "objects",
                                                     launcher=tuple(host("objects").exec_prefix())))
        """s3proxy on the objects host: the S3 a job's state goes to with ``s3://`` + `state_bucket`."""
        flink_settings = {**FLINK_SETTINGS, **self.objects.flink_settings(), **(flink_settings or {})}
        aws = self.objects.credentials_env()
        self.kafka = EstateKafka([host("kafka1"), host("kafka2"), host("kafka3")], self.work_dir / "kafka")
        self.layout = FlinkLayout(host("jm"), self.work_dir / "flink")
        self.jobmanager = FlinkDaemon(host("jm"), "jobmanager", self.layout, flink_settings, aws)
        self.taskmanagers = {name: FlinkDaemon(host(name), "taskmanager", self.layout, flink_settings, aws)
                             for name in ("tm1", "tm2")}
        self.model = ModelServer(host("model"), self.work_dir, list(model_args))
        self.model_proxy = Toxiproxy(host("model"), self.work_dir, "model", f"{host('model').address}:{MODEL_PORT}")
        """A slow link to the model: started by the scenarios that use it (`jobs/dev/estate/toxiproxy.py`)."""
        self.objects_proxy = Toxiproxy(host("objects"), self.work_dir, "objects",
                                       f"{host('objects').address}:{DEFAULT_PORT}")
        """A slow link to the object store, in use after `route_objects` ``(through_proxy=True)``."""
        self.objects_through_proxy = bool(self.jobmanager.pids()) and \
            self.jobmanager.configured("s3.endpoint") == f"http://{self.objects_proxy.listen}"
        """What the running daemons were started with (another process may have routed them)."""
        for daemon in (self.jobmanager, *self.taskmanagers.values()):
            daemon.settings.update(self.objects_settings())
        self.rest = FlinkRest(self.layout.rest_url)

    # ------------------------------------------------------------------ facts
    @property
    def bootstrap_servers(self) -> str:
        return self.kafka.bootstrap_servers

    @property
    def jobmanager_address(self) -> str:
        """``HOST:PORT`` for ``llmstream submit --jobmanager``."""
        return self.layout.address

    state_bucket = DEFAULT_BUCKET
    """The bucket on the objects host (made at start)."""

    @property
    def objects_endpoint(self) -> str:
        """Where the daemons and ``llmstream submit`` reach the object store now (`route_objects`)."""
        return f"http://{self.objects_proxy.listen}" if self.objects_through_proxy else self.objects.endpoint

    def objects_settings(self) -> dict[str, str]:
        """The ``s3.*`` keys of the daemons and of a job's ``flink:`` section, for `objects_endpoint`."""
        return {**self.objects.flink_settings(), "s3.endpoint": self.objects_endpoint}

    def route_objects(self, *, through_proxy: bool, timeout: float = 240.0) -> None:
        """Send the cluster's S3 traffic through toxiproxy on the objects host (a link that can be
        slowed) or straight to s3proxy. Flink's S3 file system takes ``s3.endpoint`` when a daemon
        starts, so a change restarts the JobManager and the TaskManagers (no job may be running)."""
        if through_proxy:
            self.objects_proxy.start()
        if through_proxy == self.objects_through_proxy:
            return
        self.objects_through_proxy = through_proxy
        for daemon in (*self.taskmanagers.values(), self.jobmanager):
            daemon.stop()
            daemon.settings.update(self.objects_settings())
        self.start(timeout)

    @property
    def state_root(self) -> Path:
        """Where jobs on the estate keep their state: a directory every host sees."""
        return self.layout.work_dir / "state"

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 240.0) -> None:
        """Network, brokers, model server, JobManager, TaskManagers; what already runs is kept."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(5.0, deadline - time.monotonic())

        self.network.up()
        self.network.heal_all()
        prepare_flink(self.layout)
        self.kafka.start(timeout=left())
        self.model.start(timeout=min(60.0, left()))
        self.objects.config.data_dir.mkdir(parents=True, exist_ok=True)
        self.objects.start(timeout=min(90.0, left()))
        if self.objects_through_proxy:
            self.objects_proxy.start()
        self.jobmanager.start()
        self.rest._wait("the JobManager's REST API", self.rest.overview, left())
        for tm in self.taskmanagers.values():
            tm.start()
        self.wait_for_taskmanagers(len(self.taskmanagers), left())

    def stop(self) -> None:
        """Every service, then the namespaces and the bridge."""
        for daemon in (*self.taskmanagers.values(), self.jobmanager):
            with contextlib.suppress(Exception):
                daemon.stop()
        with contextlib.suppress(Exception):
            self.model_proxy.stop()
        with contextlib.suppress(Exception):
            self.model.stop()
        with contextlib.suppress(Exception):
            self.objects_proxy.stop()
        with contextlib.suppress(Exception):
            self.objects.stop()
        with contextlib.suppress(Exception):
            self.kafka.stop()
        self.network.down()

    def taskmanager_addresses(self) -> list[str]:
        """Host addresses of the TaskManagers registered with slots."""
        listed = self.rest.rest("/taskmanagers").get("taskmanagers", [])
        return [str(tm.get("path", "")).split("@")[-1].split(":")[0] for tm in listed
                if int(tm.get("slotsNumber") or 0) > 0]

    def wait_for_taskmanagers(self, count: int, timeout: float) -> None:
        self.rest._wait(f"{count} TaskManagers with slots",
                        lambda: len(self.rest.rest("/taskmanagers").get("taskmanagers", [])) >= count, timeout)

    def status(self) -> dict[str, Any]:
        present = self.network.present()
        overview = self.rest.overview() if present.get("jm") else None
        return {
            "hosts": {name: {"address": host.address, "up": present[name], "processes": len(self.network.pids(host))
                             if present[name] else 0,
                             "link": present[name] and self.network.link_up(host)}
                      for name, host in self.network.hosts.items()},
            "partitions": self.network.partitions() if all(present.values()) else [],
            "kafka": {"bootstrap": self.bootstrap_servers,
                      "ready": [node.pid() is not None for node in self.kafka.nodes]},
            "flink": {"rest": self.layout.rest_url, "taskmanagers": overview.get("taskmanagers") if overview else None,
                      "jobs_running": overview.get("jobs-running") if overview else None},
            "model": {"url": self.model.url, "healthy": present.get("model", False) and self.model.healthy(1.0)},
            "objects": {"endpoint": self.objects_endpoint, "running": self.objects.pid() is not None},
        }

    # ------------------------------------------------------------------ faults
    def _hosts(self, names: str | Iterable[str]) -> list[Host]:
        return [self.network.host(n) for n in ([names] if isinstance(names, str) else names)]

    def partition(self, a: str | Iterable[str], b: str | Iterable[str]) -> None:
        """Every host of ``a`` stops hearing every host of ``b`` (and back)."""
        for x in self._hosts(a):
            for y in self._hosts(b):
                self.network.partition(x, y)

    def heal(self, a: str | Iterable[str], b: str | Iterable[str]) -> None:
        for x in self._hosts(a):
            for y in self._hosts(b):
                self.network.heal(x, y)

    @contextlib.contextmanager
    def partitioned(self, a: str | Iterable[str], b: str | Iterable[str]) -> Iterator[None]:
        self.partition(a, b)
        try:
            yield
        finally:
            self.heal(a, b)

    def isolate(self, name: str) -> None:
        self.network.isolate(self.network.host(name))

    def rejoin(self, name: str) -> None:
        self.network.rejoin(self.network.host(name))

    @contextlib.contextmanager
    def isolated(self, name: str) -> Iterator[None]:
        self.isolate(name)
        try:
            yield
        finally:
            self.rejoin(name)

    def kill_host(self, name: str) -> list[int]:
        """SIGKILL every process on the host, as a power cut would; returns their pids."""
        host = self.network.host(name)
        pids = self.network.kill(host)
        log.info("estate: %s killed (%d processes)", name, len(pids))
        return pids

    def restart_host(self, name: str, timeout: float = 180.0) -> None:
        """Start the host's services again (after `kill_host`) and wait until they answer."""
        host = self.network.host(name)
        node = self.kafka.node_of(host)
        if node is not None:
            self.kafka.restart(node, timeout)
        elif name == "model":
            self.model.start(timeout=timeout)
        elif name == "objects":
            self.objects.start(timeout=timeout)
            if self.objects_through_proxy:
                self.objects_proxy.start(timeout=timeout)
        elif name == "jm":
            self.jobmanager.start()
            self.rest._wait("the JobManager's REST API", self.rest.overview, timeout)
        elif name in self.taskmanagers:
            before = {str(tm["id"]) for tm in self.rest.rest("/taskmanagers").get("taskmanagers", [])}
            self.taskmanagers[name].start()
            self.rest._wait(f"the TaskManager on {name} to register",
                            lambda: {str(tm["id"]) for tm in self.rest.rest("/taskmanagers").get("taskmanagers", [])}
                            - before, timeout)
        else:
            raise EstateError(f"no services known on {name}")

    def leader_host(self, topic: str, partition: int = 0) -> str:
        leader = self.kafka.leader(topic, partition)
        if leader < 1:
            raise EstateError(f"{topic}-{partition} has no leader now")
        return self.kafka.host_of(leader).name

    def kill_leader(self, topic: str, partition: int = 0) -> str:
        """Kill the broker host leading ``topic``-``partition``; returns its name."""
        name = self.leader_host(topic, partition)
        self.kill_host(name)
        return name

    def job_hosts(self, job_id: str) -> list[str]:
        """The TaskManager hosts running any subtask of the job."""
        known = {host.address: name for name, host in self.network.hosts.items()} | {
            name: name for name in self.network.hosts}  # Flink names a TaskManager by what its address resolves to
        found: set[str] = set()
        for vertex in self.rest.job(job_id).get("vertices", []):
            listed = self.rest.rest(f"/jobs/{job_id}/vertices/{vertex['id']}/taskmanagers")
            for tm in listed.get("taskmanagers", []):
                for value in (tm.get("endpoint"), tm.get("host"), tm.get("taskmanager-id")):
                    where = str(value or "").split(":")[0]
                    if where in known:
                        found.add(known[where])
        if not found:
            raise EstateError(f"no TaskManager host of the estate runs job {job_id}")
        return sorted(found)
