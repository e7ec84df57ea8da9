"""The llmstream image, built here without an image registry, and the broker's container entry.

No registry is reachable from this machine, so the tests cannot pull ``python:3.11-slim``.
Instead (each step cached, so a second run only asks Docker whether anything changed):

1. **base**: ``debootstrap --variant=minbase bookworm`` with Java 17, Python 3.11 and venv
   included, then ``docker import`` as ``llmstream-base:<tag>``; the Dockerfile's apt step then
   has nothing to do.
2. **wheels**: ``pip wheel`` of setup.py's dependencies into ``var/docker/wheels``, run *inside*
   the base (markers such as ``python_full_version`` are evaluated by the image's Python) with
   the host's pip cache mounted, so nothing is downloaded twice; the Dockerfile installs from it
   offline.
3. **image**: ``docker build --build-arg BASE_IMAGE=<base>`` of the repo's Dockerfile; the jars
   come from ``pom-free/cache`` in the build context.

``python -m jobs.dev.containers image`` runs all three (``make test`` starts it in the
background); ``python -m jobs.dev.containers kafka`` is the broker's foreground entry in the
compose file. A file lock serialises builds, so a test that needs the image waits for the
background build instead of starting a second one.
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
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from jobs.runtime import jars
from udfs.errors import LLMStreamError

IMAGE = "llmstream:local"
SUITE = "bookworm"
# Everything the Dockerfile would otherwise apt-get; the tag changes when this list does.
BASE_PACKAGES = ("openjdk-17-jre-headless", "python3", "python3-venv", "procps", "ca-certificates")
BASE_IMAGE = "llmstream-base:" + SUITE + "-" + hashlib.sha256(",".join(BASE_PACKAGES).encode()).hexdigest()[:8]
# The host's trust store: pip inside the base must trust what the host's pip trusts.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


class ContainerError(LLMStreamError, RuntimeError):
    """A step of the image build failed; the message carries the command's last output."""


def work_dir() -> Path:
    return jars.repo_root() / "var" / "docker"


def wheel_dir() -> Path:
    return work_dir() / "wheels"


def _run(cmd: Sequence[str], *, timeout: float, **kwargs: object) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise ContainerError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{tail}")
    return str(proc.stdout)


