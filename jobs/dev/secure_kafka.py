"""The local KRaft broker secured: TLS, SASL/SCRAM, mutual TLS and ACLs, for tests and for users to try.

``llmstream kafka start --secure`` (or `SecureBroker`) runs `LocalBroker`'s broker with, on 127.0.0.1:

- ``SASL_SSL`` (SCRAM-SHA-512) on ``port``, also the inter-broker listener (the broker logs in as ``admin``);
- ``SSL`` with client certificates required on ``ssl_port``: a certificate's ``CN=job`` is ``User:job``,
  the same principal as the SCRAM user ``job``;
- ``WRONG_HOST``, SSL like the one above but serving a certificate for ``wrong.example`` only, so a
  client that verifies hostnames (both the Java client and kafka-python do by default) fails there:
  the reliable way to provoke a hostname mismatch on loopback;
- the PLAINTEXT ``CONTROLLER`` listener. Its principal is ``User:ANONYMOUS``, which must be a super
  user for the node to talk to itself: whoever can reach the controller port on loopback is trusted.
  That is acceptable for a broker on loopback for tests, and the reason this is not a template for
  a real cluster.

ACLs are enforced (``StandardAuthorizer``, nothing allowed without an ACL); `SecureBroker.grant`
gives a principal exactly what the job needs, or all of it but one permission. The SCRAM users,
created when the storage is formatted: ``admin`` (super user), ``job``, and one user per permission
the job needs that lacks just that one (`LACKING_USERS`), so tests can check each refusal.

Everything lives in the data dir (default ``var/kafka-secure``), made once and reused across
restarts: ``tls/`` holds a throwaway CA (``ca.pem``), a second, unrelated CA (``other-ca.pem``), the
broker's keystores and the clients' certificates; ``secrets/`` (0700) holds every password in a
file of its own (0600, no trailing newline): ``<user>.password`` for SCRAM, ``<name>.key.password``
for private keys. No password is ever on a command line, in ``server.properties`` (the broker
reads them through Kafka's ``DirectoryConfigProvider``), printed or logged.

Private keys are PKCS#8 encrypted with PBE-SHA1-3DES, not OpenSSL 3's default PBES2: the Java
client's PEM keystore (``ssl.keystore.type=PEM``) cannot decrypt PBES2 on Java 17 ("PBES2
SecretKeyFactory not available"); kafka-python reads both.

``start --secure --brokers N`` is `SecureKafkaCluster`: N such nodes in one KRaft quorum
(`jobs/dev/local_kafka.py`'s `LocalKafkaCluster`), sharing one CA, one broker certificate (it names
127.0.0.1, whichever port) and one set of passwords, kept in the cluster's data dir; each node's
state is in ``node-<i>/`` below it.

Client settings come in two forms: `SecureBroker.client_properties` (Java names with
``${file:PATH}`` placeholders, for a job's ``kafka.properties``) and
`SecureBroker.kafka_python_config` (kafka-python arguments with the secrets read).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from kafka.admin import (  # type: ignore[import-untyped]
    ACL,
    ACLFilter,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    KafkaAdminClient,
    ResourcePattern,
    ResourcePatternFilter,
    ResourceType,
)

from jobs.dev.local_kafka import (
    DEFAULT_HEAP,
    BrokerConfig,
    BrokerError,
    ClusterConfig,
    Listener,
    LocalBroker,
    LocalKafkaCluster,
    Quorum,
)
from jobs.runtime import jars
from jobs.runtime.ports import free_port, port_in_use

DEFAULT_PORT = 9192
"""SASL_SSL; by default SSL (mutual TLS) is on +1, the controller on +2, WRONG_HOST on +3."""
DEFAULT_CLUSTER_PORT = 9392
"""A secured cluster's node i (from 0) has those four ports from ``DEFAULT_CLUSTER_PORT + PORT_STRIDE * i`` on."""
MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"
JOB = "job"

