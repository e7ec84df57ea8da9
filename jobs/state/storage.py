"""Where a job's state directory lives: a local directory or an S3 bucket, behind one small seam.

`StateStore` is what the state directory (`jobs/state/snapshots.py`) needs of a file system:
list the files under a prefix with their modification times, read, write, delete and test one,
and say whether it is reachable at all. Keys are ``/``-separated paths relative to the state
directory (``checkpoints/<job id>/chk-7/_metadata``, ``job.json``, ``run.json``). `LocalStore`
is a directory; `S3Store` is a prefix of a bucket (``s3://bucket/prefix``, also ``s3a://``).
`store_for` picks by the location's scheme.

**Why boto3 for S3, not Flink's own FileSystem through the py4j gateway.** Every command reads
the state before any JVM exists: the newest snapshot is chosen, the identity record checked and
the run's lease taken before the mini cluster starts, a bad endpoint must be one line at start,
and ``llmstream status``/``submit`` never start a JVM of their own. boto3 is the maintained AWS
client, reads the AWS standard credential chain as Flink's S3A does, and is fed the same
settings as Flink (`S3Settings.from_flink`): the job's ``flink:`` keys ``s3.endpoint``,
``s3.path.style.access``, ``s3.access-key``/``s3.secret-key`` (these two only as ``${env:…}`` or
``${file:…}`` references in practice; they are resolved here, handed to boto3 and never
printed), else ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or the credentials file.

Object stores have no directories and no ``flock``: a directory "exists" once a key is under
it, and the run lease (`jobs.state.snapshots.StateDir.exclusive`) is an object of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from udfs import secret_refs
from udfs.errors import ConfigError, LLMStreamError

__all__ = ["ACCESS_KEYS", "S3_SCHEMES", "SECRET_KEYS", "LocalStore", "S3Settings", "S3Store", "StateStore", "StoreError",
           "StoredFile", "is_secret_key", "local_path", "store_for"]

S3_SCHEMES = ("s3", "s3a")
"""The schemes `S3Store` serves (Flink's flink-s3-fs-hadoop registers both)."""
ACCESS_KEYS = ("s3.access-key", "s3.access.key", "fs.s3a.access.key")
SECRET_KEYS = ("s3.secret-key", "s3.secret.key", "fs.s3a.secret.key")


def is_secret_key(key: str) -> bool:
    """Whether a `flink:` key holds an S3 credential: kept out of Flink's configuration
    (`jobs/graph/pipeline.py`), which its REST API shows, and given through the environment."""
    return key in ACCESS_KEYS or key in SECRET_KEYS


class StoreError(LLMStreamError, OSError):
    """The store cannot be reached or refused a request; the message names no credential. An
    `OSError`, as a local file system's failures are, so callers handle both alike."""


@dataclass(frozen=True)
class StoredFile:
    """One file under a store: its key relative to the store's root and when it was last written."""

    key: str
    modified: float


class StateStore(ABC):
    """A state directory's file system. ``uri`` is the directory as Flink names it."""

    uri: str
    local: bool = False

    @abstractmethod
    def list(self, prefix: str) -> Iterator[StoredFile]:
        """Every file whose key starts with ``prefix`` (recursively), in no particular order."""

    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """The file's content, None if there is none."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Writes the file whole (a reader sees the old content or the new, never a part)."""

    @abstractmethod
    def delete(self, prefix: str) -> None:
        """Deletes the file ``prefix`` or everything under the directory ``prefix`` (ends with ``/``)."""

    def exists(self, key: str) -> bool:
        """Whether the file ``key``, or anything under the directory ``key/``, exists."""
        return self.read(key) is not None or next(iter(self.list(key.rstrip("/") + "/")), None) is not None

    @abstractmethod
    def check(self, *, create: bool) -> None:
        """Raises `StoreError` (one line) unless the store answers and, with ``create``, takes writes."""

    def describe(self) -> str:
        """Where the store answers, for error messages: never a credential."""
        return self.uri


def local_path(location: str) -> Path | None:
    """The local directory a path or ``file:`` URI names; None for another file system."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and location[1:3] in (":\\", ":/")):
        return Path(location).expanduser().resolve()
    return None


class LocalStore(StateStore):
    """A directory on this machine's file system."""

    local = True

    def __init__(self, path: Path) -> None:
        self.path = path
        self.uri = path.as_uri()

    def list(self, prefix: str) -> Iterator[StoredFile]:
        base = self.path / prefix if prefix.endswith("/") else self.path / prefix.rpartition("/")[0]
        if not base.is_dir():
            return
        for root, _, files in os.walk(base):
            for name in files:
                full = Path(root) / name
                key = full.relative_to(self.path).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(OSError):
                        yield StoredFile(key, full.stat().st_mtime)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.path / key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def write(self, key: str, data: bytes) -> None:
        target = self.path / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def delete(self, prefix: str) -> None:
        target = self.path / prefix.rstrip("/")
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return (self.path / key).exists()

    def check(self, *, create: bool) -> None:
        """Nothing to reach: `jobs/state/location.py` checks a local directory itself."""


@dataclass(frozen=True)
class S3Settings:
    """What the S3 client is given, from the job's ``flink:`` section (Flink's own keys).

    ``access_key``/``secret_key`` may hold ``${env:…}``/``${file:…}`` references; they are resolved
    only when the client is made. Without them the AWS standard chain applies."""

    endpoint: str | None = None
    path_style: bool = False
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None

    @classmethod
    def from_flink(cls, flink: Mapping[str, str]) -> S3Settings:
        """The settings Flink's S3 file system would read from ``flink``. Raises a `ConfigError`
        naming the ``flink.`` key whose value Flink would misread or silently ignore: an
        ``s3.path.style.access`` that is not true/false (Hadoop falls back to virtual-host
        addressing, which an S3-compatible store answers with an unknown bucket), an
        ``s3.endpoint`` that is not an http(s) URL."""
        def named(*names: str) -> tuple[str, str | None]:
            for name in names:
                if flink.get(name) not in (None, ""):
                    return name, str(flink[name]).strip()
            return names[0], None

        style_key, style = named("s3.path.style.access", "fs.s3a.path.style.access")
        if style is not None and style.lower() not in ("true", "false"):
            raise ConfigError(f"flink.{style_key}", f"is {style!r}; write true (most S3-compatible stores) or false")
        ssl_key, ssl = named("s3.connection.ssl.enabled", "fs.s3a.connection.ssl.enabled")
        if ssl is not None and ssl.lower() not in ("true", "false"):
            raise ConfigError(f"flink.{ssl_key}", f"is {ssl!r}; write true or false")
        endpoint_key, endpoint = named("s3.endpoint", "fs.s3a.endpoint")
        if endpoint is not None:
            endpoint = _endpoint_url(endpoint_key, endpoint, ssl=(ssl or "true").lower() == "true")
        return cls(endpoint=endpoint, path_style=(style or "").lower() == "true",
                   region=named("s3.endpoint.region", "fs.s3a.endpoint.region")[1],
                   access_key=named(*ACCESS_KEYS)[1], secret_key=named(*SECRET_KEYS)[1])

    def credentials(self) -> dict[str, str]:
        """boto3's explicit key pair (resolved), or nothing for the AWS standard chain."""
        if self.access_key is None or self.secret_key is None:
            return {}
        return {"aws_access_key_id": secret_refs.resolve(self.access_key, "flink.s3.access-key"),
                "aws_secret_access_key": secret_refs.resolve(self.secret_key, "flink.s3.secret-key")}


def _endpoint_url(key: str, endpoint: str, *, ssl: bool) -> str:
    """``endpoint`` as a URL boto3 takes. Hadoop's S3A takes a bare ``host[:port]`` too, and then
    speaks https unless ``s3.connection.ssl.enabled`` is false: the same here, so that both readers
    of the state directory reach the same place."""
    parsed = urlparse(endpoint if "://" in endpoint else f"{'https' if ssl else 'http'}://{endpoint}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"flink.{key}", f"is {endpoint!r}; write http://HOST:PORT or https://HOST[:PORT] "
                                         "(or leave it out for AWS S3)")
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ConfigError(f"flink.{key}", f"is {endpoint!r}: its port is not a number") from None
    return parsed.geturl()


CREDENTIALS_HINT = ("set s3.access-key and s3.secret-key in the job's flink: section (as ${env:…} or ${file:…} "
                    "references), or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment")
_REFUSED_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                        "ExpiredToken", "AuthorizationHeaderMalformed")


