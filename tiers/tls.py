"""TLS of the tiers that reach a server over the network (any thread): the client context a
tier's options make, and the handshake a tier tries when it opens.

A tier asked to speak TLS never falls back to plaintext. What is wrong with its TLS is said at
open, in one line that names the tier and the cause: a CA or certificate file that cannot be
read (`ConfigError`); a server whose certificate the CA did not sign, an expired certificate, a
plaintext server (`TlsError`, from `check_handshake`). A server that cannot be reached at all
is not TLS's fault: the tier's calls report it (`TierUnavailable`), as without TLS.
"""

from __future__ import annotations

import socket
import ssl
import time

from tiering.errors import ConfigError, TlsError

__all__ = ["check_handshake", "client_context", "tls_cause"]


def client_context(
    tier: str,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    *,
    ca_option: str = "tls_ca_file",
) -> ssl.SSLContext:
    """A client context that verifies the server against `ca_file` (None: the system's CAs)
    and its name, presenting `cert_file` (with `key_file`, or a key within it) where given;
    a file that cannot be read or is not what it should be is a `ConfigError`."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"tier {tier!r}: {ca_option} {ca_file!r}: {_reason(e)}") from None
    if cert_file is None and key_file is not None:
        raise ConfigError(f"tier {tier!r}: tls_key_file without tls_cert_file")
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"tier {tier!r}: tls_cert_file {cert_file!r}"
                + (f" with tls_key_file {key_file!r}" if key_file else "")
                + f": {_reason(e)}"
            ) from None
    return context


def check_handshake(
    tier: str,
    host: str,
    port: int,
    context: ssl.SSLContext,
    timeout: float,
    hello: bytes = b"",
) -> None:
    """Connect to `host:port` and complete a TLS handshake, within `timeout` in all; then send
    `hello` (a request the server answers) and read a first byte of its answer, which is where
    a server that wants a client certificate says so (TLS 1.3 sends that refusal after the
    handshake). `TlsError` when TLS fails; a server that cannot be reached passes (the tier's
    calls report that)."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return
    where = f"TLS to {host}:{port}"
    try:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        with context.wrap_socket(sock, server_hostname=host) as tls:
            if hello:
                tls.settimeout(max(0.01, deadline - time.monotonic()))
                tls.sendall(hello)
                if not tls.recv(1):
                    raise TlsError(f"tier {tier!r}: {where}: {_CLOSED}")
    except TimeoutError:
        raise TlsError(
            f"tier {tier!r}: {where}: no TLS answer within {timeout:g}s (a plaintext server?)"
        ) from None
    except (ssl.SSLError, ConnectionError) as e:
        raise TlsError(f"tier {tier!r}: {where}: {tls_cause(e)}") from None
    finally:
        sock.close()


def tls_cause(error: BaseException) -> str:
    """What a TLS failure means, in a few words: the verification's own message (`certificate
    has expired`), or the handshake's."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {error.verify_message}"
    if isinstance(error, ssl.SSLEOFError | ConnectionResetError):
        return _CLOSED
    if isinstance(error, ssl.SSLError) and error.reason in (
        "WRONG_VERSION_NUMBER",
        "RECORD_LAYER_FAILURE",
    ):
        return f"{_reason(error)} (a plaintext server?)"
    return _reason(error)


_CLOSED = "the server closed the connection (does it want a client certificate?)"


def _reason(error: BaseException) -> str:
    if isinstance(error, ssl.SSLError) and error.reason:
        return error.reason.lower().replace("_", " ")
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__
