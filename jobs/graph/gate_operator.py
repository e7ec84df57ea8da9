"""The admission gate's jar: `pom-free/gate/*.java`, compiled here with javac.

The gate is a small Java operator chained in front of the inference stage (`jobs/graph/pipeline.py`
puts it there when the job has a spend budget, or a fleet or a rate limit with unaligned
checkpoints and a jar or a javac here: `gate_setting`): while the stage says it admits nothing, the
gate stops taking input but keeps running the task's mails, so an unaligned checkpoint still
completes (the class's Javadoc says how); a gated job's ticks come from `Ticks.java` (a FLIP-27
source's generator: the SQL datagen source would hold every checkpoint behind a closed gate).
The same jar holds `AdaptiveBundles.java`, the stage's operator under `python.bundle_target_ms`.
They need nothing beyond the Flink jars PyFlink ships, so they are compiled against those, without a pom, into
`pom-free/cache/gate/` under a name that holds a hash of the sources and of PyFlink's version:
a changed source or another Flink builds a new jar. `make jars` builds it ahead of time
(the image copies it from there); otherwise the first job that needs it does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

from jobs.runtime import jars
from jobs.state.operator_ids import holds_operator
from udfs.config import JobConfig
from udfs.errors import LLMStreamError
from udfs.lanes.admission import STOPPING

GATE_CLASS = "llmstream.AdmissionGate"
TICKS_CLASS = "llmstream.Ticks"
ADAPTIVE_BUNDLES_CLASS = "llmstream.AdaptiveBundles"
"""`python.bundle_target_ms`: the stage's operator with a bundle size that follows throughput."""
CHECK_MS = 5
"""How often the gate looks at the stage's pause file while records flow (one stat call)."""
IDLE_SLEEP_MS = 5
"""How long the closed gate sleeps when the task has no mail to run."""
TICKS_UID = "inference-ticks-gated"
"""The uid of a gated job's ticks: a FLIP-27 source, so its snapshots hold state for it."""


class GateBuildError(LLMStreamError, RuntimeError):
    """The gate's jar is missing and cannot be built here; the message says why and what to do."""


def sources() -> list[Path]:
    """The gate's Java sources: the gate itself and the ticks generator of a gated job."""
    return sorted((jars.repo_root() / "pom-free" / "gate").glob("*.java"))


def _flink_jars() -> list[Path]:
    """The jars the gate compiles against: PyFlink's `lib/` and its flink-python jar."""
    import pyflink

    home = Path(pyflink.__file__).resolve().parent
    return sorted(home.glob("lib/*.jar")) + sorted(home.glob("opt/flink-python*.jar"))


def jar_path() -> Path:
    """Where the jar for these sources and this PyFlink version is (built or not)."""
    from pyflink.version import __version__ as flink_version

    digest = hashlib.sha256(flink_version.encode())
    for path in sources():
        digest.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return jars.cache_root() / "gate" / f"llmstream-gate-{digest.hexdigest()[:12]}.jar"


def _javac(setting: str = "budget") -> str:
    java_home = os.environ.get("JAVA_HOME")
    candidates = [Path(java_home) / "bin" / "javac"] if java_home else []
    found = shutil.which("javac")
    if found:
        candidates.append(Path(found))
    java = shutil.which("java")
    if java:
        candidates.append(Path(java).resolve().parent / "javac")
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise GateBuildError(
        f"{setting}: the admission gate's jar ({jar_path().name}) is not built and no javac was found "
        "(JAVA_HOME, PATH): run `make jars` where a JDK is installed, or install one "
        "(apt-get install openjdk-17-jdk-headless)")


