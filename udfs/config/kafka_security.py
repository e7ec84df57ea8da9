"""`kafka.properties` (Java client names) as kafka-python arguments, for every Kafka client llmstream
opens outside Flink: preflight, admin, `llmstream status`, the demo's reader, run/submit's watchers.

Flink's Kafka source and sink take `kafka.properties` as they are; the Python clients must reach the
same secured cluster with the same settings, so the one setting is translated here, once, and a
property that matters for connecting but has no kafka-python equivalent is a `ConfigError` naming the
key at load, never a silent drop (the job would then pass preflight on one identity and run on
another, or fail preflight on a cluster the job itself could reach).

Secrets stay placeholders in the config (`udfs/secret_refs.py`); `client_args` resolves them into the
arguments it returns, which go straight to kafka-python. A literal password in the file is refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from udfs import secret_refs
from udfs.config.loader import is_file
from udfs.errors import ConfigError

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SECRET_KEYS = ("ssl.key.password", "ssl.keystore.password", "ssl.truststore.password",
               "sasl.oauthbearer.client.credentials.client.secret")
"""Properties whose value is a secret: only placeholders are accepted."""

TRANSLATED = frozenset({
    "security.protocol", "sasl.mechanism", "sasl.jaas.config",
    "ssl.truststore.location", "ssl.truststore.type", "ssl.keystore.location", "ssl.keystore.type",
    "ssl.key.password", "ssl.endpoint.identification.algorithm", "ssl.cipher.suites",
})
IGNORED = frozenset({
    # TLS details the Python ssl module decides for itself, or that PEM stores do not use.
    "ssl.protocol", "ssl.enabled.protocols", "ssl.keystore.password", "ssl.truststore.password",
    "ssl.keymanager.algorithm", "ssl.trustmanager.algorithm", "ssl.secure.random.implementation",
    # Re-login and timing knobs: the Python clients are short-lived.
    "sasl.login.refresh.window.factor", "sasl.login.refresh.window.jitter", "sasl.login.refresh.min.period.seconds",
    "sasl.login.refresh.buffer.seconds", "sasl.login.connect.timeout.ms", "sasl.login.read.timeout.ms",
    "sasl.login.retry.backoff.ms", "sasl.login.retry.backoff.max.ms",
})
CONNECTION_PREFIXES = ("security.", "sasl.", "ssl.")
JAAS_OPTION = re.compile(r'([A-Za-z_][\w.]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
JAAS_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def _key(path: str, name: str) -> str:
    return f"{path}.{name}"


def check_literal_secrets(properties: dict[str, str], path: str) -> None:
    """A password written into the config itself is refused: it would be in the file, and in every copy."""
    for name in SECRET_KEYS:
        value = properties.get(name)
        if value and not secret_refs.has_placeholder(value):
            raise ConfigError(_key(path, name), "holds a literal secret; write ${file:PATH} or ${env:NAME} instead")
    jaas = properties.get("sasl.jaas.config")
    if jaas:
        for option, value in JAAS_OPTION.findall(jaas):
            if option.lower() in ("password", "clientsecret") and not secret_refs.has_placeholder(value):
                raise ConfigError(_key(path, "sasl.jaas.config"),
                                  f'{option}="..." is a literal secret; write {option}="${{file:PATH}}" '
                                  'or "${env:NAME}" instead')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def _jaas(text: str, mechanism: str, path: str) -> tuple[str, str]:
    """(username, password) from a PLAIN or SCRAM `sasl.jaas.config`."""
    key = _key(path, "sasl.jaas.config")
    module = JAAS_MODULES[mechanism]
    if module not in text:
        raise ConfigError(key, f"needs {module} for sasl.mechanism {mechanism}")
    options = {name: _unescape(value) for name, value in JAAS_OPTION.findall(text)}
    missing = [name for name in ("username", "password") if name not in options]
    if missing:
        raise ConfigError(key, f"has no {missing[0]}=\"...\" option")
    return options["username"], options["password"]


def _pem_file(properties: dict[str, str], store: str, path: str) -> str | None:
    """The PEM file of the trust or key store, or None; JKS/PKCS12 stores cannot be read from Python."""
    location = properties.get(f"ssl.{store}.location")
    if not location:
        return None
    kind = properties.get(f"ssl.{store}.type", "JKS").upper()
    if kind != "PEM":
        raise ConfigError(_key(path, f"ssl.{store}.type"),
                          f"{kind} stores cannot be read by llmstream's Python Kafka clients (preflight, status); "
                          f"use a PEM file and set ssl.{store}.type: PEM (the Flink job reads PEM too)")
    if not is_file(location):
        raise ConfigError(_key(path, f"ssl.{store}.location"), f"file {location} does not exist")
    return str(Path(location).expanduser())


def _check_supported(properties: dict[str, str], path: str) -> None:
    for name in sorted(properties):
        if name.startswith(CONNECTION_PREFIXES) and name not in TRANSLATED and name not in IGNORED:
            raise ConfigError(_key(path, name),
                              "has no equivalent in the Python Kafka clients llmstream also uses (preflight, "
                              "status, watchers), so they could not connect as the job does; supported: "
                              + ", ".join(sorted(TRANSLATED)))


def client_args(properties: dict[str, str], path: str = "kafka.properties") -> dict[str, Any]:
    """kafka-python keyword arguments (security only) for `properties`, secrets resolved.

    Raises `ConfigError` naming the property for an unsupported protocol, mechanism or store, a
    missing file or environment variable, or a literal secret. Never logs or returns placeholders.
    """
    check_literal_secrets(properties, path)
    _check_supported(properties, path)
    props = {name: secret_refs.resolve(value, _key(path, name)) for name, value in properties.items()
             if name.startswith(CONNECTION_PREFIXES)}
    protocol = props.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise ConfigError(_key(path, "security.protocol"), f"must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    args: dict[str, Any] = {"security_protocol": protocol}
    if protocol.startswith("SASL_"):
        mechanism = props.get("sasl.mechanism", "GSSAPI").upper()
        if mechanism not in MECHANISMS:
            raise ConfigError(_key(path, "sasl.mechanism"),
                              f"{mechanism} is not supported by llmstream's Python Kafka clients; use one of "
                              f"{', '.join(MECHANISMS)}, or mutual TLS (security.protocol: SSL)")
        if "sasl.jaas.config" not in props:
            raise ConfigError(_key(path, "sasl.jaas.config"), f"required with security.protocol {protocol}")
        username, password = _jaas(props["sasl.jaas.config"], mechanism, path)
        args.update(sasl_mechanism=mechanism, sasl_plain_username=username, sasl_plain_password=password)
    if protocol in ("SSL", "SASL_SSL"):
        cafile = _pem_file(props, "truststore", path)
        if cafile:
            args["ssl_cafile"] = cafile
        keystore = _pem_file(props, "keystore", path)
        if keystore:
            args.update(ssl_certfile=keystore, ssl_keyfile=keystore)
            if props.get("ssl.key.password"):
                args["ssl_password"] = props["ssl.key.password"]
        algorithm = props.get("ssl.endpoint.identification.algorithm", "https")
        args["ssl_check_hostname"] = algorithm.strip().lower() == "https"
        if props.get("ssl.cipher.suites"):
            args["ssl_ciphers"] = props["ssl.cipher.suites"].replace(",", ":").replace(" ", "")
    return args


SHADED_PREFIX = "org.apache.flink.kafka.shaded."
"""Where flink-sql-connector-kafka relocates the Kafka client it carries (`org.apache.kafka` inside it)."""
CLASS_NAME = re.compile(r"(?<![\w.])org\.apache\.kafka\.")


def flink_properties(properties: dict[str, str], path: str = "kafka.properties") -> dict[str, str]:
    """`properties` for Flink's Kafka source and sink: secrets resolved, and Kafka class names (the login
    module in `sasl.jaas.config`, callback handlers) relocated into the connector's shaded package.

    The SQL connector jar shades kafka-clients, so `...scram.ScramLoginModule` as every Kafka guide
    writes it fails inside the job with "No LoginModule found" and a restart loop (measured); the
    Python clients take the unshaded name. Users write the usual name; this rewrites it for Flink.
    """
    resolved = secret_refs.resolve_all(properties, path)
    return {name: CLASS_NAME.sub(SHADED_PREFIX + "org.apache.kafka.", value)
            if name == "sasl.jaas.config" or name.endswith(".class") else value
            for name, value in resolved.items()}


def secret_values(args: dict[str, Any]) -> list[str]:
    """The resolved secrets among `client_args`' result, to mask in messages built from library errors."""
    return [str(args[k]) for k in ("sasl_plain_password", "ssl_password") if args.get(k)]
