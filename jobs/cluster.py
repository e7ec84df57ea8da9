"""`llmstream cluster` and `llmstream submit`: a local standalone Flink cluster from the pip package.

The apache-flink wheel is a complete FLINK_HOME (``<site-packages>/pyflink``: ``bin/``,
``lib/``, ``opt/``), so no Flink distribution is downloaded. A cluster here is a work dir
(default ``<repo>/var/flink``, git-ignored) holding:

- ``conf/``: generated from the repo's ``flink-conf/`` at every start: the same files, with
  ``config.yaml`` overridden only in ports and paths (REST and RPC ports, checkpoint,
  savepoint and tmp dirs). So what the tests run is ``flink-conf/`` itself.
- ``lib/`` (``FLINK_LIB_DIR``): links to the package's ``lib/`` jars plus flink-python and the
  Kafka connector, so those load once per cluster, not in every job's classloader (`write_lib_dir`).
- ``log/`` (``FLINK_LOG_DIR``), ``pid/`` (``FLINK_PID_DIR``: the daemons' pid files; one per
  cluster, so stopping one cluster never touches another's processes), ``tmp/``,
  ``checkpoints/`` and ``savepoints/``.

Daemons are started with Flink's own ``jobmanager.sh start`` / ``taskmanager.sh start`` and
a cluster counts as up when its REST API answers and the TaskManagers have registered.
Jobs are submitted with ``bin/flink run -d -py jobs/inference_job.py`` after
``jobs.preflight.check``.

`LocalCluster` is the programmatic API (tests use it: kill a TaskManager, read restarts,
cancel, stop with a savepoint); `main` is ``llmstream cluster start|stop|status``; `submit`
is ``llmstream submit``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import yaml

from jobs import jars
from jobs.flink_rest import TERMINAL_STATES, ClusterError, FlinkRest
from jobs.local_kafka import free_port
from jobs.processes import cmdline, pid_alive
from jobs.state import StateDir, check_identity, resume_point

if TYPE_CHECKING:
    from jobs.pipeline import RunOptions
    from udfs.config import JobConfig

log = logging.getLogger("llmstream.cluster")

DEFAULT_REST_PORT = 8081
DEFAULT_RPC_PORT = 6123
IDENT = "llmstream"  # FLINK_IDENT_STRING: names pid and log files (instead of $USER, unset in containers)
JOB_SCRIPT = "jobs/inference_job.py"
_JOB_ID = re.compile(r"JobID\s+([0-9a-f]{32})")

__all__ = [
    "ClusterConfig",
    "ClusterError",
    "LocalCluster",
    "conf_source_dir",
    "default_work_dir",
    "flink_home",
    "main",
    "python_jar",
    "render_config",
    "run_job_script",
    "stop_job",
    "submit",
    "upgrade",
    "write_lib_dir",
]


def flink_home() -> Path:
    """The pip package's FLINK_HOME (``<site-packages>/pyflink``), found without importing PyFlink."""
    spec = importlib.util.find_spec("pyflink")
    if spec is None or not spec.submodule_search_locations:
        raise ClusterError("apache-flink is not installed in this Python (no 'pyflink' package)")
    home = Path(next(iter(spec.submodule_search_locations)))
    if not (home / "bin" / "flink").is_file():
        raise ClusterError(f"{home} has no bin/flink; is apache-flink installed completely?")
    return home


def python_jar() -> Path:
    """``opt/flink-python-*.jar``: the JVM side of PyFlink, which a stock Flink ``lib/`` lacks."""
    found = sorted((flink_home() / "opt").glob("flink-python-*.jar"))
    if not found:
        raise ClusterError(f"no flink-python jar in {flink_home() / 'opt'}")
    return found[-1]


