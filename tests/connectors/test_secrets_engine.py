"""A real vLLM engine (CPU build) whose Redis tier has its password in the URL, given by the
environment (`${NAME}`): nothing the engine prints, vLLM's lines and kvtier's alike, carries
the password, right or wrong (issue 15, item 9)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.scenario import run_scenario
from kvtier.servers import RedisServer
from tests.helpers.vllm_runs import prompts, scenario, with_tiers

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.redis]

PASSWORD = "Kv7-engine-s3cr3t-Qw4"
WRONG = "Wr0ng-engine-guess-Zt6"


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def secret_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = RedisServer(tmp_path_factory.mktemp("redis-engine-secret"), password=PASSWORD)
    server.start()
    yield server
    server.stop()


def test_the_engine_log_never_shows_the_redis_password(
    vllm_python: Path,
    workdir: Path,
    secret_server: RedisServer,
) -> None:
    """A wrong password first (every demotion fails: whatever the engine logs of it must be
    redacted), then the right one (blocks reach Redis: the same URL, interpolated, works)."""
    url = f"redis://:${{KVT_TEST_REDIS_PW}}@127.0.0.1:{secret_server.port}/0"
    tiers = [{"name": "redis", "type": "redis", "url": url, "write": "through"}]
    admin = redis.Redis(host="127.0.0.1", port=secret_server.port, password=PASSWORD)
    admin.flushall()
    logs = {}
    for password, chosen in ((WRONG, prompts()), (PASSWORD, prompts()[:1])):
        result = run_scenario(
            vllm_python,
            scenario(
                workdir,
                with_tiers(workdir, tiers),
                prompts=chosen,
                env={"KVT_TEST_REDIS_PW": password},
            ),
            workdir,
        )
        assert len(result["outputs"]) == len(chosen)
        logs[password] = result["log"]
        if password == WRONG:
            assert admin.dbsize() == 0 and result["metrics"]["tier_demotions"] == 0
    assert admin.dbsize() > 0  # with the right one the engine's blocks went to Redis
    admin.close()
    # the failures were logged (the breaker opening, with the tier's error), the URL masked
    assert "invalid username-password" in logs[WRONG] and "redis://:***@" in logs[WRONG]
    for log in logs.values():
        assert PASSWORD not in log and WRONG not in log
        for line in log.splitlines():  # where the tier's URL is quoted, it is masked
            assert "redis://:$" in line or "redis://:***@" in line or "redis://:" not in line


AWKWARD = "Kv7/p#q?x=1&u@v:c 50%off-päss wörd"
"""A password with every character a URL or a log line treats specially (issue 30, item 6)."""
AWKWARD_WRONG = "Wr0ng/g#ess?y=2@w:d 75%on-fälsch"


@pytest.fixture(scope="module")
def awkward_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = RedisServer(tmp_path_factory.mktemp("redis-engine-awkward"), password=AWKWARD)
    server.start()
    yield server
    server.stop()


def test_the_engine_log_never_shows_an_awkward_password(
    vllm_python: Path, workdir: Path, awkward_server: RedisServer
) -> None:
    """The tier's `password` option holding `/ # ? & @ : %`, blanks and non-ASCII, wrong then
    right: no form of it (as given, percent-encoded, its tail) is in what the engine prints."""
    from urllib.parse import quote

    tiers = [
        {
            "name": "redis",
            "type": "redis",
            "url": f"redis://127.0.0.1:{awkward_server.port}/0",
            "password": "${KVT_TEST_REDIS_PW}",
            "write": "through",
        }
    ]
    admin = redis.Redis(host="127.0.0.1", port=awkward_server.port, password=AWKWARD)
    admin.flushall()
    for password in (AWKWARD_WRONG, AWKWARD):
        result = run_scenario(
            vllm_python,
            scenario(
                workdir,
                with_tiers(workdir, tiers),
                prompts=prompts()[:1],
                env={"KVT_TEST_REDIS_PW": password},
            ),
            workdir,
        )
        assert len(result["outputs"]) == 1
        log = result["log"]
        for secret in (AWKWARD, AWKWARD_WRONG):
            for form in (secret, quote(secret, safe=""), secret[-12:], secret.encode().hex()):
                assert form not in log, (password == AWKWARD, form)
    assert admin.dbsize() > 0  # with the right one the engine's blocks went to Redis
    admin.close()
