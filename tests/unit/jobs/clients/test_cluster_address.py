"""`jobs/clients/cluster_address.py`: the local cluster's record, and following the leader of a
highly available one (the first recorded REST API whose ``/overview`` succeeds; a dead JobManager
refuses the connection, a standby in an election answers 500 or 503)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from jobs.clients import cluster_address
from jobs.clients.cluster_address import RECORD, ClusterAddress, leader_of, target
from jobs.runtime.ports import free_port
from udfs.errors import ConfigError


class _Answer(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        status = self.server.status  # type: ignore[attr-defined]
        body = json.dumps({"taskmanagers": 1} if status == 200 else {"errors": ["leader election"]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def rest_servers() -> Iterator[Any]:
    """``serve(status)`` -> ``localhost:<port>`` of a REST API answering every GET with ``status``."""
    servers: list[ThreadingHTTPServer] = []

    def serve(status: int) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
        server.status = status  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_record_without_addresses_is_one_jobmanager(tmp_path: Path) -> None:
    (tmp_path / RECORD).write_text(json.dumps({"address": "localhost:8081", "conf_dir": "c", "log_dir": "l"}))
    record = ClusterAddress.local(tmp_path)
    assert record is not None and record.addresses == [] and record.candidates == ["localhost:8081"]


def test_a_highly_available_record_round_trips_and_lists_every_jobmanager(tmp_path: Path) -> None:
    ClusterAddress("localhost:8082", "c", "l", addresses=["localhost:8081", "localhost:8082"]).write(tmp_path)
    record = ClusterAddress.local(tmp_path)
    assert record is not None
    assert record.candidates == ["localhost:8082", "localhost:8081"]  # the last known leader first


def test_leader_of_skips_a_dead_jobmanager_and_a_standby_in_an_election(rest_servers: Any) -> None:
    dead = f"127.0.0.1:{free_port()}"
    electing, internal, leader = rest_servers(503), rest_servers(500), rest_servers(200)
    assert leader_of([dead, electing, internal, leader]) == leader
    assert leader_of([dead, electing]) is None


def test_following_the_leader_replaces_only_the_address(rest_servers: Any) -> None:
    dead = f"127.0.0.1:{free_port()}"
    leader = rest_servers(200)
    record = ClusterAddress(dead, "c", "l", addresses=[dead, leader])
    followed = record.following_leader()
    assert followed.address == leader and followed.addresses == [dead, leader] and followed.conf_dir == "c"
    alone = ClusterAddress(dead, "c", "l")
    assert alone.following_leader() is alone  # none leads: the record as it is


def test_target_follows_the_leader_of_the_local_cluster(
        tmp_path: Path, rest_servers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_address, "default_work_dir", lambda: tmp_path)
    dead = f"127.0.0.1:{free_port()}"
    standby_elected = rest_servers(200)
    ClusterAddress(dead, "c", "l", addresses=[dead, standby_elected]).write(tmp_path)
    assert target(None).address == standby_elected


def test_target_names_every_jobmanager_it_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_address, "default_work_dir", lambda: tmp_path)
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    ClusterAddress(first, "c", "l", addresses=[first, second]).write(tmp_path)
    with pytest.raises(ConfigError) as raised:
        target(None)
    assert f"http://{first}" in str(raised.value) and f"http://{second}" in str(raised.value)
