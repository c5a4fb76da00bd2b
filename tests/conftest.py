from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from kvtier.servers import RedisClusterServers, RedisServer, SeaweedS3
from kvtier.venv import default_venv_dir

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACES = ROOT.parent / "shared" / "traces"
SHIPPED_TRACES = ROOT / "bench" / "traces"
REAL_HOME = Path.home()
"""The user's home, as the test session found it: no test writes there (`test_home`)."""

# vLLM's environment stays where the user's machine keeps it (preparing it takes minutes and
# 2.5 GB): resolved once from the real home, before `test_home` moves HOME for every test.
os.environ["KVTIER_VLLM_VENV"] = str(default_venv_dir())


@pytest.fixture(autouse=True, scope="session")
def test_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A home directory of the session's own, for every test and every process it starts:
    HOME and XDG_CACHE_HOME point into it, so nothing a test runs (a migration's default
    journal under ~/.cache/kvtier, a library's cache) writes to the user's home."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
        yield home


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    """The Mooncake conversation trace: the shared copy when there is one, else the shipped one.
    Both are the same requests (test_replay checks the shipped copy against the shared one)."""
    shared = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    return shared if shared.exists() else SHIPPED_TRACES / "mooncake_conversation_trace.jsonl.gz"


# No example database in the checkout: CI runs from a fresh clone, and a failure is reproduced
# from the seed Hypothesis prints.
settings.register_profile("kvtier", database=None, print_blob=True)
settings.load_profile("kvtier")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()
