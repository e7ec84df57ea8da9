"""A local S3-compatible object store for developers and tests: s3proxy on its filesystem backend.

`org.gaul:s3proxy` (Apache-2.0) is resolved from Maven Central by pom-free (set ``objectstore``)
and keeps each bucket as a directory under ``<data dir>/buckets`` (the ``filesystem`` backend:
``filesystem-nio2`` answers a HEAD of a directory's name as a 0-byte object, so Flink takes a
savepoint's directory for its metadata file and fails to restore it); it speaks the S3 API with AWS
v2/v4 signatures, so Flink's S3 file system and boto3 use it as they would use S3
(`jobs/state/storage.py`). ``llmstream object-store start|stop|status`` runs one on
``127.0.0.1:9300``, with the bucket ``llmstream`` made, and prints the ``flink:`` settings and
environment a job's state needs to live there.

The identity and credential are fixed development values (`DEV_IDENTITY`, `DEV_CREDENTIAL`): the
server listens on loopback, or on the estate's private bridge (``ObjectStoreConfig.host``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from jobs.dev.processes import cmdline, log_tail, terminate
from jobs.runtime import jars
from jobs.runtime.pids import pid_alive
from jobs.runtime.ports import port_in_use
from udfs.errors import LLMStreamError

__all__ = ["DEV_CREDENTIAL", "DEV_IDENTITY", "ObjectStore", "ObjectStoreConfig", "ObjectStoreError", "main"]

MAIN_CLASS = "org.gaul.s3proxy.Main"
DEFAULT_PORT = 9300
DEFAULT_BUCKET = "llmstream"
DEV_IDENTITY = "llmstream-dev"
DEV_CREDENTIAL = "llmstream-dev-secret"


LOGBACK = """<configuration>
  <appender name="OUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%d{HH:mm:ss.SSS} %-5level %logger{36} - %msg%n</pattern></encoder>
  </appender>
  <root level="WARN"><appender-ref ref="OUT"/></root>
</configuration>
"""


class ObjectStoreError(LLMStreamError, RuntimeError):
    """The local object store could not be started or stopped; the message carries its log's tail."""


def default_data_dir() -> Path:
    return jars.repo_root() / "var" / "object-store"


@dataclass(frozen=True)
class ObjectStoreConfig:
    """Where the store listens, keeps its buckets, and the access key pair it accepts."""

    port: int = DEFAULT_PORT
    data_dir: Path = field(default_factory=default_data_dir)
    identity: str = DEV_IDENTITY
    credential: str = DEV_CREDENTIAL
    heap: str = "256m"
    host: str = "127.0.0.1"
    """The address it listens on and is reached at."""
    launcher: tuple[str, ...] = ()
    """Words before ``java`` in its command, e.g. ``ip netns exec <ns>`` to run it on a host of the
    estate (`jobs/dev/estate/`), whose ``host`` address only that namespace has."""

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"


