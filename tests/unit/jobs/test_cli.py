"""The `llmstream` command's own behaviour: help, subcommands, global flags, and config errors at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.cli import SERVICES, main
from tests.conftest import SHELL_ENV


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "plan", "demo", "submit", "model-server", *SERVICES):
        assert command in out


@pytest.mark.parametrize("command", ["kafka", "model-server", "status", "cluster", "bench"])
def test_service_commands_have_their_own_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"llmstream {command}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["run", "status", "plan"])
def test_bad_config_fails_at_start_naming_the_key(command: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("kafka:\n  bootstrap_servers: x:1\nmodel: {endpoint: http://x/v1, model: m}\n")
    assert main([command, "--config", str(path)]) == 2
    assert "kafka.output_topic: required" in capsys.readouterr().err


def test_missing_config_file_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err


def test_verbose_goes_before_a_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`-v` is the top-level flag: `llmstream -v kafka status` reaches the kafka command (which says
    no broker runs in an empty data dir) instead of failing on "unrecognized arguments"."""
    assert main(["-v", "kafka", "status", "--data-dir", str(tmp_path / "kafka")]) == 1
    assert "kafka: not running" in capsys.readouterr().out


def test_a_subcommand_without_its_action_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["-v", "kafka"])
    assert info.value.code == 2
    assert "required" in capsys.readouterr().err


WITHOUT_THE_DEV_WING = """
import json, sys
sys.modules["jobs.dev"] = None  # as if jobs/dev/ had been left out: importing it fails
from jobs.cli import build_parser, main
commands = sorted(build_parser()._subparsers._group_actions[0].choices)
codes = {name: main([*argv.split(), "--config", sys.argv[1]]) for name, argv in {
    "submit": "submit --state-dir " + sys.argv[1],
    "upgrade": "upgrade --state-dir " + sys.argv[1] + ".missing",
    "stop": "stop --jobmanager 127.0.0.1:9",
    "status": "status --jobmanager 127.0.0.1:9",
    "run": "run --state-dir " + sys.argv[1],
}.items()}
codes |= {name: main([name, "--help"]) for name in ("demo", "bench", "model-server")}
print(json.dumps({"commands": commands, "codes": codes}))
"""


def test_the_jobs_commands_work_without_the_dev_wing(tmp_path: Path) -> None:
    """An image that only runs the job could leave jobs/dev/ out: the job's commands still parse
    and fail as they should (here: no cluster at --jobmanager, a state directory that is a file or
    missing; checked before the broker); the development commands stay listed and each says in one
    line where it lives (exit 2), --help included, instead of argparse's "invalid choice"."""
    path = tmp_path / "job.yaml"
    path.write_text("kafka: {bootstrap_servers: '127.0.0.1:9', input_topic: i, output_topic: o, "
                    "dead_letter_topic: d, group_id: g, transactional_id_prefix: t}\n"
                    "model: {endpoint: 'http://127.0.0.1:9/v1', model: m}\n")
    result = subprocess.run([sys.executable, "-c", WITHOUT_THE_DEV_WING, str(path)], capture_output=True,
                            text=True, timeout=180, env=SHELL_ENV, check=False)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["commands"] == sorted(["run", "plan", "submit", "stop", "upgrade", "fetch-jars", "status",
                                          "demo", "kafka", "cluster", "object-store", "estate", "bench", "model-server",
                                          "scale"])
    assert outcome["codes"] == {"submit": 2, "upgrade": 2, "stop": 2, "status": 2, "run": 2,
                                "demo": 2, "bench": 2, "model-server": 2}
    assert result.stderr.count("which the installed package leaves out; run it from a source checkout") == 3
    assert "Traceback" not in result.stderr
    assert result.stderr.count("--jobmanager: no Flink REST API answers") == 2
    assert result.stderr.count("--state-dir: ") == 3
