"""Passwords holding any character never show (issue 30, item 6): for each awkward password
(`/`, `#`, `?`, `@`, `:`, `%`, a blank, non-ASCII letters, one percent-encoded), carried by a
Redis URL as written, by a URL percent-encoded, or by the tier's `password` option, beside an
`auth.secret` and `auth.previous` made of it, no command of the CLI prints it (standard output,
standard error) or logs it, as written, percent-encoded or decoded; a URL no client can read (a
`/`, `?` or `#` unencoded) is a one-line config error (exit 2) that says how to write it, the
others work; and a Redis server started for tests and benchmarks gets its password by standard
input, not on its command line."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

import pytest
import redis

from kvtier.cli import main
from kvtier.servers import RedisServer
from tiering import secrets
from tiering.keys import make_key
from tiering.secrets import MASK, redact_data, redact_url, url_secrets

pytestmark = [pytest.mark.redis]

AWKWARD = [
    "a/b-Kv71",
    "p#q-Kv72",
    "x?y=1-Kv73",
    "u@v-Kv74",
    "c:d-Kv75",
    "50%off-Kv76",
    "with space-Kv77",
    "päss wörd-Kv78",
    "s%2Fcret-Kv79",  # percent-encoded as written: a client decodes it to s/cret
]
UNREADABLE = {"a/b-Kv71", "p#q-Kv72", "x?y=1-Kv73"}
"""The passwords a URL cannot carry unencoded."""
KEY = make_key(bytes(32)).hex()
NAMESPACE = "00" * 15 + "01"


def forms(secret: str) -> set[str]:
    """Every way a secret could be printed: as written, percent-encoded (whole or but its
    slashes), decoded, its non-ASCII letters escaped (as YAML and repr write them), and its
    tail alone (`Kv71`: a piece of it printed, the rest cut off), in lower case."""
    found = {secret, quote(secret, safe=""), quote(secret), unquote(secret)}
    found |= {secret.encode("unicode_escape").decode(), secret.encode().decode("latin-1")}
    found |= {f.replace(" ", "+") for f in found} | {secret.rsplit("-", 1)[1]}
    return {f.lower() for f in found}


def leaks(text: str, secret: str) -> list[str]:
    return sorted(f for f in forms(secret) if f in text.lower())


@pytest.mark.parametrize("password", AWKWARD)
def test_a_url_or_config_carrying_an_awkward_password_is_shown_masked(password: str) -> None:
    for url in (
        f"redis://:{password}@127.0.0.1:6379/0",
        f"redis://alice:{password}@127.0.0.1:6379/0",
        f"redis://:{quote(password, safe='')}@127.0.0.1:6379/0",
    ):
        assert leaks(redact_url(url), password) == [], url
        assert redact_url(url).endswith(f":{MASK}@127.0.0.1:6379/0")
        assert unquote(password) in url_secrets(url) or password in url_secrets(url)
    config = {
        "tiers": [
            {"name": "r", "options": {"url": f"redis://:{password}@h/0"}},
            {"name": "p", "options": {"url": "redis://h/0", "password": password}},
            {"name": "s", "options": {"secret_key": password, "note": f"was {password}"}},
        ],
        "auth": {"secret": f"{password}-0123456789abcdef", "previous": [f"old {password}"]},
    }
    shown = repr(redact_data(config))
    assert leaks(shown, password) == []
    assert "'name': 'r'" in shown and "redis://:***@h/0" in shown


def test_only_a_password_holding_a_url_delimiter_needs_encoding() -> None:
    assert [p for p in AWKWARD if secrets.password_needs_encoding(f"redis://:{p}@h:1/0")] == sorted(
        UNREADABLE, key=AWKWARD.index
    )
    for fine in (
        "redis://h:6379/0?password=a@b",  # an "@" in the query is the query's
        "redis://h:6379/0",
        f"redis://:{quote('a/b#c?d', safe='')}@h/0",
        "rediss://alice:p@ss@h:6380",
    ):
        assert not secrets.password_needs_encoding(fine), fine


# -- every command of the CLI ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RedisServer]]:
    """A Redis server per password, requiring it."""
    started = {}
    try:
        for i, password in enumerate(AWKWARD):
            server = RedisServer(tmp_path_factory.mktemp(f"redis-awkward-{i}"), password=password)
            server.start()
            started[password] = server
        yield started
    finally:
        for server in started.values():
            server.stop()


def commands(tmp_path: Path) -> list[tuple[str, ...]]:
    return [
        ("validate",),
        ("show",),
        ("show", "--json"),
        ("stats",),
        ("stats", "--json"),
        ("ls", "--tier", "redis", "--namespace", NAMESPACE),
        ("inspect", "--tier", "redis", "--namespace", NAMESPACE, KEY),
        ("verify", "--tier", "redis", "--namespace", NAMESPACE),
        ("migrate", "--from", "redis", "--to", "files", "--namespace", NAMESPACE, "--dry-run"),
        ("migrate", "--from", "files", "--to", "redis", "--namespace", NAMESPACE),
        ("purge", "--tier", "redis", "--namespace", NAMESPACE, "--yes"),
        ("bench", "--tier", "redis", "--sizes", "4KiB", "--count", "2"),
    ]


@pytest.mark.parametrize("carried", ["url", "url-encoded", "password-option"])
@pytest.mark.parametrize("password", AWKWARD)
def test_no_command_prints_or_logs_an_awkward_password(
    servers: dict[str, RedisServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    password: str,
    carried: str,
) -> None:
    port = servers[password].port
    redis_tier = {
        "url": f'url: "redis://:${{KVT_PW}}@127.0.0.1:{port}/0"',
        "url-encoded": f'url: "redis://:${{KVT_PW_ENCODED}}@127.0.0.1:{port}/0"',
        "password-option": f'url: "redis://127.0.0.1:{port}/0", password: "${{KVT_PW}}"',
    }[carried]
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        f"""version: 1
primary: {{capacity: 1GiB}}
tiers:
  - {{name: files, type: file, path: "{tmp_path / "files"}", capacity: 64MiB}}
  - {{name: redis, type: redis, {redis_tier}}}