def write_lib_dir(target: Path) -> Path:
    """A ``FLINK_LIB_DIR`` for the daemons: links to the package's ``lib/*.jar``, its
    ``opt/flink-python-*.jar`` and the pinned Kafka connector jar.

    flink-python: every PyFlink job needs it on the JobManager (to deserialize its Python
    operators) and the TaskManagers. ``flink run -py`` ships it per job in ``pipeline.jars``,
    but the llmstream job sets ``pipeline.jars`` itself (the connector), replacing that list.

    Both jars on the cluster's classpath, not per job: a job's user classloader is never
    freed here (measured: after 4 cancelled jobs and a full GC, 4 job classloaders still
    live), so whatever a job loads itself stays in metaspace. With flink-python per job a
    TaskManager died of ``OutOfMemoryError: Metaspace`` after ~7 jobs; with the connector per
    job metaspace still grew ~12 MB a job. Loaded from ``lib/`` (Flink's own advice for session
    clusters, and what the Flink Docker docs do for flink-python), nearly nothing is per job:
    the job's copy of the connector in ``pipeline.jars`` is shadowed, because
    ``org.apache.flink.*`` classes load parent-first. The pip package itself is left untouched.
    """
    home = flink_home()
    target.mkdir(parents=True, exist_ok=True)
    jars.ensure("connector")
    jars.ensure("metrics")
    # The Prometheus reporter (flink-conf/config.yaml) is loaded by the daemons at start, so from lib/.
    sources = [*sorted((home / "lib").glob("*.jar")), python_jar(), *jars.jars("connector"), *jars.jars("metrics")]
    wanted = {p.name: p for p in sources}
    for existing in target.iterdir():
        if existing.name not in wanted or not existing.exists() or existing.resolve() != wanted[existing.name]:
            existing.unlink()
    for name, source in wanted.items():
        link = target / name
        if not link.exists():
            link.symlink_to(source)
    return target


def conf_source_dir() -> Path:
    """The repo's ``flink-conf/``: the configuration every cluster here is generated from."""
    return jars.repo_root() / "flink-conf"


def default_work_dir() -> Path:
    return jars.repo_root() / "var" / "flink"


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten(value, name))
        else:
            out[name] = value
    return out


def render_config(source: Path, overrides: Mapping[str, Any]) -> str:
    """``source``'s config.yaml as flat keys with ``overrides`` applied, as YAML text."""
    data = yaml.safe_load((source / "config.yaml").read_text()) or {}
    settings = _flatten(data)
    settings.update(overrides)
    header = (
        f"# GENERATED by jobs/cluster.py from {source / 'config.yaml'} at every cluster start;\n"
        "# edit that file instead. Overridden here (ports and paths only):\n"
        + "".join(f"#   {k}\n" for k in overrides)
    )
    return header + yaml.safe_dump(settings, sort_keys=False, width=1 << 16, default_flow_style=False)


