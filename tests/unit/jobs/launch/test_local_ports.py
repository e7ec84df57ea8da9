"""`llmstream run`'s fixed local ports: a taken one is one line naming its setting, before any JVM."""

from __future__ import annotations

import socket

import pytest

from jobs.launch.run import check_local_ports
from udfs.config import load_config, with_overrides
from udfs.errors import ConfigError


@pytest.mark.parametrize("setting", ["prometheus_port", "rest_port"])
def test_a_taken_port_names_its_setting(setting: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = with_overrides(load_config(), metrics={setting: port})
        with pytest.raises(ConfigError, match=rf"^metrics\.{setting}: port {port} on 127\.0\.0\.1 is taken"):
            check_local_ports(config)
    check_local_ports(config)  # free again


def test_unset_ports_need_nothing() -> None:
    check_local_ports(load_config())
