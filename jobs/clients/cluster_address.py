"""Which Flink cluster a command talks to: ``--jobmanager HOST:PORT``, else the local cluster of
``llmstream cluster start`` (``llmstream submit | stop | upgrade | status``).

The development wing starts that local cluster (`jobs/dev/local_cluster.py`) from a work dir, by
default ``<repo>/var/flink``, and records there, in ``cluster.json``, the address of its REST API
and the folders of a ``flink run`` client talking to it. The job's side only reads that record,
so it finds the cluster without importing the code that starts it.

A highly available cluster (``llmstream cluster start --ha``) records the REST addresses of all
its JobManagers (``addresses``); `target` follows the leader: it asks each in turn and takes the
first whose ``/overview`` succeeds (`leader_of`). Measured on Flink 2.3: while the leader lives,
the standby's REST API answers too (it forwards every request to the leading Dispatcher); once the
leader is killed its port refuses connections and the standby answers ``500``
(``RecipientUnreachableException``, forwarding to the dead leader) until its ZooKeeper session
expires, then ``503`` ("Service temporarily unavailable due to an ongoing leader election") for a
moment, then ``200`` as the new leader.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from jobs.clients.flink_cli import flink_conf_dir
from jobs.clients.flink_rest import FlinkRest
from jobs.runtime import jars
from udfs.errors import ConfigError

RECORD = "cluster.json"

__all__ = ["RECORD", "ClusterAddress", "default_work_dir", "leader_of", "target"]


def default_work_dir() -> Path:
    """``<repo>/var/flink``: where ``llmstream cluster start`` keeps the local cluster by default."""
    return jars.repo_root() / "var" / "flink"


def leader_of(addresses: list[str]) -> str | None:
    """The first of ``addresses`` (``host:port``) whose REST API answers as the leader: ``/overview``
    succeeds on the leading JobManager only (a standby answers 503), or None if none does."""
    for address in addresses:
        if FlinkRest(f"http://{address}").overview() is not None:
            return address
    return None


@dataclass(frozen=True)
class ClusterAddress:
    """A cluster's REST address (``host:port``, also what ``flink run -m`` takes) and the Flink
    configuration and log folders of a ``flink run`` client that talks to it. ``addresses``: every
    JobManager's REST address of a highly available cluster (empty for one JobManager)."""

    address: str
    conf_dir: str
    log_dir: str
    addresses: list[str] = field(default_factory=list)

    @property
    def candidates(self) -> list[str]:
        """The REST addresses to try, the recorded ``address`` first."""
        return [self.address, *(a for a in self.addresses if a != self.address)]

    def following_leader(self) -> ClusterAddress:
        """This record with ``address`` set to its leading JobManager's (itself if none leads)."""
        leader = leader_of(self.candidates)
        return self if leader is None or leader == self.address else replace(self, address=leader)

    @property
    def rest_url(self) -> str:
        return f"http://{self.address}"

    def rest(self) -> FlinkRest:
        return FlinkRest(self.rest_url)

    def write(self, work_dir: Path) -> None:
        """Record it as the local cluster of ``work_dir`` (atomically: a reader never sees half a record)."""
        work_dir.mkdir(parents=True, exist_ok=True)
        tmp = work_dir / (RECORD + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, work_dir / RECORD)

    @classmethod
    def local(cls, work_dir: Path | None = None) -> ClusterAddress | None:
        """The local cluster recorded in ``work_dir`` (default `default_work_dir`), or None if none was started there."""
        path = (work_dir if work_dir is not None else default_work_dir()) / RECORD
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def target(jobmanager: str | None, *, also_absent: str = "") -> ClusterAddress:
    """``jobmanager`` (``host:port``, or a URL), else the local cluster. Raises a `ConfigError` naming
    ``--jobmanager`` if its REST API does not answer; ``also_absent`` ("no local run recorded in
    ...") joins the message when neither was found."""
    if jobmanager:
        address = ClusterAddress(jobmanager.split("://", 1)[-1].rstrip("/"), str(flink_conf_dir()),
                                 str(default_work_dir() / "log"))
        why = address.rest().why_unreachable()
        if why is not None:
            raise ConfigError("--jobmanager", f"no Flink REST API answers at {address.rest_url} ({why})")
        return address
    not_given = "not given, " + (f"{also_absent}, " if also_absent else "")
    local = ClusterAddress.local()
    if local is None:
        raise ConfigError("--jobmanager", f"{not_given}and no local Flink cluster was started from "
                                          f"{default_work_dir()}; start one with `llmstream cluster start` "
                                          "or pass --jobmanager HOST:PORT")
    local = local.following_leader()
    why = local.rest().why_unreachable()
    if why is not None:
        tried = ", ".join(f"http://{a}" for a in local.candidates)
        raise ConfigError("--jobmanager", f"{not_given}and the local Flink cluster does not answer at "
                                          f"{tried} ({why}); start it with `llmstream cluster start` "
                                          "or pass --jobmanager HOST:PORT")
    return local
