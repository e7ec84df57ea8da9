"""The estate's network: one Linux bridge, one network namespace per host, a veth pair each.

Every host has its own address on the bridge's private subnet (`SUBNET`, never any other address),
so the job's traffic between JobManager, TaskManagers, brokers and the model server crosses real
interfaces. The machine itself (the root namespace, where tests and ``llmstream submit`` run) has
`GATEWAY` on the bridge and reaches every host.

Faults are network states, each undone by its opposite:

- `isolate` / `rejoin`: the host's link down (``ip link set <veth> down``): nothing in or out;
- `partition` / `heal`: two hosts stop hearing each other and nobody else: each gets a permanent
  neighbour entry for the other pointing to a MAC that no interface has, so frames between them
  are dropped silently (no RST, no ICMP: what a real partition looks like). This kernel has no
  netem, no tc actions and no iptables/nftables (docs/estate.md);
  a blackhole route would fail a local send at once instead of dropping it.

Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from jobs.runtime.pids import wait_gone
from udfs.errors import LLMStreamError

log = logging.getLogger("llmstream.estate")

__all__ = ["BRIDGE", "GATEWAY", "SUBNET", "EstateError", "Host", "Network", "unavailable"]

SUBNET = IPv4Network("10.77.0.0/24")
"""The estate's own private subnet; hosts take addresses in it and nothing else is touched."""
GATEWAY = IPv4Address("10.77.0.1")
"""The root namespace's address on the bridge."""
BRIDGE = "lls-br0"
PREFIX = "lls-"
"""Names of the estate's namespaces and root-side veths (interface names are at most 15 characters)."""
NOWHERE_MAC = "02:00:00:00:de:ad"
"""A locally administered MAC no interface here has: frames sent to it go nowhere."""
NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NAME`` mounts ``/etc/netns/NAME/<file>`` over ``/etc/<file>`` for what it runs."""


class EstateError(LLMStreamError, RuntimeError):
    """The estate could not be built, started or faulted; the message names the step."""


def unavailable() -> str | None:
    """Why the estate cannot run here (not root, no ``ip netns``), or None."""
    if os.geteuid() != 0:
        return "the estate needs root (network namespaces, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "the estate needs iproute2's `ip`"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Host:
    """One machine of the estate: a network namespace with one address on the bridge."""

    name: str
    address: str

    def __post_init__(self) -> None:
        if IPv4Address(self.address) not in SUBNET or IPv4Address(self.address) == GATEWAY:
            raise ValueError(f"host {self.name}: {self.address} is not a host address of {SUBNET}")
        if len(PREFIX + self.name) > 15:
            raise ValueError(f"host name {self.name!r} is too long for an interface name")

    @property
    def netns(self) -> str:
        return PREFIX + self.name

    @property
    def veth(self) -> str:
        """The root-side end of the host's link, on the bridge."""
        return PREFIX + self.name

    def exec_prefix(self) -> list[str]:
        """Prefix of a command run on this host (inside its namespace)."""
        return ["ip", "netns", "exec", self.netns]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise EstateError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