# botocore says at INFO which link of the AWS chain gave the credentials ("Found credentials in
# environment variables."): a second line beside a command's one-line refusal, and on every start.
logging.getLogger("botocore.credentials").setLevel(logging.WARNING)

CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 20.0


class S3Store(StateStore):
    """A prefix of an S3 bucket (``s3://bucket/prefix``), through boto3 with `S3Settings`."""

    def __init__(self, location: str, settings: S3Settings) -> None:
        parsed = urlparse(location)
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.uri = f"{parsed.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.settings = settings
        self._client: Any = None

    def describe(self) -> str:
        return f"{self.uri} at s3.endpoint {self.settings.endpoint}" if self.settings.endpoint else self.uri

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3  # type: ignore[import-untyped]
            from botocore.config import Config  # type: ignore[import-untyped]

            settings = self.settings
            config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                            retries={"max_attempts": 2, "mode": "standard"},
                            s3={"addressing_style": "path" if settings.path_style else "auto"},
                            # S3-compatible stores (s3proxy) refuse the newer default checksum headers.
                            request_checksum_calculation="when_required",
                            response_checksum_validation="when_required")
            self._client = boto3.session.Session().client(
                "s3", endpoint_url=settings.endpoint, config=config,
                region_name=settings.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                or "us-east-1", **settings.credentials())
        return self._client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        from botocore.exceptions import (  # type: ignore[import-untyped]
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        try:
            yield
        except ClientError as err:
            error = err.response.get("Error", {})
            code = str(error.get("Code", "error"))
            said = f"{code} {error.get('Message', '')}".strip()
            if code == "NoSuchBucket":
                raise StoreError(f"{what}: the bucket {self.bucket!r} does not exist ({said})") from None
            if code in _REFUSED_CREDENTIALS:
                raise StoreError(f"{what}: the store refused the credentials ({said}); {CREDENTIALS_HINT}") from None
            raise StoreError(f"{what}: {said}") from None
        except (NoCredentialsError, PartialCredentialsError):
            raise StoreError(f"{what}: no S3 credentials found; {CREDENTIALS_HINT}") from None
        except BotoCoreError as err:
            raise StoreError(f"{what}: {err}") from None

    def list(self, prefix: str) -> Iterator[StoredFile]:
        with self._errors(f"cannot list {self.uri}/{prefix}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                for item in page.get("Contents", ()):
                    if not item["Key"].endswith("/"):  # directory markers some stores and S3A write
                        yield StoredFile(self._relative(item["Key"]), item["LastModified"].timestamp())

    def read(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError  # type: ignore[import-untyped]

        with self._errors(f"cannot read {self.uri}/{key}"):
            try:
                data: bytes = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
                return data
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise

    def write(self, key: str, data: bytes) -> None:
        with self._errors(f"cannot write {self.uri}/{key}"):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def delete(self, prefix: str) -> None:
        """One request per object: S3-compatible stores (s3proxy) refuse the checksum header boto3
        puts on a batch delete, and a snapshot holds a few files."""
        keys = [self._key(f.key) for f in self.list(prefix)] if prefix.endswith("/") else [self._key(prefix)]
        with self._errors(f"cannot delete {self.uri}/{prefix}"):
            for key in keys:
                self.client.delete_object(Bucket=self.bucket, Key=key)

    def check(self, *, create: bool) -> None:
        """The bucket answers a listing; with ``create`` a probe object is written and removed."""
        with self._errors(f"cannot be reached at s3.endpoint {self.settings.endpoint or '(AWS default)'}"):
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(""), MaxKeys=1)
        if create:
            probe = f".llmstream-probe-{os.getpid()}"
            with self._errors(f"does not take writes at s3.endpoint {self.settings.endpoint or '(AWS default)'}"):
                self.client.put_object(Bucket=self.bucket, Key=self._key(probe), Body=b"")
                self.client.delete_object(Bucket=self.bucket, Key=self._key(probe))


def store_for(location: str, flink: Mapping[str, str] | None = None) -> StateStore | None:
    """The store of a state directory ``location``: local for a path or ``file:`` URI, `S3Store`
    (with `S3Settings` from ``flink``, the job's ``flink:`` section) for ``s3://``/``s3a://``,
    None for any other file system (Flink may still write there; nothing here can read it)."""
    path = local_path(location)
    if path is not None:
        return LocalStore(path)
    if urlparse(location).scheme in S3_SCHEMES:
        return S3Store(location, S3Settings.from_flink(flink or {}))
    return None
