"""A run's end prints no traceback (jobs/runtime/python_worker_shutdown.py): the report Beam's Python worker
prints when its data channel closes mid-bundle goes to the debug log, everything else through,
and the command line keeps it so until the process has exited (PyFlink stops its workers from
an atexit hook, after `main` has returned)."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import textwrap
import traceback

import pytest
from apache_beam.runners.worker.data_plane import _GrpcDataChannel

from jobs import cli
from jobs.runtime.python_worker_shutdown import QuietWorkerStderr
from tests.conftest import SHELL_ENV


def _beams_report() -> str:
    """What Beam's SDK harness prints (``traceback.format_exc()``) when a bundle's input channel
    closes under it: produced by Beam's own data channel, closed, then read from."""
    channel = _GrpcDataChannel()
    channel.close()
    try:
        list(channel.input_elements("instruction-1", ["transform-1"]))
    except RuntimeError:
        return traceback.format_exc()
    raise AssertionError("a closed Beam data channel gave its elements")


def test_the_channel_closed_report_goes_to_the_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    with caplog.at_level(logging.DEBUG, logger="llmstream.run"):
        print(_beams_report(), file=QuietWorkerStderr(stream))  # as sdk_worker.SdkHarness._execute does
    assert stream.getvalue() == ""
    assert "bundle input closed at shutdown" in caplog.text and "Channel closed prematurely" in caplog.text


def test_everything_else_gets_through() -> None:
    stream = io.StringIO()
    quiet = QuietWorkerStderr(stream)
    try:
        raise ValueError("a real problem")
    except ValueError:
        other = traceback.format_exc()
    print("llmstream: a line", file=quiet)
    print(other, file=quiet)
    assert stream.getvalue() == "llmstream: a line\n" + other + "\n"


def test_the_command_line_stays_quiet_until_the_process_exits() -> None:
    """`llmstream` as the console script runs it (`main()` reading sys.argv); the report is printed
    from an atexit hook, as PyFlink's worker server stop makes the harness print it."""
    program = textwrap.dedent("""
        import atexit, sys
        from tests.unit.jobs.runtime.test_python_worker_shutdown import _beams_report
        report = _beams_report()
        atexit.register(lambda: print(report, file=sys.stderr))
        sys.argv = ["llmstream", "fetch-jars", "--help"]
        from jobs.cli import main
        try:
            main()
        except SystemExit:
            pass
        print("stderr still works", file=sys.stderr)
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                            env=SHELL_ENV, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "stderr still works\n"


def test_a_caller_in_process_keeps_its_own_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    before = sys.stderr
    with pytest.raises(SystemExit):
        cli.main(["fetch-jars", "--help"])
    assert sys.stderr is before
    capsys.readouterr()
