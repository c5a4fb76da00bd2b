"""Credentials out of everything kvtier prints, logs, labels or puts in a child's argv.

A password reaches kvtier inside a URL (`redis://:${REDIS_PASSWORD}@host/0`, or a query
argument such as `?password=...`, which redis-py reads too) or as an option of its own
(`password`, `secret_key`, `auth.secret`, `auth.previous`). Messages, `kvtier show` and logs
carry the URL with its password replaced by `***` (the user name stays: it says who, not how);
a child process gets a secret by its environment, never its command line (which every local user
can read in /proc).

A password may hold any character. In a URL its end is the authority's last `@`: one holding
`@`, `:`, `%`, blanks or non-ASCII letters unencoded is found whole (a string that is a URL is
read whole, blanks included; a URL inside a message runs to the next blank, so there the secret
itself, known from the config, is masked). One holding `/`, `?` or `#` unencoded cannot be read
by a URL parser (they end its authority: part of the password would become the host or port,
and be printed as such), so a tier refuses such a URL with `UNENCODED_PASSWORD`; it is masked
all the same, from the user's `:` to the last `@`. A URL whose query holds an `@` after a
`host:port` is masked up to that `@` too: it cannot be told apart from such a password.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "MASK",
    "SECRET_PATHS",
    "SECRET_WORDS",
    "UNENCODED_PASSWORD",
    "is_secret_name",
    "is_secret_path",
    "password_needs_encoding",
    "redact_data",
    "redact_text",
    "redact_url",
    "secrets_in",
    "url_secrets",
]

MASK = "***"
SECRET_WORDS = ("password", "passwd", "secret", "token", "access_key", "credential")
"""An option or query argument whose name contains one of these holds a secret."""
SECRET_PATHS = frozenset({("auth", "previous")})
"""Options that hold secrets under other names, as (section, option): the secrets an engine
still accepts from before a rotation."""
UNENCODED_PASSWORD = (
    "its password holds '/', '?' or '#' unencoded, which ends a URL's host part: "
    "percent-encode them (%2F, %3F, %23) or give the password as the tier's `password` option"
)

_SCHEME = r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)"
# a URL in text runs to the next blank; its password, to the last "@" before that
_USERINFO = re.compile(_SCHEME + r"(?P<user>[^\s/?#@:]*):(?P<pw>\S*)@")
# a string that is a URL: its password runs to its last "@", blanks included
_WHOLE_URL = re.compile(r"\s*" + _SCHEME + r"(?P<user>[^/?#@:]*):(?P<pw>.*)@(?P<rest>[^@]*)", re.S)
_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]]+)(:\d*)?")
_QUERY = re.compile(r"(?P<name>[?&;][^\s=&;#]*=)(?P<value>[^\s&;#]*)")


def is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def is_secret_path(section: str, name: str) -> bool:
    """Whether option `name` of `section` holds a secret: by its name, or as one of
    `SECRET_PATHS`."""
    return is_secret_name(name) or (section, name) in SECRET_PATHS


def redact_url(url: str) -> str:
    """`url` (the whole string one URL) with the password of its user part, and the values of
    query arguments named like secrets, replaced by `***`; anything else as it was."""
    whole = _WHOLE_URL.match(url)
    if whole and whole["pw"]:
        url = f"{whole['scheme']}{whole['user']}:{MASK}@{whole['rest']}"
    return redact_text(url)


def password_needs_encoding(url: str) -> bool:
    """Whether `url`'s password (up to its last `@`) holds `/`, `?` or `#` unencoded, so that a
    URL parser would end the host part inside it: its host part then is no `host[:port]`, or
    the `@` lies in its path or fragment (in its query it may be a query argument's)."""
    whole = _WHOLE_URL.match(url)
    if not whole or not any(c in whole["pw"] for c in "/?#"):
        return False
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return True
    if "@" in parts.netloc:
        return False
    return bool(
        "@" in parts.path or "@" in parts.fragment or not _HOST_PORT.fullmatch(parts.netloc)
    )


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
    """The secrets a URL carries (its password, secret query arguments), as written and decoded
    as a client sends them: for `redact_text` on messages that might quote them without their
    URL. A string that is not one URL is searched for URLs."""
    whole = _WHOLE_URL.match(url)
    if whole and whole["pw"]:
        passwords = [whole["pw"]]
    else:
        passwords = [m["pw"] for m in _USERINFO.finditer(url) if m["pw"]]
    passwords += [m["value"] for m in _QUERY.finditer(url) if is_secret_name(m["name"][1:-1])]
    found = [form for pw in passwords for form in (pw, unquote(pw))]
    return [s for s in dict.fromkeys(found) if s]


def secrets_in(data: Any, name: str = "") -> list[str]:
    """The secrets plain data holds (as text): the value of every option named like a secret
    (`name` for `data` itself), and every credential in a string (a URL's password)."""
    found: list[str] = []

    def collect(value: Any, name: str, secret: bool, section: str = "") -> None:
        # all of a secret option's value is secret (each string of a list of them)
        secret = secret or is_secret_path(section, name)
        if isinstance(value, dict):
            for k, v in value.items():
                collect(v, str(k), secret, name)
        elif isinstance(value, list | tuple):
            for v in value:
                collect(v, name, secret, section)
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

    def mask(value: Any, name: str, section: str = "") -> Any:
        if isinstance(value, dict):
            return {k: mask(v, str(k), name) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [mask(v, name, section) for v in value]
        if value is not None and is_secret_path(section, name):
            return MASK
        if isinstance(value, str):
            return redact_text(value, found)
        return value

    return mask(data, "")
