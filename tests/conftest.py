"""The whole test session's fixtures: its own home, vLLM's environment, the trace, and the real
servers (Redis, a Redis Cluster, SeaweedFS) started once on loopback. The conformance suite's
store-down test kills and restarts them (`store_down` in the backends' test modules): a test
keeps no data on them across tests."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from kvtier.servers import RedisClusterServers, RedisServer, SeaweedS3
from kvtier.venv import default_venv_dir, ensure_vllm_venv
from tests.helpers.paths import SHARED_TRACES, SHIPPED_TRACES
from tiering.errors import KvtierError

# vLLM's environment stays where the user's machine keeps it (preparing it takes minutes and
# 2.5 GB): resolved once from the real home, before `test_home` moves HOME for every test.
os.environ["KVTIER_VLLM_VENV"] = str(default_venv_dir())
VLLM_PREPARATION_SECONDS = 1800
"""How long preparing vLLM's environment may take before the session gives up (about two
minutes on a machine with a fast network; pip's downloads are most of it)."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """Prepare vLLM's environment before the first test when a test of a real vLLM engine is
    selected: outside every test, so neither pytest's per-test faulthandler dump
    (`faulthandler_timeout`) nor a test's own bound counts the minutes of a first
    preparation, and with its status line on the terminal (pytest's capture suspended) instead
    of minutes of silence. A preparation that fails or outlives VLLM_PREPARATION_SECONDS ends
    the session with the reason."""
    if session.config.option.collectonly:
        return
    if not any(item.get_closest_marker("vllm") for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")  # None: -p no:capture
    try:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            ensure_vllm_venv(timeout=VLLM_PREPARATION_SECONDS)
    except KvtierError as e:
        pytest.exit(str(e), returncode=pytest.ExitCode.TESTS_FAILED)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM environment's python (prepared before the first test: pytest_collection_finish)."""
    return ensure_vllm_venv()


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