def _read_flat(conf_dir: Path) -> dict[str, Any]:
    try:
        return _flatten(yaml.safe_load((conf_dir / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError):
        return {}


@dataclass(frozen=True)
class ClusterConfig:
    """Where one local cluster lives and listens. ``settings`` are extra Flink overrides (tests)."""

    work_dir: Path = field(default_factory=default_work_dir)
    rest_port: int = DEFAULT_REST_PORT
    rpc_port: int = DEFAULT_RPC_PORT
    conf_source: Path = field(default_factory=conf_source_dir)
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "work_dir", Path(self.work_dir).expanduser().resolve())
        object.__setattr__(self, "conf_source", Path(self.conf_source).expanduser().resolve())

    @classmethod
    def ephemeral(cls, work_dir: Path, **kwargs: Any) -> ClusterConfig:
        """Free REST and RPC ports, for tests that must not collide with anything else."""
        rest = free_port()
        rpc = free_port()
        while rpc == rest:
            rpc = free_port()
        return cls(work_dir=work_dir, rest_port=rest, rpc_port=rpc, **kwargs)

    @classmethod
    def existing(cls, work_dir: Path | None = None) -> ClusterConfig:
        """The config of a cluster started earlier from ``work_dir`` (its ports from its generated conf)."""
        work = Path(work_dir) if work_dir is not None else default_work_dir()
        flat = _read_flat(work / "conf")
        return cls(work_dir=work, rest_port=int(flat.get("rest.port", DEFAULT_REST_PORT)),
                   rpc_port=int(flat.get("jobmanager.rpc.port", DEFAULT_RPC_PORT)))

    @property
    def checkpoint_dir(self) -> Path:
        return self.work_dir / "checkpoints"

    @property
    def savepoint_dir(self) -> Path:
        return self.work_dir / "savepoints"

    def overrides(self) -> dict[str, Any]:
        """Everything the generated config.yaml changes from ``flink-conf/``."""
        return {
            "rest.port": self.rest_port,
            "jobmanager.rpc.port": self.rpc_port,
            "execution.checkpointing.dir": self.checkpoint_dir.as_uri(),
            "execution.checkpointing.savepoint-dir": self.savepoint_dir.as_uri(),
            "io.tmp.dirs": str(self.work_dir / "tmp"),
            **self.settings,
        }


def _children(pid: int) -> list[int]:
    """All descendants of ``pid`` (the TaskManager's Python workers), via psutil."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


class LocalCluster(FlinkRest):
    """One standalone cluster: a JobManager and TaskManagers started from ``config.work_dir``."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        super().__init__(f"http://localhost:{self.config.rest_port}")
        self._orphans: list[int] = []

    def _diagnostics(self) -> str:
        return f"; JobManager log: {self.jobmanager_log()}\n{self.log_tail()}"

    # ------------------------------------------------------------------ layout
    @property
    def work_dir(self) -> Path:
        return self.config.work_dir

    @property
    def conf_dir(self) -> Path:
        return self.work_dir / "conf"

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "log"

    @property
    def lib_dir(self) -> Path:
        """``FLINK_LIB_DIR`` of the daemons: the package's lib/ plus flink-python (`write_lib_dir`)."""
        return self.work_dir / "lib"

    @property
    def pid_dir(self) -> Path:
        return self.work_dir / "pid"

    @property
    def address(self) -> str:
        """``host:port`` for ``flink run -m``."""
        return f"localhost:{self.config.rest_port}"

    def _pid_file(self, daemon: str) -> Path:
        return self.pid_dir / f"flink-{IDENT}-{daemon}.pid"

    def env(self) -> dict[str, str]:
        """Environment for Flink's bin scripts and CLI: this cluster's conf, log and pid dirs."""
        env = dict(os.environ)
        venv_bin = str(Path(sys.executable).parent)
        env.update(
            FLINK_HOME=str(flink_home()),
            FLINK_LIB_DIR=str(self.lib_dir),
            FLINK_CONF_DIR=str(self.conf_dir),
            FLINK_LOG_DIR=str(self.log_dir),
            FLINK_PID_DIR=str(self.pid_dir),
            FLINK_IDENT_STRING=IDENT,
            PATH=venv_bin + os.pathsep + env.get("PATH", ""),
        )
        return env

    def write_conf(self) -> None:
        """(Re)generate ``conf/`` from ``flink-conf/`` with this cluster's ports and paths."""
        source = self.config.conf_source
        if not (source / "config.yaml").is_file():
            raise ClusterError(f"{source}/config.yaml not found (set LLMSTREAM_HOME to the repo root)")
        tmp = self.work_dir / "conf.new"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        (tmp / "config.yaml").write_text(render_config(source, self.config.overrides()))
        shutil.rmtree(self.conf_dir, ignore_errors=True)
        tmp.rename(self.conf_dir)
        write_lib_dir(self.lib_dir)
        for sub in (self.log_dir, self.pid_dir, self.work_dir / "tmp",
                    self.config.checkpoint_dir, self.config.savepoint_dir):
            sub.mkdir(parents=True, exist_ok=True)

    def _script(self, name: str, *args: str, timeout: float = 60) -> str:
        script = flink_home() / "bin" / name
        proc = subprocess.run([str(script), *args], env=self.env(), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            raise ClusterError(f"{name} {' '.join(args)} failed ({proc.returncode}): {out[-2000:]}")
        log.debug("%s %s: %s", name, " ".join(args), out)
        return out

    # ------------------------------------------------------------------ processes
    def _pids(self, daemon: str) -> list[int]:
        try:
            lines = self._pid_file(daemon).read_text().split()
        except OSError:
            return []
        pids = []
        for line in lines:
            with contextlib.suppress(ValueError):
                pid = int(line)
                if pid_alive(pid) and str(self.conf_dir) in " ".join(cmdline(pid)):
                    pids.append(pid)
        return pids

    def jobmanager_pid(self) -> int | None:
        pids = self._pids("standalonesession")
        return pids[-1] if pids else None

    def taskmanager_pids(self) -> list[int]:
        """Live TaskManager JVMs of this cluster, oldest first."""
        return self._pids("taskexecutor")

    def python_worker_pids(self, taskmanager_pid: int | None = None) -> list[int]:
        """Processes started by the TaskManagers (PyFlink's Python workers)."""
        tms = [taskmanager_pid] if taskmanager_pid is not None else self.taskmanager_pids()
        return [c for tm in tms for c in _children(tm)]

    def _forget_pid(self, daemon: str, pid: int) -> None:
        path = self._pid_file(daemon)
        with contextlib.suppress(OSError):
            kept = [p for p in path.read_text().split() if p.strip() != str(pid)]
            path.write_text("".join(f"{p}\n" for p in kept))

    def is_running(self) -> bool:
        return self.jobmanager_pid() is not None and self.overview() is not None

    def _wait_taskmanagers(self, count: int, timeout: float) -> None:
        def enough() -> bool:
            ov = self.overview()
            return ov is not None and int(ov.get("taskmanagers", 0)) >= count

        self._wait(f"{count} registered TaskManager(s)", enough, timeout)

    def jobmanager_log(self) -> Path:
        found = sorted(self.log_dir.glob(f"flink-{IDENT}-standalonesession-*.log"))
        return found[-1] if found else self.log_dir / "(no jobmanager log)"

    def taskmanager_logs(self) -> list[Path]:
        return sorted(self.log_dir.glob(f"flink-{IDENT}-taskexecutor-*.log"))

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.jobmanager_log().read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ lifecycle
    def start(self, taskmanagers: int = 1, timeout: float = 120.0) -> None:
        """Start the JobManager and ``taskmanagers`` TaskManagers, or top up a running cluster to that many."""
        if self.jobmanager_pid() is not None:
            self._wait("the REST API", self.overview, timeout)
            missing = taskmanagers - len(self.taskmanager_pids())
            for _ in range(max(0, missing)):
                self.add_taskmanager(timeout=timeout)
            return
        from jobs.local_kafka import _port_in_use

        for port in (self.config.rest_port, self.config.rpc_port):
            if _port_in_use(port):
                raise ClusterError(f"port {port} on localhost is already in use; pick another (--port / --rpc-port)")
        self.write_conf()
        try:
            self._script("jobmanager.sh", "start")
            self._wait("the REST API", self.overview, timeout)
            for _ in range(taskmanagers):
                self._script("taskmanager.sh", "start")
            self._wait_taskmanagers(taskmanagers, timeout)
        except BaseException:
            self.stop()
            raise

    def taskmanager_ids(self) -> set[str]:
        """Resource ids of the TaskManagers registered with the JobManager (``/taskmanagers``)."""
        return {str(tm["id"]) for tm in self.rest("/taskmanagers").get("taskmanagers", [])}

    def add_taskmanager(self, timeout: float = 120.0) -> int:
        """Start one more TaskManager and wait until it registers; returns its pid.

        Waits for a new resource id rather than a count: right after a crash the dead
        TaskManager is still counted until its heartbeat times out.
        """
        before_pids = set(self.taskmanager_pids())
        before_ids = self.taskmanager_ids()
        self._script("taskmanager.sh", "start")
        self._wait("a new TaskManager to register", lambda: self.taskmanager_ids() - before_ids, timeout)
        new = [p for p in self.taskmanager_pids() if p not in before_pids]
        return new[-1] if new else self.taskmanager_pids()[-1]

    def kill_taskmanager(self, sig: int = signal.SIGKILL, pid: int | None = None) -> int:
        """Signal a TaskManager JVM (the newest by default), as a crash would; returns its pid.

        Only the JVM is signalled, so its Python workers lose their connection and exit on their
        own; `reap_orphans` (and `stop`) kills any that do not.
        """
        pids = self.taskmanager_pids()
        if not pids:
            raise ClusterError("no TaskManager is running")
        target = pid if pid is not None else pids[-1]
        self._orphans.extend(_children(target))
        os.kill(target, sig)
        deadline = time.monotonic() + 10
        while pid_alive(target) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._forget_pid("taskexecutor", target)
        return target

    def reap_orphans(self, grace_s: float = 0.0) -> list[int]:
        """Kill Python workers of killed TaskManagers still alive after ``grace_s``; returns their pids."""
        deadline = time.monotonic() + grace_s
        while any(pid_alive(w) for w in self._orphans) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [w for w in self._orphans if pid_alive(w)]
        for worker in survivors:
            log.warning("python worker %d outlived its TaskManager; killing it", worker)
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        self._orphans.clear()
        return survivors

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every daemon of this cluster (SIGKILL after ``timeout``), Python workers included."""
        daemons = [(d, p) for d in ("taskexecutor", "standalonesession") for p in self._pids(d)]
        everything = [p for _, p in daemons] + [c for _, p in daemons for c in _children(p)]
        for _, pid in daemons:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(pid_alive(p) for p in everything) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in (p for p in everything if pid_alive(p)):
            log.warning("pid %d did not stop within %g s; killing it", pid, timeout)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for daemon in ("taskexecutor", "standalonesession"):
            self._pid_file(daemon).unlink(missing_ok=True)
        self.reap_orphans()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs
    def submit(self, config_path: str | os.PathLike[str], *, savepoint: str | None = None,
               state_dir: str | None = None, timeout: float = 180.0) -> str:
        """``flink run -d`` the llmstream job with ``config_path``; returns the job id (no preflight,
        no automatic resume: ``savepoint`` is what it restores)."""
        return run_job_script(config_path, self.address, env=self.env(), savepoint=savepoint,
                              state_dir=state_dir, timeout=timeout)


def run_job_script(config_path: str | os.PathLike[str], address: str, *, env: Mapping[str, str],
                   savepoint: str | None = None, state_dir: str | None = None, timeout: float = 180.0) -> str:
    """Runs ``bin/flink run -d ... -py jobs/inference_job.py --config FILE``; returns the job id.

    ``-pyexec``/``-pyclientexec`` are this interpreter, so the client and the Python workers
    use the same venv; the job ships ``udfs/`` and the connector jar itself. The cluster must
    have flink-python on its classpath (`write_lib_dir`; the docker-compose image does too),
    because the job's own ``pipeline.jars`` replaces the list ``flink run -py`` would ship it in.
    ``savepoint`` (``-s``) resumes from a savepoint or a retained checkpoint; ``state_dir`` is
    where the job keeps its checkpoints and savepoints (default: from the job config).
    """
    config = Path(config_path).expanduser().resolve()
    cmd = [str(flink_home() / "bin" / "flink"), "run", "-d", "-m", address,
           "-pyexec", sys.executable, "-pyclientexec", sys.executable]
    if savepoint:
        cmd += ["-s", savepoint]
    cmd += ["-py", str(jars.repo_root() / JOB_SCRIPT), "--config", str(config)]
    if state_dir:
        cmd += ["--state-dir", state_dir]
    log.info("submitting: %s", " ".join(cmd))
    proc = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=str(jars.repo_root()), check=False)
    output = proc.stdout + proc.stderr
    match = _JOB_ID.search(output)
    if proc.returncode != 0 or match is None:
        raise ClusterError(f"flink run failed (exit {proc.returncode}):\n{output[-4000:]}")
    return match.group(1)


def _target(jobmanager: str | None) -> tuple[str, dict[str, str], FlinkRest]:
    """(``flink run -m`` address, environment for Flink's CLI, REST client) of the cluster to use."""
    local = LocalCluster(ClusterConfig.existing())
    if not jobmanager:
        if not local.is_running():
            raise ClusterError(f"no local Flink cluster answers at {local.rest_url}; start one with "
                               "`llmstream cluster start` or pass --jobmanager HOST:PORT")
        return local.address, local.env(), local
    env = dict(os.environ)
    conf_dir = local.conf_dir if local.conf_dir.is_dir() else conf_source_dir()
    log_dir = default_work_dir() / "log"
    log_dir.mkdir(parents=True, exist_ok=True)
    env.update(FLINK_HOME=str(flink_home()), FLINK_CONF_DIR=str(conf_dir), FLINK_LOG_DIR=str(log_dir))
    return jobmanager, env, FlinkRest(f"http://{jobmanager}")


def _load(config_path: str | None) -> tuple[Path, JobConfig]:
    from udfs.config import DEFAULT_CONFIG, load_config

    path = Path(config_path) if config_path else DEFAULT_CONFIG
    return path, load_config(path)


def _live_job(rest: FlinkRest, config: JobConfig) -> str:
    live = rest.live_jobs(config.name)
    if not live:
        raise ClusterError(f"no running job called {config.name!r} at {rest.rest_url}")
    return str(live[0]["jid"])


def submit(config_path: str | None, jobmanager: str | None = None, options: RunOptions | None = None) -> int:
    """``llmstream submit``: preflight, then submit to ``jobmanager`` (HOST:PORT; default the local
    cluster), resuming from the newest snapshot in the job's state directory (`jobs/state.py`).

    Refuses while a job of the same name is live: two jobs committing the same state and
    transactional ids would duplicate output. With ``until_end`` it then waits until the group
    has committed the records present at submission and stops the job with a draining
    savepoint. Returns 0, or 1 if the cluster refused. A `ConfigError` propagates (exit 2).
    """
    from jobs import preflight
    from jobs.pipeline import RunOptions

    options = options or RunOptions()
    path, config = _load(config_path)
    preflight.check(config)
    jars.ensure("connector")
    try:
        address, env, rest = _target(jobmanager)
        live = rest.live_jobs(config.name)
        if live:
            raise ClusterError(f"job {config.name!r} is already {live[0]['state']} as {live[0]['jid']}; "
                               "use `llmstream upgrade` to change it or `llmstream stop` first")
        state = StateDir.for_job(config, options.state_dir)
        check_identity(state, config, fresh=options.fresh)
        restore, how = resume_point(state, fresh=options.fresh, explicit=options.from_savepoint)
        print(f"llmstream: {how}")
        targets = _end_offsets(config) if options.until_end else None
        job_id = run_job_script(path, address, env=env, savepoint=restore, state_dir=state.location)
        print(f"llmstream: submitted job {config.name} as {job_id}")
        print(f"llmstream: web UI {rest.rest_url}/#/job/running/{job_id}/overview")
        if targets is not None:
            return _finish_backfill(rest, job_id, config, state, targets)
        return 0
    except ClusterError as err:
        print(f"llmstream: {err}", file=sys.stderr)
        return 1


def _end_offsets(config: JobConfig) -> dict[int, int]:
    from jobs.run import GroupProgress

    with contextlib.closing(GroupProgress(config)) as progress:
        return progress.end_offsets()


def _finish_backfill(rest: FlinkRest, job_id: str, config: JobConfig, state: StateDir,
                     targets: dict[int, int], poll_s: float = 1.0) -> int:
    """Waits until the group has committed ``targets``, then stops the job with a draining savepoint."""
    from jobs.run import GroupProgress

    print(f"llmstream: backfill: waiting until the group has committed {sum(targets.values())} input records")
    with contextlib.closing(GroupProgress(config)) as progress:
        while not progress.reached(targets):
            status = rest.job_status(job_id)
            if status in TERMINAL_STATES:
                raise ClusterError(f"job {job_id} ended {status} before the backfill was done: {rest.failure(job_id)}")
            time.sleep(poll_s)
    savepoint = _stop_when_running(rest, job_id, state, drain=True)
    print(f"llmstream: backfill done; stopped with savepoint {savepoint}")
    return 0


def _stop_when_running(rest: FlinkRest, job_id: str, state: StateDir, *, drain: bool,
                       timeout_s: float = 180.0) -> str:
    """Stop-with-savepoint into the job's state directory, retried while Flink refuses it because
    a task is still starting or restarting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return rest.stop_with_savepoint(job_id, state.savepoints_uri, drain=drain, timeout=timeout_s)
        except ClusterError:
            if time.monotonic() > deadline or rest.job_status(job_id) in TERMINAL_STATES:
                raise
            time.sleep(1.0)


def stop_job(config_path: str | None, jobmanager: str | None = None, state_dir: str | None = None) -> int:
    """``llmstream stop``: stop the config's running job with a savepoint in its state directory."""
    _, config = _load(config_path)
    try:
        _, _, rest = _target(jobmanager)
        job_id = _live_job(rest, config)
        state = StateDir.for_job(config, state_dir)
        print(f"llmstream: stopping job {config.name} ({job_id}) with a savepoint ...")
        savepoint = _stop_when_running(rest, job_id, state, drain=False)
    except ClusterError as err:
        print(f"llmstream: {err}", file=sys.stderr)
        return 1
    print(f"llmstream: stopped; savepoint {savepoint}")
    print("llmstream: `llmstream submit` resumes from it")
    return 0


def upgrade(config_path: str | None, jobmanager: str | None = None, state_dir: str | None = None) -> int:
    """``llmstream upgrade``: stop the running job with a savepoint and resubmit it from there with
    the (changed) config: capacity, retries, endpoint, parallelism. The config is checked first,
    so a broken one never stops a healthy job."""
    from jobs import preflight

    path, config = _load(config_path)
    preflight.check(config)
    jars.ensure("connector")
    try:
        address, env, rest = _target(jobmanager)
        job_id = _live_job(rest, config)
        state = StateDir.for_job(config, state_dir)
        check_identity(state, config, fresh=False)
        print(f"llmstream: upgrading job {config.name} ({job_id}): stopping it with a savepoint ...")
        savepoint = _stop_when_running(rest, job_id, state, drain=False)
        print(f"llmstream: savepoint {savepoint}; resubmitting with {path}")
        new_id = run_job_script(path, address, env=env, savepoint=savepoint, state_dir=state.location)
    except ClusterError as err:
        print(f"llmstream: {err}", file=sys.stderr)
        return 1
    print(f"llmstream: upgraded: job {config.name} runs as {new_id}, restored from {savepoint}")
    return 0


# ---------------------------------------------------------------------- command line


def _status_text(cluster: LocalCluster) -> tuple[bool, str]:
    pid = cluster.jobmanager_pid()
    overview = cluster.overview()
    if pid is None and overview is None:
        return False, f"cluster: not running (work dir {cluster.work_dir})"
    if overview is None:
        return False, f"cluster: JobManager pid {pid} runs but its REST API at {cluster.rest_url} does not answer"
    lines = [
        f"cluster: running, web UI {cluster.rest_url} (work dir {cluster.work_dir})",
        f"  jobmanagers: 1 (pid {pid}, Flink {overview.get('flink-version')})",
        (f"  taskmanagers: {overview.get('taskmanagers')} (pids {cluster.taskmanager_pids()}), "
         f"slots {overview.get('slots-available')}/{overview.get('slots-total')} free"),
        (f"  jobs: {overview.get('jobs-running')} running, {overview.get('jobs-finished')} finished, "
         f"{overview.get('jobs-cancelled')} cancelled, {overview.get('jobs-failed')} failed"),
    ]
    for job in cluster.jobs():
        if job.get("state") not in TERMINAL_STATES:
            lines.append(f"    {job['jid']}  {job['state']:<10} {job['name']}  "
                         f"({int(job.get('duration', 0)) // 1000} s)")
    return True, "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmstream cluster",
                                     description="A local standalone Flink cluster from the pip package.")
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--taskmanagers", type=int, default=1,
                        help="start: TaskManagers to run (a running cluster is topped up to this many)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"REST / web UI port (default {DEFAULT_REST_PORT}, or the running cluster's)")
    parser.add_argument("--rpc-port", type=int, default=None, help=f"JobManager RPC port (default {DEFAULT_RPC_PORT})")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="conf, logs, pids, checkpoints (default <repo>/var/flink)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for start (default 120)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    existing = ClusterConfig.existing(args.work_dir)
    config = ClusterConfig(
        work_dir=existing.work_dir,
        rest_port=args.port if args.port is not None else existing.rest_port,
        rpc_port=args.rpc_port if args.rpc_port is not None else existing.rpc_port,
    )
    cluster = LocalCluster(config)
    try:
        if args.command == "start":
            started = time.monotonic()
            cluster.start(taskmanagers=args.taskmanagers, timeout=args.timeout)
            print(f"cluster: up in {time.monotonic() - started:.1f} s; logs in {cluster.log_dir}")
            print(_status_text(cluster)[1])
            return 0
        if args.command == "stop":
            running = cluster.jobmanager_pid() is not None or bool(cluster.taskmanager_pids())
            cluster.stop()
            print("cluster: stopped" if running else f"cluster: not running (work dir {cluster.work_dir})")
            return 0
        running, text = _status_text(cluster)
        print(text)
        return 0 if running else 1
    except (ClusterError, OSError, subprocess.SubprocessError) as err:
        print(f"cluster: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