class Network:
    """Build, inspect and tear down the bridge and the hosts' namespaces; inject network faults."""

    def __init__(self, hosts: Iterable[Host]) -> None:
        self.hosts = {host.name: host for host in hosts}

    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise EstateError(f"no host {name!r} (hosts: {', '.join(self.hosts)})") from None

    # ------------------------------------------------------------------ build
    def up(self) -> None:
        """The bridge and every host's namespace, link and address; what exists already is kept."""
        if not _exists("link", BRIDGE):
            _ip("link", "add", BRIDGE, "type", "bridge")
            _ip("addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        _forward_on_bridge(add=True)
        present = set(self.namespaces())
        for host in self.hosts.values():
            if host.netns not in present:
                _ip("netns", "add", host.netns)
            if not _exists("link", host.veth):
                _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                _ip("-n", host.netns, "addr", "add", f"{host.address}/{SUBNET.prefixlen}", "dev", "eth0")
            _ip("link", "set", host.veth, "master", BRIDGE, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "route", "replace", "default", "via", str(GATEWAY))
            self._write_names(host)

    def _write_names(self, host: Host) -> None:
        """Each host's ``/etc/hosts`` names every host of the estate, and its resolver asks no one.

        The machine's name server is not reachable from a namespace: there a reverse lookup took
        10 s, and the JobManager resolves each TaskManager's address (its ``TaskManagerLocation``);
        while it waited, heartbeats went unanswered and both TaskManagers timed out at once.
        """
        etc = NETNS_ETC / host.netns
        etc.mkdir(parents=True, exist_ok=True)
        # The namespaces share the machine's host name: on each host it names that host, as on a machine.
        names = "".join(f"{other.address} {other.name}{' ' + socket.gethostname() if other is host else ''}\n"
                        for other in self.hosts.values())
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        (etc / "resolv.conf").write_text("# the estate's hosts resolve from /etc/hosts only\n"
                                         "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def down(self) -> None:
        """Kill every process on every host, then remove the namespaces, links and the bridge."""
        for host in self.hosts.values():
            if host.netns in self.namespaces():
                self.kill(host)
                _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.veth, check=False)
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
        # Another estate's hosts (other names) may still be on the bridge: remove it only when empty.
        if _exists("link", BRIDGE) and not _ip("link", "show", "master", BRIDGE, check=False).stdout.strip():
            _ip("link", "del", BRIDGE, check=False)
            _forward_on_bridge(add=False)

    @staticmethod
    def namespaces() -> list[str]:
        out = _ip("netns", "list", check=False).stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def present(self) -> dict[str, bool]:
        names = set(self.namespaces())
        return {name: host.netns in names for name, host in self.hosts.items()}

    # ------------------------------------------------------------------ processes
    @staticmethod
    def pids(host: Host) -> list[int]:
        """Every process in the host's namespace."""
        out = _ip("netns", "pids", host.netns, check=False).stdout
        return [int(word) for word in out.split() if word.isdigit()]

    def kill(self, host: Host, sig: int = signal.SIGKILL, timeout: float = 15.0) -> list[int]:
        """Signal every process on the host (SIGKILL: the machine lost power); returns their pids."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL and wait_gone(pids, timeout):
            raise EstateError(f"processes on {host.name} survived SIGKILL: {wait_gone(pids, 0)}")
        return pids

    # ------------------------------------------------------------------ faults
    def link_up(self, host: Host) -> bool:
        out = _ip("-o", "link", "show", host.veth, check=False).stdout
        return "state UP" in out or ",UP" in out.split(">")[0]

    def isolate(self, host: Host) -> None:
        """The host's link down: it hears nobody and nobody hears it."""
        _ip("link", "set", host.veth, "down")
        log.info("estate: %s isolated (link down)", host.name)

    def rejoin(self, host: Host) -> None:
        _ip("link", "set", host.veth, "master", BRIDGE, "up")
        log.info("estate: %s rejoined (link up)", host.name)

    def partition(self, a: Host, b: Host) -> None:
        """``a`` and ``b`` stop hearing each other (frames between them are dropped silently)."""
        for here, there in ((a, b), (b, a)):
            _ip("-n", here.netns, "neigh", "replace", there.address, "lladdr", NOWHERE_MAC, "dev", "eth0",
                "nud", "permanent")
        log.info("estate: %s and %s partitioned", a.name, b.name)

    def heal(self, a: Host, b: Host) -> None:
        for here, there in ((a, b), (b, a)):
            _ip("-n", here.netns, "neigh", "del", there.address, "dev", "eth0", check=False)
        log.info("estate: %s and %s healed", a.name, b.name)

    def partitions(self) -> list[tuple[str, str]]:
        """The host pairs partitioned now (each pair once)."""
        by_address = {host.address: name for name, host in self.hosts.items()}
        found = set()
        for name, host in self.hosts.items():
            out = _ip("-n", host.netns, "neigh", "show", "dev", "eth0", check=False).stdout
            for line in out.splitlines():
                words = line.split()
                if NOWHERE_MAC in words and words and words[0] in by_address:
                    found.add(tuple(sorted((name, by_address[words[0]]))))
        return sorted(found)  # type: ignore[arg-type]

    def heal_all(self) -> None:
        for a, b in self.partitions():
            self.heal(self.host(a), self.host(b))
        for host in self.hosts.values():
            if _exists("link", host.veth) and not self.link_up(host):
                self.rejoin(host)


def _exists(kind: str, name: str) -> bool:
    return _ip(kind, "show", name, check=False).returncode == 0


FORWARD_RULE = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]


def _forward_on_bridge(*, add: bool) -> None:
    """Let frames between the estate's hosts through the machine's firewall, or stop letting them.

    Where iptables is installed and ``br_netfilter`` is loaded (dockerd does both, and sets the
    FORWARD policy to DROP), frames between two ports of a Linux bridge pass the FORWARD chain:
    the hosts then reached the root namespace but not each other (the brokers never formed a
    quorum). One rule for this bridge only, as Docker's own for ``docker0``; nothing else changes.
    """
    if shutil.which("iptables") is None:
        return
    present = subprocess.run(["iptables", "-C", *FORWARD_RULE], capture_output=True, check=False).returncode == 0
    if add and not present:
        done = subprocess.run(["iptables", "-I", *FORWARD_RULE], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise EstateError(f"iptables -I {' '.join(FORWARD_RULE)}: {done.stderr.strip()}")
    while not add and present:
        subprocess.run(["iptables", "-D", *FORWARD_RULE], capture_output=True, check=False)
        present = subprocess.run(["iptables", "-C", *FORWARD_RULE], capture_output=True, check=False).returncode == 0
