#!/usr/bin/env python3
"""Fetch the project's JVM jars from Maven Central without keeping a pom in the repo.

The jars are pinned by ``manifest.tsv`` (coordinates plus sha256), which acts as a
lock file. ``--lock`` regenerates it from ``ROOTS`` by letting Maven resolve the
runtime classpath of each set; the default mode downloads exactly the locked
coordinates (transitive resolution switched off) and refuses any jar whose hash
differs. Standard library only, so it runs before any virtualenv exists.

Usage: python pom-free/fetch.py [--set connector|broker|metrics|ml-predict|...|all] [--lock] [--cache-dir DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.tsv"
DEFAULT_CACHE = HERE / "cache"

# The roots each set is resolved from by --lock. The manifest is generated output.
# slf4j-api is pinned because kafka_2.13 pulls 1.7.36 transitively, which does not
# bind to log4j-slf4j2-impl; a direct dependency wins Maven's nearest-first mediation.
ROOTS: dict[str, tuple[str, ...]] = {
    # The newest Kafka connector on Maven Central, built for Flink 2.2; none is built for 2.3, and
    # this one runs on apache-flink 2.3.0 (the integration and fault tests, the 2.2 -> 2.3 savepoint test).
    "connector": ("org.apache.flink:flink-sql-connector-kafka:5.0.0-2.2",),
    # Flink's Prometheus reporter, same version as apache-flink (its client is shaded inside).
    "metrics": ("org.apache.flink:flink-metrics-prometheus:2.3.0",),
    "broker": (
        "org.apache.kafka:kafka_2.13:4.1.1",
        "org.apache.logging.log4j:log4j-slf4j2-impl:2.24.3",
        "org.apache.logging.log4j:log4j-core:2.24.3",
        "org.slf4j:slf4j-api:2.0.17",
    ),
    # Only for its CRD YAML (META-INF/fabric8/flinkdeployments.flink.apache.org-v1.yml), which
    # tests/integration/test_kubernetes.py validates flink-conf/kubernetes/ against. 1.10.0 is the
    # newest release Maven Central serves to this machine.
    "operator-crd": ("org.apache.flink:flink-kubernetes-operator-api:1.10.0",),
    # Flink's own SQL ML_PREDICT with the openai model provider, the peer `llmstream bench`
    # compares with (approach ml-predict). Self-contained: openai-java and OkHttp are shaded inside.
    "ml-predict": ("org.apache.flink:flink-model-openai:2.3.0",),
    # A Confluent-compatible Schema Registry for the Avro tests and developers (jobs/dev/schema_registry.py):
    # Apicurio's Quarkus distribution, one tar.gz with its own lib/. 3.0.9 because its runner jar
    # runs on Java 17, which is what a fresh machine has (3.x from 3.1 on needs Java 21).
    "registry": ("io.apicurio:apicurio-registry-app:3.0.9:all",),
    # Flink's S3 file system (Hadoop's S3A shaded inside), for state on `s3://` (jobs/state/storage.py):
    # on the mini cluster's classpath (jobs/graph/pipeline.py) and in a standalone cluster's
    # plugins/s3-fs-hadoop/ (jobs/dev/local_cluster.py). The presto variant hung here.
    "s3": ("org.apache.flink:flink-s3-fs-hadoop:2.3.0",),
    # A real S3-compatible server for the tests and developers (jobs/dev/object_store.py), its
    # filesystem backend keeping buckets as directories.
    "objectstore": ("org.gaul:s3proxy:2.6.0",),
    # A ZooKeeper server for a highly available standalone cluster (jobs/dev/zookeeper.py,
    # `llmstream cluster start --ha`); Flink's ZooKeeper client is shaded inside flink-dist.
    # metrics-core and snappy-java are provided dependencies of zookeeper, but its server fails
    # without them (NoClassDefFoundError: com/codahale/metrics/Reservoir at start, then
    # org/xerial/snappy/SnappyInputStream at its first snapshot: it answers "not currently serving").
    # log4j's SLF4J binding, so its errors reach zookeeper.log (log4j's default: ERROR to the console).
    "zookeeper": (
        "org.apache.zookeeper:zookeeper:3.9.4",
        "io.dropwizard.metrics:metrics-core:4.1.12.1",
        "org.xerial.snappy:snappy-java:1.1.10.5",
        "org.apache.logging.log4j:log4j-slf4j2-impl:2.24.3",
        "org.apache.logging.log4j:log4j-core:2.24.3",
    ),
}
# Sets locked as their roots alone, without the roots' dependencies (nothing here runs them,
# or the artifact carries its own).
INTRANSITIVE: frozenset[str] = frozenset({"operator-crd", "registry", "s3"})
# Sets whose artifacts are archives of that type rather than jars; fetch_set unpacks each
# beside itself (``cache/<set>/<archive name without the extension>/``).
ARCHIVES: dict[str, str] = {"registry": "tar.gz"}
# Sets whose root's parent pom Maven Central does not serve (flink-model-openai:2.3.0 names
# org.apache.flink:flink-models:2.3.0, which is not published): copy-dependencies cannot read
# their descriptor, so they are the root jars alone, fetched with `dependency:get -U
# -Dtransitive=false` (`run_mvn_get`).
POMLESS: frozenset[str] = frozenset({"ml-predict", "registry"})
SETS: tuple[str, ...] = tuple(ROOTS)

# Pinned so resolution and output naming do not depend on Maven's built-in default.
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"


class FetchError(Exception):
    """Raised for any failure a caller should report and exit on."""


@dataclass(frozen=True, order=True)
class Entry:
    """One locked jar: its set, Maven coordinates and expected sha256."""

    set_name: str
    coord: str
    sha256: str

    @property
    def parts(self) -> tuple[str, str, str, str | None]:
        bits = self.coord.split(":")
        if len(bits) not in (3, 4) or not all(bits):
            raise FetchError(f"bad coordinate {self.coord!r}: want group:artifact:version[:classifier]")
        return bits[0], bits[1], bits[2], bits[3] if len(bits) == 4 else None

    @property
    def extension(self) -> str:
        """``jar``, or the archive type of a set in ``ARCHIVES``."""
        return ARCHIVES.get(self.set_name, "jar")

    @property
    def filename(self) -> str:
        """The flat file name ``copy-dependencies`` gives the jar, also its name in the cache."""
        _, artifact, version, classifier = self.parts
        return f"{artifact}-{version}{'-' + classifier if classifier else ''}.{self.extension}"

    @property
    def unpacked_name(self) -> str:
        """The directory an archive is unpacked into (its file name without the extension)."""
        return self.filename.removesuffix(f".{self.extension}")


def cache_root() -> Path:
    """The cache root: ``$LLMSTREAM_JAR_CACHE`` if set, else ``pom-free/cache``."""
    env = os.environ.get("LLMSTREAM_JAR_CACHE")
    return Path(env).expanduser().resolve() if env else DEFAULT_CACHE


def read_manifest(path: Path = MANIFEST) -> list[Entry]:
    """Parse the manifest; malformed rows raise so a bad lock never half-works."""
    entries: list[Entry] = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        cols = line.split("\t")
        if len(cols) != 3:
            raise FetchError(f"{path}:{lineno}: want 3 tab-separated columns, got {len(cols)}")
        set_name, coord, sha = cols
        if set_name not in ROOTS:
            raise FetchError(f"{path}:{lineno}: unknown set {set_name!r}")
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise FetchError(f"{path}:{lineno}: sha256 must be 64 lowercase hex digits")
        entry = Entry(set_name, coord, sha)
        entry.parts  # noqa: B018 - validates the coordinate early
        entries.append(entry)
    return entries


def entries_for(set_name: str, entries: Sequence[Entry]) -> list[Entry]:
    return [e for e in entries if e.set_name == set_name]


def write_manifest(entries: Iterable[Entry], path: Path = MANIFEST) -> None:
    rows = sorted(entries)
    lines = [
        "# pom-free lock file. Generated by `python pom-free/fetch.py --lock`; do not edit by hand.",
        "# To change a version, edit ROOTS in pom-free/fetch.py and re-run --lock.",
        "# columns: set<TAB>group:artifact:version[:classifier]<TAB>sha256",
    ]
    for set_name in sorted(ROOTS):
        lines += [f"# root {set_name} {coord}" for coord in ROOTS[set_name]]
    lines += [f"{e.set_name}\t{e.coord}\t{e.sha256}" for e in rows]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def stale_entries(directory: Path, entries: Sequence[Entry]) -> list[Entry]:
    """Entries whose jar is absent from ``directory`` or has the wrong hash."""
    return [
        e for e in entries
        if not (directory / e.filename).is_file() or sha256_of(directory / e.filename) != e.sha256
    ]


def verify(directory: Path, entries: Sequence[Entry]) -> None:
    """Check every jar in ``directory`` against its locked hash.

    Bad or missing jars are deleted so a later run cannot pick them up, and a
    FetchError names each one with the expected and actual hash.
    """
    problems: list[str] = []
    for e in entries:
        jar = directory / e.filename
        if not jar.is_file():
            problems.append(f"{e.coord}: {jar.name} missing")
            continue
        actual = sha256_of(jar)
        if actual != e.sha256:
            jar.unlink()
            problems.append(f"{e.coord}: {jar.name} sha256 mismatch: expected {e.sha256}, got {actual}")
    if problems:
        raise FetchError("jar verification failed:\n  " + "\n  ".join(problems))


def _dependency_xml(coord: str, exclude_all: bool, extension: str = "jar") -> str:
    bits = coord.split(":")
    group, artifact, version = bits[:3]
    classifier = f"<classifier>{escape(bits[3])}</classifier>" if len(bits) == 4 else ""
    if extension != "jar":
        classifier += f"<type>{escape(extension)}</type>"
    exclusions = (
        "<exclusions><exclusion><groupId>*</groupId><artifactId>*</artifactId></exclusion></exclusions>"
        if exclude_all else ""
    )
    return (
        f"    <dependency><groupId>{escape(group)}</groupId><artifactId>{escape(artifact)}</artifactId>"
        f"<version>{escape(version)}</version>{classifier}{exclusions}</dependency>"
    )


def render_pom(coords: Iterable[str], *, exclude_all: bool, extension: str = "jar") -> str:
    """A throwaway pom whose only purpose is to hold ``coords`` as dependencies."""
    deps = "\n".join(_dependency_xml(c, exclude_all, extension) for c in coords)
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>llmstream.pomfree</groupId>
  <artifactId>throwaway</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
{deps}
  </dependencies>
</project>
"""


