"""An earlier release of llmstream, built once per machine, for the tests of upgrades across Flink versions.

`ReleaseBuild.ensure` exports one commit of this repository (``git archive``, so the clone needs its
history) into the user's cache directory (``~/.cache/llmstream/builds/<name>/src``), makes it a
virtualenv of its own (``venv/``, ``pip install -e`` of that source: its own setup.py pins, its own
apache-flink) and fetches its jars into its own ``src/pom-free/cache``. It is what a user ran before
upgrading: that commit's code, Flink, connector and ``flink-conf/``, nothing of this checkout. The
build runs once, under a lock (two pytest workers, or two checkouts, may ask at once), and is marked
ready only when complete; later runs reuse it. ``run`` starts one of its ``llmstream`` commands
from outside either checkout.

`FLINK_2_2` is a commit of main on apache-flink 2.2.1 (7b3e867), from before the move to 2.3.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from jobs.runtime.jars import user_cache_dir
from tests.conftest import SHELL_ENV

log = logging.getLogger("llmstream.tests.release_build")

REPO = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 1800.0
"""pip's install of apache-flink and its dependencies (pandas, pyarrow, apache-beam...) on a fresh machine."""


@dataclass(frozen=True)
class ReleaseBuild:
    """One commit of llmstream in a venv of its own, pinned to the Flink version it names."""

    name: str
    commit: str
    flink_version: str

    @property
    def root(self) -> Path:
        return user_cache_dir(SHELL_ENV) / "builds" / self.name

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def bin(self) -> Path:
        return self.root / "venv" / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    @property
    def _ready(self) -> Path:
        return self.root / "ready.json"

    def env(self) -> dict[str, str]:
        """The user's environment, without anything that would point the build at this checkout
        (PYTHONPATH, LLMSTREAM_HOME, a jar cache), and without the JVM class archive, whose three
        slots per machine belong to the checkouts (`jobs/runtime/jvm_archive.py`)."""
        env = {k: v for k, v in SHELL_ENV.items()
               if k not in ("PYTHONPATH", "LLMSTREAM_HOME", "LLMSTREAM_JAR_CACHE", "VIRTUAL_ENV")}
        env["PATH"] = os.pathsep.join([str(self.bin), env.get("PATH", "")])
        env["LLMSTREAM_JVM_ARCHIVE"] = "off"
        return env

    def command(self, *args: str) -> list[str]:
        """``llmstream <args>`` of this build."""
        return [str(self.bin / "llmstream"), *args]

    def run(self, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """``llmstream <args>`` of this build to its end, from ``cwd`` (outside either checkout)."""
        return subprocess.run(self.command(*args), cwd=cwd, env=self.env(), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)

    def ensure(self) -> ReleaseBuild:
        """The build, made first if this machine has none (minutes: a venv and its Flink)."""
        with self._locked():
            if self._ready.is_file() and self.python.is_file():
                return self
            started = time.monotonic()
            shutil.rmtree(self.src, ignore_errors=True)
            shutil.rmtree(self.root / "venv", ignore_errors=True)
            self._export()
            pins = (self.src / "setup.py").read_text()
            assert f'"apache-flink=={self.flink_version}"' in pins, (
                f"{self.commit} does not pin apache-flink {self.flink_version}: not the build this test means")
            build_log = self.root / "build.log"
            with build_log.open("w") as out:
                for step in ([sys.executable, "-m", "venv", str(self.root / "venv")],
                             [str(self.python), "-m", "pip", "install", "-q", "-e", str(self.src)],
                             [str(self.python), str(self.src / "pom-free" / "fetch.py"), "--set", "connector"],
                             [str(self.python), str(self.src / "pom-free" / "fetch.py"), "--set", "metrics"]):
                    out.write(f"$ {' '.join(step)}\n")
                    out.flush()
                    done = subprocess.run(step, cwd=self.root, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                          timeout=BUILD_TIMEOUT_S, check=False)
                    assert done.returncode == 0, f"building {self.name} failed at {step}: see {build_log}"
            self._check()
            self._ready.write_text(json.dumps({"commit": self.commit, "flink": self.flink_version,
                                               "built_s": round(time.monotonic() - started, 1)}) + "\n")
            log.info("built %s in %.0f s", self.name, time.monotonic() - started)
            return self

    def _export(self) -> None:
        """``git archive`` of the commit into ``src``."""
        known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{self.commit}^{{commit}}"],
                               capture_output=True, text=True, check=False)
        assert known.returncode == 0, (
            f"commit {self.commit} ({self.name}) is not in this clone's history; a shallow clone needs "
            "`git fetch --unshallow`")
        self.src.mkdir(parents=True)
        archive = self.root / "src.tar"
        with archive.open("wb") as out:
            subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", self.commit], stdout=out, check=True,
                           timeout=300)
        with tarfile.open(archive) as tar:
            tar.extractall(self.src, filter="data")
        archive.unlink()

    def _check(self) -> None:
        """The venv imports the build's own code and Flink, not this checkout's."""
        probe = "import jobs, pyflink.version; print(jobs.__file__); print(pyflink.version.__version__)"
        done = subprocess.run([str(self.python), "-c", probe], cwd=self.root, env=self.env(), capture_output=True,
                              text=True, timeout=120, check=True)
        where, version = done.stdout.split()
        assert Path(where).is_relative_to(self.src), where
        assert version == self.flink_version, version

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root.parent / f".{self.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


FLINK_2_2 = ReleaseBuild(name="llmstream-7b3e867-flink-2.2.1", commit="7b3e86702b4777103dca166e1615165abbce6377",
                         flink_version="2.2.1")
"""main at 7b3e867: apache-flink 2.2.1, flink-sql-connector-kafka 5.0.0-2.2, the Prometheus reporter 2.2.1."""

BEFORE_LANES = ReleaseBuild(name="llmstream-5c33062-flink-2.3.0", commit="5c3306271b94ca29ed0548107041372d30f6bd3a",
                            flink_version="2.3.0")
"""main at 5c33062, the last commit before the lanes moved to `udfs/lanes/` (90b96cf): its provider-batch
lane keeps `Held` and `BatchEntry` in state pickled under `udfs.provider_batch.entries`."""


if __name__ == "__main__":
    # `make test` starts this in the background beside its image and llama.cpp builds, so the upgrade
    # test finds the build ready (or finishes waiting on its lock) instead of spending a worker's minute
    # or more on pip. Only `FLINK_2_2`: `BEFORE_LANES` is used by the full fault run alone. A failure
    # ends this process only (var/release-build-background.log); the test's fixture builds it again.
    logging.basicConfig(level=logging.INFO)
    FLINK_2_2.ensure()
