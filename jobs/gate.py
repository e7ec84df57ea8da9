"""The admission gate's jar: `pom-free/gate/*.java`, compiled here with javac.

The gate is a small Java operator chained in front of the inference stage (`jobs/pipeline.py`
puts it there when the job has a spend budget): while the stage says it admits nothing, the
gate stops taking input but keeps running the task's mails, so an unaligned checkpoint still
completes (the class's Javadoc says how); a gated job's ticks come from `Ticks.java` (a FLIP-27
source's generator: the SQL datagen source would hold every checkpoint behind a closed gate).
They need nothing beyond the Flink jars PyFlink ships, so they are compiled against those, without a pom, into
`pom-free/cache/gate/` under a name that holds a hash of the sources and of PyFlink's version:
a changed source or another Flink builds a new jar. `make jars` builds it ahead of time
(the image copies it from there); otherwise the first job that needs it does.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jobs import jars
from udfs.config import JobConfig
from udfs.errors import LLMStreamError

GATE_CLASS = "llmstream.AdmissionGate"
TICKS_CLASS = "llmstream.Ticks"
CHECK_MS = 5
"""How often the gate looks at the stage's pause file while records flow (one stat call)."""
IDLE_SLEEP_MS = 5
"""How long the closed gate sleeps when the task has no mail to run."""


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


def _javac() -> str:
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
        f"budget: the admission gate's jar ({jar_path().name}) is not built and no javac was found "
        "(JAVA_HOME, PATH): run `make jars` where a JDK is installed, or install one "
        "(apt-get install openjdk-17-jdk-headless)")


def ensure() -> Path:
    """The gate's jar, compiled first if this source and classpath have none yet."""
    if not sources():
        raise GateBuildError(f"budget: the admission gate's sources are missing from {jars.repo_root() / 'pom-free' / 'gate'}")
    target = jar_path()
    if target.is_file():
        return target
    javac = _javac()
    classpath = os.pathsep.join(str(jar) for jar in _flink_jars())
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmstream-gate-") as scratch:
        classes = Path(scratch) / "classes"
        done = subprocess.run([javac, "--release", "11", "-nowarn", "-cp", classpath, "-d", str(classes),
                               *map(str, sources())], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            first = (done.stderr or done.stdout).strip().splitlines()
            raise GateBuildError(f"budget: compiling the admission gate failed: {first[0] if first else done.returncode}")
        staged = target.parent / f".{target.name}.{os.getpid()}.tmp"  # renamed into place: never half a jar
        with zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: llmstream jobs/gate.py\n\n")
            for path in sorted(classes.rglob("*.class")):
                jar.write(path, path.relative_to(classes).as_posix())
        os.replace(staged, target)
    return target


def ensure_for(config: JobConfig) -> None:
    """Before any JVM starts (`llmstream run`, `submit`, `upgrade`): the gate's jar when the job has
    a spend budget, so a machine without javac gets one line naming the budget, not a traceback
    from the job's build."""
    if config.budget.enabled:
        ensure()


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
