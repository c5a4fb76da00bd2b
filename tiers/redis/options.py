"""The Redis tier's settings and the URL arguments it accepts (any thread: values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

from tiering.errors import ConfigError
from tiering.tier.options import TierOptions, option
from tiering.units import format_duration

__all__ = ["URL_ARGUMENTS", "URL_QUERY", "RedisOptions", "milliseconds"]

URL_QUERY = frozenset(URL_QUERY_ARGUMENT_PARSERS) | {
    "password",
    "username",
    "client_name",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
}
"""Query arguments a Redis URL may carry (redis-py reads them as connection options)."""
URL_ARGUMENTS = URL_QUERY | {"host", "port", "path", "connection_class"}


def _unshown(field: Any) -> Any:
    """`field` (an `option`) left out of the record's repr: a secret must not reach a log."""
    field.repr = False
    return field


@dataclass(frozen=True, kw_only=True, slots=True)
class RedisOptions(TierOptions):
    """The Redis tier's settings (any thread: a value)."""

    url: str = _unshown(  # it may carry a password
        option(
            "redis://127.0.0.1:6379/0",
            low=1,
            what="a URL like 'redis://host:6379/0'",
            help="The server, as redis-py reads it (`rediss://` for TLS).",
        )
    )
    username: str | None = option(None, help="The user to AUTH as (null: the URL's, or none).")
    password: str | None = _unshown(
        option(None, help="The password to AUTH with (null: the URL's, or none); use `${ENV_VAR}`.")
    )
    ttl: float | None = option(
        None,
        kind="duration",
        help="Blocks expire this long after they are written, in whole milliseconds (null: never).",
    )
    cluster: bool = option(False, help="Talk to a Redis Cluster through any of its nodes.")
    tls_ca_file: str | None = option(
        None,
        help="CA bundle for TLS (makes the URL `rediss://`; null: the system's CAs). TLS is "
        "tried at open: a wrong CA, an expired certificate or a plaintext server is an error "
        "there, never a fall back to plaintext.",
    )
    tls_cert_file: str | None = option(
        None, help="Client certificate for TLS (a server that asks for one)."
    )
    tls_key_file: str | None = option(None, help="Client key for TLS (null: in the certificate).")
    socket_timeout: float = option(2.0, kind="duration", help="Socket timeout of each command.")
    connect_timeout: float = option(1.0, kind="duration", help="Timeout of each connection.")
    streams: int = option(
        2,
        low=1,
        high=256,
        help="Connections a batch's values move on at once (fast path; more only add overhead "
        "against one single-threaded server).",
    )
    fast_path: bool = option(
        True,
        help="Move blocks through kvtier's own RESP client on plain TCP (false: redis-py only; "
        "TLS: redis-py, said once in the log).",
    )

    def __post_init__(self) -> None:
        if self.ttl is not None and milliseconds(self.ttl) is None:
            raise ConfigError(
                f"ttl: a whole number of milliseconds (Redis expires keys by the millisecond), "
                f"got {format_duration(self.ttl)}"
            )


def milliseconds(seconds: float) -> int | None:
    """`seconds` in whole milliseconds (at least 1), or None where it is not that."""
    ms = round(seconds * 1000)
    return ms if ms >= 1 and abs(seconds * 1000 - ms) < 1e-3 else None  # (float error: < 1 µs)
