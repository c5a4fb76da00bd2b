"""`kvtier purge --idle-for` beside a live engine, on a `files` directory, redis-server and
SeaweedFS: a namespace written after the plan is kept, every block of it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.idle import idle_plan, purge_idle
from kvtier.servers import RedisServer, SeaweedS3
from tests.helpers.live_writer import block_key
from tests.helpers.paths import ROOT
from tiering.config import parse_config, tier_from_config
from tiering.testing import payload

pytestmark = [pytest.mark.redis, pytest.mark.s3]

GONE = bytes(range(1, 17))
"""A model nobody runs any more: idle at the plan, idle at its turn."""
RESUMED = bytes(range(30, 46))
"""A model idle at the plan, that an engine resumes right after it."""
SIZE = 8192
OLD_BLOCKS = 20
FRESH_BLOCKS = 300
IDLE = 2.0
"""The purge's `--idle-for`: both namespaces are older than it at the plan (S3 times writes to
the second, so the wait is a second longer)."""


class Store:
    """A tier's YAML entry over a store of its own, and its blocks as a reader finds them."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry = entry

    def tier(self, namespace: bytes) -> Any:
        config = parse_config({"tiers": [self.entry]})
        return tier_from_config(config.tiers[0], namespace, config)

    def fill(self, namespace: bytes, ids: range) -> None:
        async def go() -> None:
            async with self.tier(namespace) as tier:
                await tier.put_many([(block_key(i), payload(SIZE, i)) for i in ids])

        asyncio.run(go())

    def found(self, namespace: bytes, ids: list[int]) -> int:
        """How many of blocks `ids` a reader gets back, exact."""

        async def go() -> int:
            async with self.tier(namespace) as tier:
                return sum(
                    [await tier.get_bytes(block_key(i), SIZE) == payload(SIZE, i) for i in ids]
                )

        return asyncio.run(go())


@pytest.fixture(params=["files", "redis", "s3"])
def store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    redis_server: RedisServer,
    s3_server: SeaweedS3,
) -> Iterator[Store]:
    if request.param == "files":
        yield Store({"name": "t", "type": "file", "path": str(tmp_path / "d"), "min_free": 0})
        return
    if request.param == "redis":
        client = redis.Redis.from_url(redis_server.url)
        client.flushall()
        yield Store({"name": "t", "type": "redis", "url": redis_server.url})
        client.flushall()
        client.close()
        return
    yield Store(
        {
            "name": "t",
            "type": "s3",
            "bucket": s3_server.bucket,
            "prefix": f"purge-live-{time.monotonic_ns()}/",
            "endpoint_url": s3_server.endpoint,
            "access_key": s3_server.ACCESS_KEY,
            "secret_key": s3_server.SECRET_KEY,
        }
    )


def start_writer(store: Store, namespace: bytes, first: int) -> subprocess.Popen[str]:
    """A live engine's writer in a process of its own (`tests.helpers.live_writer`), once it
    has landed its first `FRESH_BLOCKS` and goes on writing."""
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.live_writer"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert writer.stdin is not None and writer.stdout is not None
    args = {
        "entry": store.entry,
        "namespace": namespace.hex(),
        "first": first,
        "ready": FRESH_BLOCKS,
        "size": SIZE,
    }
    writer.stdin.write(json.dumps(args) + "\n")
    writer.stdin.flush()
    assert json.loads(writer.stdout.readline()) == {"ready": FRESH_BLOCKS}
    return writer


def test_a_namespace_resumed_after_the_plan_is_kept_whole(store: Store) -> None:
    """Two namespaces idle when the plan is made; then a live engine (another process)
    resumes one of them, landing 300 fresh blocks and writing on during the purge. The purge,
    with that plan, takes the other one whole and keeps the resumed one: its 20 old blocks,
    its 300 fresh ones and every one written while the purge ran (on today's main the stale
    plan took them all: 300 of 300 fresh blocks lost)."""
    store.fill(GONE, range(OLD_BLOCKS))
    store.fill(RESUMED, range(OLD_BLOCKS))
    time.sleep(IDLE + 1.1)

    async def plan() -> list[Any]:
        async with store.tier(bytes(16)) as probe:
            return idle_plan(await probe.usage(), IDLE).idle

    idle = asyncio.run(plan())
    assert {row.namespace for row in idle} == {GONE, RESUMED}

    writer = start_writer(store, RESUMED, first=1000)
    try:
        done = asyncio.run(purge_idle(idle, store.tier, IDLE))
    finally:
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write("stop\n")
        writer.stdin.close()
        streamed = [json.loads(line) for line in writer.stdout]
        writer.stdout.close()
        assert writer.wait(timeout=30) == 0
    during = [row["i"] for row in streamed if "i" in row]

    outcomes = {d.namespace: d for d in done}
    assert outcomes[GONE].deleted == OLD_BLOCKS and not outcomes[GONE].kept
    assert outcomes[RESUMED].kept and outcomes[RESUMED].deleted == 0
    assert outcomes[RESUMED].last_write is not None
    assert time.time() - outcomes[RESUMED].last_write < IDLE + 30
    assert store.found(GONE, list(range(OLD_BLOCKS))) == 0
    assert store.found(RESUMED, list(range(OLD_BLOCKS))) == OLD_BLOCKS
    fresh = list(range(1000, 1000 + FRESH_BLOCKS))
    assert store.found(RESUMED, fresh) == FRESH_BLOCKS
    assert during and store.found(RESUMED, during) == len(during)