def ensure(setting: str = "budget") -> Path:
    """The gate's jar, compiled first if this source and classpath have none yet. `setting`:
    what needs it, named first in an error."""
    if not sources():
        raise GateBuildError(f"{setting}: the admission gate's sources are missing from {jars.repo_root() / 'pom-free' / 'gate'}")
    target = jar_path()
    if target.is_file():
        return target
    javac = _javac(setting)
    classpath = os.pathsep.join(str(jar) for jar in _flink_jars())
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmstream-gate-") as scratch:
        classes = Path(scratch) / "classes"
        done = subprocess.run([javac, "--release", "11", "-nowarn", "-cp", classpath, "-d", str(classes),
                               *map(str, sources())], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            first = (done.stderr or done.stdout).strip().splitlines()
            raise GateBuildError(f"{setting}: compiling the admission gate failed: {first[0] if first else done.returncode}")
        staged = target.parent / f".{target.name}.{os.getpid()}.tmp"  # renamed into place: never half a jar
        with zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: llmstream jobs/graph/gate_operator.py\n\n")
            for path in sorted(classes.rglob("*.class")):
                jar.write(path, path.relative_to(classes).as_posix())
        os.replace(staged, target)
    return target


def ensure_for(config: JobConfig) -> None:
    """Before any JVM starts (`llmstream run`, `submit`, `upgrade`): the gate's jar when the job
    needs one, so a machine without javac gets one line naming the setting, not a traceback from
    the job's build."""
    setting = gate_setting(config)
    if setting is not None:
        ensure(setting)
    if config.python.bundle_target_ms:
        ensure("python.bundle_target_ms")


def _buildable() -> bool:
    try:
        return jar_path().is_file() or bool(sources() and _javac())
    except GateBuildError:
        return False


def gate_setting(config: JobConfig) -> str | None:
    """What puts the admission gate (and the gated ticks) in front of the job's stage, or None.

    `budget`: a spend budget pauses for up to a window; it needs the gate (and unaligned
    checkpoints, checked at load). `model.endpoints`: a fleet whose endpoints are all down waits
    for a cooldown (up to `model.circuit.max_cooldown_s`); the gate keeps checkpoints going
    meanwhile when checkpoints are unaligned and the gate's jar is here or can be built. Without
    them the fleet runs as before: a checkpoint then waits for the cooldown. `rate_limit`: a
    binding requests- or tokens-per-minute limit queues calls for as long as the stage has slots
    (a slot a second at 60 a minute), and a 429's Retry-After holds every call; under the same
    conditions as a fleet, the gate stops the input while either wait is over a second
    (`udfs.inference.client.PAUSE_AFTER_S`). `model.mode`: the provider-batch lane makes a batch only
    once a completed checkpoint holds it, which the gate tells it. A job with none of these has no
    gate: a Retry-After then holds a checkpoint for up to `retry.max_retry_after_s`."""
    if config.budget.enabled:
        return "budget"
    if config.model.mode == "batch":
        return "model.mode"  # never closes: it tells the batch lane which checkpoint completed (AdmissionGate.java)
    gateable = config.python.unaligned_checkpoints and _buildable()
    if config.model.routed and gateable:
        return "model.endpoints"
    if config.rate_limit.enabled and gateable:
        return "rate_limit"
    return None


GATE_DIR_SWEEP_S = 86_400.0
"""Empty gate directories untouched this long are removed when a new gated job is built."""


def job_directory() -> str:
    """Where this job's inference subtasks and their gates meet: a fresh directory name under the
    temporary directory of the host (a Python worker runs on its TaskManager's host).

    A job's stages remove their directory when they close; a killed one leaves it, empty. Those
    older than a day are swept here; a live job whose empty directory goes with them makes it
    again when it next pauses (`udfs.lanes.admission.GateSignal.set`)."""
    root = Path(tempfile.gettempdir()) / "llmstream-gate"
    cutoff = time.time() - GATE_DIR_SWEEP_S
    with contextlib.suppress(OSError):
        for old in root.iterdir():
            with contextlib.suppress(OSError):
                if old.stat().st_mtime < cutoff:
                    old.rmdir()  # only if empty
    return str(root / uuid.uuid4().hex)


def open_for_stop(directory: str | None) -> None:
    """Tells the job's stages that a stop with a savepoint is under way: a savepoint is aligned,
    and its barrier waits in the input a closed gate does not read, so while it is there a
    paused stage opens its gate and parks what comes in (a few buffers' worth: the sources
    stop at the barrier). Only where this host runs the job's stages (`llmstream run`)."""
    if directory is None:
        return
    with contextlib.suppress(OSError):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / STOPPING).touch()


def forget(directory: str | None) -> None:
    """After the job: removes the stop mark and the directory, if nothing else is in it."""
    if directory is None:
        return
    with contextlib.suppress(OSError):
        (Path(directory) / STOPPING).unlink(missing_ok=True)
        Path(directory).rmdir()


def gated(config: JobConfig) -> bool:
    """Whether the job runs with the admission gate (and the gated ticks) in front of its stage."""
    return gate_setting(config) is not None


def left_behind(config: JobConfig, restore: str | None) -> str | None:
    """Why a restore of `restore` must allow state with no operator to go to, or None.

    A gated job's ticks come from a FLIP-27 source (`TICKS_UID`), whose snapshots hold its
    enumerator's and readers' state; a job without the gate has no such operator, and Flink
    refuses the snapshot unless told to leave that state behind. Only ticks are lost (which
    slot to wake next), so a run that drops the gate (its budget or its fleet) is allowed to;
    any other unclaimed state still stops the restore. The other way (a gate added) needs
    nothing: the SQL ticks keep no state."""
    if restore is None or gated(config) or not holds_operator(restore, TICKS_UID):
        return None
    return ("the snapshot was taken with the admission gate (a spend budget, budget.*, a fleet, "
            "model.endpoints, or rate_limit.*) and this config has none: the state of the gate's tick source (which slot "
            "to wake next, nothing else) is left behind")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build the admission gate's jar (pom-free/gate)")
    parser.parse_args(argv)
    try:
        print(f"pom-free: gate: {ensure()}")
    except GateBuildError as err:
        print(f"llmstream: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
