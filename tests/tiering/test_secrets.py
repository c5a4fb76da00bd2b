"""Secrets stay secret (issue 15, item 9): a Redis password inside a URL never appears in what
kvtier prints (show, stats, ls, inspect, verify, bench, their errors against a wrong
password), in its messages, or on a child process's command line (redis-benchmark's argv)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from kvtier.servers import RedisServer
from tests.helpers.paths import ROOT
from tiering.errors import ConfigError, TierUnavailable
from tiering.secrets import MASK, redact_data, redact_text, redact_url, url_secrets
from tiering.testing import NAMESPACE, key, payload
from tiers.redis import RedisTier

PASSWORD = "Kv7-s3cr3t-Zq9"
WRONG = "Wr0ng-guess-Xy8"


# -- redaction ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter22@10.0.0.1:6379/0", "redis://:***@10.0.0.1:6379/0"),
        ("redis://alice:hunter22@h/0", "redis://alice:***@h/0"),
        ("rediss://alice:hun@ter:22@h:6380", "rediss://alice:***@h:6380"),  # "@" left unencoded
        ("redis://:hun%40ter22@h/0", "redis://:***@h/0"),
        (
            "redis://h/0?password=hunter22&socket_timeout=1",
            "redis://h/0?password=***&socket_timeout=1",
        ),
        ("redis://alice@h/0", "redis://alice@h/0"),  # a user name alone is no secret
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "hunter22" not in redact_text(f"failed: {url} (and again: {url})")


def test_the_secrets_a_url_carries_are_found_as_written_and_decoded() -> None:
    assert url_secrets("redis://:hun%40ter22@h/0?token=abc%2Fdef") == [
        "hun%40ter22",
        "hun@ter22",
        "abc%2Fdef",
        "abc/def",
    ]
    # a message that quotes the decoded password without its URL is cleaned too
    assert redact_text("AUTH hun@ter22 refused", url_secrets("redis://:hun%40ter22@h")) == (
        f"AUTH {MASK} refused"
    )


def test_config_data_is_redacted_by_option_name_and_inside_strings() -> None:
    data = {
        "tiers": [
            {"name": "r", "options": {"url": "redis://:hunter22@h/0", "password": "pw-abc-123"}},
            {"name": "s3", "options": {"secret_key": "sk-xyz", "note": "key pw-abc-123 here"}},
        ],
        "auth": {"secret": "a-deployment-secret"},
    }
    shown = repr(redact_data(data))
    for secret in ("hunter22", "pw-abc-123", "sk-xyz", "a-deployment-secret"):
        assert secret not in shown
    assert "redis://:***@h/0" in shown and "'name': 'r'" in shown


# -- the Redis tier's messages --------------------------------------------------------------------


@pytest.fixture(scope="module")
def secret_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-secret"), password=PASSWORD)
    server.start()
    yield server
    server.stop()


def url_with(server: RedisServer, password: str) -> str:
    return f"redis://:{quote(password, safe='')}@127.0.0.1:{server.port}/0"


@pytest.mark.redis
@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_tier_errors_name_the_server_without_its_password(
    secret_server: RedisServer, fast_path: bool
) -> None:
    async def body() -> None:
        url = url_with(secret_server, WRONG)
        async with RedisTier(namespace=NAMESPACE, url=url, fast_path=fast_path) as tier:
            assert WRONG not in tier.url
            for call in (tier.put(key(1), b"x"), tier.get(key(1), bytearray(1)), tier.stat()):
                with pytest.raises(TierUnavailable) as caught:
                    await call
                assert "invalid username-password" in str(caught.value)
                assert WRONG not in str(caught.value) and "***" in str(caught.value)

    asyncio.run(body())


@pytest.mark.parametrize(
    ("url", "shown", "problem"),
    [
        ("redis://:hunter22@h:notaport/0", "redis://:***@h:notaport/0", "Port could not be cast"),
        (
            "redis://h/0?password=hunter22&colour=red",  # redis-py: TypeError when connecting
            "redis://h/0?password=***&colour=red",
            "unknown query argument 'colour'",
        ),
    ],
)
def test_a_bad_url_is_refused_at_once_without_quoting_its_password(
    url: str, shown: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        RedisTier(namespace=NAMESPACE, url=url)
    assert "hunter22" not in str(caught.value)
    assert shown in str(caught.value) and problem in str(caught.value)


# -- every output of the CLI ----------------------------------------------------------------------


def kvtier(config: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvtier", args[0], "--config", str(config), *args[1:]]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False
    )


@pytest.mark.redis
def test_no_cli_output_shows_the_password_and_redis_benchmark_never_gets_it(
    secret_server: RedisServer, tmp_path: Path
) -> None:
    """Every command, with the right password and with a wrong one (tracebacks on: a leak
    through one would show), prints neither password, as typed or percent-encoded; the
    redis-benchmark the bench runs gets neither in its argv (a wrapper first on PATH records
    it), yet authenticates, and the one-time ACL user it used is gone afterwards."""
    admin = redis.Redis(host="127.0.0.1", port=secret_server.port, password=PASSWORD)
    admin.flushall()
    users_before = admin.acl_users()
    config = tmp_path / "tiers.yaml"
    config.write_text(
        f"""
version: 1
primary: {{capacity: 1GiB}}
tiers:
  - {{name: redis, type: redis, url: "redis://:${{KVT_TEST_PW}}@127.0.0.1:{secret_server.port}/0"}}
"""
    )
    wrapper = tmp_path / "bin" / "redis-benchmark"
    wrapper.parent.mkdir()
    argv_log = tmp_path / "argv.log"
    real = shutil.which("redis-benchmark")
    assert real is not None
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> "{argv_log}"\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}",
        "KVTIER_DEBUG": "1",
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }

    async def seed() -> None:
        async with RedisTier(
            namespace=NAMESPACE, url=url_with(secret_server, PASSWORD), name="redis"
        ) as tier:
            await tier.put(key(1), payload(4096, 1))

    asyncio.run(seed())
    block = key(1).hex()
    commands = [
        ("validate",),
        ("show",),
        ("show", "--json"),
        ("stats",),
        ("stats", "--json"),
        ("ls", "--tier", "redis"),
        ("inspect", "--tier", "redis", block),
        ("verify", "--tier", "redis"),
        ("bench", "--tier", "redis", "--sizes", "4KiB", "--count", "16"),
    ]
    outputs = []
    for password in (PASSWORD, WRONG):
        for args in commands:
            done = kvtier(config, {**env, "KVT_TEST_PW": password}, *args)
            outputs.append((password, args, done.returncode, done.stdout + done.stderr))
    leaks = [
        (args, password)
        for password, args, _, out in outputs
        for secret in (PASSWORD, WRONG)
        if secret in out or quote(secret, safe="") in out
    ]
    assert leaks == []
    right = {args: (code, out) for password, args, code, out in outputs if password == PASSWORD}
    wrong = {args: (code, out) for password, args, code, out in outputs if password == WRONG}
    assert [(args, out) for args, (code, out) in right.items() if code] == []
    assert "redis://:***@127.0.0.1" in right[("show",)][1]
    assert "baseline: redis-benchmark" in right[commands[-1]][1]
    for args in commands[3:]:  # the commands that talk to the server
        code, out = wrong[args]
        assert code != 0 and "invalid username-password" in out, (args, out)
        assert "Traceback" not in out
    argv = argv_log.read_text()
    assert "-t" not in argv.split() and "key:" not in argv  # its own keys, by its own command
    assert PASSWORD not in argv and WRONG not in argv
    assert admin.acl_users() == users_before
    admin.close()
