"""Credentials out of everything kvtier prints, logs, labels or puts in a child's argv.

A password reaches kvtier inside a URL (`redis://:${REDIS_PASSWORD}@host/0`, or a query
argument such as `?password=...`, which redis-py reads too) or as an option of its own
(`password`, `secret_key`). Messages, `kvtier show` and logs carry the URL with its password
replaced by `***` (the user name stays: it says who, not how); a child process gets a secret by
its environment, never its command line (which every local user can read in /proc).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote

__all__ = [
    "MASK",
    "SECRET_WORDS",
    "is_secret_name",
    "redact_data",
    "redact_text",
    "redact_url",
    "secrets_in",
    "url_secrets",
]

MASK = "***"
SECRET_WORDS = ("password", "passwd", "secret", "token", "access_key", "credential")
"""An option or query argument whose name contains one of these holds a secret."""

_USERINFO = re.compile(
    # the password runs to the authority's last "@" (one left unencoded in it must not leak)
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/?#@:]*):(?P<pw>[^\s/?#]*)@"
)
_QUERY = re.compile(r"(?P<name>[?&;][^\s=&;#]*=)(?P<value>[^\s&;#]*)")


def is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def redact_url(url: str) -> str:
    """`url` with the password of its user part, and the values of query arguments named like
    secrets, replaced by `***`; anything else as it was."""
    return redact_text(url)


def redact_text(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with every URL's password and secret query arguments masked (see `redact_url`),
    and every occurrence of each of `secrets` (as given and percent-encoded) too."""

    def user(match: re.Match[str]) -> str:
        return f"{match['scheme']}{match['user']}:{MASK}@" if match["pw"] else match[0]

    def query(match: re.Match[str]) -> str:
        name = match["name"]
        return f"{name}{MASK}" if is_secret_name(name[1:-1]) and match["value"] else match[0]

    text = _USERINFO.sub(user, text)
    if "?" in text:
        text = _QUERY.sub(query, text)
    for secret in secrets:
        if secret and len(secret) >= 3:  # masking a one- or two-character string masks noise
            for form in {secret, quote(secret, safe=""), unquote(secret)}:
                text = text.replace(form, MASK)
    return text


def url_secrets(url: str) -> list[str]:
    """The secrets a URL carries (its password, secret query arguments), decoded as a client
    sends them: for `redact_text` on messages that might quote them without their URL."""
    found = [unquote(m["pw"]) for m in _USERINFO.finditer(url) if m["pw"]]
    found += [unquote(m["value"]) for m in _QUERY.finditer(url) if is_secret_name(m["name"][1:-1])]
    return [s for s in found if s]


def secrets_in(data: Any, name: str = "") -> list[str]:
    """The secrets plain data holds (as text): the value of every option named like a secret
    (`name` for `data` itself), and every credential in a string (a URL's password)."""
    found: list[str] = []

    def collect(value: Any, name: str, secret: bool) -> None:
        secret = secret or is_secret_name(name)  # all of a secret option's value is secret
        if isinstance(value, dict):
            for k, v in value.items():
                collect(v, str(k), secret)
        elif isinstance(value, list | tuple):
            for v in value:
                collect(v, name, secret)
        elif value is not None and secret:
            found.append(str(value))
        elif isinstance(value, str):
            found.extend(url_secrets(value))

    collect(data, name, False)
    return found


def redact_data(data: Any) -> Any:
    """Plain data (a config as dicts, lists and scalars) with its secrets masked: the value of
    every option named like a secret, and every credential in a string (a URL's password, or
    any secret of the first kind quoted elsewhere)."""
    found = secrets_in(data)

    def mask(value: Any, name: str) -> Any:
        if isinstance(value, dict):
            return {k: mask(v, str(k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [mask(v, name) for v in value]
        if value is not None and is_secret_name(name):
            return MASK
        if isinstance(value, str):
            return redact_text(value, found)
        return value

    return mask(data, "")