def docker_ready() -> bool:
    """The engine answers (``docker info``)."""
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True, timeout=30,
                          check=False).returncode == 0


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    work_dir().mkdir(parents=True, exist_ok=True)
    with (work_dir() / ".build.lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_base() -> str:
    """``llmstream-base:<tag>`` from debootstrap + ``docker import``; reused while it exists."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    if shutil.which("debootstrap") is None:
        raise ContainerError("debootstrap not found: apt-get install -y debootstrap (make docker)")
    rootfs = work_dir() / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs)],
         timeout=900)
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (rootfs / cache).glob("*"):
            if path.is_file():
                path.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        _run(["docker", "import", "-", BASE_IMAGE], timeout=300, stdin=tar.stdout)
    finally:
        if tar.stdout:
            tar.stdout.close()
        tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_IMAGE


def _wheel_inputs() -> str:
    setup = (jars.repo_root() / "setup.py").read_bytes()
    return hashlib.sha256(setup + BASE_IMAGE.encode()).hexdigest()


def ensure_wheels(base: str) -> Path:
    """A wheelhouse of setup.py's dependencies for the base's Python; rebuilt when setup.py changes."""
    out = wheel_dir()
    stamp = work_dir() / "wheels.stamp"
    if out.is_dir() and stamp.is_file() and stamp.read_text() == _wheel_inputs():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    pip_cache = Path.home() / ".cache" / "pip"
    pip_cache.mkdir(parents=True, exist_ok=True)
    cmd = ["docker", "run", "--rm", "--network", "host",
           "-v", f"{pip_cache}:/root/.cache/pip",
           "-v", f"{jars.repo_root() / 'setup.py'}:/tmp/project/setup.py:ro",
           "-v", f"{out}:/out"]
    if HOST_CA_BUNDLE.is_file():
        cmd += ["-v", f"{HOST_CA_BUNDLE}:/etc/ssl/certs/ca-certificates.crt:ro",
                "-e", "PIP_CERT=/etc/ssl/certs/ca-certificates.crt"]
    script = ("python3 -m venv /tmp/venv && /tmp/venv/bin/pip wheel -q -w /out setuptools wheel"
              " && /tmp/venv/bin/pip install -q --no-index --find-links /out setuptools wheel"
              " && /tmp/venv/bin/pip wheel -q --no-build-isolation -w /out /tmp/project"
              " && rm -f /out/llmstream-*.whl")
    _run([*cmd, base, "sh", "-c", script], timeout=900)
    stamp.write_text(_wheel_inputs())
    return out


def ensure_image(*, log: bool = False) -> str:
    """Base, wheelhouse and ``docker build``: returns the image name. Docker's layer cache makes
    an unchanged rebuild a few seconds; a source change rebuilds only the last layers."""
    with _build_lock():
        steps: list[str] = []
        started = time.monotonic()
        base = ensure_base()
        steps.append(f"base {time.monotonic() - started:.0f}s")
        mark = time.monotonic()
        jars.ensure("connector")
        jars.ensure("metrics")
        jars.ensure("broker")
        jars.ensure("s3")  # the image's S3 file system plugin (Dockerfile)
        ensure_wheels(base)
        steps.append(f"wheels+jars {time.monotonic() - mark:.0f}s")
        mark = time.monotonic()
        _run(["docker", "build", "--force-rm", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE,
              str(jars.repo_root())], timeout=1800)
        steps.append(f"build {time.monotonic() - mark:.0f}s")
        if log:
            print(f"containers: {IMAGE} ready ({', '.join(steps)}; {time.monotonic() - started:.0f}s in all)")
        return IMAGE


# ------------------------------------------------------------------ the broker in a container

def run_broker(port: int, controller_port: int, host_port: int, advertised_host: str, data_dir: Path) -> int:
    """Format (once) and exec a KRaft broker in the foreground, as PID 1 of its container.

    Two client listeners: ``PLAINTEXT`` on ``port`` for the other containers (advertised as
    ``advertised_host``), and ``HOST`` on ``host_port`` advertised as 127.0.0.1, which the compose
    file publishes on the same port for clients on the host.
    """
    from jobs.dev.local_kafka import BrokerConfig, LocalBroker, _java

    listeners = f"PLAINTEXT://0.0.0.0:{port},CONTROLLER://127.0.0.1:{controller_port},HOST://0.0.0.0:{host_port}"
    broker = LocalBroker(BrokerConfig(
        port=port, controller_port=controller_port, data_dir=data_dir, extra_properties={
            "listeners": listeners,
            "advertised.listeners": (f"PLAINTEXT://{advertised_host}:{port},"
                                     f"CONTROLLER://127.0.0.1:{controller_port},HOST://127.0.0.1:{host_port}"),
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,HOST:PLAINTEXT",
        }))
    broker.data_dir.mkdir(parents=True, exist_ok=True)
    broker._write_config()
    broker._format_storage()
    cmd = [_java(), "-Xmx512m", "-Xms512m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
           f"-Dlog4j2.configurationFile={broker.log4j_file}", "-cp", jars.classpath("broker"),
           "kafka.Kafka", str(broker.properties_file)]
    print(f"containers: kafka on :{port} (containers) and :{host_port} (host), log {broker.log_file}", flush=True)
    os.execv(cmd[0], cmd)
    return 1  # pragma: no cover - execv does not return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.containers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("image", help=f"make the base, the wheelhouse and {IMAGE} (cached)")
    kafka = sub.add_parser("kafka", help="run a KRaft broker in the foreground (the compose file's kafka)")
    kafka.add_argument("--port", type=int, default=9092)
    kafka.add_argument("--controller-port", type=int, default=9093)
    kafka.add_argument("--host-port", type=int, default=9094)
    kafka.add_argument("--advertised-host", default="kafka")
    kafka.add_argument("--data-dir", type=Path, default=Path("/llmstream/var/kafka"))
    args = parser.parse_args(argv)
    if args.command == "kafka":
        return run_broker(args.port, args.controller_port, args.host_port, args.advertised_host, args.data_dir)
    try:
        ensure_image(log=True)
    except (ContainerError, subprocess.TimeoutExpired) as exc:
        print(f"containers: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
