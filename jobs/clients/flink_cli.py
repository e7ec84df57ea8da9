"""Flink's own command line from the apache-flink pip package, which is a complete FLINK_HOME
(``<site-packages>/pyflink``: ``bin/``, ``lib/``, ``opt/``): where it is, the environment its
scripts run in, and ``flink run`` of the job.

Both `jobs/launch/submit.py` (any cluster) and `jobs/dev/local_cluster.py` (the local one) use it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from jobs.clients.flink_rest import ClusterError, last_error_line
from jobs.runtime import jars

log = logging.getLogger("llmstream.submit")

JOB_SCRIPT = "jobs/inference_job.py"
_JOB_ID = re.compile(r"JobID\s+([0-9a-f]{32})")

__all__ = ["JOB_SCRIPT", "client_env", "flink_conf_dir", "flink_home", "python_jar", "run_job_script"]


def flink_home() -> Path:
    """The pip package's FLINK_HOME (``<site-packages>/pyflink``), found without importing PyFlink."""
    spec = importlib.util.find_spec("pyflink")
    if spec is None or not spec.submodule_search_locations:
        raise ClusterError("apache-flink is not installed in this Python (no 'pyflink' package)")
    home = Path(next(iter(spec.submodule_search_locations)))
    if not (home / "bin" / "flink").is_file():
        raise ClusterError(f"{home} has no bin/flink; is apache-flink installed completely?")
    return home


def flink_conf_dir() -> Path:
    """The repo's ``flink-conf/``: the Flink configuration of every cluster llmstream runs (the local
    one generates its ``conf/`` from it, the image reads it as is), and of a ``flink run`` client
    submitting to a cluster given by ``--jobmanager``."""
    return jars.repo_root() / "flink-conf"


def client_env(conf_dir: Path, log_dir: Path) -> dict[str, str]:
    """The environment of Flink's bin scripts: this one with FLINK_HOME, FLINK_CONF_DIR and
    FLINK_LOG_DIR set (the pip package's own log dir is read-only site-packages), and this
    interpreter's bin/ first on PATH."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(FLINK_HOME=str(flink_home()), FLINK_CONF_DIR=str(conf_dir), FLINK_LOG_DIR=str(log_dir),
               PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
    return env


def python_jar() -> Path:
    """``opt/flink-python-*.jar``: the JVM side of PyFlink, which a stock Flink ``lib/`` lacks."""
    found = sorted((flink_home() / "opt").glob("flink-python-*.jar"))
    if not found:
        raise ClusterError(f"no flink-python jar in {flink_home() / 'opt'}")
    return found[-1]


def run_job_script(config_path: str | os.PathLike[str], address: str, *, env: Mapping[str, str],
                   savepoint: str | None = None, state_dir: str | None = None, leave_behind: bool = False,
                   python_files: Sequence[str] = (), timeout: float = 180.0, script: str = JOB_SCRIPT) -> str:
    """Runs ``bin/flink run -d ... -py jobs/inference_job.py --config FILE``; returns the job id.
    ``script``: another job script of the repository taking the same options (a job of a user's
    own that calls the stage, `jobs/examples/enrich_and_infer.py`).

    ``-pyexec``/``-pyclientexec`` are this interpreter, so the client and the Python workers
    use the same venv; the job ships ``udfs/`` and the connector jar itself. The cluster must
    have flink-python on its classpath (`write_lib_dir`; the docker-compose image does too),
    because the job's own ``pipeline.jars`` replaces the list ``flink run -py`` would ship it in.
    ``savepoint`` (``-s``) resumes from a savepoint or a retained checkpoint, ``leave_behind``
    (``-n``) dropping its state for operators the job lacks (`jobs.graph.gate_operator.left_behind`); ``state_dir`` is
    where the job keeps its checkpoints and savepoints (default: from the job config).
    ``python_files``: the user functions' modules (`jobs.launch.plan.user_modules`), found where
    the command was given and shipped by the job script (``flink run`` runs it from the checkout).
    """
    config = Path(config_path).expanduser().resolve()
    cmd = [str(flink_home() / "bin" / "flink"), "run", "-d", "-m", address,
           "-pyexec", sys.executable, "-pyclientexec", sys.executable]
    if savepoint:
        cmd += ["-s", savepoint]
        if leave_behind:
            cmd += ["-n"]
    cmd += ["-py", str(jars.repo_root() / script), "--config", str(config)]
    if state_dir:
        cmd += ["--state-dir", state_dir]
    for python_file in python_files:
        cmd += ["--python-file", python_file]
    log.info("submitting: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd=str(jars.repo_root()), check=False)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"flink run against {address} did not finish within {timeout:g} s") from None
    output = proc.stdout + proc.stderr
    match = _JOB_ID.search(output)
    if proc.returncode != 0 or match is None:
        log.debug("flink run output:\n%s", output)
        raise ClusterError(f"flink run against {address} failed (exit {proc.returncode}): {last_error_line(output)} "
                           "(Flink's whole output with llmstream -v)")
    return match.group(1)
