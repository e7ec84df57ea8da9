"""TLS towards the model server: the `ssl.SSLContext` built from `model.tls`, and which
failures are TLS failures.

`tls_context` is built once per client, on the worker: a CA bundle replaces the system's
trust store, a client certificate and key are presented for mutual TLS, and `verify: false`
(allowed only with `allow_insecure`, checked at load) turns certificate checks off. A key
file that is encrypted is refused instead of letting OpenSSL prompt on the worker's terminal.

`tls_failure` tells a TLS failure (untrusted or misnamed certificate, a refused or missing
client certificate, a failed handshake) from a connection that merely dropped: the first is
a setting to fix, a `TlsError` dead-lettered after one attempt; the second is retried.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from udfs.errors import ConfigError, TlsError

if TYPE_CHECKING:
    from udfs.config import ModelTlsConfig

MAX_DETAIL_CHARS = 300


def _no_password() -> str:
    raise ConfigError("model.tls.client_key_file", "the key is encrypted; give an unencrypted key file "
                                                   "(readable only by the job's user)")


def tls_context(tls: ModelTlsConfig, path: str = "model.tls") -> ssl.SSLContext | bool:
    """The context for HTTPS calls to the model server, or `True` (aiohttp's default verified
    context) when `model.tls` sets nothing. A file that is not a usable certificate or key is a
    `ConfigError` naming its key."""
    if not (tls.ca_file or tls.client_cert_file or not tls.verify):
        return True
    try:
        context = ssl.create_default_context(cafile=str(Path(tls.ca_file).expanduser()) if tls.ca_file else None)
    except (ssl.SSLError, OSError) as err:
        raise ConfigError(f"{path}.ca_file", f"{tls.ca_file} holds no usable CA certificate ({_ssl_text(err)})") from None
    if tls.client_cert_file and tls.client_key_file:
        try:
            context.load_cert_chain(str(Path(tls.client_cert_file).expanduser()),
                                    str(Path(tls.client_key_file).expanduser()), password=_no_password)
        except (ssl.SSLError, OSError) as err:
            raise ConfigError(f"{path}.client_cert_file", f"{tls.client_cert_file} and {tls.client_key_file} are "
                                                          f"not a usable certificate and key ({_ssl_text(err)})") from None
    if not tls.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _ssl_text(err: BaseException) -> str:
    """The readable part of an OpenSSL message (`[SSL: X] text (_ssl.c:N)` -> `text`)."""
    if isinstance(err, ssl.SSLCertVerificationError) and err.verify_message:
        return f"certificate verify failed: {err.verify_message}"
    text = str(err.args[1]) if len(err.args) > 1 and isinstance(err.args[1], str) else str(err)
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.rsplit(" (_ssl.c:", 1)[0]


def _hint(err: ssl.SSLError) -> str:
    reason = (err.reason or "").upper()
    if isinstance(err, ssl.SSLCertVerificationError):
        if "hostname" in (err.verify_message or "").lower() or "IP address mismatch" in (err.verify_message or ""):
            return "the server's certificate does not name this host: fix model.endpoint or the certificate"
        return "the server's certificate is not trusted: set model.tls.ca_file to the CA that signed it"
    if "CERTIFICATE_REQUIRED" in reason:
        return "the server requires a client certificate: set model.tls.client_cert_file and client_key_file"
    if "ALERT" in reason and ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason):
        return "the server refused the client certificate (model.tls.client_cert_file)"
    if "WRONG_VERSION_NUMBER" in reason:
        return "the server does not speak TLS on this port: is model.endpoint http:// rather than https://?"
    return "check model.endpoint and model.tls"


def _is_tls_failure(err: BaseException, during_connect: bool) -> bool:
    if isinstance(err, aiohttp.ClientError):  # some are ssl errors too: what counts is behind them
        return False
    if isinstance(err, ssl.SSLCertVerificationError):
        return True
    # EOF and other ssl.SSLError subclasses are dropped connections; an alert is the server's verdict
    return type(err) is ssl.SSLError and (during_connect or "ALERT" in (err.reason or "").upper())


def _ssl_cause(err: BaseException, during_connect: bool) -> ssl.SSLError | None:
    """The SSL error behind an aiohttp error if it is a TLS failure rather than a dropped
    connection: a certificate check, an alert from the server, or any handshake error
    other than an unexpected EOF."""
    todo: list[BaseException | None] = [err]
    seen: set[int] = set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if _is_tls_failure(current, during_connect):
            assert isinstance(current, ssl.SSLError)
            return current
        todo += [current.__cause__, current.__context__, getattr(current, "certificate_error", None),
                 getattr(current, "os_error", None)]
    return None


def tls_failure(err: aiohttp.ClientError, host: str) -> TlsError | None:
    """A `TlsError` saying what failed and which setting to look at, if `err` is a TLS failure."""
    cause = _ssl_cause(err, during_connect=isinstance(err, aiohttp.ClientSSLError))
    if cause is None:
        return None
    return TlsError(f"TLS with {host} failed: {_ssl_text(cause)}; {_hint(cause)}"[:MAX_DETAIL_CHARS])