auth: {{secret: "${{KVT_AUTH}}"}}
"""
    )
    monkeypatch.setenv("KVT_PW", password)
    monkeypatch.setenv("KVT_PW_ENCODED", quote(password, safe=""))
    monkeypatch.setenv("KVT_AUTH", f"{password} is the key of the MAC, long enough")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    caplog.set_level(logging.DEBUG)
    refused = carried == "url" and password in UNREADABLE
    # redis-py decodes a URL's password: "s%2Fcret" written as is reaches the server as "s/cret"
    works = not refused and not (carried == "url" and "%2F" in password)
    found = []
    for args in commands(tmp_path):
        code = main([args[0], "--config", str(config), *args[1:]])
        out, err = capsys.readouterr()
        logged = "\n".join(
            f"{r.getMessage()} {r.exc_text or ''} {r.exc_info[1] if r.exc_info else ''}"
            for r in caplog.records
        )
        caplog.clear()
        found += [
            (args, where, leaks(text, password))
            for where, text in (("out", out), ("err", err), ("log", logged))
            if leaks(text, password)
        ]
        talks = args[0] not in ("validate", "show")
        if refused and talks:
            assert code == 2 and err.count("\n") == 1, (args, err)
            assert "percent-encode" in err and "redis://:***@127.0.0.1" in err, (args, err)
        elif args[0] == "inspect" and works:  # it asked the server, which has no such block
            assert code == 1 and "is not in tier 'redis'" in err, (args, err)
        elif works or not talks:
            assert code == 0, (args, out, err)
        if args == ("show",):
            assert "***" in out and "redis" in out
    assert found == []


def test_a_test_redis_server_gets_its_password_by_standard_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper first on PATH records the argv redis-server is started with (it rewrites its
    own in /proc at once); the server requires the password all the same."""
    password = 'päss wörd/#?@:%"\\-Kv80'
    real = shutil.which("redis-server")
    assert real is not None
    wrapper = tmp_path / "bin" / "redis-server"
    wrapper.parent.mkdir()
    argv_log = tmp_path / "argv.log"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> "{argv_log}"\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    server = RedisServer(tmp_path / "redis", password=password)
    server.start()
    try:
        argv = argv_log.read_text()
        assert leaks(argv, password) == [] and "requirepass" not in argv and "--port" in argv
        assert server.ping()  # it requires that very password
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, password="wrong").ping()
    finally:
        server.stop()