class ObjectStore:
    """Start, stop and query one s3proxy whose buckets live in ``config.data_dir/buckets``."""

    def __init__(self, config: ObjectStoreConfig | None = None) -> None:
        self.config = config or ObjectStoreConfig()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return self.config.endpoint

    @property
    def properties_file(self) -> Path:
        return self.config.data_dir / "s3proxy.properties"

    @property
    def log_file(self) -> Path:
        return self.config.data_dir / "s3proxy.log"

    @property
    def pid_file(self) -> Path:
        return self.config.data_dir / "s3proxy.pid"

    def flink_settings(self) -> dict[str, str]:
        """The ``flink:`` section keys of a job whose state lives in this store. Flink's S3 file
        system (Hadoop 3.3's S3A) deletes the "directory" marker objects above each file it writes;
        s3proxy's filesystem backend maps those to real directories that are not empty and spends
        10 s on each such delete (a checkpoint took 72 s), so the markers are kept, as Hadoop 3.4
        does by default."""
        return {"s3.endpoint": self.endpoint, "s3.path.style.access": "true",
                "s3.directory.marker.retention": "keep"}

    def credentials_env(self) -> dict[str, str]:
        """The AWS standard chain's variables for this store's key pair."""
        return {"AWS_ACCESS_KEY_ID": self.config.identity, "AWS_SECRET_ACCESS_KEY": self.config.credential}

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if not pid_alive(pid):
            return None
        cmd = cmdline(pid)
        if cmd and not (MAIN_CLASS in cmd and str(self.properties_file) in cmd):
            return None
        return pid

    def _write_properties(self) -> None:
        buckets = self.config.data_dir / "buckets"
        buckets.mkdir(parents=True, exist_ok=True)
        lines = {
            "s3proxy.endpoint": self.endpoint,
            "s3proxy.authorization": "aws-v2-or-v4",
            "s3proxy.identity": self.config.identity,
            "s3proxy.credential": self.config.credential,
            "jclouds.provider": "filesystem",
            "jclouds.filesystem.basedir": str(buckets),
        }
        self.properties_file.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        self.properties_file.chmod(0o600)
        # Without a configuration logback logs every request at DEBUG: CPU the job needs.
        self.logback_file.write_text(LOGBACK)

    @property
    def logback_file(self) -> Path:
        return self.config.data_dir / "logback.xml"

    def start(self, timeout: float = 60, bucket: str | None = DEFAULT_BUCKET) -> None:
        """Start the store, wait until it answers, and make ``bucket`` (if given); a no-op start
        when it already runs."""
        if self.pid() is None:
            if not self.config.launcher and port_in_use(self.config.port, self.config.host):
                raise ObjectStoreError(f"port {self.config.port} on {self.config.host} is already in use; pick another (--port)")
            jars.ensure("objectstore")
            self._write_properties()
            java = shutil.which("java", path=str(Path(os.environ["JAVA_HOME"]) / "bin")) \
                if os.environ.get("JAVA_HOME") else shutil.which("java")
            if java is None:
                raise ObjectStoreError("java not found (need Java 17+ on PATH or JAVA_HOME)")
            cmd = [*self.config.launcher, java, f"-Xmx{self.config.heap}", f"-Dlogback.configurationFile={self.logback_file}", "-cp", jars.classpath("objectstore"), MAIN_CLASS,
                   "--properties", str(self.properties_file)]
            with self.log_file.open("ab") as out:
                self._process = subprocess.Popen(cmd, cwd=self.config.data_dir, stdin=subprocess.DEVNULL,
                                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.pid_file.write_text(f"{self._process.pid}\n")
        try:
            self._wait_ready(timeout)
            if bucket:
                self.make_bucket(bucket)
        except BaseException:
            if self._process is not None and self._process.poll() is None:
                self._process.kill()
                self._process.wait(timeout=10)
                self.pid_file.unlink(missing_ok=True)
            raise

    def client(self) -> object:
        """A boto3 S3 client of this store (the dev key pair, path-style addressing)."""
        import boto3  # type: ignore[import-untyped]
        from botocore.config import Config  # type: ignore[import-untyped]

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.config.identity, aws_secret_access_key=self.config.credential,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                          request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required",
                                          connect_timeout=2, read_timeout=10))

    def make_bucket(self, name: str) -> None:
        """Creates the bucket ``name`` unless it exists."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,  # type: ignore[attr-defined]
                                 client.exceptions.BucketAlreadyExists):  # type: ignore[attr-defined]
            client.create_bucket(Bucket=name)  # type: ignore[attr-defined]

    def _alive(self) -> bool:
        if self._process is not None:
            return self._process.poll() is None
        return self.pid() is not None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self._alive():
                raise ObjectStoreError(f"s3proxy exited during start-up; last lines of {self.log_file}:\n{log_tail(self.log_file, 15)}")
            if self._answers():
                return
            if time.monotonic() > deadline:
                raise ObjectStoreError(f"s3proxy not ready after {timeout:g} s at {self.endpoint}; "
                                       f"last lines of {self.log_file}:\n{log_tail(self.log_file, 15)}")
            time.sleep(0.3)

    def _answers(self) -> bool:
        try:
            self.client().list_buckets()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - not answering yet; the caller's deadline decides
            return False
        return True

    def stop(self, timeout: float = 20) -> None:
        pid = self.pid()
        if pid is not None and terminate([pid], timeout, "s3proxy"):
            raise ObjectStoreError(f"s3proxy pid {pid} survived SIGKILL")
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
            self._process = None
        self.pid_file.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store_command", metavar="{start,stop,status}", choices=["start", "stop", "status"])
    parser.add_argument("--port", dest="store_port", type=int, default=DEFAULT_PORT,
                        help=f"S3 API port on 127.0.0.1 (default {DEFAULT_PORT})")
    parser.add_argument("--data-dir", dest="store_data_dir", type=Path, default=None,
                        help="buckets, config and log (default: <repo>/var/object-store)")


def run(args: argparse.Namespace) -> int:
    store = ObjectStore(ObjectStoreConfig(port=args.store_port,
                                          data_dir=args.store_data_dir or default_data_dir()))
    try:
        if args.store_command == "start":
            store.config.data_dir.mkdir(parents=True, exist_ok=True)
            store.start()
            print(f"object-store: running pid {store.pid()} at {store.endpoint}, bucket {DEFAULT_BUCKET}; "
                  f"log {store.log_file}")
            print("a job's state there: in its config\n  checkpointing:\n"
                  f"    directory: s3://{DEFAULT_BUCKET}/<job name>\n  flink:")
            for key, value in store.flink_settings().items():
                print(f"    {key}: {value!r}")
            print("and in the environment of `llmstream run` (and of `llmstream cluster start`):")
            for name in store.credentials_env():
                print(f"  export {name}=...   # see {store.properties_file} (s3proxy.identity / credential)")
            return 0
        if args.store_command == "stop":
            pid = store.pid()
            store.stop()
            print(f"object-store: stopped pid {pid}" if pid else "object-store: not running")
            return 0
        pid = store.pid()
        print(f"object-store: running pid {pid} at {store.endpoint}" if pid else "object-store: not running")
        return 0 if pid else 1
    except (ObjectStoreError, OSError) as exc:
        print(f"object-store: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmstream object-store", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