def run_mvn(coords: Sequence[str], output_dir: Path, *, exclude_all: bool, repository_layout: bool,
            extension: str = "jar") -> None:
    """Run ``copy-dependencies`` (runtime scope) on a pom written to a temp dir outside the repo."""
    if shutil.which("mvn") is None:
        raise FetchError("mvn not found on PATH; install Maven (apt-get install maven)")
    with tempfile.TemporaryDirectory(prefix="pom-free-") as tmp:
        pom = Path(tmp) / "pom.xml"
        pom.write_text(render_pom(coords, exclude_all=exclude_all, extension=extension), encoding="utf-8")
        cmd = [
            "mvn", "-B", "-q", "-f", str(pom),
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={output_dir}",
            f"-Dmdep.useRepositoryLayout={'true' if repository_layout else 'false'}",
        ]
        proc = subprocess.run(cmd, check=False, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise FetchError(f"mvn failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


# `get` of the 2.x plugin skips a descriptor it cannot read when transitive resolution is off,
# and writes the jar where `dest` says; 3.x fails on the missing parent pom and has no `dest`.
POMLESS_GET_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:2.8"


def run_mvn_get(coords: Sequence[str], output_dir: Path, set_name: str = "") -> None:
    """The jars (or a set's archives) of ``coords`` alone (no descriptor, no dependencies) into
    ``output_dir`` under their flat names: for the ``POMLESS`` sets, whose parent pom
    copy-dependencies cannot read."""
    if shutil.which("mvn") is None:
        raise FetchError("mvn not found on PATH; install Maven (apt-get install maven)")
    output_dir.mkdir(parents=True, exist_ok=True)
    for coord in coords:
        entry = Entry(set_name, coord, "0" * 64)
        target = output_dir / entry.filename
        artifact = coord
        if entry.extension != "jar":  # get's form is group:artifact:version:packaging:classifier
            group, name, version, classifier = entry.parts
            artifact = f"{group}:{name}:{version}:{entry.extension}" + (f":{classifier}" if classifier else "")
        cmd = ["mvn", "-B", "-q", "-U", f"{POMLESS_GET_PLUGIN}:get", f"-Dartifact={artifact}", "-Dtransitive=false",
               f"-Ddest={target}"]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if proc.returncode != 0 or not target.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise FetchError(f"mvn failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _coord_from_layout(rel: Path, extension: str = "jar") -> str:
    """Recover ``group:artifact:version[:classifier]`` from a repository-layout path."""
    *group, artifact, version, filename = rel.parts
    prefix = f"{artifact}-{version}"
    if not filename.endswith(f".{extension}") or not filename.startswith(prefix):
        raise FetchError(f"unexpected artifact {rel}: only plain {extension} files are supported")
    rest = filename[len(prefix):-len(f".{extension}")]
    coord = f"{'.'.join(group)}:{artifact}:{version}"
    return coord + (f":{rest[1:]}" if rest else "")


def _is_repo_metadata(name: str) -> bool:
    """Bookkeeping files Maven copies alongside artifacts in repository layout."""
    return name == "_remote.repositories" or name.startswith("maven-metadata") or name.endswith(
        (".sha1", ".md5", ".lastUpdated")
    )


def resolve_set(set_name: str) -> list[Entry]:
    """Resolve the runtime classpath of one set's roots and hash every jar."""
    if set_name in POMLESS:
        with tempfile.TemporaryDirectory(prefix=f"pom-free-lock-{set_name}-") as tmp:
            run_mvn_get(ROOTS[set_name], Path(tmp), set_name)
            return [Entry(set_name, coord, sha256_of(Path(tmp) / Entry(set_name, coord, "0" * 64).filename))
                    for coord in ROOTS[set_name]]
    with tempfile.TemporaryDirectory(prefix=f"pom-free-lock-{set_name}-") as tmp:
        out = Path(tmp) / "out"
        extension = ARCHIVES.get(set_name, "jar")
        run_mvn(ROOTS[set_name], out, exclude_all=set_name in INTRANSITIVE, repository_layout=True,
                extension=extension)
        entries = [
            Entry(set_name, _coord_from_layout(jar.relative_to(out), extension), sha256_of(jar))
            for jar in sorted(out.rglob("*")) if jar.is_file() and not _is_repo_metadata(jar.name)
        ]
    names = [e.filename for e in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise FetchError(f"set {set_name}: jar file names collide in the flat cache: {dupes}")
    if not entries:
        raise FetchError(f"set {set_name}: mvn resolved no jars")
    return entries


def lock(sets: Sequence[str]) -> None:
    """Re-resolve ``sets`` and rewrite the manifest, keeping rows of other sets as they are."""
    previous = read_manifest() if MANIFEST.exists() else []
    kept = [e for e in previous if e.set_name not in sets]
    for set_name in sets:
        started = time.monotonic()
        resolved = resolve_set(set_name)
        kept += resolved
        print(f"pom-free: {set_name}: locked {len(resolved)} jars ({time.monotonic() - started:.1f}s)")
    write_manifest(kept)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Serialise fetches so two processes never swap the same set directory at once."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_set(set_name: str, entries: Sequence[Entry], root: Path) -> str:
    """Make ``root/<set>`` hold exactly the locked jars; returns a one-line status."""
    wanted = entries_for(set_name, entries)
    if not wanted:
        raise FetchError(f"manifest has no rows for set {set_name!r}; run --lock")
    target = root / set_name
    if target.is_dir() and not stale_entries(target, wanted):
        extras = {p.name for p in target.glob("*.jar")} - {e.filename for e in wanted}
        if not extras:
            unpack_archives(target, wanted, root)
            return f"pom-free: {set_name}: {len(wanted)} jars OK (cached)"
    with _locked(root):
        started = time.monotonic()
        missing = stale_entries(target, wanted) if target.is_dir() else list(wanted)
        staging = root / f".staging-{set_name}-{uuid.uuid4().hex[:8]}"
        try:
            staging.mkdir(parents=True)
            present = [e for e in wanted if e not in missing]
            for e in present:
                os.link(target / e.filename, staging / e.filename)
            if missing and set_name in POMLESS:
                run_mvn_get([e.coord for e in missing], staging, set_name)
            elif missing:
                run_mvn([e.coord for e in missing], staging, exclude_all=True, repository_layout=False,
                        extension=ARCHIVES.get(set_name, "jar"))
            verify(staging, wanted)
            unlocked = sorted(p.name for p in staging.iterdir())
            unlocked = [n for n in unlocked if n not in {e.filename for e in wanted}]
            if unlocked:
                raise FetchError(f"mvn produced unlocked files: {unlocked}")
            old = root / f".old-{set_name}-{uuid.uuid4().hex[:8]}"
            if target.exists():
                os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        took = time.monotonic() - started
    unpack_archives(target, wanted, root)
    return f"pom-free: {set_name}: {len(wanted)} jars OK (fetched {len(missing)} in {took:.1f}s)"


def unpack_archives(target: Path, entries: Sequence[Entry], root: Path) -> None:
    """Unpack each verified archive of ``entries`` into ``target/<unpacked_name>/`` once: a
    ``.sha256`` file inside records which archive it came from, and the directory appears
    whole (extracted beside it, then renamed) so a launcher never sees half of it."""
    archives = [e for e in entries if e.extension != "jar"]
    if not archives:
        return
    with _locked(root):
        for e in archives:
            into = target / e.unpacked_name
            marker = into / ".sha256"
            if marker.is_file() and marker.read_text().strip() == e.sha256:
                continue
            staging = target / f".unpack-{uuid.uuid4().hex[:8]}"
            try:
                staging.mkdir()
                with tarfile.open(target / e.filename) as archive:
                    archive.extractall(staging, filter="data")
                (staging / ".sha256").write_text(e.sha256 + "\n")
                shutil.rmtree(into, ignore_errors=True)
                os.replace(staging, into)
            finally:
                shutil.rmtree(staging, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="set_name", choices=[*SETS, "all"], default="all")
    parser.add_argument("--lock", action="store_true", help="re-resolve ROOTS and rewrite manifest.tsv")
    parser.add_argument("--cache-dir", type=Path, help="cache root (default: $LLMSTREAM_JAR_CACHE or pom-free/cache)")
    args = parser.parse_args(argv)
    sets = list(SETS) if args.set_name == "all" else [args.set_name]
    try:
        if args.lock:
            lock(sets)
        entries = read_manifest()
        root = args.cache_dir.resolve() if args.cache_dir else cache_root()
        for set_name in sets:
            print(fetch_set(set_name, entries, root))
    except FetchError as exc:
        print(f"pom-free: error: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:
        print(f"pom-free: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
