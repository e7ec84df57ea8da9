"""The `llmstream` command's own behaviour: help, subcommands, global flags, and config errors at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.cli import SERVICES, main


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