Permission = Literal["read_input", "read_group", "write_output", "write_dead_letter", "transactional_id"]
"""One permission of the job's that `SecureBroker.grant` can leave out:
READ on the input topics, READ on the group, WRITE on the output topic, WRITE on the
dead-letter topic, WRITE on the transactional ids."""
PERMISSIONS: tuple[Permission, ...] = get_args(Permission)
LACKING_USERS: dict[str, Permission] = {
    "no-read-input": "read_input",
    "no-read-group": "read_group",
    "no-write-output": "write_output",
    "no-write-dlq": "write_dead_letter",
    "no-txn": "transactional_id",
}
"""SCRAM users meant to be granted everything the job needs but one permission."""
SCRAM_USERS: tuple[str, ...] = (ADMIN, JOB, *LACKING_USERS)
TLS_CLIENTS: tuple[str, ...] = (JOB,)
"""Client certificates issued by the broker's CA (``CN=<name>``, so the principal ``User:<name>``)."""
UNTRUSTED_CLIENT = "untrusted-job"
"""A client certificate with ``CN=job`` issued by the other CA: the SSL listener must refuse it."""
WRONG_HOST = "wrong.example"
Via = Literal["scram", "mtls"]

_WRONG_HOST_LISTENER = "WRONG_HOST"
_CERT_DAYS = 3650
_SCRAM_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule"

__all__ = [
    "ADMIN",
    "DEFAULT_PORT",
    "JOB",
    "LACKING_USERS",
    "PERMISSIONS",
    "SCRAM_USERS",
    "TLS_CLIENTS",
    "UNTRUSTED_CLIENT",
    "WRONG_HOST",
    "ClientCertificate",
    "Permission",
    "SecureBroker",
    "SecureBrokerConfig",
    "SecureKafkaCluster",
    "SecurityFiles",
    "Via",
    "default_cluster_dir",
    "default_data_dir",
    "job_acls",
]


def default_data_dir() -> Path:
    return jars.repo_root() / "var" / "kafka-secure"


def default_cluster_dir() -> Path:
    return jars.repo_root() / "var" / "kafka-cluster-secure"


# ---------------------------------------------------------------------- certificates and passwords


@dataclass(frozen=True)
class ClientCertificate:
    """The PEM files of one mutual-TLS identity.

    ``key`` is encrypted PKCS#8 (password in ``password_file``); ``keystore`` is the encrypted key
    followed by the certificate, what the Java client's ``ssl.keystore.type=PEM`` reads.
    """

    name: str
    certificate: Path
    key: Path
    keystore: Path
    password_file: Path


_OPENSSL_CONFIG = """\
# Written by jobs/dev/secure_kafka.py for its throwaway CA; independent of the system openssl.cnf.
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[broker]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
[wrong_host]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:{wrong_host}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
"""


