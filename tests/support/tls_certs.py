"""Throwaway certificates for tests of TLS towards the model server, made with the `openssl` CLI.

`make_certs(directory)` writes a test CA, a server certificate for `IP:127.0.0.1` and a client
certificate signed by it, and a second CA that nothing trusts, with its own client certificate
and a server certificate for `IP:127.0.0.1` (the simulator's `tls-cert-change` presents it).
EC P-256 keys, valid two days: the whole set takes a few tens of milliseconds. Private keys are
written mode 600, as a job's would be.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_client_cert: str
    other_client_key: str
    other_server_cert: str
    other_server_key: str


def _openssl(*args: str) -> None:
    subprocess.run([OPENSSL, *args], check=True, capture_output=True, timeout=60)


def _self_signed(directory: Path, name: str, subject: str) -> tuple[str, str]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={subject}")
    os.chmod(key, 0o600)
    return str(cert), str(key)


def _signed(directory: Path, name: str, subject: str, ca: tuple[str, str], *extensions: str) -> tuple[str, str]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    added = [arg for ext in ("basicConstraints=critical,CA:FALSE", *extensions) for arg in ("-addext", ext)]
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={subject}", *added,
             "-CA", ca[0], "-CAkey", ca[1])
    os.chmod(key, 0o600)
    return str(cert), str(key)


def make_certs(directory: Path) -> Certs:
    ca = _self_signed(directory, "ca", "llmstream test CA")
    server = _signed(directory, "server", "127.0.0.1", ca, "subjectAltName=IP:127.0.0.1",
                     "extendedKeyUsage=serverAuth")
    client = _signed(directory, "client", "llmstream-job", ca, "extendedKeyUsage=clientAuth")
    other = _self_signed(directory, "other-ca", "unknown test CA")
    other_client = _signed(directory, "other-client", "llmstream-job", other, "extendedKeyUsage=clientAuth")
    other_server = _signed(directory, "other-server", "127.0.0.1", other, "subjectAltName=IP:127.0.0.1",
                           "extendedKeyUsage=serverAuth")
    return Certs(ca=ca[0], server_cert=server[0], server_key=server[1], client_cert=client[0],
                 client_key=client[1], other_ca=other[0], other_client_cert=other_client[0],
                 other_client_key=other_client[1], other_server_cert=other_server[0],
                 other_server_key=other_server[1])
