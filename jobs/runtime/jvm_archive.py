"""A class-data-sharing archive of `llmstream run`'s JVM: later runs map Flink's classes from a file.

Every `llmstream run` starts a JVM (PyFlink's gateway, which hosts the mini cluster) that loads,
parses and verifies the same tens of thousands of classes from Flink's jars. A dynamic CDS archive
(JDK 13+) keeps them ready to map, so a run's whole process tree spends less CPU and starts
sooner ([Performance](../docs/performance.md#job-start) has the figures).

How it is made: a run that finds no archive for its JVM (this `java`, this classpath) starts the
JVM with ``-XX:ArchiveClassesAtExit=<tmp>``; when the run ends it shuts the JVM down, which
writes every class it loaded (once; its size and time are in docs/operations.md, "Running
locally"). The file is kept only if a JVM starts with
it under ``-Xshare:on``, and that check is repeated before each use: a truncated archive crashes a
JVM (SIGBUS) instead of being ignored. An archive of another classpath is ignored by the JVM
itself; the file name's hash changes with the java binary, the classpath and its jars.

Only `llmstream run` (the CLI) uses it: it owns its process, so it may shut the JVM down at the end.
``LLMSTREAM_JVM_ARCHIVE=off`` turns it off; ``LLMSTREAM_JVM_ARCHIVE_DIR`` moves it (default
``$XDG_CACHE_HOME/llmstream/jvm`` or ``~/.cache/llmstream/jvm``); a ``JVM_ARGS`` that already
names ``-Xshare`` or an archive is left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from jobs.runtime.jars import user_cache_dir
from jobs.runtime.pids import wait_gone

log = logging.getLogger("llmstream.jvm_archive")

SWITCH_ENV = "LLMSTREAM_JVM_ARCHIVE"
DIR_ENV = "LLMSTREAM_JVM_ARCHIVE_DIR"
KEEP = 3
"""Archives kept per directory (the newest used): two checkouts or venvs on one machine each keep theirs."""
STALE_TMP_S = 600.0
SAVE_TIMEOUT_S = 180.0
_USER_FLAGS = ("-Xshare", "SharedArchiveFile", "ArchiveClassesAtExit", "AutoCreateSharedArchive")
_QUIET = "-Xlog:cds*=off"  # CDS warnings (thousands of "Skipping ..." at a dump) would land on the run's stdout


def archive_dir(env: Mapping[str, str] = os.environ) -> Path:
    if env.get(DIR_ENV):
        return Path(env[DIR_ENV]).expanduser()
    return user_cache_dir(env) / "jvm"


def java_major(java: str) -> int | None:
    """The major version from the JDK's ``release`` file beside ``bin/java`` (None if unreadable)."""
    release = Path(java).resolve().parent.parent / "release"
    try:
        match = re.search(r'^JAVA_VERSION="(\d+)', release.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def gateway_java_and_classpath(env: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """The java binary and classpath PyFlink's launcher gives the gateway JVM, from its own functions."""
    from pyflink import pyflink_gateway_server as launcher

    scratch = dict(env)
    launcher.prepare_environment_variables(scratch)
    classpath = os.pathsep.join([launcher.construct_flink_classpath(scratch),
                                 launcher.construct_hadoop_classpath(scratch)])
    java = shutil.which(launcher.find_java_executable())
    return (java, classpath) if java else None


class GatewayArchive:
    """The archive for one (java, classpath), and the dump this process's JVM may owe it."""

    def __init__(self, directory: Path, java: str, classpath: str) -> None:
        self.directory = directory
        self.java = java
        self.classpath = classpath
        self.path = directory / f"gateway-{self._key()}.jsa"
        self.pending: Path | None = None  # where this process's JVM writes its dump at exit

    @classmethod
    def find(cls, env: Mapping[str, str] = os.environ) -> GatewayArchive | None:
        """The archive this process's gateway should use or make, or None when off or impossible."""
        if env.get(SWITCH_ENV, "").lower() in ("off", "0", "false", "no"):
            return None
        if any(flag in env.get("JVM_ARGS", "") for flag in _USER_FLAGS):
            return None
        found = gateway_java_and_classpath(env)
        if found is None or (java_major(found[0]) or 0) < 13:
            return None
        directory = archive_dir(env)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            log.info("no JVM class archive: %s is not writable (%s)", directory, err)
            return None
        if not os.access(directory, os.W_OK):
            return None
        archive = cls(directory, *found)
        archive._drop_stale_dumps()
        return archive

    def _key(self) -> str:
        digest = hashlib.sha256()
        for part in (os.path.realpath(self.java), self.classpath):
            digest.update(part.encode() + b"\0")
        for entry in [self.java, *self.classpath.split(os.pathsep)]:
            with contextlib.suppress(OSError):
                st = os.stat(entry)
                digest.update(f"{st.st_size}:{st.st_mtime_ns}\0".encode())
        return digest.hexdigest()[:16]

    def usable(self, path: Path) -> bool:
        """Whether a JVM with this classpath starts with `path` mapped (``-Xshare:on`` fails otherwise)."""
        # A bad archive crashes the check (that is the point): its hs_err file goes to a scratch
        # directory, not into the user's working directory.
        with tempfile.TemporaryDirectory(prefix="llmstream-cds-check-") as scratch:
            try:
                done = subprocess.run([self.java, "-Xshare:on", f"-XX:SharedArchiveFile={path}", _QUIET,
                                       f"-XX:ErrorFile={scratch}/hs_err_pid%p.log", "-cp", self.classpath, "-version"],
                                      capture_output=True, timeout=60, check=False, cwd=scratch)
            except (OSError, subprocess.TimeoutExpired):
                return False
        return done.returncode == 0

    def jvm_options(self, log_file: Path | None = None) -> list[str]:
        """Options for the gateway JVM: map the archive if a good one exists, else dump one at exit."""
        if self.path.exists():
            if self.usable(self.path):
                os.utime(self.path)  # the newest used are the ones `KEEP` keeps
                options = [f"-XX:SharedArchiveFile={self.path}", _QUIET]
                if log_file is not None:  # what the JVM mapped, for a reader (and the tests)
                    options.append(f"-Xlog:cds=info,cds+dynamic=info:file={log_file}")
                return options
            log.warning("the JVM class archive %s does not load; making a new one", self.path)
            with contextlib.suppress(OSError):
                self.path.unlink()
        self.pending = self.directory / f"{self.path.stem}.{os.getpid()}.tmp"
        return [f"-XX:ArchiveClassesAtExit={self.pending}", _QUIET]

    def jvm_args(self, current: str, log_file: Path | None = None) -> str:
        """`current` ``JVM_ARGS`` with `jvm_options` added, for PyFlink's launcher."""
        return " ".join([*current.split(), *self.jvm_options(log_file)])

    def save(self, report: Callable[[str], None]) -> None:
        """Ends this process's JVM, so that it writes the archive it owes, and keeps the archive if
        it loads. Call last: PyFlink's gateway is gone afterwards. Nothing to do if none is owed."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        from pyflink.java_gateway import get_gateway

        gateway = get_gateway()
        if f"-XX:ArchiveClassesAtExit={pending}" not in list(
                gateway.jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()):
            return  # this process's JVM was started before, without the option
        pid = int(gateway.jvm.ProcessHandle.current().pid())
        report("llmstream: saving the JVM's loaded classes for faster starts (once per Flink install) ...")
        started = time.monotonic()
        try:
            gateway.close()  # the JVM's watchdog sees the gateway go and exits, writing the archive
            if wait_gone([pid], SAVE_TIMEOUT_S):
                report(f"llmstream: the JVM did not exit within {SAVE_TIMEOUT_S:g} s; no class archive this time")
                return
            if not pending.exists() or not self.usable(pending):
                report("llmstream: the JVM's class archive did not load; later runs start without one")
                return
            os.replace(pending, self.path)
        except KeyboardInterrupt:  # a Ctrl-C while saving: the archive waits for another run
            return
        finally:
            with contextlib.suppress(OSError):
                pending.unlink()
        self._prune()
        size_mb = self.path.stat().st_size / 1e6
        report(f"llmstream: saved {self.path} ({size_mb:.0f} MB) in {time.monotonic() - started:.0f} s; "
               f"later runs start faster ({SWITCH_ENV}=off turns this off)")

    def _prune(self) -> None:
        archives = sorted(self.directory.glob("gateway-*.jsa"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in archives[KEEP:]:
            with contextlib.suppress(OSError):
                old.unlink()

    def _drop_stale_dumps(self) -> None:
        """Dumps of runs that died before keeping them (a SIGKILL mid-write leaves a torn file)."""
        now = time.time()
        for tmp in self.directory.glob("gateway-*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