def _read_secret(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    return text.removesuffix("\n")


def _write_secret(path: Path, value: str) -> None:
    """A new 0600 file holding ``value`` (no trailing newline); an existing file is replaced."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(value)


class SecurityFiles:
    """The throwaway CAs, certificates and passwords under one data dir: made once, then reused.

    Layout: ``tls/`` (0700) with ``ca.pem`` and ``ca.key`` (kept to issue more client
    certificates), ``other-ca.pem``, ``broker.pem`` and ``wrong-host.pem`` (encrypted key +
    certificate, the broker's PEM keystores), ``<client>.crt/.key/.pem``; ``secrets/`` (0700) with
    ``<user>.password`` and ``<name>.key.password``, each 0600. ``tls/.complete`` marks a finished
    set: an interrupted run starts the TLS material over instead of mixing two CAs.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tls_dir = self.root / "tls"
        self.secrets_dir = self.root / "secrets"

    @property
    def ca_file(self) -> Path:
        return self.tls_dir / "ca.pem"

    @property
    def other_ca_file(self) -> Path:
        """A CA that signed nothing the broker serves: a client trusting only it must fail TLS."""
        return self.tls_dir / "other-ca.pem"

    @property
    def broker_keystore(self) -> Path:
        return self.tls_dir / "broker.pem"

    @property
    def wrong_host_keystore(self) -> Path:
        return self.tls_dir / "wrong-host.pem"

    def password_file(self, user: str) -> Path:
        """Where the SCRAM password of ``user`` is (the file may not exist yet)."""
        return self.secrets_dir / f"{user}.password"

    def key_password_file(self, name: str) -> Path:
        return self.secrets_dir / f"{name}.key.password"

    def password(self, user: str) -> str:
        """The SCRAM password of ``user``; a `BrokerError` if it was never made."""
        try:
            return _read_secret(self.password_file(user))
        except FileNotFoundError:
            raise BrokerError(f"no SCRAM user {user!r} on this broker ({self.password_file(user)} is missing)") from None

    def client(self, name: str) -> ClientCertificate:
        """The files of the client certificate ``CN=<name>`` (whether they exist or not)."""
        return ClientCertificate(
            name=name,
            certificate=self.tls_dir / f"{name}.crt",
            key=self.tls_dir / f"{name}.key",
            keystore=self.tls_dir / f"{name}.pem",
            password_file=self.key_password_file(name),
        )

    def ensure(self, users: Sequence[str], clients: Sequence[str], formatted: bool) -> None:
        """Make whatever is missing: a password per SCRAM user, the TLS material, client certificates.

        ``formatted``: the broker's storage already holds the SCRAM users; a password file missing
        then cannot be made up again (the broker would not know it), so that is a `BrokerError`.
        """
        for directory in (self.root, self.tls_dir, self.secrets_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.tls_dir.chmod(0o700)
        self.secrets_dir.chmod(0o700)
        for user in users:
            path = self.password_file(user)
            if path.exists():
                continue
            if formatted:
                raise BrokerError(f"{path} is missing but the broker's storage was formatted with it; "
                                  f"delete {self.root} to start over")
            _write_secret(path, secrets.token_urlsafe(24))
        if not (self.tls_dir / ".complete").exists():
            self._make_tls()
        for name in clients:
            if not self.client(name).keystore.exists():
                self.issue_client(name)

    # -- openssl

    def _openssl(self, *args: str) -> None:
        binary = shutil.which("openssl")
        if binary is None:
            raise BrokerError("openssl not found on PATH (the secured broker makes its certificates with it)")
        proc = subprocess.run([binary, *args], cwd=self.tls_dir, check=False, capture_output=True, text=True,
                              timeout=60)
        if proc.returncode != 0:
            raise BrokerError(f"openssl {args[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")

    def _config(self) -> Path:
        path = self.tls_dir / "openssl.cnf"
        path.write_text(_OPENSSL_CONFIG.format(wrong_host=WRONG_HOST))
        return path

    def _new_ca(self, stem: str, common_name: str) -> None:
        self._openssl("req", "-x509", "-new", "-config", str(self._config()), "-extensions", "ca",
                      "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                      "-keyout", f"{stem}.key", "-out", f"{stem}.pem", "-days", str(_CERT_DAYS),
                      "-subj", f"/CN={common_name}")
        (self.tls_dir / f"{stem}.key").chmod(0o600)

    def _issue(self, ca: str, name: str, common_name: str, extensions: str) -> Path:
        """A key and certificate signed by CA ``ca``; writes ``<name>.crt``, ``<name>.key``
        (encrypted, password in ``secrets/<name>.key.password``) and ``<name>.pem`` (both)."""
        raw, csr = f"{name}.raw.key", f"{name}.csr"
        password_file = self.key_password_file(name)
        _write_secret(password_file, secrets.token_urlsafe(24))
        try:
            self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", raw)
            self._openssl("req", "-new", "-config", str(self._config()), "-key", raw, "-subj", f"/CN={common_name}",
                          "-out", csr)
            self._openssl("x509", "-req", "-in", csr, "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                          "-set_serial", str(secrets.randbits(63)), "-days", str(_CERT_DAYS),
                          "-extfile", str(self._config()), "-extensions", extensions, "-out", f"{name}.crt")
            self._openssl("pkcs8", "-topk8", "-v1", "PBE-SHA1-3DES", "-in", raw, "-out", f"{name}.key",
                          "-passout", f"file:{password_file}")
        finally:
            for scratch in (raw, csr):
                (self.tls_dir / scratch).unlink(missing_ok=True)
        key, cert = self.tls_dir / f"{name}.key", self.tls_dir / f"{name}.crt"
        key.chmod(0o600)
        keystore = self.tls_dir / f"{name}.pem"
        _write_secret(keystore, key.read_text() + cert.read_text())
        return keystore

    def _make_tls(self) -> None:
        for stale in self.tls_dir.iterdir():
            stale.unlink()
        self._new_ca("ca", "llmstream throwaway CA")
        self._issue("ca", "broker", "localhost", "broker")
        self._issue("ca", "wrong-host", WRONG_HOST, "wrong_host")
        self._new_ca("other-ca", "llmstream other CA")
        self._issue("other-ca", UNTRUSTED_CLIENT, JOB, "client")
        (self.tls_dir / "other-ca.key").unlink()
        (self.tls_dir / ".complete").write_text("")

    def issue_client(self, name: str) -> ClientCertificate:
        """A client certificate ``CN=<name>`` from the broker's CA, i.e. principal ``User:<name>``."""
        if not name or any(ch in name for ch in "/,=+\\\"<>;#\n") or name.startswith("."):
            raise ValueError(f"not a usable certificate name: {name!r}")
        self._issue("ca", name, name, "client")
        return self.client(name)


# ---------------------------------------------------------------------- ACLs


def _principal(name: str) -> str:
    return name if name.startswith("User:") else f"User:{name}"


def _acl_key(acl: ACL) -> tuple[Any, ...]:
    pattern = acl.resource_pattern
    return (acl.principal, acl.host, acl.operation, acl.permission_type,
            pattern.resource_type, pattern.resource_name, pattern.pattern_type)


def _wait_until_enforced(client: KafkaAdminClient, principal: str, acls: Sequence[ACL],
                         timeout_s: float = 60.0) -> None:
    """Return once the broker's authorizer lists every one of ``acls`` for ``principal``."""
    wanted = {_acl_key(acl) for acl in acls}
    everything = ACLFilter(principal=principal, host="*", operation=ACLOperation.ANY,
                           permission_type=ACLPermissionType.ANY,
                           resource_pattern=ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY))
    deadline = time.monotonic() + timeout_s
    while True:
        listed, _error = client.describe_acls(everything)
        missing = wanted - {_acl_key(acl) for acl in listed}
        if not missing:
            return
        if time.monotonic() > deadline:
            raise BrokerError(f"{len(missing)} ACLs for {principal} not enforced after {timeout_s:.0f} s")
        time.sleep(0.05)


def _create_acls(client: KafkaAdminClient, principal: str, acls: Sequence[ACL]) -> None:
    result = client.create_acls(list(acls))
    if result["failed"]:
        raise BrokerError(f"creating ACLs for {_principal(principal)} failed: {result['failed']}")
    _wait_until_enforced(client, _principal(principal), acls)


def job_acls(
    principal: str,
    *,
    input_topics: Sequence[str],
    output_topic: str,
    dead_letter_topic: str,
    group_id: str,
    transactional_id_prefix: str,
    prefixed: bool = False,
    omit: Permission | None = None,
) -> list[ACL]:
    """The ACLs the job needs as ``principal``, without the one named by ``omit``.

    READ+DESCRIBE on the input topics and on the group, WRITE+DESCRIBE on the output and
    dead-letter topics and on the transactional ids (always a PREFIXED pattern), IDEMPOTENT_WRITE
    and DESCRIBE_CONFIGS on the cluster (preflight reads ``transaction.max.timeout.ms``).
    ``omit`` drops only the READ or WRITE, never the DESCRIBE, so the refusal is of that one
    operation. ``prefixed`` makes the topic and group names prefixes instead of literal names.
    """
    if omit is not None and omit not in PERMISSIONS:
        raise ValueError(f"omit must be one of {', '.join(PERMISSIONS)}, got {omit!r}")
    if not input_topics:
        raise ValueError("input_topics: give at least one topic (or prefix)")
    named = ACLResourcePatternType.PREFIXED if prefixed else ACLResourcePatternType.LITERAL
    acls: list[ACL] = []

    def allow(resource: ResourcePattern, operation: ACLOperation, unless: Permission | None = None) -> None:
        if unless is None or unless != omit:
            acls.append(ACL(_principal(principal), "*", operation, ACLPermissionType.ALLOW, resource))

    for topic in input_topics:
        allow(ResourcePattern(ResourceType.TOPIC, topic, named), ACLOperation.READ, "read_input")
        allow(ResourcePattern(ResourceType.TOPIC, topic, named), ACLOperation.DESCRIBE)
    allow(ResourcePattern(ResourceType.GROUP, group_id, named), ACLOperation.READ, "read_group")
    allow(ResourcePattern(ResourceType.GROUP, group_id, named), ACLOperation.DESCRIBE)
    allow(ResourcePattern(ResourceType.TOPIC, output_topic, named), ACLOperation.WRITE, "write_output")
    allow(ResourcePattern(ResourceType.TOPIC, output_topic, named), ACLOperation.DESCRIBE)
    allow(ResourcePattern(ResourceType.TOPIC, dead_letter_topic, named), ACLOperation.WRITE, "write_dead_letter")
    allow(ResourcePattern(ResourceType.TOPIC, dead_letter_topic, named), ACLOperation.DESCRIBE)
    txn = ResourcePattern(ResourceType.TRANSACTIONAL_ID, transactional_id_prefix, ACLResourcePatternType.PREFIXED)
    allow(txn, ACLOperation.WRITE, "transactional_id")
    allow(txn, ACLOperation.DESCRIBE)
    cluster = ResourcePattern(ResourceType.CLUSTER, "kafka-cluster", ACLResourcePatternType.LITERAL)
    allow(cluster, ACLOperation.IDEMPOTENT_WRITE)
    allow(cluster, ACLOperation.DESCRIBE_CONFIGS)
    return acls


# ---------------------------------------------------------------------- the broker


@dataclass(frozen=True)
class SecureBrokerConfig:
    """Ports and data dir of a secured broker; a port 0 means ``port`` + 1 (SSL), + 2 (controller), + 3 (WRONG_HOST).

    ``files_dir`` holds the certificates and passwords (default: ``data_dir``; a cluster's nodes share
    one); ``quorum`` makes the broker a node of a cluster (`Quorum`).
    """

    port: int = DEFAULT_PORT
    ssl_port: int = 0
    controller_port: int = 0
    wrong_host_port: int = 0
    data_dir: Path = field(default_factory=default_data_dir)
    heap: str = DEFAULT_HEAP
    quorum: Quorum | None = None
    files_dir: Path | None = None

    def __post_init__(self) -> None:
        for offset, name in enumerate(("ssl_port", "controller_port", "wrong_host_port"), start=1):
            if not getattr(self, name):
                object.__setattr__(self, name, self.port + offset)
        for name in ("data_dir", "files_dir"):
            path = Path(getattr(self, name) or self.data_dir).expanduser().resolve()
            if ":" in str(path):
                raise ValueError(f"{name} must not contain ':' (Kafka's config placeholders split on it): {path}")
            object.__setattr__(self, name, path)

    @property
    def security_dir(self) -> Path:
        """Where the certificates and passwords are."""
        return Path(self.files_dir or self.data_dir)

    @classmethod
    def ephemeral(cls, data_dir: Path, **kwargs: Any) -> SecureBrokerConfig:
        """A config on four fresh free ports, for tests that must not collide."""
        ports: list[int] = []
        while len(ports) < 4:
            port = free_port()
            if port not in ports:
                ports.append(port)
        return cls(port=ports[0], ssl_port=ports[1], controller_port=ports[2], wrong_host_port=ports[3],
                   data_dir=data_dir, **kwargs)

    def broker_config(self) -> BrokerConfig:
        """The `LocalBroker` config: listeners and security settings, secrets only as ``${dir:…}`` references."""
        files = SecurityFiles(self.security_dir)
        secrets_dir = files.secrets_dir

        def secret(path: Path) -> str:
            return f"${{dir:{secrets_dir}:{path.name}}}"

        admin_jaas = f'{_SCRAM_MODULE} required username="{ADMIN}" password="{secret(files.password_file(ADMIN))}";'
        wrong = f"listener.name.{_WRONG_HOST_LISTENER.lower()}."
        properties = {
            "config.providers": "dir",
            "config.providers.dir.class": "org.apache.kafka.common.config.provider.DirectoryConfigProvider",
            "sasl.enabled.mechanisms": MECHANISM,
            "sasl.mechanism.inter.broker.protocol": MECHANISM,
            f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config": admin_jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(files.broker_keystore),
            "ssl.key.password": secret(files.key_password_file("broker")),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(files.ca_file),
            "listener.name.ssl.ssl.client.auth": "required",
            f"{wrong}ssl.client.auth": "required",
            f"{wrong}ssl.keystore.type": "PEM",
            f"{wrong}ssl.keystore.location": str(files.wrong_host_keystore),
            f"{wrong}ssl.key.password": secret(files.key_password_file("wrong-host")),
            "ssl.principal.mapping.rules": "RULE:^CN=([^,]+).*$/$1/,DEFAULT",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{ADMIN};User:ANONYMOUS",
        }
        return BrokerConfig(
            port=self.port,
            controller_port=self.controller_port,
            data_dir=self.data_dir,
            heap=self.heap,
            extra_properties=properties,
            listener="SASL_SSL",
            extra_listeners=(Listener("SSL", self.ssl_port, "SSL"),
                             Listener(_WRONG_HOST_LISTENER, self.wrong_host_port, "SSL")),
            quorum=self.quorum,
        )


class SecureBroker(LocalBroker):
    """`LocalBroker` with TLS, SCRAM, mutual TLS and ACLs; its certificates and users made on first start."""

    def __init__(self, config: SecureBrokerConfig | None = None) -> None:
        self.secure_config = config or SecureBrokerConfig()
        super().__init__(self.secure_config.broker_config())
        self.files = SecurityFiles(self.secure_config.security_dir)

    # -- where

    @property
    def ssl_bootstrap_servers(self) -> str:
        """The mutual-TLS listener."""
        return f"127.0.0.1:{self.secure_config.ssl_port}"

    @property
    def wrong_host_bootstrap_servers(self) -> str:
        """A mutual-TLS listener whose certificate names only ``wrong.example``: hostname checks fail here."""
        return f"127.0.0.1:{self.secure_config.wrong_host_port}"

    @property
    def ca_file(self) -> Path:
        return self.files.ca_file

    @property
    def other_ca_file(self) -> Path:
        return self.files.other_ca_file

    def password_file(self, user: str) -> Path:
        return self.files.password_file(user)

    # -- client settings

    def client_properties(self, user: str = JOB, via: Via = "scram") -> dict[str, str]:
        """Java client properties (a job's ``kafka.properties``) to connect as ``user``.

        ``via="scram"``: SASL_SSL with the SCRAM password as ``${file:…}``; connect to
        ``bootstrap_servers``. ``via="mtls"``: SSL with ``user``'s client certificate (issued on
        demand) and its key password as ``${file:…}``; connect to ``ssl_bootstrap_servers``.
        Both trust ``ca.pem``. No secret is in the returned values.
        """
        trust = {"ssl.truststore.type": "PEM", "ssl.truststore.location": str(self.ca_file)}
        if via == "scram":
            password = f"${{file:{self.files.password_file(user)}}}"
            return {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": MECHANISM,
                "sasl.jaas.config": f'{_SCRAM_MODULE} required username="{user}" password="{password}";',
                **trust,
            }
        cert = self._client_certificate(user)
        return {
            "security.protocol": "SSL",
            **trust,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(cert.keystore),
            "ssl.key.password": f"${{file:{cert.password_file}}}",
        }

    def kafka_python_config(self, user: str = JOB, via: Via = "scram") -> dict[str, Any]:
        """kafka-python keyword arguments (bootstrap included) to connect as ``user``, secrets read."""
        if via == "scram":
            return {
                "bootstrap_servers": self.bootstrap_servers,
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": MECHANISM,
                "sasl_plain_username": user,
                "sasl_plain_password": self.files.password(user),
                "ssl_cafile": str(self.ca_file),
            }
        cert = self._client_certificate(user)
        return {
            "bootstrap_servers": self.ssl_bootstrap_servers,
            "security_protocol": "SSL",
            "ssl_cafile": str(self.ca_file),
            "ssl_certfile": str(cert.certificate),
            "ssl_keyfile": str(cert.key),
            "ssl_password": _read_secret(cert.password_file),
        }

    def client_snippet(self, user: str = JOB, *, bootstrap: str | None = None, ssl_bootstrap: str | None = None) -> str:
        """The ``kafka:`` part of a job config for ``user`` over SCRAM, the mutual-TLS alternative as a
        comment, and where the admin's password is: YAML that names secrets, never holds them.
        ``bootstrap``/``ssl_bootstrap`` replace this broker's listeners (a cluster lists every node's)."""
        scram = {"kafka": {"bootstrap_servers": bootstrap or self.bootstrap_servers,
                           "properties": self.client_properties(user, "scram")}}
        mtls = {"kafka": {"bootstrap_servers": ssl_bootstrap or self.ssl_bootstrap_servers,
                          "properties": self.client_properties(user, "mtls")}}
        def dump(doc: dict[str, Any]) -> str:
            return str(yaml.safe_dump(doc, sort_keys=False, width=1000))

        commented = "".join(f"# {line}\n" for line in dump(mtls).splitlines())
        return (f"# {user} over SASL_SSL (SCRAM-SHA-512):\n{dump(scram)}"
                f"# or {user} over mutual TLS:\n{commented}"
                f"# User:{user} may do nothing until granted (SecureBroker.grant in jobs/dev/secure_kafka.py);\n"
                f"# {ADMIN} is a super user, password in {self.files.password_file(ADMIN)}\n")

    def _client_certificate(self, name: str) -> ClientCertificate:
        cert = self.files.client(name)
        if not cert.keystore.exists():
            self.files.tls_dir.mkdir(parents=True, exist_ok=True)
            if not self.files.ca_file.exists():
                raise BrokerError(f"no CA in {self.files.tls_dir} yet: start the broker first")
            cert = self.files.issue_client(name)
        return cert

    # -- administration

    @contextlib.contextmanager
    def admin(self, timeout_s: float = 30.0) -> Iterator[KafkaAdminClient]:
        """A kafka-python admin client logged in as ``admin`` (a super user), closed on exit."""
        ms = int(timeout_s * 1000)
        with KafkaAdminClient(**self.kafka_python_config(ADMIN), request_timeout_ms=ms, bootstrap_timeout_ms=ms,
                              client_id="llmstream-secure-admin") as client:
            yield client

    def grant(
        self,
        principal: str,
        *,
        input_topics: Sequence[str],
        output_topic: str,
        dead_letter_topic: str,
        group_id: str,
        transactional_id_prefix: str,
        prefixed: bool = False,
        omit: Permission | None = None,
    ) -> list[ACL]:
        """Allow ``principal`` (``job`` or ``User:job``) what the job needs, but ``omit``; see `job_acls`.

        Idempotent (an ACL that exists already is kept). Returns the ACLs once the broker enforces them;
        a refused one is a `BrokerError`.

        The controller acknowledges CreateAcls once the records are in the metadata log; the broker's
        authorizer applies them a moment later. A client that connects in between is refused (seen in CI:
        a preflight saw "may not READ" for an ACL created just before), so this waits until DescribeAcls,
        which the broker answers from its authorizer, lists every one.
        """
        acls = job_acls(principal, input_topics=input_topics, output_topic=output_topic,
                        dead_letter_topic=dead_letter_topic, group_id=group_id,
                        transactional_id_prefix=transactional_id_prefix, prefixed=prefixed, omit=omit)
        with self.admin() as client:
            _create_acls(client, principal, acls)
        return acls

    # -- LocalBroker's hooks

    def _write_config(self) -> None:
        formatted = (self.data_dir / "data" / "meta.properties").exists()
        self.files.ensure(SCRAM_USERS, TLS_CLIENTS, formatted=formatted)
        super()._write_config()

    def _format_args(self) -> list[str]:
        args: list[str] = []
        for user in SCRAM_USERS:
            args += ["--add-scram", f"{MECHANISM}=[name={user},password={self.files.password(user)}]"]
        return args

    def _answers(self, timeout_s: float) -> bool:
        """Whether the broker answers ``admin`` over SASL_SSL (TLS, SCRAM and the authorizer all up)."""
        if not self.files.password_file(ADMIN).exists() or not port_in_use(self.secure_config.port):
            return False  # at once: kafka-python would retry until the timeout
        ms = max(int(timeout_s * 1000), 500)
        try:
            with KafkaAdminClient(**self.kafka_python_config(ADMIN), request_timeout_ms=ms, bootstrap_timeout_ms=ms,
                                  reconnect_backoff_max_ms=200, client_id="llmstream-readiness") as client:
                client.describe_cluster()
                client.list_topics()
            return True
        except Exception:  # noqa: BLE001 - any failure just means "not ready yet"
            return False

    def status(self) -> dict[str, Any]:
        return {
            **super().status(),
            "ssl_bootstrap": self.ssl_bootstrap_servers,
            "wrong_host_bootstrap": self.wrong_host_bootstrap_servers,
            "ca_file": str(self.ca_file),
            "secrets_dir": str(self.files.secrets_dir),
        }


# ---------------------------------------------------------------------- several secured nodes


class SecureKafkaCluster(LocalKafkaCluster):
    """`LocalKafkaCluster` of `SecureBroker` nodes: every node has the four listeners of a secured broker
    (SASL_SSL, SSL, WRONG_HOST, the controller's, in that order in ``ClusterConfig.ports``), and all
    share the certificates and passwords in ``config.data_dir`` (made before the first node starts).
    Client settings and ``grant`` are the single broker's, with every node's listener to bootstrap from."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        config = config or ClusterConfig(port=DEFAULT_CLUSTER_PORT, data_dir=default_cluster_dir())
        if ":" in str(config.data_dir):
            raise ValueError(f"data_dir must not contain ':' (Kafka's config placeholders split on it): "
                             f"{config.data_dir}")
        self.files = SecurityFiles(config.data_dir)
        super().__init__(config)
        self.secure_nodes: list[SecureBroker] = [node for node in self.nodes if isinstance(node, SecureBroker)]

    @classmethod
    def ephemeral(cls, data_dir: Path, brokers: int = 3, **kwargs: Any) -> SecureKafkaCluster:
        """A cluster on fresh free ports (four a node), for tests that must not collide."""
        return cls(ClusterConfig.ephemeral(data_dir, brokers, per_node=4, **kwargs))

    def _make_nodes(self) -> list[LocalBroker]:
        ports = self.config.node_ports(4)
        voters = tuple(controller for _, _, controller, _ in ports)
        return [SecureBroker(SecureBrokerConfig(
                    port=port, ssl_port=ssl_port, controller_port=controller, wrong_host_port=wrong_host,
                    data_dir=self.config.node_dir(node), heap=self.config.heap, quorum=Quorum(node, voters),
                    files_dir=self.config.data_dir))
                for node, (port, ssl_port, controller, wrong_host) in enumerate(ports, start=1)]

    def _prepare(self) -> None:
        formatted = any((node.data_dir / "data" / "meta.properties").exists() for node in self.nodes)
        self.files.ensure(SCRAM_USERS, TLS_CLIENTS, formatted=formatted)

    @property
    def ssl_bootstrap_servers(self) -> str:
        """Every node's mutual-TLS listener."""
        return ",".join(node.ssl_bootstrap_servers for node in self.secure_nodes)

    @property
    def ca_file(self) -> Path:
        return self.files.ca_file

    def client_properties(self, user: str = JOB, via: Via = "scram") -> dict[str, str]:
        """`SecureBroker.client_properties`: the same on every node."""
        return self.secure_nodes[0].client_properties(user, via)

    def kafka_python_config(self, user: str = JOB, via: Via = "scram") -> dict[str, Any]:
        """`SecureBroker.kafka_python_config` bootstrapping from every node."""
        servers = self.bootstrap_servers if via == "scram" else self.ssl_bootstrap_servers
        return {**self.secure_nodes[0].kafka_python_config(user, via), "bootstrap_servers": servers}

    def client_args(self) -> dict[str, Any]:
        return self.kafka_python_config(ADMIN)

    def client_snippet(self, user: str = JOB) -> str:
        return self.secure_nodes[0].client_snippet(user, bootstrap=self.bootstrap_servers,
                                                   ssl_bootstrap=self.ssl_bootstrap_servers)

    def grant(self, principal: str, **names: Any) -> list[ACL]:
        """`SecureBroker.grant` (same keywords) through the whole cluster."""
        acls = job_acls(principal, **names)
        ms = 30_000
        with KafkaAdminClient(**self.client_args(), request_timeout_ms=ms, bootstrap_timeout_ms=ms,
                              client_id="llmstream-secure-admin") as client:
            _create_acls(client, principal, acls)
        return acls

    def status(self) -> dict[str, Any]:
        return {**super().status(), "ssl_bootstrap": self.ssl_bootstrap_servers, "ca_file": str(self.ca_file),
                "secrets_dir": str(self.files.secrets_dir)}
