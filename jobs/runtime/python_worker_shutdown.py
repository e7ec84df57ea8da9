"""The expected noise of PyFlink's in-process Python workers when a mini cluster stops, kept quiet.

`llmstream run` runs its Python operators in loopback mode: Beam's SDK harness runs in the
command's own process. When the job stops (Ctrl-C stops it with a savepoint), and again when the
process exits (PyFlink stops its worker server from an ``atexit`` hook), the harness's gRPC
streams are closed under it: its reader thread dies with a CANCELLED error, and a bundle still
waiting for input prints ``RuntimeError: Channel closed prematurely.`` with its traceback to
``sys.stderr``. Both say only that the job ended, so they go to the debug log instead.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

log = logging.getLogger("llmstream.run")

CHANNEL_CLOSED = "RuntimeError: Channel closed prematurely."

__all__ = ["QuietWorkerStderr", "install", "quiet_worker_shutdown"]


class QuietWorkerStderr:
    """A stream (``sys.stderr``) less the traceback Beam's harness prints, with ``print(traceback,
    file=sys.stderr)``, when its data channel closes in the middle of a bundle; the newline that
    print writes after it goes too."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._drop_newline = False

    def write(self, text: str) -> int:
        drop_newline, self._drop_newline = self._drop_newline, False
        if drop_newline and text == "\n":
            return len(text)
        if (text.startswith("Traceback (most recent call last)") and "apache_beam" in text
                and text.rstrip().endswith(CHANNEL_CLOSED)):
            log.debug("python worker: bundle input closed at shutdown:\n%s", text)
            self._drop_newline = True
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _quiet_hook(previous: Any) -> Any:
    def hook(args: threading.ExceptHookArgs) -> None:
        if "grpc" in type(args.exc_value).__module__ and "CANCELLED" in str(args.exc_value):
            log.debug("python worker stream closed at shutdown: %s", args.exc_value)
            return
        previous(args)

    return hook


@contextlib.contextmanager
def quiet_worker_shutdown() -> Iterator[None]:
    """Quiet while inside (a run in a process that goes on: tests, the demo)."""
    previous_hook, previous_stderr = threading.excepthook, sys.stderr
    threading.excepthook = _quiet_hook(previous_hook)
    if not isinstance(previous_stderr, QuietWorkerStderr):
        sys.stderr = QuietWorkerStderr(previous_stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        threading.excepthook = previous_hook
        sys.stderr = previous_stderr


def install() -> None:
    """Quiet for the rest of the process, its ``atexit`` hooks included (the command line)."""
    threading.excepthook = _quiet_hook(threading.excepthook)
    if not isinstance(sys.stderr, QuietWorkerStderr):
        sys.stderr = QuietWorkerStderr(sys.stderr)  # type: ignore[assignment]
